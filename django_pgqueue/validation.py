"""The checks of a message's fields, shared by ``enqueue()``, ``enqueue_many()``,
``publish()`` and the dead letters' revive.

Each check raises ``InvalidMessage`` with a sentence that names the field,
before anything is written, or returns the value as it will be stored (a
payload's JSON text, a delay in seconds). ``validate`` checks one message
into a ``Row``: its ``Options`` (every field but the payload) and its
payload. ``validate_many`` checks ``enqueue_many()``'s dicts: the keywords
they share once, then only each message's payload.
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, connections

from django_pgqueue import conf
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.fields import TIMESTAMP_MAX, TIMESTAMP_MIN


class MessageFields(TypedDict, total=False):
    """The keywords of ``enqueue()`` that describe a message: a dict of
    ``enqueue_many()``'s input, and its shared defaults."""

    topic: str
    payload: Any
    delay: float | datetime.timedelta | None
    run_at: datetime.datetime | None
    priority: int
    queue: str | None
    dedup_key: str | None
    group_key: str | None
    headers: dict[str, Any] | None
    max_attempts: int | None
    partition_key: str | None


FIELD_NAMES = frozenset(MessageFields.__annotations__)

_INT_MAX = 2**31 - 1  # max_attempts is an integer column


@dataclass(slots=True)  # not frozen: its __init__ would cost more (enqueue_many makes many)
class Options:
    """A validated message's fields but its payload, as the INSERT stores
    them: what the messages of one ``enqueue_many()`` call often share."""

    queue: str
    topic: str
    headers_json: str
    priority: int
    run_at: datetime.datetime | None
    delay_seconds: float
    max_attempts: int | None
    dedup_key: str | None
    group_key: str | None
    partition_key: str | None

    def row(self, payload: Any, headers: dict[str, Any]) -> Row:
        """A message with these options, ``payload`` (checked here) and
        ``headers`` (the dict these options' ``headers_json`` encodes)."""
        return Row(payload, to_json("payload", payload), headers, self)


@dataclass(slots=True)
class Row:
    """One validated message: the caller's payload and headers objects (the
    returned ``Message`` holds them), the payload's JSON text, its options."""

    payload: Any
    payload_json: str
    headers: dict[str, Any]
    options: Options


def validate(fields: Mapping[str, Any]) -> Row:
    """Check one message's fields (``MessageFields``; ``topic`` is required);
    return its ``Row`` or raise ``InvalidMessage``."""
    get = fields.get
    return validate_one(
        fields["topic"],
        get("payload"),
        get("delay"),
        get("run_at"),
        get("priority", 0),
        get("queue"),
        get("dedup_key"),
        get("group_key"),
        get("headers"),
        get("max_attempts"),
        get("partition_key"),
    )


def validate_one(
    topic: str,
    payload: Any,
    delay: float | datetime.timedelta | None,
    run_at: datetime.datetime | None,
    priority: int,
    queue: str | None,
    dedup_key: str | None,
    group_key: str | None,
    headers: dict[str, Any] | None,
    max_attempts: int | None,
    partition_key: str | None,
) -> Row:
    """``validate`` for ``enqueue()``'s keywords as they were given, in
    ``MessageFields``' order. The common values (names seen before, no
    delay, keys or headers, priority 0) are checked inline, the rest by the
    checks below: ``enqueue()`` one message per transaction pays for every
    Python call here (``benchmarks/instructions.py``). The types are what
    the caller should give; anything else is refused here."""
    if type(topic) is not str or ("topic", topic) not in _GOOD_NAMES:
        check_name("topic", topic, conf.TOPIC_MAX_LENGTH)
    if queue is None:
        queue = conf.get("DEFAULT_QUEUE")
    if type(queue) is not str or ("queue", queue) not in _GOOD_NAMES:
        queue = check_name("queue", queue, conf.QUEUE_MAX_LENGTH)
    payload_json = to_json("payload", payload)
    if headers is None:  # nearly always
        headers, headers_json = {}, "{}"
    else:
        headers, headers_json = check_headers(headers)
    if type(priority) is not int or not conf.PRIORITY_MIN <= priority <= conf.PRIORITY_MAX:
        priority = _priority(priority)
    if delay is None:
        delay_seconds = 0.0
        if run_at is not None:
            run_at = _run_at(run_at)
    elif run_at is not None:
        raise InvalidMessage("give delay or run_at, not both")
    else:
        delay_seconds = _delay_seconds(delay)
    if max_attempts is not None:
        max_attempts = _max_attempts(max_attempts)
    if dedup_key is not None:
        dedup_key = check_key("dedup_key", dedup_key)
    if group_key is not None:
        group_key = check_key("group_key", group_key)
    if partition_key is not None:
        partition_key = check_key("partition_key", partition_key)
    options = Options(  # positional: the dataclass's __init__ takes them faster
        queue, topic, headers_json, priority, run_at, delay_seconds, max_attempts, dedup_key,
        group_key, partition_key,
    )  # fmt: skip
    return Row(payload, payload_json, headers, options)


