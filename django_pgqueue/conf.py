"""Settings: one ``PGQUEUE`` dict in the project's settings, every key optional.

Values are read at call time (``get``), never cached at import, so
``override_settings`` and per-test changes just work. ``validate`` returns the
problems that ``checks.py`` turns into system-check errors.
"""

import difflib
import ipaddress
import re
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

# Names of queues and topics travel in NOTIFY payloads, log lines, metric
# labels and URLs: keep them to a plain, printable alphabet. \Z, not $: "$"
# also matches before a trailing newline ("default\n").
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*\Z")
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
    # Attempts before a message becomes a dead letter (a handler's
    # max_attempts, or a message's, takes precedence).
    "MAX_ATTEMPTS": 5,
    # Retry backoff: the delay before attempt n+1 is drawn from
    # [0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (n - 1))] (full jitter), or is
    # exactly that bound when BACKOFF_JITTER is False. Seconds.
    "BACKOFF_BASE": 2.0,
    "BACKOFF_CAP": 3600.0,
    "BACKOFF_JITTER": True,
    # DEPENDENCY failures (a downstream service is down) back off this many
    # times longer than the others.
    "DEPENDENCY_BACKOFF_FACTOR": 5.0,
    # Message groups (group_key): when a message of a group is dead-lettered,
    # False lets the group go on with its next message; True keeps the group
    # blocked until the dead letter is revived (it then runs first),
    # resolved or deleted. A handler's dead_letter_blocks_group overrides it.
    "DEAD_LETTER_BLOCKS_GROUP": False,
    # Classification rules tried before the built-in ones, first match wins.
    # Each is a dict with "category" and one or more conditions: "exception"
    # (a class or dotted path; subclasses match), "message" (a substring of
    # str(exc)), "regex" (searched in str(exc)), "topic" (equal), "payload"
    # (a callable or dotted path: payload -> bool).
    "CLASSIFY_RULES": [],
    # A callable (or dotted path) (exc, message) -> category or None, asked
    # before the rules.
    "CLASSIFIER": None,
    # Lease (visibility timeout) in seconds. The worker's heartbeat extends it
    # every quarter lease while a handler runs; a crashed worker's messages
    # come back after about one lease.
    "LEASE_SECONDS": 60.0,
    # Seconds between polls when no notification arrives (jittered +-10%).
    "POLL_INTERVAL": 5.0,
    # The queues this project runs workers for. Health checks expect a live
    # worker for each, status and metrics report each even when empty, and
    # pgqueue_worker serves them when given no --queues. None: [DEFAULT_QUEUE].
    "QUEUES": None,
    # Seconds between a worker's heartbeats (its row in the worker table). A
    # worker counts as alive until three intervals pass without one.
    "HEARTBEAT_INTERVAL": 10.0,
    # Limits on the worker's own statements that may wait for a lock (an
    # atomic handler's acknowledgement, lease extension, heartbeat and poll,
    # retries and dead-lettering, maintenance), in seconds; None keeps the
    # server's setting. The claim and the batched acknowledgements of
    # atomic=False handlers never wait for a lock (SKIP LOCKED) and carry
    # none. Set per transaction (SET LOCAL), so they never reach a handler's
    # own queries and hold behind PgBouncer in transaction pooling.
    # LOCK_TIMEOUT: how long one of them waits for a row or table lock that
    # another transaction holds before it fails and is retried.
    # STATEMENT_TIMEOUT: the longest one may run; they take milliseconds, so
    # one that runs this long is stuck.
    "LOCK_TIMEOUT": 5.0,
    "STATEMENT_TIMEOUT": 60.0,
    # Who may read the metrics and health URLs of django_pgqueue.urls:
    # "open" (anyone), "staff" (a logged-in staff user) or "token" (an
    # "Authorization: Bearer <ENDPOINT_TOKEN>" header).
    "METRICS_ACCESS": "staff",
    "HEALTH_ACCESS": "open",
    "ENDPOINT_TOKEN": None,
    # Address a worker's --metrics-port and --health-port listen on (its
    # --http-host option overrides it). Loopback by default: those ports
    # answer everyone who can reach them unless the matching *_ACCESS is
    # "token"; "0.0.0.0" or "::" opens them to every network of the host.
    "WORKER_HTTP_HOST": "127.0.0.1",
    # Dead-letter alerts: a JSON POST to this URL (None: no alerts), at most
    # one per topic and category per ALERT_WINDOW seconds (the next one tells
    # how many were held back). Sent by a worker as a message of its own
    # (topic "pgqueue.alert"), so a slow or failing webhook never holds up
    # other messages; tried 1 + ALERT_WEBHOOK_RETRIES times.
    "ALERT_WEBHOOK_URL": None,
    # Extra request headers, e.g. {"Authorization": "Bearer ..."}. Their
    # values are secrets: never logged, never shown in the admin.
    "ALERT_WEBHOOK_HEADERS": {},
    "ALERT_WEBHOOK_TIMEOUT": 5.0,  # seconds, at most 50
    "ALERT_WEBHOOK_RETRIES": 3,
    "ALERT_WINDOW": 300.0,
    # Scheme and host the alert's admin link starts with, e.g.
    # "https://ops.example.com". None: the link is a path only.
    "ALERT_SITE_URL": None,
}

