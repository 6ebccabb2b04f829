"""Dead-letter triage: revive(), resolve() and categorize(), the only module
that changes ``DeadLetter.state``::

    new --revive--> revived        (a new Message in the queue, attempts 0)
     '--resolve--> resolved        (kept for audit, with who and a note)
    revived/resolved --revive(force=True)--> revived (again)

Each function takes a ``DeadLetter`` queryset, or an iterable of ids (or of
``DeadLetter`` instances), and works through it in chunks of ``chunk_size``
rows in id order, one transaction per chunk. A chunk's rows are locked with
``SELECT ... FOR UPDATE`` (waiting, not skipping) and their state re-read
under the lock: two operators reviving the same rows at once revive each
row once; the second one finds it revived and skips it. A failure rolls back
its own chunk only; earlier chunks stay done. Only the ids of one chunk, and
that chunk's rows, are in memory at a time.

Rows that are left alone are counted by reason in the returned
``TriageResult``. Bad arguments raise ``DeadLetterError`` before anything is
written. Who did it and the note go into ``notes``, one line per change.
"""

import collections
import datetime
import logging
import math
import time
from dataclasses import dataclass, field

from django.db import connections, transaction
from django.db.models import Case, F, Max, QuerySet, TextField, Value, When
from django.db.models.functions import Concat
from django.utils import timezone

from django_pgqueue import conf, lifecycle
from django_pgqueue.enqueuing import check_message, enqueue_many
from django_pgqueue.exceptions import DeadLetterError, InvalidMessage
from django_pgqueue.models import UNFINISHED, Category, DeadLetter, DeadLetterState, Message

logger = logging.getLogger(__name__)

CHUNK_SIZE = 500

# Why a row was left alone: the keys of TriageResult.skipped.
ALREADY_REVIVED = "already revived"
IS_RESOLVED = "resolved"
DUPLICATE = "duplicate"  # an unfinished message holds the same topic and dedup_key
INVALID = "invalid"  # the message could not be enqueued as it is (see the log)
ALREADY_RESOLVED = "already resolved"
IS_REVIVED = "revived"
UNCHANGED = "category unchanged"
GONE = "gone"  # deleted (purged) between the selection and the lock

_PAST = {"revive": "revived", "resolve": "resolved", "categorize": "categorized"}

_ACTOR_MAX_LENGTH = DeadLetter._meta.get_field("resolved_by").max_length

# What resolve() and categorize() read of a row: the state, and what the log says.
_LOG_FIELDS = ("id", "message_id", "topic", "state", "category")


@dataclass
class TriageResult:
    """What one revive(), resolve() or categorize() call did (or, with
    ``dry_run``, would do): ``done`` rows changed, ``skipped`` rows by reason."""

    action: str
    dry_run: bool = False
    done: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self):
        return self.done + sum(self.skipped.values())

    def __str__(self):
        would = "would " if self.dry_run else ""
        text = f"{would}{self.action if self.dry_run else _PAST[self.action]} {self.done}"
        skipped = sum(self.skipped.values())
        text += f", {would}{'skip' if self.dry_run else 'skipped'} {skipped}"
        if skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
            text += f" ({reasons})"
        return ("dry run: " if self.dry_run else "") + text