_PAYLOAD_ONLY = frozenset({"payload"})


def validate_many(messages: Iterable[dict[str, Any]], defaults: Mapping[str, Any]) -> Iterator[Row]:
    """The Row of each of ``enqueue_many()``'s dicts, in order, as they are
    consumed; ``defaults`` fills in the keys a dict leaves out. The error
    names the message by its index."""
    base = {"payload": None, "queue": conf.get("DEFAULT_QUEUE"), **defaults}
    # The usual bulk call gives each dict a payload and nothing else: the
    # rest comes from ``defaults``, checked once here instead of per message.
    # (If they are wrong, the first message reports it, as it would anyway.)
    shared: Options | None = None
    shared_headers = base.get("headers")  # None: each message gets a {} of its own
    if "topic" in base:
        try:
            shared = validate(base).options
        except InvalidMessage:
            pass
    for index, item in enumerate(messages):
        if not isinstance(item, dict):
            raise InvalidMessage(
                f"message {index}: expected a dict of enqueue() keywords, got {type(item).__name__}"
            )
        try:
            if shared is not None and item.keys() <= _PAYLOAD_ONLY:
                headers = {} if shared_headers is None else shared_headers
                yield shared.row(item.get("payload"), headers)
                continue
            if not item.keys() <= FIELD_NAMES:
                unknown = sorted(set(item) - FIELD_NAMES)
                raise InvalidMessage(
                    f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(FIELD_NAMES))}"
                )
            fields = {**base, **item}
            if "topic" not in fields:
                raise InvalidMessage("no topic (give it in the dict or as topic=)")
            yield validate(fields)
        except InvalidMessage as exc:
            raise InvalidMessage(f"message {index}: {exc}") from None


def check_message(**fields: Any) -> None:
    """Raise ``InvalidMessage`` if ``enqueue(**fields)`` would; write nothing.

    A bulk caller (``deadletters.revive``) checks each row first and sets the
    bad ones aside, instead of having one bad row fail a whole
    ``enqueue_many()`` call.
    """
    if "topic" not in fields:
        raise InvalidMessage("no topic")
    validate(fields)


def check_payload(payload: Any) -> None:
    """Raise ``InvalidMessage`` if ``payload`` cannot be a message's payload
    (the admin's form checks an edited dead letter's payload with it)."""
    to_json("payload", payload)


_GOOD_NAMES: set[tuple[str, str]] = set()  # (kind, name) checked: a few, again and again


def check_name(kind: str, value: object, max_length: int) -> str:
    """``value`` if it is a valid queue, topic or stream name, else InvalidMessage."""
    if isinstance(value, str) and (kind, value) in _GOOD_NAMES:
        return value
    problem = conf.name_problem(kind, value, max_length)
    if problem is not None or not isinstance(value, str):
        raise InvalidMessage(problem)
    if len(_GOOD_NAMES) < 10_000:
        _GOOD_NAMES.add((kind, value))
    return value


