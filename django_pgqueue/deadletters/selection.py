"""Which dead letters a triage call works through: ``select()`` (the
filters of ``pgqueue_deadletters``), and the chunks of ids, in id order,
that revive(), resolve() and categorize() lock one transaction at a time."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence

from django.db.models import Max, QuerySet
from django.utils import timezone

from django_pgqueue import conf
from django_pgqueue.deadletters import arguments
from django_pgqueue.deadletters.result import GONE, TriageResult
from django_pgqueue.exceptions import DeadLetterError
from django_pgqueue.models import Category, DeadLetter, DeadLetterState
from django_pgqueue.paging import ids_in_chunks, slices

CHUNK_SIZE = 500

# What a triage call is given: a queryset, or ids, or DeadLetter instances.
DeadLetters = QuerySet[DeadLetter] | DeadLetter | Iterable[int | DeadLetter]


def select(
    *,
    topics: str | Iterable[str] | None = None,
    categories: str | Iterable[str] | None = None,
    states: str | Iterable[str] | None = None,
    since: datetime.datetime | None = None,
    ids: Iterable[int | DeadLetter] | None = None,
) -> QuerySet[DeadLetter]:
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
            arguments.text("topics", topic)
        queryset = queryset.filter(topic__in=topics)
    if categories is not None:
        queryset = queryset.filter(category__in=arguments.choices("category", categories, Category))
    if states is not None:
        queryset = queryset.filter(state__in=arguments.choices("state", states, DeadLetterState))
    if since is not None:
        if not isinstance(since, datetime.datetime) or timezone.is_naive(since):
            raise DeadLetterError(f"since must be an aware datetime, not {since!r}")
        queryset = queryset.filter(dead_lettered_at__gte=since)
    if ids is not None:
        queryset = queryset.filter(pk__in=checked_ids(ids, using))
    return queryset


def database_of(dead_letters: DeadLetters) -> tuple[DeadLetters, str]:
    """(``dead_letters``, read once if an iterator, and the alias they are
    on): a queryset's ``.using()`` alias, the dead letters' own database,
    else the database the code works on (``conf.database_alias()``).
    Dead letters of several databases are a DeadLetterError."""
    if isinstance(dead_letters, QuerySet):
        # _db: the alias its .using() named, if any (QuerySet.db would
        # answer the router's default instead of the database in scope).
        return dead_letters, dead_letters._db or conf.database_alias()  # type: ignore[union-attr]
    if isinstance(dead_letters, DeadLetter):
        return dead_letters, dead_letters._state.db or conf.database_alias()
    if isinstance(dead_letters, str | bytes) or not isinstance(dead_letters, Iterable):
        return dead_letters, conf.database_alias()  # (checked_ids says what is wrong)
    items = list(dead_letters)
    found = {d._state.db for d in items if isinstance(d, DeadLetter) and d._state.db}
    if len(found) > 1:
        raise DeadLetterError(
            f"the dead letters are on several databases ({', '.join(sorted(found))}): "
            "triage those of each database in a call of its own"
        )
    return items, found.pop() if found else conf.database_alias()


def id_batches(dead_letters: DeadLetters, using: str, size: int) -> Iterator[list[int]]:
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
            return slices(ids, size)
        return _queryset_batches(dead_letters.using(using), size)
    if isinstance(dead_letters, DeadLetter):
        dead_letters = [dead_letters]
    return slices(checked_ids(dead_letters, using), size)


def locked(
    ids: Sequence[int],
    using: str,
    result: TriageResult,
    only: Sequence[str] = (),
    lock: bool = True,
) -> list[DeadLetter]:
    """The rows of ``ids`` that still exist, locked (unless ``lock`` is
    False: a dry run), in id order: the same order for every operator, so two
    of them never deadlock. The others are counted as GONE."""
    queryset = DeadLetter.objects.using(using).filter(pk__in=ids)
    if lock:
        queryset = queryset.select_for_update()
    if only:
        queryset = queryset.only(*only)
    rows = list(queryset.order_by("pk"))
    if len(rows) < len(ids):
        result.skipped[GONE] += len(ids) - len(rows)
    return rows


def checked_ids(items: object, using: str) -> list[int]:
    """Sorted distinct ids of ``items`` (ids or DeadLetter instances), every
    one an existing dead letter."""
    if isinstance(items, str | bytes | int | dict) or not isinstance(items, Iterable):
        raise DeadLetterError(
            "expected a DeadLetter queryset or an iterable of dead-letter ids (e.g. [12, 15]), "
            f"not {type(items).__name__}"
        )
    distinct = set()
    for item in items:
        if isinstance(item, DeadLetter):
            item = item.pk
        if not conf.is_int(item) or item < 1:
            raise DeadLetterError(f"dead-letter ids are whole numbers of at least 1, not {item!r}")
        distinct.add(item)
    ids = sorted(distinct)
    missing = []
    for chunk in slices(ids, 10_000):
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


def _queryset_batches(queryset: QuerySet[DeadLetter], size: int) -> Iterator[list[int]]:
    selected = DeadLetter.objects.using(queryset.db).filter(pk__in=queryset.values("pk"))
    # Only the rows there are now: a revived message that fails again becomes
    # a new dead letter matching the same filter, and must not be revived
    # again by the same (perhaps hours-long, rate-limited) run.
    last = selected.aggregate(last=Max("pk"))["last"]
    if last is None:
        return iter(())
    return ids_in_chunks(selected, size, upto=last)