def revive(
    dead_letters,
    *,
    queue=None,
    topic=None,
    force=False,
    by="",
    note="",
    rate=None,
    dry_run=False,
    now=None,
    chunk_size=CHUNK_SIZE,
    clock=time.monotonic,
    sleep=time.sleep,
):
    """Put dead letters back into the queue as new messages.

    Each becomes a waiting ``Message`` with the same topic, payload, headers,
    priority, queue, group_key, dedup_key and max_attempts, and 0 attempts,
    inserted through the producer's INSERT (so its NOTIFY wakes the
    workers); ``queue=`` or ``topic=`` sends it elsewhere instead. In the
    same transaction the dead letter becomes ``revived`` with
    ``revived_at``, ``revive_count + 1``, ``revived_message_id``,
    ``revived_by`` (``by``: a name or a user) and a line in ``notes`` saying
    who and ``note``.

    Skipped: dead letters already revived or resolved, unless ``force``;
    those whose dedup_key an unfinished message of the topic holds
    (``DUPLICATE``: that message already carries the work; resolve the dead
    letter, or revive it when the other has finished); those the producer
    rejects (``INVALID``; revive them with another ``topic=``/``queue=``).

    ``rate``: revive at most this many messages per second, sleeping between
    chunks (outside any transaction, so call it in autocommit mode), so that
    a large redrive trickles in instead of flooding the workers. ``clock``
    and ``sleep`` are for tests.
    """
    using = conf.database_alias()
    queue = _name_or_none("queue", queue, conf.QUEUE_MAX_LENGTH)
    topic = _name_or_none("topic", topic, conf.TOPIC_MAX_LENGTH)
    by, note = _actor(by), _note(note)
    chunk_size = _chunk_size(chunk_size)
    if rate is not None:
        if not _is_number(rate) or not 0 < rate < math.inf:
            raise DeadLetterError(f"rate must be a number of messages per second > 0, not {rate!r}")
        if not dry_run and connections[using].in_atomic_block:
            raise DeadLetterError(
                "revive(rate=...) sleeps between chunks and must not hold a transaction open: "
                "call it outside transaction.atomic()"
            )
        chunk_size = max(1, min(chunk_size, int(rate)))
    batches = _id_batches(dead_letters, using, chunk_size)

    reviver = _Reviver(using, queue, topic, force, by, note, now, TriageResult("revive", dry_run))
    started = clock()
    for ids in batches:
        if rate is not None and not dry_run and reviver.result.done:
            wait = started + reviver.result.done / rate - clock()
            if wait > 0:
                sleep(wait)
        reviver.revive_chunk(ids)
    return reviver.result


@dataclass
class _Reviver:
    """One revive() call: its options, its result so far, and (for a dry run)
    the dedup keys its earlier chunks would have taken."""

    using: str
    queue: str | None
    topic: str | None
    force: bool
    by: str
    note: str
    now: datetime.datetime | None
    result: TriageResult
    planned_keys: set = field(default_factory=set)

    def revive_chunk(self, ids):
        result, skips = self.result, []  # skips: (row, reason, detail for the log)
        with transaction.atomic(using=self.using):
            rows = _locked(ids, self.using, result, lock=not result.dry_run)
            now = self.now or timezone.now()
            candidates = []  # (row, fields of its new message)
            for row in rows:
                if row.state == DeadLetterState.REVIVED and not self.force:
                    result.skipped[ALREADY_REVIVED] += 1
                elif row.state == DeadLetterState.RESOLVED and not self.force:
                    result.skipped[IS_RESOLVED] += 1
                else:
                    fields = self.message_fields(row)
                    try:
                        check_message(**fields)
                    except InvalidMessage as exc:
                        skips.append((row, INVALID, str(exc)))
                    else:
                        candidates.append((row, fields))

            # Dedup: an unfinished message holding the key already carries the
            # work. The INSERT's ON CONFLICT would find it too (and two rows
            # of this chunk with one key); asking first serves the dry run.
            held = _held_keys([fields for _, fields in candidates], self.using)
            inserts = []
            for row, fields in candidates:
                key = (fields["topic"], fields["dedup_key"])
                holder = held.get(key)
                if holder is None and result.dry_run and key in self.planned_keys:
                    holder = "(another dead letter of this run)"
                if holder is not None:
                    skips.append((row, DUPLICATE, f"message id={holder} holds its dedup_key"))
                    continue
                if fields["dedup_key"] is not None:
                    self.planned_keys.add(key)
                inserts.append((row, fields))

            revived = []
            if result.dry_run:
                result.done += len(inserts)
            elif inserts:
                messages = enqueue_many([fields for _, fields in inserts], using=self.using)
                for (row, _), message in zip(inserts, messages, strict=True):
                    if message.created:
                        self.mark(row, message, now)
                        revived.append((row, message))
                    else:  # the ON CONFLICT found a holder after all
                        skips.append(
                            (row, DUPLICATE, f"message id={message.pk} holds its dedup_key")
                        )
                for row, message in revived:
                    if row.holds_group:
                        # It kept its group blocked: it goes first.
                        lifecycle.lead_group(message)
                        row.holds_group = False
                _mark_revived([row for row, _ in revived], self.using)
                result.done += len(revived)
            for _, reason, _ in skips:
                result.skipped[reason] += 1
        # Logged once the chunk has committed: a rolled-back chunk changed nothing.
        for row, message in revived:
            logger.info(
                "Dead letter id=%s topic=%s revived as message id=%s queue=%s topic=%s by %s",
                row.pk,
                row.topic,
                message.pk,
                message.queue,
                message.topic,
                self.by or "-",
                extra=_log_extra(
                    row,
                    state=DeadLetterState.REVIVED,
                    revived_message_id=message.pk,
                    queue=message.queue,
                    revived_topic=message.topic,
                    actor=self.by,
                ),
            )
        for row, reason, detail in [] if result.dry_run else skips:
            logger.warning(
                "Dead letter id=%s topic=%s not revived (%s): %s",
                row.pk,
                row.topic,
                reason,
                detail,
                extra=_log_extra(row, skipped=reason),
            )

    def message_fields(self, row):
        """The enqueue() keywords of the dead letter's new message."""
        return {
            "topic": self.topic or row.topic,
            "payload": row.payload,
            "headers": row.headers,
            "priority": row.priority,
            "queue": self.queue or row.queue,
            "dedup_key": row.dedup_key,
            "group_key": row.group_key,
            "max_attempts": row.max_attempts,
        }

    def mark(self, row, message, now):
        row.state = DeadLetterState.REVIVED
        row.revived_at = now
        row.revive_count += 1
        row.revived_message_id = message.pk
        row.revived_by = self.by
        moved = [
            f"{name} {old} -> {new}"
            for name, old, new in [
                ("queue", row.queue, message.queue),
                ("topic", row.topic, message.topic),
            ]
            if old != new
        ]
        what = f"revived as message {message.pk}" + (f" ({', '.join(moved)})" if moved else "")
        row.notes = _appended(row.notes, _note_line(now, what, self.by, self.note))


