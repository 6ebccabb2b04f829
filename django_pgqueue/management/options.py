"""argparse ``type=`` validators shared by the management commands (a
command module must not import another).

Every option of every command goes through one of these: a value they let
through is one the command can use, so a bad one is argparse's error naming
the option ("argument --topic: ..."), exit status 2 from manage.py and a
CommandError from call_command, never a traceback from deep inside.
"""

import argparse
import getpass
import math
import threading

from django_pgqueue import conf
from django_pgqueue.conf.limits import WEIGHT_MAX

# PostgreSQL's bigint: the most a whole number can be that reaches SQL (a LIMIT).
BIGINT_MAX = 2**63 - 1
# The longest a thread can wait (about 292 years): a longer poll interval or
# shutdown timeout overflows the platform's time_t.
SECONDS_MAX = threading.TIMEOUT_MAX


# --- text -------------------------------------------------------------------------------


def _checked_by(problem_of):
    """A validator from a ``conf`` problem function (value -> why not, or None)."""

    def parse(value):
        problem = problem_of(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


# Any text PostgreSQL can store (a name to look up, who did it).
free_text = _checked_by(conf.text_problem)
# The address a worker's HTTP ports listen on (--http-host).
http_host = _checked_by(conf.host_problem)


def non_blank_text(value):
    """Text with something besides whitespace (a note)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return free_text(value)


def text_list(value):
    """Comma-separated values, surrounding whitespace stripped, at least one."""
    items = [free_text(item.strip()) for item in value.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one value")
    return items


def _name(kind, max_length):
    return _checked_by(lambda value: conf.name_problem(kind, value, max_length))


queue_name = _name("queue name", conf.QUEUE_MAX_LENGTH)
topic_name = _name("topic name", conf.TOPIC_MAX_LENGTH)


def topic_list(value):
    """Comma-separated topic names, at least one."""
    return [topic_name(item) for item in text_list(value)]


def queue_list(value):
    """Comma-separated queue names, at least one: a list (claimed in that
    order), or, when one has a weight (``bulk=3``), {name: weight} (the
    claims shared by weight; a name without one weighs 1)."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("give at least one queue name")
    weights: dict[str, int] = {}
    weighted = False
    for item in items:
        name, has_weight, weight = (part.strip() for part in item.partition("="))
        name = queue_name(name)
        if name in weights:
            raise argparse.ArgumentTypeError(f"names the queue {name!r} twice")
        weights[name] = 1
        if has_weight:
            weighted = True
            try:
                weights[name] = _whole_number(weight, 1, "at least 1", WEIGHT_MAX)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"queue {name!r}: weight {exc}") from None
    return weights if weighted else list(weights)


# --- numbers ----------------------------------------------------------------------------


def _whole_number(text, minimum, words, maximum=BIGINT_MAX):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {words}, not {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, not {value}")
    return value


def id_list(value):
    """Comma-separated row ids (whole numbers, at least 1), at least one."""
    ids = []
    for item in text_list(value):
        try:
            number = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a whole number") from None
        if number < 1:
            raise argparse.ArgumentTypeError(f"ids are at least 1, not {number}")
        ids.append(number)
    return ids


def positive_int(text):
    return _whole_number(text, 1, "at least 1")


def non_negative_int(text):
    return _whole_number(text, 0, "zero or more")


def up_to(maximum, why):
    """A positive_int of at most ``maximum``; ``why`` says why, after the limit."""

    def parse(text):
        value = positive_int(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum} ({why}), not {value}")
        return value

    return parse


def _seconds(text, allow_zero):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (0 <= value < math.inf) or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(
            f"must be {'zero or more' if allow_zero else 'more than zero'} seconds, not {text}"
        )
    if value > SECONDS_MAX:
        raise argparse.ArgumentTypeError(
            f"must be at most {SECONDS_MAX:.0f} seconds (about 292 years), not {text}"
        )
    return value


def seconds(text):
    """A number of seconds, more than zero."""
    return _seconds(text, allow_zero=False)


def seconds_or_zero(text):
    return _seconds(text, allow_zero=True)


# --- who acts ---------------------------------------------------------------------------


def default_actor():
    """Who a command acts as when ``--by`` is not given: the login name, or
    "" where the uid has no name (a bare container)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


# --- databases --------------------------------------------------------------------------


def database_alias(value):
    """A database alias that holds the app's tables (``conf.databases()``)."""
    known = conf.databases()
    if value not in known:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a database of the queues; choose from: {', '.join(known)}"
        )
    return value


def add_database(parser, verb="read"):
    """The ``--database ALIAS`` option of a command that goes through every
    database holding the app's tables."""
    parser.add_argument(
        "--database",
        type=database_alias,
        metavar="ALIAS",
        help=f"{verb} this database only (default: every database that holds the queues: "
        "PGQUEUE['DATABASE'] and those its QUEUES and STREAMS name)",
    )


def databases(alias):
    """The aliases a command goes through: ``[alias]`` when --database gave
    one, else every database of the queues, DATABASE first."""
    return [alias] if alias else conf.databases()