def check_key(name: str, value: object) -> str | None:
    """``value`` if it can be a ``dedup_key``, ``group_key``, ``partition_key``
    or an event's ``key`` (a non-empty string or None), else InvalidMessage."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidMessage(f"{name} must be a non-empty string or None, not {value!r}")
    if len(value) > conf.KEY_MAX_LENGTH:
        raise InvalidMessage(
            f"{name} is {len(value)} characters long; the limit is {conf.KEY_MAX_LENGTH}"
        )
    if "\x00" in value:
        raise InvalidMessage(f"{name} must not contain a NUL character (PostgreSQL text cannot)")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidMessage(
                f"{name} must be valid Unicode text (it holds a lone surrogate): {value!r}"
            ) from None
    return value


def check_using(using: str | None) -> str:
    """The alias of the caller's transaction (``using``, default ``"default"``),
    or InvalidMessage if DATABASES has no such alias."""
    caller = DEFAULT_DB_ALIAS if using is None else using
    if caller not in connections.settings:
        raise InvalidMessage(f"using={caller!r} is not a database alias in DATABASES")
    return caller


def check_headers(headers: object) -> tuple[dict[str, Any], str]:
    """The headers (a new ``{}`` for None) and their JSON text, or InvalidMessage."""
    if headers is None:  # nearly always
        return {}, "{}"
    if not isinstance(headers, dict) or not all(isinstance(k, str) for k in headers):
        raise InvalidMessage("headers must be a dict with string keys")
    return headers, to_json("headers", headers)


# One encoder for every call (json.dumps(cls=...) would build one per call).
_ENCODER = DjangoJSONEncoder(allow_nan=False)
# Its C core, built once: JSONEncoder.encode builds one on every call, a
# good share of a small payload's encoding. Without the memo of the
# containers being encoded (markers None, which also makes it safe to share
# between threads), a circular payload recurses until RecursionError, which
# to_json then hands to _ENCODER to be named. None where the C module is
# missing (another Python implementation): _ENCODER.encode then.
_make_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE = (
    None
    if _make_c_encoder is None
    else _make_c_encoder(
        None,  # markers
        _ENCODER.default,
        json.encoder.encode_basestring_ascii,
        None,  # indent
        _ENCODER.key_separator,
        _ENCODER.item_separator,
        False,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
)

# jsonb cannot store the NUL character; catch "\u0000" escapes that are not
# themselves an escaped backslash followed by "u0000".
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def to_json(what: str, value: Any) -> str:
    """``value`` as the JSON text a jsonb column stores unchanged, or
    InvalidMessage naming ``what`` ("payload", "headers")."""
    if value == {} and type(value) is dict:  # headers, nearly always
        return "{}"
    try:
        text = _ENCODER.encode(value) if _C_ENCODE is None else "".join(_C_ENCODE(value, 0))
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"{what} is not JSON-serializable: {exc}") from None
    except RecursionError:
        raise InvalidMessage(f"{what} {_too_deep(value)}") from None
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise InvalidMessage(
            f"{what} contains a NUL character (\\u0000), which PostgreSQL cannot store"
        )
    problem = _content_problem(value, surrogates="\\ud" in text)
    if problem:
        raise InvalidMessage(f"{what} {problem}")
    return text


def _too_deep(value: Any) -> str:
    """Why encoding ``value`` recursed too deeply: a circular reference (the
    encoder with its memo says so) or nesting."""
    try:
        _ENCODER.encode(value)
    except ValueError as exc:
        return f"is not JSON-serializable: {exc}"
    except RecursionError:
        pass
    return "is nested too deeply to serialize"


def _content_problem(value: Any, surrogates: bool) -> str | None:
    """What the encoder lets through but the stored message would not keep:
    a dict key that is not a string (JSON turns 1 into "1", and {1: "a",
    "1": "b"} would lose an entry), a lone surrogate (not Unicode; PostgreSQL
    refuses it). None if there is nothing. Iterative: any nesting the
    encoder accepted. ``surrogates``: whether the JSON text has a surrogate
    escape at all (the ASCII-only encoder writes every one as "\\udxxx"),
    else strings are not looked at."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if surrogates and not item.isascii() and _has_surrogate(item):
                return f"contains a lone surrogate in {item[:40]!r}, which is not valid Unicode"
        elif isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return (
                        f"has a dict key that is not a string: {key!r} "
                        f"({type(key).__name__}); JSON object keys are strings"
                    )
            if surrogates:
                pending += item
            pending += item.values()
        elif isinstance(item, list | tuple):
            pending += item
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _priority(priority: object) -> int:
    if not conf.is_int(priority):
        raise InvalidMessage(f"priority must be an integer, not {type(priority).__name__}")
    if not conf.PRIORITY_MIN <= priority <= conf.PRIORITY_MAX:
        raise InvalidMessage(
            f"priority {priority} is out of range "
            f"[{conf.PRIORITY_MIN}, {conf.PRIORITY_MAX}] (higher runs first)"
        )
    return priority


