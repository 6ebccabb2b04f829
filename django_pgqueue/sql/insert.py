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


def _insert_sql(source: str, dedup: bool, fair: bool = False) -> str:
    """The INSERT of ``source`` rows. Without dedup keys no row can be
    skipped: the returned rows are the input rows in order, so neither the
    ON CONFLICT nor the columns that match rows back are needed. ``fair``:
    rows with a partition key get their round (_FAIR)."""
    if dedup:
        skip, returning = f"{_SKIP_DEDUP}\n", "id, topic, dedup_key, run_at::text, created_at::text"
    else:
        skip, returning = "", "id, run_at::text, created_at::text"
    if fair:
        return f"{_FAIR.replace('{source}', source)}\n{skip}RETURNING {returning}"
    return f"INSERT INTO {{table}} {_COLUMNS}\n{source}\n{skip}RETURNING {returning}"


# Rows with a partition key (a caller that sends any uses these): a keyed
# row outside a group of a queue with "fair": False (the first parameter:
# those queues) gets its run_at in microseconds as its "round" (the strict
# order, sql.claim.RANKED_STRICT_SQL); one due at once, outside a group, of
# any other queue gets its round in the fair claim
# (fair_tag, sql.claim.PICK_SQL): its partition's last waiting round + 1,
# or the queue's current round at its priority (the lowest waiting round)
# if that is later; the rows of one partition in one statement take the
# rounds after it, in input order. Two index descents per keyed row
# (pgqueue_msg_round_idx, pgqueue_msg_fair_idx). Concurrent inserts into one
# partition may share a round: a tie, broken by id. Every other row has no
# round: the claim ranks it as it reads it.
_FAIR = """INSERT INTO {table} (queue, topic, payload, headers, priority, run_at, max_attempts,
    dedup_key, group_key, partition_key, fair_tag)
SELECT f.queue, f.topic, f.payload::jsonb, f.headers::jsonb, f.priority::smallint, f.run_at,
    f.max_attempts::integer, f.dedup_key, f.group_key, f.partition_key,
    CASE WHEN f.partition_key IS NULL OR f.group_key IS NOT NULL THEN NULL
    WHEN f.queue = ANY(%s::varchar[]) THEN (extract(epoch FROM f.run_at) * 1000000)::bigint
    WHEN f.run_at > now() THEN NULL
    ELSE GREATEST(
        (SELECT t.fair_tag + 1 FROM {table} AS t
         WHERE t.queue = f.queue AND t.partition_key = f.partition_key
            AND t.status = 'waiting' AND t.fair_tag IS NOT NULL
         ORDER BY t.fair_tag DESC LIMIT 1),
        (SELECT t.fair_tag FROM {table} AS t
         WHERE t.queue = f.queue AND t.priority = f.priority::smallint
            AND t.status = 'waiting' AND t.fair_tag IS NOT NULL
         ORDER BY t.fair_tag LIMIT 1),
        0) - 1 + row_number() OVER (PARTITION BY f.queue, f.partition_key ORDER BY f.n) END
FROM (SELECT s.*, row_number() OVER () AS n
      FROM ({source}) AS s(queue, topic, payload, headers, priority, run_at, max_attempts,
        dedup_key, group_key, partition_key)) AS f
ORDER BY f.n"""

INSERT_SQL = _insert_sql(_FROM_DOCUMENT, dedup=True)
INSERT_NO_DEDUP_SQL = _insert_sql(_FROM_DOCUMENT, dedup=False)
INSERT_SHARED_SQL = _insert_sql(_FROM_PAYLOADS, dedup=True)
INSERT_SHARED_NO_DEDUP_SQL = _insert_sql(_FROM_PAYLOADS, dedup=False)
INSERT_ONE_SQL = _insert_sql(_VALUES, dedup=True)
INSERT_ONE_NO_DEDUP_SQL = _insert_sql(_VALUES, dedup=False)
# The same for rows of which some have a partition key (their first
# parameter: the queues with "fair": False).
FAIR_INSERTS = {
    template: _insert_sql(source, dedup, fair=True)
    for template, source, dedup in (
        (INSERT_SQL, _FROM_DOCUMENT, True),
        (INSERT_NO_DEDUP_SQL, _FROM_DOCUMENT, False),
        (INSERT_SHARED_SQL, _FROM_PAYLOADS, True),
        (INSERT_SHARED_NO_DEDUP_SQL, _FROM_PAYLOADS, False),
        (INSERT_ONE_SQL, _VALUES, True),
        (INSERT_ONE_NO_DEDUP_SQL, _VALUES, False),
    )
}
# One message with every option at its default (the usual ``enqueue(topic,
# payload)``): three parameters, the other columns their db_default, run_at
# now() as _VALUES computes it for no delay. Fewer values for the client to
# adapt and the server to bind and check (benchmarks/instructions.py: 11%
# fewer of the client's instructions per enqueue()).
INSERT_ONE_PLAIN_SQL = """INSERT INTO {table} (queue, topic, payload, run_at)
VALUES (%s, %s, %s::jsonb, now())
RETURNING id, run_at::text, created_at::text"""
