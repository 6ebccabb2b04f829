"""What the soak enqueued, recorded beside the messages in the same
transaction, and what became of each message: the invariant's query, the
final counts."""

from benchmarks.scenarios.chaos import FAILURE_KINDS, MAX_ATTEMPTS, TOPICS, with_retry

# What the driver records of each message: its id, topic kind and wave.
EXPECTED_TABLE = "chaos_expected"
EXPECTED_DDL = f"""
CREATE TABLE IF NOT EXISTS {EXPECTED_TABLE} (
    message_id bigint PRIMARY KEY,
    atomic boolean NOT NULL,
    chunk integer NOT NULL
)"""

# One snapshot (one statement) per check.
CHECK_SQL = f"""
SELECT
    count(*) FILTER (WHERE in_queue AND dead),
    count(*) FILTER (WHERE NOT in_queue AND NOT dead AND NOT handled),
    count(*) FILTER (WHERE atomic AND handled AND (in_queue OR dead)),
    count(*) FILTER (WHERE in_queue),
    count(*)
FROM (
    SELECT e.atomic,
        EXISTS (SELECT 1 FROM django_pgqueue_message m WHERE m.id = e.message_id) AS in_queue,
        EXISTS (SELECT 1 FROM django_pgqueue_deadletter d
                WHERE d.message_id = e.message_id) AS dead,
        EXISTS (SELECT 1 FROM demo_handled h WHERE h.message_id = e.message_id) AS handled
    FROM {EXPECTED_TABLE} e
) AS state
"""

FINAL_SQL = f"""
SELECT
    count(*) FILTER (WHERE handled > 0 AND NOT dead AND NOT in_queue),
    count(*) FILTER (WHERE dead AND NOT in_queue),
    count(*) FILTER (WHERE handled = 0 AND NOT dead AND NOT in_queue),
    count(*) FILTER (WHERE atomic AND handled > 1),
    coalesce(sum(handled - 1) FILTER (WHERE NOT atomic AND handled > 1), 0),
    count(*) FILTER (WHERE in_queue)
FROM (
    SELECT e.atomic,
        EXISTS (SELECT 1 FROM django_pgqueue_message m WHERE m.id = e.message_id) AS in_queue,
        EXISTS (SELECT 1 FROM django_pgqueue_deadletter d
                WHERE d.message_id = e.message_id) AS dead,
        (SELECT count(*) FROM demo_handled h WHERE h.message_id = e.message_id) AS handled
    FROM {EXPECTED_TABLE} e
) AS state
"""


def make_payloads(count, args, rng):
    payloads = []
    for _ in range(count):
        payload = {}
        if rng.random() < args.fail_rate:
            attempts = rng.sample(range(1, MAX_ATTEMPTS + 1), rng.randint(1, 3))
            payload["fail"] = {str(a): rng.choice(FAILURE_KINDS) for a in attempts}
        if rng.random() < args.slow_rate:
            payload["sleep"] = round(rng.uniform(0.05, 0.3), 3)
        elif args.work_ms:
            payload["sleep"] = round(min(rng.expovariate(1000 / args.work_ms), 0.05), 4)
        payloads.append(payload)
    return payloads


def enqueue_wave(wave, size, args, rng):
    """Enqueue one wave in chunks, each chunk recorded in EXPECTED_TABLE in the
    same transaction: after an error the chunk's fate is read, not guessed."""
    from django.db import connection, transaction

    from django_pgqueue import enqueue_many

    chunk_size = 1000
    enqueued = 0
    for start in range(0, size, chunk_size):
        chunk = wave * 1_000_000 + start
        n = min(chunk_size, size - start)
        topic = rng.choice(list(TOPICS))
        payloads = make_payloads(n, args, rng)
        items = [{"payload": payload} for payload in payloads]

        def insert(topic=topic, items=items, chunk=chunk):
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT 1 FROM {EXPECTED_TABLE} WHERE chunk = %s LIMIT 1", [chunk])
                if cursor.fetchone():
                    return 0  # committed before the error that brought us here
            with transaction.atomic():
                messages = enqueue_many(items, topic=topic)
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"INSERT INTO {EXPECTED_TABLE} (message_id, atomic, chunk)"
                        " SELECT unnest(%s::bigint[]), %s, %s",
                        [[m.pk for m in messages], TOPICS[topic], chunk],
                    )
            return len(messages)

        with_retry(insert, f"enqueueing wave {wave}")
        enqueued += n
    return enqueued


def empty_tables(reset):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(EXPECTED_DDL)
        cursor.execute(
            "SELECT (SELECT count(*) FROM django_pgqueue_message)"
            " + (SELECT count(*) FROM django_pgqueue_deadletter)"
            " + (SELECT count(*) FROM demo_handled)"
            f" + (SELECT count(*) FROM {EXPECTED_TABLE})"
        )
        rows = cursor.fetchone()[0]
        if rows and not reset:
            raise SystemExit(
                f"the database {connection.settings_dict['NAME']!r} holds {rows} queue,"
                " dead-letter or ledger row(s): pass --reset to empty the tables first"
            )
        cursor.execute(
            "TRUNCATE django_pgqueue_message, django_pgqueue_deadletter, demo_handled,"
            f" {EXPECTED_TABLE}"
        )


def queue_is_empty():
    from django_pgqueue.models import Message

    return not Message.objects.exists()


def final_counts(args, seed, enqueued, seconds, workers, faults, checker):
    from django.db import connection

    def read():
        with connection.cursor() as cursor:
            cursor.execute(FINAL_SQL)
            return cursor.fetchone()

    done, dead, lost, atomic_twice, nonatomic_extra, still_queued = with_retry(read, "counting")
    categories = dict(with_retry(dead_letter_categories, "counting dead letters"))
    return {
        "messages": args.messages,
        "enqueued": enqueued,
        "done": done,
        "dead_lettered": dead,
        "dead_letter_categories": categories,
        "still_queued": still_queued,
        "lost": lost,
        "handled_twice_atomic": atomic_twice,
        "extra_handlings_nonatomic": int(nonatomic_extra),
        "exposed_in_flight": faults.exposed,
        "invariant_checks": checker.checks,
        "invariant_violations": checker.violations,
        "unexpected_worker_exits": workers.unexpected_exits,
        "workers_started": workers.started,
        "faults": faults.counts,
        "seconds": round(seconds, 2),
        "messages_per_s": round(enqueued / seconds, 1) if seconds else None,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "seed": seed,
    }


def dead_letter_categories():
    from django.db.models import Count

    from django_pgqueue.models import DeadLetter

    return list(DeadLetter.objects.values_list("category").annotate(n=Count("id")).order_by())


def ok(result):
    return (
        not result["timed_out"]
        and result["enqueued"] == result["messages"]
        and result["lost"] == 0
        and result["still_queued"] == 0
        and result["handled_twice_atomic"] == 0
        and result["extra_handlings_nonatomic"] <= result["exposed_in_flight"]
        and result["invariant_checks"] > 0
        and not result["invariant_violations"]
        and not result["unexpected_worker_exits"]
    )
