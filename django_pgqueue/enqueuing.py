"""The producer: enqueue() and enqueue_many(), the only place that inserts ``Message`` rows.

A message follows the caller's transaction. On the queue's own database the
row is inserted inside that transaction, so it becomes visible, and its
NOTIFY is delivered, only when the caller commits; a rollback (or a rolled
back savepoint) discards it. When the queue lives on another database alias,
the insert waits for the caller's commit through ``transaction.on_commit``.

Bad input raises ``InvalidMessage`` at the call site and writes nothing (a
large ``enqueue_many`` validates and sends its rows a chunk at a time, in one
transaction that the error rolls back).
"""

import datetime
import itertools
import json
import math
import re
from dataclasses import dataclass

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import Q
from django.db.models.base import ModelState

from django_pgqueue import conf, signals
from django_pgqueue.db import prepared_cursor
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.fields import TIMESTAMP_MAX, TIMESTAMP_MIN
from django_pgqueue.models import UNFINISHED, Message, Status, timestamp_from_text

# One statement for one message or fifty thousand: the ORM cannot say
# "INSERT ... ON CONFLICT (cols) WHERE <partial index predicate> DO NOTHING
# RETURNING", which dedup needs. The rows travel as one JSON array (one
# parameter, parsed by the server in C; payloads go in as the JSON text they
# were validated as, never parsed twice), each row an array in the column
# order below. ORDER BY the ordinality makes ids follow the input order,
# which is how the returned rows are matched back to the input. Columns left
# out take their db_default. Timestamps come back as text: they repeat (one
# now() per statement), and parsing each distinct one once is far cheaper.
_COLUMNS = "(queue, topic, payload, headers, priority, run_at, max_attempts, dedup_key, group_key)"
_FROM_DOCUMENT = """SELECT r->>0, r->>1, r->2, r->3, (r->>4)::smallint,
    COALESCE((r->>5)::timestamptz, now() + make_interval(secs => (r->>6)::float8)),
    (r->>7)::integer, r->>8, r->>9
FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS input(r, n)
ORDER BY n"""
# One message: plain VALUES (no JSON document to take apart), about a quarter
# faster per call, which is what one-message-per-transaction callers pay.
_VALUES = """VALUES (%s, %s, %s::jsonb, %s::jsonb, %s,
    COALESCE(%s::timestamptz, now() + make_interval(secs => %s)), %s, %s, %s)"""
_SKIP_DEDUP = """ON CONFLICT (topic, dedup_key)
    WHERE status IN ('waiting', 'blocked', 'processing') AND dedup_key IS NOT NULL DO NOTHING"""


def _insert_sql(source, dedup):
    """The INSERT of ``source`` rows. Without dedup keys no row can be
    skipped: the returned rows are the input rows in order, so neither the
    ON CONFLICT nor the columns that match rows back are needed."""
    if dedup:
        skip, returning = f"{_SKIP_DEDUP}\n", "id, topic, dedup_key, run_at::text, created_at::text"
    else:
        skip, returning = "", "id, run_at::text, created_at::text"
    return f"INSERT INTO {{table}} {_COLUMNS}\n{source}\n{skip}RETURNING {returning}"


INSERT_SQL = _insert_sql(_FROM_DOCUMENT, dedup=True)
INSERT_NO_DEDUP_SQL = _insert_sql(_FROM_DOCUMENT, dedup=False)
INSERT_ONE_SQL = _insert_sql(_VALUES, dedup=True)
INSERT_ONE_NO_DEDUP_SQL = _insert_sql(_VALUES, dedup=False)

OPTION_NAMES = frozenset(
    {
        "delay",
        "run_at",
        "priority",
        "queue",
        "dedup_key",
        "group_key",
        "headers",
        "max_attempts",
    }
)

# jsonb cannot store the NUL character; catch "\u0000" escapes that are not
# themselves an escaped backslash followed by "u0000".
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

_INT_MAX = 2**31 - 1

# enqueue_many sends more rows than this as several INSERTs of this many, in
# pipeline mode (see _insert_stream). Smaller chunks start the server sooner
# and leave less to wait for after the last one; too small, and statements
# cost more than rows (benchmarks/enqueue_many_chunks.py: 1,000 was the
# fastest of 500, 1,000, 2,000 and 4,000).
STREAM_CHUNK = 1000

# How often a dedup'd message that finished between the INSERT and the look-up
# of the existing row is inserted again before giving up.
_DEDUP_RACE_RETRIES = 3


