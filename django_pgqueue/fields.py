"""The timestamp column of every table of the app: reads what Python cannot.

PostgreSQL's timestamptz holds 'infinity', '-infinity' and years from 4713
BC to 294276; Python's datetime, years 1 to 9999. Only another client's
SQL writes such a value into these tables (enqueue refuses them), but one
such row would make every page, report and worker loop that loads it fail
(psycopg raises DataError "timestamp too large"). Every read clamps instead.
"""

import datetime

from django.db import models

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


def finite_sql(value):
    """The SQL of the timestamptz expression ``value`` clamped to
    [TIMESTAMP_MIN, TIMESTAMP_MAX]: for raw SQL that reads a timestamp
    column of these tables (DateTimeField does it for the ORM)."""
    return _CLAMP_SQL.format(value=value)


class DateTimeField(models.DateTimeField):
    """A ``DateTimeField`` whose value is selected clamped (``finite_sql``)
    wherever the ORM reads it: a model, ``values()``, an aggregate. Written
    and filtered on as any ``DateTimeField`` (its indexes still serve), and
    migrated as one."""

    def select_format(self, compiler, sql, params):
        sql, params = super().select_format(compiler, sql, params)
        return finite_sql(f"({sql})"), (*params, *params, *params)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        # The column is a plain DateTimeField's: no migration for the class.
        return name, "django.db.models.DateTimeField", args, kwargs


class FiniteDatesQuerySet(models.QuerySet):
    """``dates()`` and ``datetimes()`` (the admin's date hierarchy) over the
    rows whose timestamp is within [TIMESTAMP_MIN, TIMESTAMP_MAX]: they
    truncate the column in SQL, and the truncation of 'infinity' is
    'infinity' again. Such a row has no day to list."""

    def dates(self, field_name, kind, order="ASC"):
        return super().dates(field_name, kind, order).filter(**_finite(field_name))

    def datetimes(self, field_name, kind, order="ASC", tzinfo=None):
        return super().datetimes(field_name, kind, order, tzinfo).filter(**_finite(field_name))


def _finite(field_name):
    return {f"{field_name}__range": (TIMESTAMP_MIN, TIMESTAMP_MAX)}
