"""enqueue() and enqueue_many(): the only place that inserts ``Message`` rows.

A message follows the caller's transaction. On the queue's own database the
row is inserted inside that transaction, so it becomes visible, and its
NOTIFY is delivered, only when the caller commits; a rollback (or a rolled
back savepoint) discards it. When the queue lives on another database alias,
the insert waits for the caller's commit through ``transaction.on_commit``.

Bad input raises ``InvalidMessage`` at the call site and writes nothing
(``validation.py`` holds the checks; a large ``enqueue_many`` validates and
sends its rows a chunk at a time, in one transaction that the error rolls
back).
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Unpack

from django.db import connections, transaction
from django.db.models import Q

from django_pgqueue import conf, signals, tracing
from django_pgqueue.db import prepared_cursor
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.fields import timestamp_from_text
from django_pgqueue.models import UNFINISHED, Message, Status
from django_pgqueue.sql.insert import (
    FAIR_INSERTS,
    INSERT_NO_DEDUP_SQL,
    INSERT_ONE_NO_DEDUP_SQL,
    INSERT_ONE_PLAIN_SQL,
    INSERT_ONE_SQL,
    INSERT_SHARED_NO_DEDUP_SQL,
    INSERT_SHARED_SQL,
    INSERT_SQL,
)
from django_pgqueue.validation import (
    FIELD_NAMES,
    MessageFields,
    Options,
    Row,
    check_using,
    payloads_json,
    rows_json,
    validate_many,
    validate_one,
)

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.utils import CursorWrapper

# enqueue_many sends more rows than this as several INSERTs of this many, in
# pipeline mode (see _insert_stream). Smaller chunks start the server sooner
# and leave less to wait for after the last one; too small, and statements
# cost more than rows (benchmarks/enqueue_many_chunks.py compares sizes).
STREAM_CHUNK = 1000

# How often a dedup'd message that finished between the INSERT and the look-up
# of the existing row is inserted again before giving up.
_DEDUP_RACE_RETRIES = 3


def enqueue(
    topic: str,
    payload: Any = None,
    *,
    delay: float | datetime.timedelta | None = None,
    run_at: datetime.datetime | None = None,
    priority: int = 0,
    queue: str | None = None,
    dedup_key: str | None = None,
    group_key: str | None = None,
    headers: dict[str, Any] | None = None,
    max_attempts: int | None = None,
    partition_key: str | None = None,
    using: str | None = None,
) -> Message:
    """Enqueue one message for ``topic`` and return it as a ``Message``.

    ``message.created`` is True when a row was inserted, False when an
    unfinished message with the same topic and ``dedup_key`` already existed
    (that message is returned instead), and None while the insert waits for
    the caller's commit on another database alias (``message.pk`` is None
    until then). ``using`` is the alias of the caller's transaction
    (default: ``"default"``).

    ``partition_key`` (a non-empty string of at most 255 characters, e.g.
    ``"tenant:42"``) puts the message in that partition of its queue;
    without one it is in the queue's default partition. The key is kept
    with the message, its dead letter and its revival, and shown per queue
    by ``pgqueue_status`` and the Queues page. The claim shares a queue
    fairly between its partitions (unless the queue's settings say
    ``"fair": False``), and a queue's ``"partition"`` limits hold for each
    of them (docs: *Fair shares between tenants*).
    """

    def insert(headers: dict[str, Any] | None) -> Message:
        row = validate_one(
            topic, payload, delay, run_at, priority, queue, dedup_key, group_key, headers,
            max_attempts, partition_key,
        )  # fmt: skip
        return _enqueue_one(row, using)

    tracer = tracing.tracer()
    if tracer is None:
        return insert(headers)
    destination = queue or conf.get("DEFAULT_QUEUE")
    with tracing.producing(tracer, destination, topic) as (span, carrier):
        message = insert(tracing.with_context(headers, carrier))
        tracing.sent(span, message.pk)
        return message


def enqueue_many(
    messages: Iterable[dict[str, Any]],
    *,
    using: str | None = None,
    **defaults: Unpack[MessageFields],
) -> list[Message]:
    """Enqueue many messages in one INSERT statement; return them in input order.

    ``messages`` is an iterable of dicts, each with the keywords of
    ``enqueue`` (``topic``, ``payload``, ``delay``, ...); ``defaults`` gives
    values for keys the dicts leave out::

        enqueue_many([{"payload": {"n": n}} for n in range(1000)], topic="numbers")

    Each returned message has ``created`` set as in ``enqueue``.
    """
    unknown = sorted(set(defaults) - FIELD_NAMES)
    if unknown:
        raise InvalidMessage(
            f"enqueue_many() got unknown keyword(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(FIELD_NAMES))}"
        )
    if isinstance(messages, dict | str | bytes):
        raise InvalidMessage("enqueue_many() takes an iterable of dicts, one per message")
    tracer = tracing.tracer()
    if tracer is None:
        return _enqueue_many(messages, using, defaults)
    destination = defaults.get("queue") or conf.get("DEFAULT_QUEUE")
    count = len(messages) if isinstance(messages, Sequence) else None
    with tracing.producing(tracer, destination, defaults.get("topic"), count) as (_, carrier):
        if not carrier:  # no SDK configured: nothing to carry
            return _enqueue_many(messages, using, defaults)
        given = defaults.get("headers")
        traced = defaults["headers"] = tracing.with_context(given, carrier)
        enqueued = _enqueue_many(tracing.with_context_many(messages, carrier), using, defaults)
        if given is None:
            # Each message its own headers, as without tracing (the shared
            # dict was the statement's, not the caller's).
            for message in enqueued:
                if message.headers is traced:
                    message.headers = dict(traced)
        return enqueued


def _enqueue_many(
    messages: Iterable[dict[str, Any]], using: str | None, defaults: MessageFields
) -> list[Message]:
    caller = check_using(using)
    rows = validate_many(messages, defaults)
    if len(conf.databases()) > 1:
        return _enqueue_routed(list(rows), caller)
    queue_alias = conf.get("DATABASE")
    if caller != queue_alias:
        return _enqueue_rows(list(rows), caller, queue_alias)  # validated now, inserted at commit
    return _insert_stream(rows, queue_alias)


def _enqueue_routed(rows: list[Row], caller: str) -> list[Message]:
    """enqueue_many when queues live on several databases: the rows of each
    database as one enqueue_many there (in the caller's transaction on its
    own alias, at its commit on the others); the messages in input order."""
    database_of = {queue: conf.queue_database(queue) for queue in {r.options.queue for r in rows}}
    indexes: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        indexes.setdefault(database_of[row.options.queue], []).append(i)
    messages: list[Message] = [None] * len(rows)  # type: ignore[list-item]  # all filled below
    for alias, taken in indexes.items():
        part = [rows[i] for i in taken]
        if alias == caller:
            enqueued = _insert_stream(iter(part), alias)
        else:
            enqueued = _enqueue_rows(part, caller, alias)
        for i, message in zip(taken, enqueued, strict=True):
            messages[i] = message
    return messages


def _enqueue_rows(rows: list[Row], caller: str, queue_alias: str) -> list[Message]:
    messages = [_unsaved(row) for row in rows]
    if caller == queue_alias:
        _insert(messages, rows, queue_alias)
    else:
        # The queue is on another database: its insert cannot join the
        # caller's transaction, so it waits for that transaction's commit.
        transaction.on_commit(lambda: _insert(messages, rows, queue_alias), using=caller)
    return messages


def _enqueue_one(row: Row, using: str | None) -> Message:
    """enqueue()'s message. On the queue's own database, _insert's short way
    for one row: the prepared INSERT on the kept cursor, and a look-up only
    if a dedup conflict returned no row. One-message-per-transaction callers
    pay for every Python call here (benchmarks/instructions.py)."""
    caller, queue_alias = check_using(using), conf.queue_database(row.options.queue)
    if caller != queue_alias:
        return _enqueue_rows([row], caller, queue_alias)[0]
    message = _unsaved(row)
    connection = connections[queue_alias]
    cursor = prepared_cursor(connection)
    o = row.options
    if _is_plain(o):
        cursor.execute(
            _one_sql(connection, INSERT_ONE_PLAIN_SQL), [o.queue, o.topic, row.payload_json]
        )
    else:
        template = INSERT_ONE_SQL if o.dedup_key is not None else INSERT_ONE_NO_DEDUP_SQL
        params = _insert_values(row)
        if o.partition_key is not None:
            template, params = FAIR_INSERTS[template], [_unfair(), *params]
        cursor.execute(_one_sql(connection, template), params)
    returned = cursor.fetchone()
    if returned is None:  # an unfinished message holds the dedup_key
        _insert([message], [row], queue_alias, first_skipped=[0])
    else:
        _saved(message, returned[0], returned[-2], returned[-1], queue_alias)
        # (Nothing to send after the commit when nothing listens now.)
        if signals.message_enqueued.receivers:
            connection.on_commit(lambda: _send_enqueued([message], queue_alias))
    return message


def _is_plain(o: Options) -> bool:
    """Whether every option but the names is its default (INSERT_ONE_PLAIN_SQL)."""
    return (
        o.headers_json == "{}"
        and o.priority == 0
        and o.delay_seconds == 0.0
        and o.run_at is None
        and o.max_attempts is None
        and o.dedup_key is None
        and o.group_key is None
        and o.partition_key is None
    )


_ONE_SQL: dict[str, str] = {}  # a one-message INSERT template -> its text for the table


def _one_sql(connection: BaseDatabaseWrapper, template: str) -> str:
    sql = _ONE_SQL.get(template)
    if sql is None:
        table = connection.ops.quote_name(Message._meta.db_table)
        sql = _ONE_SQL[template] = template.format(table=table)
    return sql


def _insert_stream(rows: Iterator[Row], alias: str) -> list[Message]:
    """enqueue_many on the queue's own database. Fewer than STREAM_CHUNK rows:
    one INSERT. More: one transaction (a savepoint of the caller's) in which each
    chunk's INSERT is sent in pipeline mode as soon as it is validated, so
    the server inserts a chunk while the next one is checked (and its
    messages built); the results are read at the end. A bad row rolls every
    chunk back."""
    chunk = list(itertools.islice(rows, STREAM_CHUNK))
    if len(chunk) < STREAM_CHUNK:
        messages = [_unsaved(row) for row in chunk]
        if messages:
            _insert(messages, chunk, alias)
        return messages
    connection = connections[alias]
    messages, all_rows = [], []
    sent: list[tuple[int, int, CursorWrapper, bool]] = []
    with transaction.atomic(using=alias):
        with connection.wrap_database_errors, connection.connection.pipeline():
            while chunk:
                sent.append((len(messages), len(chunk), *_send_insert(connection, chunk)))
                messages += [_unsaved(row) for row in chunk]
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


def _insert(
    messages: list[Message],
    rows: Sequence[Row],
    alias: str,
    first_skipped: list[int] | None = None,
) -> None:
    """Insert ``rows`` on ``alias`` and fill in ``messages`` (same order).
    ``first_skipped``: the rows were inserted already (by _insert_stream),
    these indexes were skipped by a dedup_key conflict."""
    pending = list(range(len(rows)))
    for attempt in range(_DEDUP_RACE_RETRIES):
        if attempt > 0:
            skipped = _insert_once(
                [messages[i] for i in pending], [rows[i] for i in pending], alias
            )
        elif first_skipped is None:
            skipped = _insert_once(messages, rows, alias)
        else:
            skipped = first_skipped
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


def _insert_once(messages: list[Message], rows: Sequence[Row], alias: str) -> list[int]:
    """One INSERT; returns the indexes (into ``rows``) that a dedup_key conflict skipped."""
    cursor, dedup = _send_insert(connections[alias], rows)
    returned = sorted(cursor.fetchall())  # ids ascend in input order
    if len(rows) > 1:
        cursor.close()  # its own cursor (prepared_cursor's one stays open)
    return _match_returned(messages, returned, dedup, alias)


def _send_insert(
    connection: BaseDatabaseWrapper, rows: Sequence[Row]
) -> tuple[CursorWrapper, bool]:
    """Execute the INSERT of ``rows``; returns (its cursor, whether it skips
    dedup conflicts). In pipeline mode the rows come back later."""
    dedup = any(row.options.dedup_key is not None for row in rows)
    keyed = any(row.options.partition_key is not None for row in rows)
    table = connection.ops.quote_name(Message._meta.db_table)
    cursor: CursorWrapper
    if len(rows) == 1:
        # The statement one-message-per-transaction callers repeat: prepared.
        template = INSERT_ONE_SQL if dedup else INSERT_ONE_NO_DEDUP_SQL
        params = _insert_values(rows[0])
        cursor = prepared_cursor(connection)
    else:
        shared = rows[0].options
        if all(row.options is shared for row in rows):
            template = INSERT_SHARED_SQL if dedup else INSERT_SHARED_NO_DEDUP_SQL
            params = [*_option_values(shared), payloads_json(rows)]
        else:
            template = INSERT_SQL if dedup else INSERT_NO_DEDUP_SQL
            params = [rows_json(rows)]
        cursor = connection.cursor()
    if keyed:
        template, params = FAIR_INSERTS[template], [_unfair(), *params]
    sql = _one_sql(connection, template) if len(rows) == 1 else template.format(table=table)
    cursor.execute(sql, params)
    return cursor, dedup


def _unfair() -> list[str]:
    """The queues with "fair": False, as the fair INSERTs' first parameter."""
    return sorted(conf.unfair_queues())


def _insert_values(row: Row) -> list[Any]:
    """The row as INSERT_ONE_SQL's parameters."""
    o = row.options
    return [
        *(o.queue, o.topic, row.payload_json, o.headers_json, o.priority),
        *(o.run_at, o.delay_seconds, o.max_attempts, o.dedup_key, o.group_key),
        o.partition_key,
    ]


def _option_values(o: Options) -> list[Any]:
    """INSERT_SHARED_SQL's parameters before the payloads."""
    return [
        *(o.queue, o.topic, o.headers_json, o.priority, o.run_at, o.delay_seconds),
        *(o.max_attempts, o.dedup_key, o.group_key, o.partition_key),
    ]


def _match_returned(
    messages: list[Message], returned: list[tuple[Any, ...]], dedup: bool, alias: str
) -> list[int]:
    """Fill ``messages`` in from the INSERT's ``returned`` rows (sorted by id,
    that is in input order); returns the indexes a dedup conflict skipped.
    An INSERT has one now(): its timestamps repeat, and timestamp_from_text
    parses each distinct text once."""
    if not dedup:
        if len(returned) != len(messages):
            raise RuntimeError("INSERT returned fewer rows than it was given")
        for message, (pk, run_at, created_at) in zip(messages, returned, strict=True):
            _saved(message, pk, run_at, created_at, alias)
        return []
    skipped = []
    position = 0
    for index, message in enumerate(messages):
        if position < len(returned):
            pk, topic, dedup_key, run_at, created_at = returned[position]
            same_key = (topic, dedup_key) == (message.topic, message.dedup_key)
            if message.dedup_key is None or same_key:
                _saved(message, pk, run_at, created_at, alias)
                position += 1
                continue
        if message.dedup_key is None:  # only a dedup conflict may skip a row
            raise RuntimeError("INSERT returned fewer rows than it was given")
        skipped.append(index)
    return skipped


def _unsaved(row: Row) -> Message:
    """The message an enqueue returns, as the INSERT will store it, unsaved
    (``created`` None) until ``_saved`` gives it what the INSERT returned,
    as ``bulk_create`` treats the instances it inserts. Built with
    ``Message.from_db`` from the row's values (Django's own path whenever
    ``__init__`` must run: see Message.from_db), then marked unsaved, which
    costs a fraction of ``Message(...)`` per message; built while the
    server inserts (the pipelined enqueue_many) where it can be: this is
    the largest per-message cost of a large enqueue_many in Python."""
    o = row.options
    values = (  # in _FIELDS order
        None, o.queue, o.topic, row.payload, row.headers, Status.WAITING, o.priority, o.run_at,
        0, o.max_attempts, None, "", None, o.dedup_key, o.group_key, "", "", None, None, None,
        None, None, o.partition_key, None,
    )  # fmt: skip
    message = Message.from_db(None, _FIELDS, values)
    message._state.adding = True
    message.created = None
    return message


# Message's concrete fields in the order _unsaved passes their values.
_FIELDS = (
    *("id", "queue", "topic", "payload", "headers", "status", "priority", "run_at"),
    *("attempts", "max_attempts", "lease_expires_at", "locked_by", "lease_token"),
    *("dedup_key", "group_key", "last_error", "last_error_category", "first_failed_at"),
    *("created_at", "updated_at", "cancel_requested_at", "workflow_step_id", "partition_key"),
    "fair_tag",
)
if _FIELDS != tuple(field.attname for field in Message._meta.concrete_fields):
    raise RuntimeError("enqueuing._FIELDS must list Message's concrete fields in their order")


def _saved(message: Message, pk: int, run_at: str, created_at: str, alias: str) -> None:
    """Give ``message`` what the INSERT returned, as Model.save() and
    bulk_create() leave an instance they inserted."""
    message.id, message.run_at = pk, timestamp_from_text(run_at)
    if message.group_key is not None:
        message.status = Status.BLOCKED  # the insert trigger's doing (migration 0009)
    message.created_at = message.updated_at = timestamp_from_text(created_at)
    message.created = True
    message._state.adding, message._state.db = False, alias


def _adopt_existing(messages: list[Message], alias: str) -> list[int]:
    """Point each dedup'd message at the unfinished row that holds its key
    (its fields set from that row, as Model.refresh_from_db does).

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
        for name in _FIELDS:
            setattr(message, name, getattr(found, name))
        message.created = False
        message._state.adding, message._state.db = False, alias
    return missing


def _send_enqueued(messages: list[Message], alias: str) -> None:
    if signals.message_enqueued.has_listeners(Message):
        for message in messages:
            signals.send(signals.message_enqueued, sender=Message, message=message, using=alias)
