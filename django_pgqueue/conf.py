"""Settings: one ``PGQUEUE`` dict in the project's settings, every key optional.

Values are read at call time (``get``), never cached at import, so
``override_settings`` and per-test changes just work. ``validate`` returns the
problems that ``checks.py`` turns into system-check errors.
"""

import difflib
import re

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# Names of queues and topics travel in NOTIFY payloads, log lines, metric
# labels and URLs: keep them to a plain, printable alphabet.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*$")
QUEUE_MAX_LENGTH = 100
TOPIC_MAX_LENGTH = 200
KEY_MAX_LENGTH = 255  # dedup_key, group_key

# Priority: higher runs first. A bounded range keeps the claim index small and
# leaves room above and below the default.
PRIORITY_MIN = -100
PRIORITY_MAX = 100

DEFAULTS = {
    # Alias of the database that holds the queue tables. When it differs from
    # the caller's alias, enqueue defers the insert to the caller's commit.
    "DATABASE": "default",
    # Send a NOTIFY wake-up from the insert trigger. Turn off (poll-only mode)
    # behind PgBouncer in transaction pooling, or at very high insert rates:
    # every notifying transaction takes a cluster-wide lock at commit. The
    # trigger is enabled or disabled to match when ``migrate`` runs.
    "NOTIFY": True,
    # Queue used when enqueue() is given none.
    "DEFAULT_QUEUE": "default",
}


def get(name):
    """The value of ``PGQUEUE[name]``, or its default."""
    if name not in DEFAULTS:
        raise KeyError(f"PGQUEUE has no setting {name!r}")
    user = getattr(settings, "PGQUEUE", None) or {}
    if not isinstance(user, dict):
        raise ImproperlyConfigured(
            f"PGQUEUE must be a dict, not {type(user).__name__} (manage.py check tells more)"
        )
    return user.get(name, DEFAULTS[name])


def name_problem(kind, value, max_length):
    """Why ``value`` is not a valid queue or topic name, or None if it is."""
    if not isinstance(value, str):
        return f"{kind} must be a string, not {type(value).__name__}"
    if not value:
        return f"{kind} must not be empty"
    if len(value) > max_length:
        return f"{kind} is {len(value)} characters long; the limit is {max_length}"
    if not NAME_RE.match(value):
        return (
            f"{kind} {value!r} may contain only letters, digits and _ . : / - "
            "and must not start with punctuation other than _"
        )
    return None


def _bool(value):
    return None if isinstance(value, bool) else "must be True or False"


def alias_problem(value):
    if not isinstance(value, str) or not value:
        return "must be a database alias (a non-empty string)"
    if value not in settings.DATABASES:
        return f"names the alias {value!r}, which is not in DATABASES"
    return None


def _queue(value):
    return name_problem("the queue name", value, QUEUE_MAX_LENGTH)


_VALIDATORS = {
    "DATABASE": alias_problem,
    "NOTIFY": _bool,
    "DEFAULT_QUEUE": _queue,
}


def validate():
    """Problems with the ``PGQUEUE`` setting, as (id, message, hint) tuples."""
    user = getattr(settings, "PGQUEUE", None)
    if user is None:
        return []
    if not isinstance(user, dict):
        return [
            (
                "pgqueue.E001",
                f"PGQUEUE must be a dict, not {type(user).__name__}.",
                'Write PGQUEUE = {"NOTIFY": False, ...} or remove the setting.',
            )
        ]
    problems = []
    for key, value in user.items():
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            problems.append(
                (
                    "pgqueue.E002",
                    f"PGQUEUE has an unknown key {key!r}.",
                    hint + "Known keys: " + ", ".join(sorted(DEFAULTS)) + ".",
                )
            )
            continue
        problem = _VALIDATORS[key](value)
        if problem:
            problems.append(
                (
                    "pgqueue.E003",
                    f"PGQUEUE[{key!r}] {problem} (got {value!r}).",
                    f"Fix or remove PGQUEUE[{key!r}]; its default is {DEFAULTS[key]!r}.",
                )
            )
    return problems