def _max_attempts(max_attempts: object) -> int | None:
    if max_attempts is None or (conf.is_int(max_attempts) and 1 <= max_attempts <= _INT_MAX):
        return max_attempts
    raise InvalidMessage(f"max_attempts must be a whole number of at least 1, not {max_attempts!r}")


# A naive run_at (USE_TZ = False) is read in the session's time zone, less
# than a day from UTC: the day of margin in the bounds covers it.
_NAIVE_MIN, _NAIVE_MAX = TIMESTAMP_MIN.replace(tzinfo=None), TIMESTAMP_MAX.replace(tzinfo=None)


def _run_at(run_at: object) -> datetime.datetime:
    """``run_at`` as the plain datetime the INSERT sends, or InvalidMessage.
    PostgreSQL takes 'infinity' and years past 9999 or BC, which no Python
    reader can load (see fields.py): run_at must be within TIMESTAMP_MIN and
    TIMESTAMP_MAX."""
    if not isinstance(run_at, datetime.datetime):
        raise InvalidMessage(f"run_at must be a datetime, not {type(run_at).__name__}")
    if type(run_at) is not datetime.datetime:
        # A subclass (pandas' Timestamp, say) goes in as the datetime it
        # holds: its isoformat() or str(), which the INSERT would send, could
        # say anything ('infinity', 'NaT').
        run_at = datetime.datetime.combine(run_at.date(), run_at.timetz())
    aware = run_at.utcoffset() is not None
    if settings.USE_TZ and not aware:
        raise InvalidMessage(
            "run_at is a naive datetime while USE_TZ is True; "
            "give an aware one (django.utils.timezone.now() + ...)"
        )
    low, high = (TIMESTAMP_MIN, TIMESTAMP_MAX) if aware else (_NAIVE_MIN, _NAIVE_MAX)
    if not low <= run_at <= high:
        raise InvalidMessage(
            f"run_at must be from {low.isoformat()} to {high.isoformat()}, not {run_at.isoformat()}"
        )
    return run_at


def _delay_seconds(delay: object) -> float:
    if delay is None:
        return 0.0
    if isinstance(delay, datetime.timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise InvalidMessage(
            f"delay must be a timedelta or a number of seconds, not {type(delay).__name__}"
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidMessage(f"delay must be zero or more seconds, not {delay!r}")
    # The database adds it to its own clock; should that run ahead of this
    # one, the run_at past TIMESTAMP_MAX still loads, as TIMESTAMP_MAX.
    if seconds > (TIMESTAMP_MAX - datetime.datetime.now(datetime.UTC)).total_seconds():
        raise InvalidMessage(
            f"delay must not reach past {TIMESTAMP_MAX.isoformat()} (the latest run_at), "
            f"not {delay!r}"
        )
    return seconds


# The JSON documents enqueue_many's INSERTs read (enqueuing.py); a Row's
# values go in as they were validated, as text already JSON where they can.


def payloads_json(rows: Iterable[Row]) -> str:
    """The rows' payloads as one JSON array (each is JSON text already)."""
    return "[" + ",".join([row.payload_json for row in rows]) + "]"


def rows_json(rows: Iterable[Row]) -> str:
    """The rows as enqueuing.INSERT_SQL reads them: a JSON array of arrays
    in its column order. What surrounds the payload is the same for every row of
    one Options (the usual enqueue_many), so it is written once for them."""
    parts = []
    options = None
    head = tail = ""
    for row in rows:
        if row.options is not options:
            options = row.options
            head, tail = _around_payload(options)
        parts.append(f"{head}{row.payload_json}{tail}")
    return "[" + ",".join(parts) + "]"


def _around_payload(o: Options) -> tuple[str, str]:
    """The JSON of a row before and after its payload. Queue and topic names
    are limited to a plain alphabet (conf.NAME_RE), so they need no
    escaping; the headers are JSON already."""
    run_at = None if o.run_at is None else o.run_at.isoformat()
    return f'["{o.queue}","{o.topic}",', (
        f",{o.headers_json},{o.priority},{_json_or_null(run_at)},{o.delay_seconds!r},"
        f"{_json_or_null(o.max_attempts)},{_json_or_null(o.dedup_key)},"
        f"{_json_or_null(o.group_key)},{_json_or_null(o.partition_key)}]"
    )


def _json_or_null(value: object) -> str:
    return "null" if value is None else json.dumps(value)