def _mark_revived(rows, using):
    """The revived dead letters' UPDATE, in the transaction of their INSERT."""
    if rows:
        DeadLetter.objects.using(using).bulk_update(
            rows,
            [
                "state",
                "revived_at",
                "revive_count",
                "revived_message_id",
                "revived_by",
                "notes",
                "holds_group",  # a trigger releases the group (migration 0009)
            ],
        )


def _held_keys(fields_list, using):
    """{(topic, dedup_key): id of the unfinished message holding it}."""
    wanted = {(f["topic"], f["dedup_key"]) for f in fields_list if f["dedup_key"] is not None}
    if not wanted:
        return {}
    rows = (
        Message.objects.using(using)
        .filter(
            status__in=UNFINISHED,
            topic__in={t for t, _ in wanted},
            dedup_key__in={k for _, k in wanted},
        )
        .values_list("topic", "dedup_key", "pk")
    )
    return {(t, k): pk for t, k, pk in rows if (t, k) in wanted}


def resolve(dead_letters, *, note, by="", dry_run=False, now=None, chunk_size=CHUNK_SIZE):
    """Close dead letters without redelivering them; they are kept for audit.

    Each ``new`` dead letter becomes ``resolved`` with ``resolved_at``,
    ``resolved_by`` (``by``: a name or a user) and ``note`` appended to
    ``notes``; ``note`` is required. Already resolved and revived ones are
    skipped.
    """
    using = conf.database_alias()
    by, note = _actor(by), _note(note)
    if not note:
        raise DeadLetterError("resolve() needs a note saying why (note='...')")
    batches = _id_batches(dead_letters, using, _chunk_size(chunk_size))
    result = TriageResult("resolve", dry_run=dry_run)
    for ids in batches:
        with transaction.atomic(using=using):
            rows = _locked(ids, using, result, only=_LOG_FIELDS, lock=not dry_run)
            fresh = []
            for row in rows:
                if row.state == DeadLetterState.NEW:
                    fresh.append(row)
                elif row.state == DeadLetterState.RESOLVED:
                    result.skipped[ALREADY_RESOLVED] += 1
                else:
                    result.skipped[IS_REVIVED] += 1
            if dry_run or not fresh:
                result.done += len(fresh)
                continue
            now_value = now or timezone.now()
            result.done += (
                DeadLetter.objects.using(using)
                .filter(pk__in=[row.pk for row in fresh], state=DeadLetterState.NEW)
                .update(
                    state=DeadLetterState.RESOLVED,
                    holds_group=False,  # a trigger releases the group (migration 0009)
                    resolved_at=now_value,
                    resolved_by=by,
                    notes=_append_expression(_note_line(now_value, "resolved", by, note)),
                )
            )
        for row in fresh:
            logger.info(
                "Dead letter id=%s topic=%s resolved by %s",
                row.pk,
                row.topic,
                by or "-",
                extra=_log_extra(row, state=DeadLetterState.RESOLVED, actor=by),
            )
    return result


