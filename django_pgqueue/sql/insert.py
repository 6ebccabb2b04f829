"""The INSERT statements of enqueue() and enqueue_many() (``enqueuing``),
with ``{table}`` for the queue table's quoted name."""

from __future__ import annotations

# One statement for one message or fifty thousand: the ORM cannot say
# "INSERT ... ON CONFLICT (cols) WHERE <partial index predicate> DO NOTHING
# RETURNING", which dedup needs. The rows travel as one JSON array (one
# parameter, parsed by the server in C; payloads go in as the JSON text they
# were validated as, never parsed twice), each row an array in the column
# order below. ORDER BY the ordinality makes ids follow the input order,
# which is how the returned rows are matched back to the input. Columns left
# out take their db_default. Timestamps come back as text: they repeat (one
# now() per statement), and each distinct one is parsed once.
_COLUMNS = (
    "(queue, topic, payload, headers, priority, run_at, max_attempts, dedup_key, group_key,"
    " partition_key)"
)
_FROM_DOCUMENT = """SELECT r->>0, r->>1, r->2, r->3, (r->>4)::smallint,
    COALESCE((r->>5)::timestamptz, now() + make_interval(secs => (r->>6)::float8)),
    (r->>7)::integer, r->>8, r->>9, r->>10
FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS input(r, n)
ORDER BY n"""
# Rows that share one Options (the usual enqueue_many: a topic and options
# given once, a payload per message; validation.validate_many hands them the
# same Options object) send those once, as parameters, and only their
# payloads as the JSON array: per row the server then takes one value apart
# instead of eleven and computes no run_at of its own, and the client writes
# only the payloads. A quarter less server CPU for a chunk of 1,000 than the
# array of arrays above, which rows that differ still use; unnest() of ten
# typed arrays, and COPY into a temporary table (for the ON CONFLICT and
# RETURNING that COPY cannot do), cost about as much as that array
# (benchmarks/insert_forms.py).
_FROM_PAYLOADS = """SELECT %s, %s, p, %s::jsonb, %s::smallint,
    COALESCE(%s::timestamptz, now() + make_interval(secs => %s)), %s::integer, %s, %s, %s
FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS input(p, n)
ORDER BY n"""
# One message: plain VALUES, with no JSON document to take apart, is cheaper
# per call, which is what one-message-per-transaction callers pay.
_VALUES = """VALUES (%s, %s, %s::jsonb, %s::jsonb, %s,
    COALESCE(%s::timestamptz, now() + make_interval(secs => %s)), %s, %s, %s, %s)"""
_SKIP_DEDUP = """ON CONFLICT (topic, dedup_key)
    WHERE status IN ('waiting', 'blocked', 'processing') AND dedup_key IS NOT NULL DO NOTHING"""


def _insert_sql(source: str, dedup: bool) -> str:
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
INSERT_SHARED_SQL = _insert_sql(_FROM_PAYLOADS, dedup=True)
INSERT_SHARED_NO_DEDUP_SQL = _insert_sql(_FROM_PAYLOADS, dedup=False)
INSERT_ONE_SQL = _insert_sql(_VALUES, dedup=True)
INSERT_ONE_NO_DEDUP_SQL = _insert_sql(_VALUES, dedup=False)
# One message with every option at its default (the usual ``enqueue(topic,
# payload)``): three parameters, the other columns their db_default, run_at
# now() as _VALUES computes it for no delay. Fewer values for the client to
# adapt and the server to bind and check (benchmarks/instructions.py: 11%
# fewer of the client's instructions per enqueue()).
INSERT_ONE_PLAIN_SQL = """INSERT INTO {table} (queue, topic, payload, run_at)
VALUES (%s, %s, %s::jsonb, now())
RETURNING id, run_at::text, created_at::text"""
