"""Keyset paging: walk a selection by its ids, a chunk at a time.

Each chunk is one query, ``pk > last id seen ORDER BY pk LIMIT size``: the
index on the primary key finds where the chunk starts, so the thousandth
chunk costs what the first did (an OFFSET would read and skip every row
before it), and rows that change or leave the selection between two chunks
never make it skip or repeat one. The admin's actions and the dead-letter
operations work through "select all" selections of any size this way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import QuerySet


def ids_in_chunks(
    queryset: QuerySet[Any], size: int, *, upto: int | None = None
) -> Iterator[list[int]]:
    """The ids of ``queryset``, ascending, ``size`` at a time; only those up
    to ``upto`` when given (the rows there were when the walk began: a row
    added meanwhile, with a larger id, is left for the next walk)."""
    after = 0
    while upto is None or after < upto:
        rows = queryset.filter(pk__gt=after)
        if upto is not None:
            rows = rows.filter(pk__lte=upto)
        ids = list(rows.order_by("pk").values_list("pk", flat=True)[:size])
        if not ids:
            return
        yield ids
        after = ids[-1]


def slices(ids: list[int], size: int) -> Iterator[list[int]]:
    """``ids`` (already known, in the order given) ``size`` at a time: the
    chunks of an explicit selection, where there is nothing to page through."""
    for start in range(0, len(ids), size):
        yield ids[start : start + size]