def categorize(
    dead_letters, category, *, note="", by="", dry_run=False, now=None, chunk_size=CHUNK_SIZE
):
    """Set the category of dead letters (in any state), as a person decided.

    ``category`` is one of ``models.Category``. ``category_set_by`` (``by``)
    and ``category_set_at`` record who and when; a line in ``notes`` records
    the previous category, who and ``note``. Dead letters already in
    that category are skipped.
    """
    using = conf.database_alias()
    if category not in Category.values:
        raise DeadLetterError(f"unknown category {category!r}; one of {', '.join(Category.values)}")
    category = Category(category).value
    by, note = _actor(by), _note(note)
    batches = _id_batches(dead_letters, using, _chunk_size(chunk_size))
    result = TriageResult("categorize", dry_run=dry_run)
    for ids in batches:
        with transaction.atomic(using=using):
            rows = _locked(ids, using, result, only=_LOG_FIELDS, lock=not dry_run)
            by_old = collections.defaultdict(list)
            for row in rows:
                if row.category == category:
                    result.skipped[UNCHANGED] += 1
                else:
                    by_old[row.category].append(row)
            changed = [row for group in by_old.values() for row in group]
            if dry_run or not changed:
                result.done += len(changed)
                continue
            now_value = now or timezone.now()
            # One UPDATE per previous category (at most five), so the note
            # line can say what the category was.
            for old, group in by_old.items():
                line = _note_line(now_value, f"category set to {category} (was {old})", by, note)
                result.done += (
                    DeadLetter.objects.using(using)
                    .filter(pk__in=[row.pk for row in group], category=old)
                    .update(
                        category=category,
                        category_set_by=by,
                        category_set_at=now_value,
                        notes=_append_expression(line),
                    )
                )
        for row in changed:
            logger.info(
                "Dead letter id=%s topic=%s category %s -> %s by %s",
                row.pk,
                row.topic,
                row.category,
                category,
                by or "-",
                extra=_log_extra(row, category=category, previous_category=row.category, actor=by),
            )
    return result


def select(*, topics=None, categories=None, states=None, since=None, ids=None):
    """The dead letters that match every filter given (None: no filter), as a
    queryset on the queue's database.

    ``topics``, ``categories``, ``states`` and ``ids`` are iterables, ``since``
    an aware datetime (``dead_lettered_at`` at or after it). Raises
    ``DeadLetterError`` for an unknown category or state, a bad id and an id
    that no dead letter has.
    """
    using = conf.database_alias()
    queryset = DeadLetter.objects.using(using).all()
    if topics is not None:
        topics = [topics] if isinstance(topics, str) else list(topics)
        for topic in topics:
            _text("topics", topic)
        queryset = queryset.filter(topic__in=topics)
    if categories is not None:
        queryset = queryset.filter(category__in=_choices("category", categories, Category))
    if states is not None:
        queryset = queryset.filter(state__in=_choices("state", states, DeadLetterState))
    if since is not None:
        if not isinstance(since, datetime.datetime) or timezone.is_naive(since):
            raise DeadLetterError(f"since must be an aware datetime, not {since!r}")
        queryset = queryset.filter(dead_lettered_at__gte=since)
    if ids is not None:
        ids = _checked_ids(ids, using)
        queryset = queryset.filter(pk__in=ids)
    return queryset


# --- helpers ----------------------------------------------------------------------


def _locked(ids, using, result, only=None, lock=True):
    """The rows of ``ids`` that still exist, locked (unless ``lock`` is
    False: a dry run), in id order: the same order for every operator, so two
    of them never deadlock."""
    queryset = DeadLetter.objects.using(using).filter(pk__in=ids)
    if lock:
        queryset = queryset.select_for_update()
    if only:
        queryset = queryset.only(*only)
    rows = list(queryset.order_by("pk"))
    if len(rows) < len(ids):
        result.skipped[GONE] += len(ids) - len(rows)
    return rows


def _id_batches(dead_letters, using, size):
    """Check ``dead_letters`` now (raising DeadLetterError) and return an
    iterator over its ids, ascending, ``size`` at a time."""
    if isinstance(dead_letters, QuerySet):
        if dead_letters.model is not DeadLetter:
            raise DeadLetterError(
                f"expected a DeadLetter queryset, not one of {dead_letters.model.__name__}"
            )
        if dead_letters.query.is_sliced:
            # A slice of a filter on the state would select other rows once
            # the first chunk has changed state: take its ids now.
            ids = sorted(set(dead_letters.using(using).values_list("pk", flat=True)))
            return _slices(ids, size)
        return _queryset_batches(dead_letters.using(using), size)
    if isinstance(dead_letters, DeadLetter):
        dead_letters = [dead_letters]
    return _slices(_checked_ids(dead_letters, using), size)