ACCESS_CHOICES = ("open", "staff", "token")
ALERT_TOPIC = "pgqueue.alert"


def queues():
    """The configured queues (PGQUEUE["QUEUES"], or the default queue)."""
    configured = get("QUEUES")
    return list(configured) if configured else [get("DEFAULT_QUEUE")]


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


def database_alias():
    """The database alias the queue's tables live in (``PGQUEUE["DATABASE"]``)."""
    return get("DATABASE")


def is_int(value):
    """An int that is not a bool (``True`` is an ``int`` to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


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


def text_problem(text):
    """Why the string ``text`` cannot go to PostgreSQL as text, or None. It
    cannot hold NUL; and bytes that are not UTF-8 (a command line's arrive as
    lone surrogates) cannot be encoded at all."""
    if "\x00" in text:
        return "must not contain a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"{text!r} is not valid UTF-8 text"
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


def _positive_int(value):
    if is_int(value) and value >= 1:
        return None
    return "must be a whole number of at least 1"


def _positive_number(value):
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf"):
        return None
    return "must be a number of seconds greater than 0"


def _factor(value):
    if isinstance(value, int | float) and not isinstance(value, bool) and 1 <= value < float("inf"):
        return None
    return "must be a number of at least 1"


# PostgreSQL's timeouts are whole milliseconds up to INT_MAX.
DB_TIMEOUT_MAX = 2_147_483.0


def _db_timeout(value):
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if 0.001 <= value <= DB_TIMEOUT_MAX:
            return None
    return f"must be a number of seconds from 0.001 to {DB_TIMEOUT_MAX:.0f}, or None"


def milliseconds(seconds):
    """A LOCK_TIMEOUT or STATEMENT_TIMEOUT as PostgreSQL reads it ("5000ms"),
    or None."""
    return None if seconds is None else f"{max(1, round(seconds * 1000))}ms"


def _webhook_timeout(value):
    # The alert handler's own timeout is 60 s: a request must give up first.
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 50:
        return None
    return "must be a number of seconds greater than 0 and at most 50"


def _non_negative_int(value):
    if is_int(value) and value >= 0:
        return None
    return "must be a whole number of at least 0"


def _queues(value):
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        return "must be a non-empty list of queue names, or None"
    for name in value:
        problem = _queue(name)
        if problem:
            return problem
    if len(set(value)) != len(value):
        return "names a queue twice"
    return None


def _access(value):
    if value in ACCESS_CHOICES:
        return None
    return "must be one of " + ", ".join(repr(c) for c in ACCESS_CHOICES)


def _token(value):
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < 16:
        return "must be a string of at least 16 characters, or None"
    return None


_HOST_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def host_problem(value):
    """Why ``value`` cannot be the address a worker's HTTP ports listen on
    (WORKER_HTTP_HOST, --http-host), or None: an IPv4 or IPv6 address, or a
    host name. Whether it can be bound is known only when the worker binds."""
    if not isinstance(value, str) or not value:
        return "must be an IP address or a host name (a non-empty string)"
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    labels = value.split(".")
    # An all-digit last label is a mistyped IPv4 address ("10.0.0.256"), not a name.
    if (
        len(value) <= 253
        and all(_HOST_LABEL_RE.match(label) for label in labels)
        and not labels[-1].isdigit()
    ):
        return None
    return (
        "must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) or a host name, "
        "without brackets or a port"
    )


def _http_url(value):
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^https?://[^\s/]+", value):
        return "must be an http:// or https:// URL, or None"
    return None


def _webhook_url(value):
    problem = _http_url(value)
    if problem or value is None:
        return problem
    try:
        netloc = urlsplit(value).netloc
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return "must be a valid http:// or https:// URL, or None"
    if "@" in netloc:
        # urllib sends no credentials from the URL (and would put them into
        # its error messages): they belong in a header.
        return (
            "must not carry a user name or password (user:password@host); send them in "
            "ALERT_WEBHOOK_HEADERS, e.g. an Authorization header"
        )
    return None


def _headers(value):
    if not isinstance(value, dict):
        return "must be a dict of header names to values"
    for name, header in value.items():
        if not isinstance(name, str) or not re.match(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$", name):
            return f"has an invalid header name {name!r}"
        if not isinstance(header, str) or "\r" in header or "\n" in header:
            return f"header {name!r} must have a one-line string value"
    return None


def _classifier(value):
    if value is None or callable(value):
        return None
    return _importable(value)


def _importable(value):
    if not isinstance(value, str):
        return "must be a callable or its dotted path"
    from django.utils.module_loading import import_string

    try:
        imported = import_string(value)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    return None if callable(imported) else "does not name a callable"


RULE_CONDITIONS = ("exception", "message", "regex", "topic", "payload")


def rule_problem(rule):
    """Why a CLASSIFY_RULES entry is malformed, or None."""
    if not isinstance(rule, dict):
        return "each rule must be a dict"
    unknown = sorted(set(rule) - {"category", *RULE_CONDITIONS})
    if unknown:
        return f"a rule has unknown key(s) {', '.join(unknown)}"
    categories = ("transient", "dependency", "permanent", "business", "unknown")
    if rule.get("category") not in categories:
        return f"a rule's category must be one of {', '.join(categories)}"
    if not any(key in rule for key in RULE_CONDITIONS):
        return f"a rule needs at least one condition: {', '.join(RULE_CONDITIONS)}"
    exception = rule.get("exception")
    if exception is not None and not (
        isinstance(exception, type) and issubclass(exception, BaseException)
    ):
        from django.utils.module_loading import import_string

        try:
            imported = import_string(exception) if isinstance(exception, str) else None
        except ImportError as exc:
            return f"a rule's exception cannot be imported ({exc})"
        if not (isinstance(imported, type) and issubclass(imported, BaseException)):
            return "a rule's exception must be an exception class or its dotted path"
    for key in ("message", "topic"):
        if key in rule and not isinstance(rule[key], str):
            return f"a rule's {key} must be a string"
    if "regex" in rule:
        try:
            re.compile(rule["regex"])
        except (re.error, TypeError) as exc:
            return f"a rule's regex does not compile ({exc})"
    if "payload" in rule and not callable(rule["payload"]):
        problem = _importable(rule["payload"])
        if problem:
            return f"a rule's payload predicate {problem}"
    return None


def _rules(value):
    if not isinstance(value, list | tuple):
        return "must be a list of rule dicts"
    for index, rule in enumerate(value):
        problem = rule_problem(rule)
        if problem:
            return f"rule {index}: {problem}"
    return None


_VALIDATORS = {
    "DATABASE": alias_problem,
    "NOTIFY": _bool,
    "DEFAULT_QUEUE": _queue,
    "MAX_ATTEMPTS": _positive_int,
    "BACKOFF_BASE": _positive_number,
    "BACKOFF_CAP": _positive_number,
    "BACKOFF_JITTER": _bool,
    "DEAD_LETTER_BLOCKS_GROUP": _bool,
    "DEPENDENCY_BACKOFF_FACTOR": _factor,
    "CLASSIFY_RULES": _rules,
    "CLASSIFIER": _classifier,
    "LEASE_SECONDS": _positive_number,
    "POLL_INTERVAL": _positive_number,
    "QUEUES": _queues,
    "HEARTBEAT_INTERVAL": _positive_number,
    "LOCK_TIMEOUT": _db_timeout,
    "STATEMENT_TIMEOUT": _db_timeout,
    "METRICS_ACCESS": _access,
    "HEALTH_ACCESS": _access,
    "ENDPOINT_TOKEN": _token,
    "WORKER_HTTP_HOST": host_problem,
    "ALERT_WEBHOOK_URL": _webhook_url,
    "ALERT_WEBHOOK_HEADERS": _headers,
    "ALERT_WEBHOOK_TIMEOUT": _webhook_timeout,
    "ALERT_WEBHOOK_RETRIES": _non_negative_int,
    "ALERT_WINDOW": _positive_number,
    "ALERT_SITE_URL": _http_url,
}


# --- streams (the transactional outbox) -------------------------------------------------
# Seconds a stream event is kept once every subscription of its stream has
# passed it (a stream without subscriptions: once it is this old); then the
# maintenance round deletes it. None keeps every event.
DEFAULTS["STREAM_RETENTION"] = 7 * 24 * 3600.0


def _retention(value):
    if value is None or _positive_number(value) is None:
        return None
    return "must be a number of seconds greater than 0, or None (keep every event)"


_VALIDATORS["STREAM_RETENTION"] = _retention


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
            shown = "a hidden value" if key in SECRET_KEYS else repr(value)
            problems.append(
                (
                    "pgqueue.E003",
                    f"PGQUEUE[{key!r}] {problem} (got {shown}).",
                    f"Fix or remove PGQUEUE[{key!r}]; its default is {DEFAULTS[key]!r}.",
                )
            )
    for key in ("METRICS_ACCESS", "HEALTH_ACCESS"):
        if user.get(key) == "token" and not user.get("ENDPOINT_TOKEN"):
            problems.append(
                (
                    "pgqueue.E003",
                    f"PGQUEUE[{key!r}] is 'token' but PGQUEUE['ENDPOINT_TOKEN'] is not set.",
                    "Set ENDPOINT_TOKEN to a long random string (read it from the "
                    "environment), or choose 'open' or 'staff'.",
                )
            )
    return problems


# Settings whose values are secrets: never echoed in check messages or logs
# (a webhook URL may carry a token in its path or query string).
SECRET_KEYS = frozenset({"ENDPOINT_TOKEN", "ALERT_WEBHOOK_HEADERS", "ALERT_WEBHOOK_URL"})


class Secret(str):
    """A secret setting's value: the same string to every use (equal to it,
    sent as it is), but its repr is Django's mask. Django's debug page (the
    technical 500 page and its text and e-mail forms) masks settings by name
    only (API, AUTH, TOKEN, KEY, SECRET, PASS, SIGNATURE), which
    "ALERT_WEBHOOK_URL" and the header names in "ALERT_WEBHOOK_HEADERS" need
    not match, and shows every other value through repr(), as do pprint and
    the debug page's local variables."""

    __slots__ = ()

    def __repr__(self):
        return "'********************'"


def hide_secrets(user=None):
    """Make the secret values of the PGQUEUE setting (``user``, default the
    current one) ``Secret`` strings, in place, so that no debug page shows
    them whatever the project's exception reporter filter. Called when the
    app is ready and whenever PGQUEUE changes (override_settings); anything
    that is not a string is left to the system checks."""
    if user is None:
        user = getattr(settings, "PGQUEUE", None)
    if not isinstance(user, dict):
        return
    for key in ("ENDPOINT_TOKEN", "ALERT_WEBHOOK_URL"):
        value = user.get(key)
        if isinstance(value, str) and not isinstance(value, Secret):
            user[key] = Secret(value)
    headers = user.get("ALERT_WEBHOOK_HEADERS")
    if isinstance(headers, dict):
        for name, value in list(headers.items()):
            if isinstance(value, str) and not isinstance(value, Secret):
                headers[name] = Secret(value)