def enqueue(
    topic,
    payload=None,
    *,
    delay=None,
    run_at=None,
    priority=0,
    queue=None,
    dedup_key=None,
    group_key=None,
    headers=None,
    max_attempts=None,
    using=None,
):
    """Enqueue one message for ``topic`` and return it as a ``Message``.

    ``message.created`` is True when a row was inserted, False when an
    unfinished message with the same topic and ``dedup_key`` already existed
    (that message is returned instead), and None while the insert waits for
    the caller's commit on another database alias (``message.pk`` is None
    until then). ``using`` is the alias of the caller's transaction
    (default: ``"default"``).
    """
    row = _validate(
        dict(
            topic=topic,
            payload=payload,
            delay=delay,
            run_at=run_at,
            priority=priority,
            queue=queue,
            dedup_key=dedup_key,
            group_key=group_key,
            headers=headers,
            max_attempts=max_attempts,
        )
    )
    return _enqueue_rows([row], using)[0]


def enqueue_many(messages, *, using=None, **defaults):
    """Enqueue many messages in one INSERT statement; return them in input order.

    ``messages`` is an iterable of dicts, each with the keywords of
    ``enqueue`` (``topic``, ``payload``, ``delay``, ...); ``defaults`` gives
    values for keys the dicts leave out::

        enqueue_many([{"payload": {"n": n}} for n in range(1000)], topic="numbers")

    Each returned message has ``created`` set as in ``enqueue``.
    """
    known = OPTION_NAMES | {"topic", "payload"}
    unknown = sorted(set(defaults) - known)
    if unknown:
        raise InvalidMessage(
            f"enqueue_many() got unknown keyword(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    if isinstance(messages, dict | str | bytes):
        raise InvalidMessage("enqueue_many() takes an iterable of dicts, one per message")
    caller, queue_alias = _aliases(using)
    rows = _validated_rows(messages, defaults, known)
    if caller != queue_alias:
        return _enqueue_rows(list(rows), using)  # all validated now, inserted at commit
    return _insert_stream(rows, queue_alias)


def _validated_rows(messages, defaults, known):
    """The _Row of each of enqueue_many's dicts, in order, as they are consumed."""
    default_queue = conf.get("DEFAULT_QUEUE")  # once, not per message
    base = {"payload": None, "queue": default_queue, **defaults}
    # The usual bulk call gives each dict a payload and nothing else: the
    # rest comes from ``defaults``, checked once here instead of per message.
    # (If they are wrong, the first message reports it, as it would anyway.)
    shared = None
    fresh_headers = base.get("headers") is None  # each message gets a {} of its own
    if "topic" in base:
        try:
            shared = _validate(base)
        except InvalidMessage:
            pass
    for index, item in enumerate(messages):
        if not isinstance(item, dict):
            raise InvalidMessage(
                f"message {index}: expected a dict of enqueue() keywords, got {type(item).__name__}"
            )
        try:
            if shared is not None and item.keys() <= _PAYLOAD_ONLY:
                headers = {} if fresh_headers else shared.headers
                yield shared.with_payload(item.get("payload"), headers)
                continue
            if not item.keys() <= known:
                unknown = sorted(set(item) - known)
                raise InvalidMessage(
                    f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            fields = {**base, **item}
            if "topic" not in fields:
                raise InvalidMessage("no topic (give it in the dict or as topic=)")
            yield _validate(fields)
        except InvalidMessage as exc:
            raise InvalidMessage(f"message {index}: {exc}") from None


_PAYLOAD_ONLY = frozenset({"payload"})


def _aliases(using):
    """(the caller's alias, the queue's alias); the caller's must exist."""
    caller = DEFAULT_DB_ALIAS if using is None else using
    if caller not in connections.settings:
        raise InvalidMessage(f"using={caller!r} is not a database alias in DATABASES")
    return caller, conf.get("DATABASE")


def _insert_stream(rows, alias):
    """enqueue_many on the queue's own database. Fewer than STREAM_CHUNK rows:
    one INSERT. More: one transaction (a savepoint of the caller's) in which each
    chunk's INSERT is sent in pipeline mode as soon as it is validated, so
    the server inserts a chunk while the next one is checked; the results
    are read at the end. A bad row rolls every chunk back."""
    chunk = list(itertools.islice(rows, STREAM_CHUNK))
    if len(chunk) < STREAM_CHUNK:
        messages = [_unsaved_message(row) for row in chunk]
        if messages:
            _insert(messages, chunk, alias)
        return messages
    connection = connections[alias]
    messages, all_rows, sent = [], [], []
    with transaction.atomic(using=alias):
        with connection.wrap_database_errors, connection.connection.pipeline():
            while chunk:
                sent.append((len(messages), len(chunk), *_send_insert(connection, chunk)))
                messages += [_unsaved_message(row) for row in chunk]
                all_rows += chunk
                chunk = list(itertools.islice(rows, STREAM_CHUNK))
            skipped = []
            for offset, size, cursor, dedup in sent:
                with cursor:
                    returned = sorted(cursor.fetchall())
                chunk_messages = messages[offset : offset + size]
                skipped += [
                    offset + i for i in _match_returned(chunk_messages, returned, dedup, alias)
                ]
        _insert(messages, all_rows, alias, first_skipped=skipped)
    return messages


def _enqueue_rows(rows, using):
    caller, queue_alias = _aliases(using)
    messages = [_unsaved_message(row) for row in rows]
    if caller == queue_alias:
        _insert(messages, rows, queue_alias)
    else:
        # The queue is on another database: its insert cannot join the
        # caller's transaction, so it waits for that transaction's commit.
        transaction.on_commit(lambda: _insert(messages, rows, queue_alias), using=caller)
    return messages


def _insert(messages, rows, alias, first_skipped=None):
    """Insert ``rows`` on ``alias`` and fill in ``messages`` (same order).
    ``first_skipped``: the rows were inserted already (by _insert_stream),
    these indexes were skipped by a dedup_key conflict."""
    pending = list(range(len(rows)))
    for attempt in range(_DEDUP_RACE_RETRIES):
        if attempt == 0 and first_skipped is not None:
            skipped = first_skipped
        else:
            skipped = _insert_once(
                [messages[i] for i in pending], [rows[i] for i in pending], alias
            )
        pending = [pending[i] for i in skipped]
        if not pending:
            break
        missing = _adopt_existing([messages[i] for i in pending], alias)
        pending = [pending[i] for i in missing]
        if not pending:
            break
    else:
        raise InvalidMessage(
            "could not enqueue: the unfinished message with the same dedup_key kept "
            "finishing between the insert and its look-up"
        )
    created = [m for m in messages if m.created]
    if created:
        transaction.on_commit(lambda: _send_enqueued(created, alias), using=alias)


def _insert_once(messages, rows, alias):
    """One INSERT; returns the indexes (into ``rows``) that a dedup_key conflict skipped."""
    cursor, dedup = _send_insert(connections[alias], rows)
    returned = sorted(cursor.fetchall())  # ids ascend in input order
    if len(rows) > 1:
        cursor.close()  # its own cursor (prepared_cursor's one stays open)
    return _match_returned(messages, returned, dedup, alias)


def _send_insert(connection, rows):
    """Execute the INSERT of ``rows``; returns (its cursor, whether it skips
    dedup conflicts). In pipeline mode the rows come back later."""
    dedup = any(row.dedup_key is not None for row in rows)
    table = connection.ops.quote_name(Message._meta.db_table)
    if len(rows) == 1:
        # The statement one-message-per-transaction callers repeat: prepared.
        sql = (INSERT_ONE_SQL if dedup else INSERT_ONE_NO_DEDUP_SQL).format(table=table)
        params = rows[0].values()
        cursor = prepared_cursor(connection)
    else:
        sql = (INSERT_SQL if dedup else INSERT_NO_DEDUP_SQL).format(table=table)
        params = ["[" + ",".join(row.as_json() for row in rows) + "]"]
        cursor = connection.cursor()
    cursor.execute(sql, params)
    return cursor, dedup


def _match_returned(messages, returned, dedup, alias):
    """Fill ``messages`` in from the INSERT's ``returned`` rows (sorted by id,
    that is in input order); returns the indexes a dedup conflict skipped."""
    # One INSERT has one now(): its rows share created_at and, undelayed,
    # run_at; each distinct text is parsed once.
    parsed = {}

    def when(text):
        value = parsed.get(text)
        if value is None:
            value = parsed[text] = timestamp_from_text(text)
        return value

    if not dedup:
        if len(returned) != len(messages):
            raise RuntimeError("INSERT returned fewer rows than it was given")
        for message, (pk, run_at, created_at) in zip(messages, returned, strict=True):
            _saved(message, pk, when(run_at), when(created_at), alias)
        return []
    skipped = []
    position = 0
    for index, message in enumerate(messages):
        if position < len(returned):
            pk, topic, dedup_key, run_at, created_at = returned[position]
            same_key = (topic, dedup_key) == (message.topic, message.dedup_key)
            if message.dedup_key is None or same_key:
                _saved(message, pk, when(run_at), when(created_at), alias)
                position += 1
                continue
        if message.dedup_key is None:  # only a dedup conflict may skip a row
            raise RuntimeError("INSERT returned fewer rows than it was given")
        skipped.append(index)
    return skipped


def _saved(message, pk, run_at, created_at, alias):
    message.id, message.run_at = pk, run_at
    if message.group_key is not None:
        message.status = Status.BLOCKED  # the insert trigger's doing (migration 0009)
    message.created_at = message.updated_at = created_at
    message.created = True
    message._state.adding, message._state.db = False, alias


def _adopt_existing(messages, alias):
    """Point each dedup'd message at the unfinished row that holds its key.

    Returns the indexes whose row finished meanwhile, to be inserted again.
    """
    wanted = Q()
    for message in messages:
        wanted |= Q(topic=message.topic, dedup_key=message.dedup_key)
    existing = {
        (m.topic, m.dedup_key): m
        for m in Message.objects.using(alias).filter(wanted, status__in=UNFINISHED)
    }
    missing = []
    for index, message in enumerate(messages):
        found = existing.get((message.topic, message.dedup_key))
        if found is None:
            missing.append(index)
            continue
        message.__dict__.update(
            {f.attname: getattr(found, f.attname) for f in Message._meta.concrete_fields}
        )
        message.created = False
        message._state.adding, message._state.db = False, alias
    return missing


def _send_enqueued(messages, alias):
    if signals.message_enqueued.has_listeners(Message):
        for message in messages:
            signals.send(signals.message_enqueued, sender=Message, message=message, using=alias)


def _unsaved_message(row):
    """The Message an enqueue returns, built the way ``Model.from_db`` fills
    an instance (attributes set directly; ``Model.__init__`` would cost more
    than the insert itself in a large ``enqueue_many``)."""
    message = Message.__new__(Message)
    message.__dict__ = {
        **_BLANK_FIELDS,
        "queue": row.queue,
        "topic": row.topic,
        "payload": row.payload,
        "headers": row.headers,
        "priority": row.priority,
        "run_at": row.run_at,
        "max_attempts": row.max_attempts,
        "dedup_key": row.dedup_key,
        "group_key": row.group_key,
        "_state": ModelState(),
        "created": None,
    }
    return message


# Every concrete field's attribute on a fresh, unsaved message.
_BLANK_FIELDS = {
    **{field.attname: None for field in Message._meta.concrete_fields},
    "status": Status.WAITING,
    "priority": 0,
    "attempts": 0,
    "locked_by": "",
    "last_error": "",
    "last_error_category": "",
}


@dataclass(slots=True)  # not frozen: its __init__ would cost more (enqueue_many makes many)
class _Row:
    """One validated message: the caller's objects and the column values."""

    queue: str
    topic: str
    payload: object
    headers: dict
    payload_json: str
    headers_json: str
    priority: int
    run_at: datetime.datetime | None
    delay_seconds: float
    max_attempts: int | None
    dedup_key: str | None
    group_key: str | None

    def with_payload(self, payload, headers):
        """This row with another payload (checked here) and headers dict."""
        return _Row(
            self.queue,
            self.topic,
            payload,
            headers,
            _to_json("payload", payload),
            self.headers_json,
            self.priority,
            self.run_at,
            self.delay_seconds,
            self.max_attempts,
            self.dedup_key,
            self.group_key,
        )

    def values(self):
        """The row as INSERT_ONE_SQL's parameters."""
        return [
            self.queue,
            self.topic,
            self.payload_json,
            self.headers_json,
            self.priority,
            self.run_at,
            self.delay_seconds,
            self.max_attempts,
            self.dedup_key,
            self.group_key,
        ]

    def as_json(self):
        """The row as INSERT_SQL reads it: a JSON array in its column order.
        Queue and topic names are limited to a plain alphabet (conf.NAME_RE),
        so they need no escaping; the payload and headers are already JSON."""
        return (
            f'["{self.queue}","{self.topic}",{self.payload_json},{self.headers_json},'
            f"{self.priority},{_json_or_null(self.run_at and self.run_at.isoformat())},"
            f"{self.delay_seconds!r},{_json_or_null(self.max_attempts)},"
            f"{_json_or_null(self.dedup_key)},{_json_or_null(self.group_key)}]"
        )


def _json_or_null(value):
    return "null" if value is None else json.dumps(value)


def _validate(fields):
    """Check one message's fields; return its _Row or raise InvalidMessage."""
    topic = fields["topic"]
    problem = _name_problem("topic", topic, conf.TOPIC_MAX_LENGTH)
    if problem:
        raise InvalidMessage(problem)

    queue = fields.get("queue")
    if queue is None:
        queue = conf.get("DEFAULT_QUEUE")
    problem = _name_problem("queue", queue, conf.QUEUE_MAX_LENGTH)
    if problem:
        raise InvalidMessage(problem)

    payload = fields.get("payload")
    payload_json = _to_json("payload", payload)
    headers = fields.get("headers")
    if headers is None:
        headers = {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) for k in headers):
        raise InvalidMessage("headers must be a dict with string keys")
    headers_json = _to_json("headers", headers)

    priority = fields.get("priority", 0)
    if not conf.is_int(priority):
        raise InvalidMessage(f"priority must be an integer, not {type(priority).__name__}")
    if not conf.PRIORITY_MIN <= priority <= conf.PRIORITY_MAX:
        raise InvalidMessage(
            f"priority {priority} is out of range "
            f"[{conf.PRIORITY_MIN}, {conf.PRIORITY_MAX}] (higher runs first)"
        )

    delay, run_at = fields.get("delay"), fields.get("run_at")
    if delay is not None and run_at is not None:
        raise InvalidMessage("give delay or run_at, not both")
    delay_seconds = _delay_seconds(delay)
    if run_at is not None:
        run_at = _run_at(run_at)

    max_attempts = fields.get("max_attempts")
    if max_attempts is not None and (
        not conf.is_int(max_attempts) or not 1 <= max_attempts <= _INT_MAX
    ):
        raise InvalidMessage(
            f"max_attempts must be a whole number of at least 1, not {max_attempts!r}"
        )

    dedup_key = _key("dedup_key", fields.get("dedup_key"))
    group_key = _key("group_key", fields.get("group_key"))

    return _Row(
        queue=queue,
        topic=topic,
        payload=payload,
        headers=headers,
        payload_json=payload_json,
        headers_json=headers_json,
        priority=priority,
        run_at=run_at,
        delay_seconds=delay_seconds,
        max_attempts=max_attempts,
        dedup_key=dedup_key,
        group_key=group_key,
    )


_GOOD_NAMES = set()  # (kind, name) already checked: a few topics and queues, again and again


def _name_problem(kind, value, max_length):
    if isinstance(value, str) and (kind, value) in _GOOD_NAMES:
        return None
    problem = conf.name_problem(kind, value, max_length)
    if problem is None and len(_GOOD_NAMES) < 10_000:
        _GOOD_NAMES.add((kind, value))
    return problem


# One encoder for every call (json.dumps(cls=...) would build one per call).
_ENCODER = DjangoJSONEncoder(allow_nan=False)


def _to_json(what, value):
    if value == {} and type(value) is dict:  # headers, nearly always
        return "{}"
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidMessage(f"{what} is not JSON-serializable: {exc}") from None
    except RecursionError:
        raise InvalidMessage(f"{what} is nested too deeply to serialize") from None
    if _JSON_NUL.search(text):
        raise InvalidMessage(
            f"{what} contains a NUL character (\\u0000), which PostgreSQL cannot store"
        )
    problem = _content_problem(value, surrogates="\\ud" in text)
    if problem:
        raise InvalidMessage(f"{what} {problem}")
    return text


def _content_problem(value, surrogates):
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


def _has_surrogate(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# A naive run_at (USE_TZ = False) is read in the session's time zone, less
# than a day from UTC: the day of margin in the bounds covers it.
_NAIVE_MIN, _NAIVE_MAX = TIMESTAMP_MIN.replace(tzinfo=None), TIMESTAMP_MAX.replace(tzinfo=None)


def _run_at(run_at):
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


def _delay_seconds(delay):
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


def _key(name, value):
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidMessage(f"{name} must be a non-empty string or None, not {value!r}")
    if len(value) > conf.KEY_MAX_LENGTH:
        raise InvalidMessage(
            f"{name} is {len(value)} characters long; the limit is {conf.KEY_MAX_LENGTH}"
        )
    return value


# --- for deadletters.revive() ---------------------------------------------------


def check_payload(payload):
    """Raise ``InvalidMessage`` if ``payload`` cannot be a message's payload
    (the admin's form checks an edited dead letter's payload with it)."""
    _to_json("payload", payload)


def check_message(**fields):
    """Raise ``InvalidMessage`` if ``enqueue(**fields)`` would; write nothing.

    A bulk caller (``deadletters.revive``) checks each row first and sets the
    bad ones aside, instead of having one bad row fail a whole
    ``enqueue_many()`` call.
    """
    if "topic" not in fields:
        raise InvalidMessage("no topic")
    _validate({"payload": None, **fields})