def _queryset_batches(queryset, size):
    selected = DeadLetter.objects.using(queryset.db).filter(pk__in=queryset.values("pk"))
    # Only the rows there are now: a revived message that fails again becomes
    # a new dead letter matching the same filter, and must not be revived
    # again by the same (perhaps hours-long, rate-limited) run.
    last = selected.aggregate(last=Max("pk"))["last"]
    after = 0
    while last is not None and after < last:
        ids = list(
            selected.filter(pk__gt=after, pk__lte=last)
            .order_by("pk")
            .values_list("pk", flat=True)[:size]
        )
        if not ids:
            return
        yield ids
        after = ids[-1]


def _slices(ids, size):
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def _checked_ids(items, using):
    """Sorted distinct ids of ``items`` (ids or DeadLetter instances), every
    one an existing dead letter."""
    if isinstance(items, str | bytes | int | dict) or not hasattr(items, "__iter__"):
        raise DeadLetterError(
            "expected a DeadLetter queryset or an iterable of dead-letter ids (e.g. [12, 15]), "
            f"not {type(items).__name__}"
        )
    ids = set()
    for item in items:
        if isinstance(item, DeadLetter):
            item = item.pk
        if not isinstance(item, int) or isinstance(item, bool) or item < 1:
            raise DeadLetterError(f"dead-letter ids are whole numbers of at least 1, not {item!r}")
        ids.add(item)
    ids = sorted(ids)
    missing = []
    for chunk in _slices(ids, 10_000):
        found = set(
            DeadLetter.objects.using(using).filter(pk__in=chunk).values_list("pk", flat=True)
        )
        missing += [pk for pk in chunk if pk not in found]
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise DeadLetterError(
            f"no dead letter has the id {', '.join(map(str, missing[:10]))}{more}"
        )
    return ids


def _choices(what, values, choices):
    if isinstance(values, str):
        values = [values]
    values = list(values)
    unknown = [v for v in values if v not in choices.values]
    if unknown:
        raise DeadLetterError(
            f"unknown {what} {', '.join(map(repr, unknown))}; one of {', '.join(choices.values)}"
        )
    return values


def _name_or_none(kind, value, max_length):
    if value is None:
        return None
    problem = conf.name_problem(kind, value, max_length)
    if problem:
        raise DeadLetterError(problem)
    return value


def _actor(by):
    """Who did it, as the name stored in the audit fields."""
    if by is None:
        return ""
    if hasattr(by, "get_username"):  # a user object
        by = by.get_username()
    if not isinstance(by, str):
        raise DeadLetterError(f"by must be a name or a user, not {type(by).__name__}")
    by = _text("by", by).strip()
    if len(by) > _ACTOR_MAX_LENGTH:
        raise DeadLetterError(f"by is {len(by)} characters long; the limit is {_ACTOR_MAX_LENGTH}")
    return by


def _note(note):
    """The note on one line: ``notes`` holds one line per change."""
    if note is None:
        return ""
    if not isinstance(note, str):
        raise DeadLetterError(f"note must be a string, not {type(note).__name__}")
    return " ".join(_text("note", note).split())


def _text(name, value):
    """``value`` if PostgreSQL can store it as text, else DeadLetterError."""
    if not isinstance(value, str):
        raise DeadLetterError(f"{name} must be strings, not {type(value).__name__}")
    problem = conf.text_problem(value)
    if problem:
        raise DeadLetterError(f"{name}: {problem}")
    return value


def _chunk_size(size):
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DeadLetterError(f"chunk_size must be a whole number of at least 1, not {size!r}")
    return size


def _is_number(value):
    return isinstance(value, int | float) and not isinstance(value, bool)


def _note_line(now, what, by, note):
    line = f"[{now.isoformat(timespec='seconds')}] {what}"
    if by:
        line += f" by {by}"
    if note:
        line += f": {note}"
    return line


def _appended(notes, line):
    return f"{notes}\n{line}" if notes else line


def _append_expression(line):
    """``notes`` with ``line`` appended, for an UPDATE."""
    return Case(
        When(notes="", then=Value(line)),
        default=Concat(F("notes"), Value("\n" + line), output_field=TextField()),
        output_field=TextField(),
    )


def _log_extra(row, **fields):
    return {"dead_letter_id": row.pk, "message_id": row.message_id, "topic": row.topic, **fields}
