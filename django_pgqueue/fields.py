"""The timestamp column of every table of the app: reads what Python cannot.

PostgreSQL's timestamptz holds 'infinity', '-infinity' and years from 4713
BC to 294276; Python's datetime, years 1 to 9999. Only another client's
SQL writes such a value into these tables (enqueue refuses them), but one
such row would make every page, report and worker loop that loads it fail
(psycopg raises DataError "timestamp too large"). Every read clamps instead.
"""

from __future__ import annotations

import datetime
import functools
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from django.conf import settings
from django.db import models

if TYPE_CHECKING:
    from django.db.models.sql.compiler import SQLCompiler, _AsSqlType, _ParamsT

# What such a value reads as: a day inside Python's range, so that any time
# zone can show it (datetime.max in UTC is past year 9999 in Paris). The
# latest and earliest run_at that enqueue accepts.
TIMESTAMP_MAX = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)
TIMESTAMP_MIN = datetime.datetime(1, 1, 2, tzinfo=datetime.UTC)

# NULL stays NULL: neither comparison is true.
_CLAMP_SQL = (
    "CASE WHEN {value} > '9999-12-31 00:00:00+00'::timestamptz "
    "THEN '9999-12-31 00:00:00+00'::timestamptz "
    "WHEN {value} < '0001-01-02 00:00:00+00'::timestamptz "
    "THEN '0001-01-02 00:00:00+00'::timestamptz ELSE {value} END"
)


def finite_sql(value: str) -> str:
    """The SQL of the timestamptz expression ``value`` clamped to
    [TIMESTAMP_MIN, TIMESTAMP_MAX]: for raw SQL that reads a timestamp
    column of these tables (DateTimeField does it for the ORM)."""
    return _CLAMP_SQL.format(value=value)


# PostgreSQL's infinite timestamps as the datetimes every read gives them.
_INFINITE = {"infinity": TIMESTAMP_MAX, "-infinity": TIMESTAMP_MIN}


@overload
def timestamp_from_text(text: str) -> datetime.datetime: ...
@overload
def timestamp_from_text(text: None) -> None: ...


@functools.lru_cache(maxsize=1024)
def timestamp_from_text(text: str | None) -> datetime.datetime | None:
    """A timestamptz column read as text (``col::text``) as Django would
    return it, clamped as DateTimeField reads it: aware in UTC with USE_TZ
    (the session's time zone then is UTC), naive local time without. The
    hot paths (claim, enqueue_many, publish) read timestamps this way: many
    repeat (one now() per statement), and ``fromisoformat`` of each distinct
    text costs less than Django's timestamptz loader on every row."""
    if text is None:
        return None
    if text in _INFINITE:  # only another client's raw SQL writes these
        value = _INFINITE[text]
    elif text.endswith(" BC"):  # so do these, and years past 9999 ("10000-01-01 ...")
        value = TIMESTAMP_MIN
    elif text.index("-", 1) > 4:
        value = TIMESTAMP_MAX
    else:
        value = min(max(datetime.datetime.fromisoformat(text), TIMESTAMP_MIN), TIMESTAMP_MAX)
    return value if settings.USE_TZ else value.replace(tzinfo=None)


class DateTimeField(models.DateTimeField):
    """A ``DateTimeField`` whose value is selected clamped (``finite_sql``)
    wherever the ORM reads it: a model, ``values()``, an aggregate. Written
    and filtered on as any ``DateTimeField`` (its indexes still serve), and
    migrated as one."""

    def select_format(self, compiler: SQLCompiler, sql: str, params: _ParamsT) -> _AsSqlType:
        sql, params = super().select_format(compiler, sql, params)
        return finite_sql(f"({sql})"), (*params, *params, *params)

    def deconstruct(self) -> Any:
        name, path, args, kwargs = super().deconstruct()
        # The column is a plain DateTimeField's: no migration for the class.
        return name, "django.db.models.DateTimeField", args, kwargs


_M = TypeVar("_M", bound=models.Model)
_DateKind = Literal["year", "month", "week", "day"]
_DateTimeKind = Literal["year", "month", "week", "day", "hour", "minute", "second"]
_Order = Literal["ASC", "DESC"]


class FiniteDatesQuerySet(models.QuerySet[_M]):
    """``dates()`` and ``datetimes()`` (the admin's date hierarchy) over the
    rows whose timestamp is within [TIMESTAMP_MIN, TIMESTAMP_MAX]: they
    truncate the column in SQL, and the truncation of 'infinity' is
    'infinity' again. Such a row has no day to list."""

    def dates(
        self, field_name: str, kind: _DateKind, order: _Order = "ASC"
    ) -> models.QuerySet[_M, datetime.date]:
        return super().dates(field_name, kind, order).filter(**_finite(field_name))

    def datetimes(
        self,
        field_name: str,
        kind: _DateTimeKind,
        order: _Order = "ASC",
        tzinfo: datetime.tzinfo | None = None,
    ) -> models.QuerySet[_M, datetime.datetime]:
        return super().datetimes(field_name, kind, order, tzinfo).filter(**_finite(field_name))


def _finite(field_name: str) -> dict[str, tuple[datetime.datetime, datetime.datetime]]:
    return {f"{field_name}__range": (TIMESTAMP_MIN, TIMESTAMP_MAX)}


# A manager class made at module level (not QuerySet.as_manager() in the
# model), which django-stubs resolves in every mypy run.
FiniteDatesManager = models.Manager.from_queryset(FiniteDatesQuerySet)


class BrinIndex(models.Index):
    """A BRIN index (a summary per range of ``pages_per_range`` table pages,
    nothing written per row) on columns that grow with the table's physical
    order. Django's own ``django.contrib.postgres.indexes.BrinIndex`` needs
    ``django.contrib.postgres`` in ``INSTALLED_APPS`` (a system check
    refuses it otherwise from Django 6.1 on), which this app must not ask of
    a project for one index method."""

    suffix = "brin"

    def __init__(self, *expressions: Any, pages_per_range: int = 32, **kwargs: Any) -> None:
        if pages_per_range <= 0:
            raise ValueError("pages_per_range must be a positive integer")
        self.pages_per_range = pages_per_range
        super().__init__(*expressions, **kwargs)

    def deconstruct(self) -> Any:
        path, args, kwargs = super().deconstruct()
        kwargs["pages_per_range"] = self.pages_per_range
        return path, args, kwargs

    def create_sql(self, model: Any, schema_editor: Any, using: str = "", **kwargs: Any) -> Any:
        statement = super().create_sql(model, schema_editor, using=" USING brin", **kwargs)
        parts: dict[str, Any] = statement.parts
        parts["extra"] = f" WITH (pages_per_range = {self.pages_per_range:d}){parts['extra']}"
        return statement
