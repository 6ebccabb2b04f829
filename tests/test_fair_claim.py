"""The fair claim and the limits of partitions (issue 38), one claim at a
time against the real database: the rounds enqueue() gives keyed messages
(``fair_tag``), the rotation between partitions that the claim makes of
them, "fair": False, priority, and the limits of each partition (settings,
``PartitionLimit`` rows, the default partition, a rescued lease), with the
indexes each claim reads. The claim runs as the worker's does
(``lifecycle.ack_and_claim_rows``). Real workers: test_fair_workers.py."""

import datetime
import uuid
from collections import Counter

import pytest
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_pgqueue import enqueue, enqueue_many, lifecycle, maintenance
from django_pgqueue.conf import Limits, Rate
from django_pgqueue.models import Category, Message, PartitionLimit, PartitionStart, Status
from django_pgqueue.sql.claim import claim_statement
from django_pgqueue.sql.limited import limited_claim_statements

pytestmark = pytest.mark.django_db(transaction=True)

SECOND = datetime.timedelta(seconds=1)
TOPIC = "test.record"
QUEUE = "fair"


def claim(limit, limits=None, now=None, queue=QUEUE):
    """The messages one claim of ``queue`` leases, in claim order."""
    result = lifecycle.ack_and_claim_rows(
        [], [queue], limit, "w", 60, now=now, limits=None if limits is None else {queue: limits}
    )
    return [lifecycle.message_from_row(row) for row in result.rows]


def keys(messages):
    """How many of ``messages`` each partition gave (None: the default one)."""
    return Counter(m.partition_key for m in messages)


def put(count, key=None, queue=QUEUE, **options):
    """``count`` messages of partition ``key`` in one enqueue_many()."""
    return enqueue_many(
        [{"payload": {"n": n}} for n in range(count)],
        topic=TOPIC,
        queue=queue,
        partition_key=key,
        **options,
    )


def tags(messages):
    """The stored rounds (fair_tag) of ``messages``, in their order."""
    stored = dict(
        Message.objects.filter(pk__in=[m.pk for m in messages]).values_list("pk", "fair_tag")
    )
    return [stored[m.pk] for m in messages]


def drain(size, limits=None, now=None, queue=QUEUE):
    """Claims of ``size`` until none is left: the claimed messages in claim
    order, claim after claim."""
    order = []
    while batch := claim(size, limits, now, queue):
        order += batch
    return order


# --- the rotation between partitions ---------------------------------------------


def test_b_to_e_all_run_before_the_200th_of_a_enqueued_before_them():
    """The issue's case: A's 400 messages enqueued before B..E's 20 each (and
    20 without a key, last). Claims of 10 take one of each partition per
    round: A's first 20, B..E's 20 each and the default partition's 20 in
    the first 120 claimed, not A's 400 first."""
    a = put(400, "A")
    others = {key: put(20, key) for key in "BCDE"}
    plain = put(20)
    order = drain(10)
    assert len(order) == 500 and len({m.pk for m in order}) == 500
    position = {m.pk: i for i, m in enumerate(order)}
    a_200th = position[a[199].pk]
    last_other = max(position[m.pk] for ms in [*others.values(), plain] for m in ms)
    assert last_other < a_200th, (
        f"B..E and the default partition must all be claimed before A's 200th message "
        f"(position {a_200th}); the last of them came at {last_other}"
    )
    assert keys(order[:120]) == {"A": 20, "B": 20, "C": 20, "D": 20, "E": 20, None: 20}, (
        "one message of each of the 6 partitions per round"
    )
    # Claim by claim: no claim of 10 gives A more than its share (10 / 6).
    for start in range(0, 120, 10):
        assert keys(order[start : start + 10])["A"] <= 2, keys(order[start : start + 10])
    # Within a partition, enqueue order.
    assert [m.pk for m in order if m.partition_key == "A"] == [m.pk for m in a]
    assert [m.pk for m in order if m.partition_key is None] == [m.pk for m in plain]


def test_the_default_partition_takes_a_turn_in_every_round():
    a = put(6, "A")
    plain = put(6)
    order = drain(2)
    assert [m.partition_key for m in order] == ["A", None] * 6
    assert [m.pk for m in order if m.partition_key] == [m.pk for m in a]
    assert [m.pk for m in order if not m.partition_key] == [m.pk for m in plain]


# --- the round given at enqueue ----------------------------------------------------


def test_a_partitions_messages_take_consecutive_rounds_and_a_new_one_joins_the_current_round():
    a = put(5, "A")
    assert tags(a) == [0, 1, 2, 3, 4]
    assert keys(claim(2)) == {"A": 2}  # rounds 0 and 1: left the rotation
    assert Message.objects.filter(pk__in=[a[0].pk, a[1].pk], fair_tag__isnull=True).count() == 2
    b = put(3, "B")
    assert tags(b) == [2, 3, 4], "a new partition joins at the current round (A's lowest: 2)"
    more_a = put(2, "A")
    assert tags(more_a) == [5, 6], "after its partition's last round"
    one = enqueue(TOPIC, {}, queue=QUEUE, partition_key="C")
    assert tags([one]) == [2]
    # Another queue's rounds are its own.
    assert tags(put(2, "A", queue="elsewhere")) == [0, 1]
    order = drain(1)
    assert [m.partition_key for m in order] == ["A", "B", "C", "A", "B", "A", "B", "A", "A"]


def test_enqueue_many_with_mixed_keys_gives_each_partition_its_rounds_in_input_order():
    put(3, "A")  # rounds 0..2
    rows = [
        {"payload": 1, "partition_key": "A"},
        {"payload": 2, "partition_key": "C"},
        {"payload": 3, "partition_key": "A"},
        {"payload": 4},
        {"payload": 5, "partition_key": "C"},
        {"payload": 6, "partition_key": "D", "delay": 60},
        {"payload": 7, "partition_key": "E", "group_key": "g"},
    ]
    mixed = enqueue_many(rows, topic=TOPIC, queue=QUEUE)
    assert tags(mixed) == [3, 0, 4, None, 1, None, None], (
        "A continues after its rounds, C starts at the current round, the message "
        "without a key, the delayed one and the grouped one get none"
    )


def test_a_delayed_keyed_message_gets_no_round_and_is_claimed_when_due():
    a = put(4, "A")  # rounds 0..3
    (late_a,) = put(1, "A", delay=10)
    (late_b,) = put(1, "B", delay=10)
    assert tags([late_a, late_b]) == [None, None]
    now = timezone.now()
    assert [m.pk for m in claim(2, now=now)] == [a[0].pk, a[1].pk]
    with transaction.atomic():  # a claim just before they are due, undone
        assert [m.pk for m in claim(10, now=now + 9 * SECOND)] == [a[2].pk, a[3].pk]
        transaction.set_rollback(True)
    order = drain(2, now=now + 11 * SECOND)
    # Due, each joins the rotation where a message enqueued now would: B
    # (nothing else waiting in it) at the current round (2), A after its
    # partition's last round (3).
    assert [m.pk for m in order] == [a[2].pk, late_b.pk, a[3].pk, late_a.pk]


def test_a_retried_or_rescued_message_rejoins_the_rotation():
    a = put(3, "A")
    (b,) = put(1, "B")
    first = claim(2)
    assert keys(first) == {"A": 1, "B": 1}
    claimed_b = next(m for m in first if m.partition_key == "B")
    assert Message.objects.get(pk=b.pk).fair_tag is None, "the claim clears the round"
    # A retry (due at once) and a rescue put them back without a round.
    assert lifecycle.retry_later(claimed_b, 0, Category.TRANSIENT, "try again")
    claimed_a = next(m for m in first if m.partition_key == "A")
    assert claimed_a.pk == a[0].pk
    Message.objects.filter(pk=claimed_a.pk).update(lease_expires_at=timezone.now() - SECOND)
    assert maintenance.rescue_expired().requeued == 1
    back = Message.objects.filter(pk__in=[claimed_a.pk, b.pk])
    assert set(back.values_list("status", "fair_tag")) == {(Status.WAITING, None)}
    a1, a2 = a[1:]
    c1, c2, c3 = put(3, "C")  # a new partition meanwhile: at the current round (1)
    assert tags([a1, a2, c1, c2, c3]) == [1, 2, 1, 2, 3]
    # B (nothing else waiting in it) joins at the current round; the rescued
    # A after its partition's last round (2).
    claims = [{m.pk for m in claim(3)} for _ in range(3)]
    assert claims == [{a1.pk, b.pk, c1.pk}, {a2.pk, c2.pk, claimed_a.pk}, {c3.pk}]
    assert Message.objects.get(pk=claimed_a.pk).attempts == 2


def _default_partition():
    for key in "BCDE":
        put(5, key)
    put(5)  # enqueued after B..E's: later ids than their rounds'
    return None


def _delayed():
    for key in "BCDE":
        put(5, key)
    put(5, "Z", delay=1)  # due after B..E's rounds were given
    return timezone.now() + 2 * SECOND


def _retried():
    put(5, "Z")  # earlier ids than B..E's
    for message in claim(10):
        assert lifecycle.retry_later(message, 0, Category.TRANSIENT, "try again")
    for key in "BCDE":
        put(5, key)
    return None


@pytest.mark.parametrize(
    "setup", [_default_partition, _delayed, _retried], ids=["default", "delayed", "retried"]
)
def test_rows_ranked_at_claim_time_get_one_turn_per_round_in_claims_of_one(setup):
    """A worker with one free thread claims one message. Five partitions
    with five ready messages each, one of them without rounds given at
    enqueue (the default partition; a keyed partition whose messages were
    delayed, or retried): every five claims of one take one of each."""
    now = setup()
    order = drain(1, now=now)
    assert len(order) == 25
    rounds = [
        "".join(sorted(m.partition_key or "_" for m in order[i : i + 5])) for i in range(0, 25, 5)
    ]
    assert rounds == [rounds[0]] * 5 and len(set(rounds[0])) == 5, (
        "five claims of one should take one message of each partition; took, five by five: "
        + ", ".join(rounds)
    )


# --- strict order and priority -----------------------------------------------------


@override_settings(PGQUEUE={"QUEUES": {QUEUE: {"fair": False}}})
def test_a_queue_with_fair_false_is_claimed_in_strict_priority_run_at_id_order():
    now = timezone.now()
    a = put(4, "A")
    plain = put(2)
    b = put(2, "B")
    urgent = put(1, "C", priority=5)
    older = put(1, "B", run_at=now - 60 * SECOND)
    # Strict order: a keyed row's "round" is its run_at in microseconds.
    keyed = [*a, *b, *urgent, *older]
    assert tags(keyed) == [round(m.run_at.timestamp() * 1_000_000) for m in keyed]
    assert set(tags(plain)) == {None}
    order = drain(1)
    expected = [*urgent, *older, *a, *plain, *b]
    assert [m.pk for m in order] == [m.pk for m in expected]


def test_priority_comes_before_the_rotation():
    low_a = put(5, "A")
    low_b = put(5, "B")
    high_b = put(2, "B", priority=5)
    high_plain = put(1, priority=5)
    high_c = put(1, "C", priority=9)
    order = drain(1)
    assert order[0].pk == high_c[0].pk
    assert {m.pk for m in order[1:4]} == {m.pk for m in [*high_b, *high_plain]}
    assert {m.pk for m in order[4:]} == {m.pk for m in [*low_a, *low_b]}
    assert [m.partition_key for m in order[4:]] == ["A", "B"] * 5


# --- the concurrency of each partition ---------------------------------------------

EACH_TWO = Limits(partition=Limits(concurrency=2))


def test_each_partition_gets_no_more_than_its_free_slots(make_message):
    make_message(queue=QUEUE, partition_key="A", status=Status.PROCESSING)
    make_message(queue="other", partition_key="B", status=Status.PROCESSING)  # not this queue's
    put(10, "A")
    put(10, "B")
    put(10)
    first = claim(20, EACH_TWO)
    assert keys(first) == {"A": 1, "B": 2, None: 2}, "A has one running already"
    assert claim(20, EACH_TWO) == [], "every partition is full"
    # One of B's finishes: B has a slot again, the others still none.
    assert lifecycle.ack(next(m for m in first if m.partition_key == "B"))
    assert keys(claim(20, EACH_TWO)) == {"B": 1}


def test_the_queues_concurrency_still_caps_the_total():
    for key in "ABC":
        put(10, key)
    limits = Limits(concurrency=5, partition=Limits(concurrency=2))
    first = claim(20, limits)
    assert len(first) == 5 and max(keys(first).values()) == 2, keys(first)
    assert claim(20, limits) == [], "the queue is full, whatever its partitions' slots"
    lifecycle.ack(first[0])
    assert len(claim(20, limits)) == 1


# --- the rate of each partition ----------------------------------------------------


def test_each_partitions_rate_counts_its_starts_in_the_window():
    put(10, "A")
    put(10, "B")
    put(10)
    now = timezone.now() + SECOND
    # In A's window (0.5 s before), and just out of B's (exactly 1 s before).
    PartitionStart.objects.create(
        queue=QUEUE, partition_key="A", started_at=now - SECOND / 2, count=2
    )
    PartitionStart.objects.create(queue=QUEUE, partition_key="B", started_at=now - SECOND, count=9)
    limits = Limits(partition=Limits(rate=Rate(3, 1)))
    assert keys(claim(20, limits, now=now)) == {"A": 1, "B": 3, None: 3}
    recorded = PartitionStart.objects.filter(queue=QUEUE, started_at=now)
    assert dict(recorded.values_list("partition_key", "count")) == {"A": 1, "B": 3, "": 3}
    assert claim(20, limits, now=now + SECOND * 0.4) == [], "A's 2 are 0.9 s old: still in"
    assert keys(claim(20, limits, now=now + SECOND / 2)) == {"A": 2}, "A's 2 left the window"
    assert claim(20, limits, now=now + SECOND * 0.999) == []
    assert keys(claim(20, limits, now=now + SECOND)) == {"A": 1, "B": 3, None: 3}
    assert PartitionStart.objects.count() == 2 + 3 + 1 + 3, "one row per partition per claim"
    # Starts older than the longest window (an hour) are pruned by the claim.
    old = now - datetime.timedelta(hours=2)
    PartitionStart.objects.create(queue=QUEUE, partition_key="A", started_at=old, count=1)
    PartitionStart.objects.create(queue="other", partition_key="A", started_at=old, count=1)
    claim(20, limits, now=now + 2 * SECOND)
    pruned = PartitionStart.objects.filter(started_at=old)
    assert list(pruned.values_list("queue", flat=True)) == ["other"]


# --- named partitions: PartitionLimit rows -------------------------------------------


def test_a_named_partitions_concurrency_replaces_the_settings():
    PartitionLimit.objects.create(queue=QUEUE, partition_key="vip", concurrency=4)
    PartitionLimit.objects.create(queue=QUEUE, partition_key="free")  # no limit of either kind
    PartitionLimit.objects.create(queue="other", partition_key="A", concurrency=9)
    for key in ("A", "vip", "free"):
        put(10, key)
    limits = Limits(partition=Limits(concurrency=1, rate=Rate(2, 1)), named_partitions=True)
    assert keys(claim(30, limits)) == {"A": 1, "vip": 4, "free": 10}
    # Named partitions' limits only, none in the settings: the others have none.
    PartitionLimit.objects.filter(partition_key="free").update(concurrency=1)
    put(5, "B")
    put(5, "free")
    assert keys(claim(30, Limits(named_partitions=True))) == {"A": 9, "B": 5}


def test_a_named_partitions_rate_replaces_the_settings():
    PartitionLimit.objects.create(queue=QUEUE, partition_key="fast", rate="5/s")
    PartitionLimit.objects.create(queue=QUEUE, partition_key="free", concurrency=100)  # no rate
    PartitionLimit.objects.create(queue=QUEUE, partition_key="slow", rate="1/m")
    for key in ("A", "fast", "free", "slow"):
        put(10, key)
    now = timezone.now() + SECOND
    limits = Limits(partition=Limits(rate=Rate(2, 1)), named_partitions=True)
    assert keys(claim(40, limits, now=now)) == {"A": 2, "fast": 5, "free": 10, "slow": 1}
    later = now + SECOND
    assert keys(claim(40, limits, now=later)) == {"A": 2, "fast": 5}, "slow: one a minute"
    starts = PartitionStart.objects.filter(queue=QUEUE, started_at=later)
    assert dict(starts.values_list("partition_key", "count")) == {"A": 2, "fast": 5}


def test_the_default_partition_is_limited_like_the_others():
    put(10)
    put(10, "A")
    assert keys(claim(20, EACH_TWO)) == {None: 2, "A": 2}
    assert claim(20, EACH_TWO) == []
    # Its own limits: the partition "".
    PartitionLimit.objects.create(queue=QUEUE, partition_key="", concurrency=3)
    named = Limits(partition=Limits(concurrency=2), named_partitions=True)
    assert keys(claim(20, named)) == {None: 1}


def test_a_rescued_lease_stops_counting_against_its_partition(make_message):
    expired = timezone.now() - 5 * SECOND
    for _ in range(2):
        make_message(
            queue=QUEUE, partition_key="A", status=Status.PROCESSING, lease_expires_at=expired
        )
    put(3, "A")
    put(3, "B")
    assert keys(claim(10, EACH_TWO)) == {"B": 2}, "A's expired leases count until rescued"
    assert maintenance.rescue_expired().requeued == 2
    assert keys(claim(10, EACH_TWO)) == {"A": 2}


# --- the indexes each claim reads --------------------------------------------------


def _plan(sql, params):
    """EXPLAIN (ANALYZE) of one claim statement, rolled back."""
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


def _fill(keyed):
    """2,000 ready messages of the queue, keyed (with their rounds) or not,
    and the table's statistics."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (queue, topic, payload, run_at, partition_key,"
            " fair_tag) SELECT %s, 'bulk', '{}', now() - interval '1 minute',"
            " CASE WHEN %s THEN 't' || (n %% 50) END, CASE WHEN %s THEN n / 50 END"
            " FROM generate_series(0, 1999) AS n",
            [QUEUE, keyed, keyed],
        )
        cursor.execute("ANALYZE django_pgqueue_message")


def test_a_queue_without_partitions_claims_through_the_claim_index():
    _fill(keyed=False)
    sql, params = claim_statement("default", QUEUE, 10, "w")
    plan = _plan(sql, params)
    assert "pgqueue_msg_claim_idx" in plan and "Seq Scan" not in plan, plan
    assert "rows=10 loops=1" in plan.splitlines()[0], plan


@pytest.mark.parametrize("limited", [False, True], ids=["plain claim", "limited claim"])
def test_a_keyed_queues_claim_reads_the_fair_index(limited):
    _fill(keyed=True)
    if limited:
        statements, params = limited_claim_statements(
            "default", QUEUE, 10, "w", None, None, partitioned=True, partition_concurrency=2
        )
        # The claim alone: between the lock's parameter and the state's five.
        sql, params = statements[1], params[1:-5]
    else:
        sql, params = claim_statement("default", QUEUE, 10, "w")
    params[1] = uuid.uuid4()
    plan = _plan(sql, params)
    assert "pgqueue_msg_fair_idx" in plan and "Seq Scan on django_pgqueue_message" not in plan, plan
    assert "rows=10 loops=1" in plan.splitlines()[0] or limited, plan


def test_a_limited_claim_reads_the_partitions_starts_of_the_rates_window_only():
    """A queue whose partitions have a rate of 20/s records a start row per
    partition per claim; the hour the claim keeps can hold hundreds of
    thousands. The claim, under the queue's lock, should read the second
    its rate counts, not the hour."""
    put(10, "A")
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_partitionstart (queue, partition_key, started_at, count)"
            " SELECT %s, 't' || (n %% 20), now() - n * interval '30 ms', 1"
            " FROM generate_series(100, 100000) AS n",  # from 3 s to 50 min old
            [QUEUE],
        )
        cursor.execute("ANALYZE django_pgqueue_partitionstart")
    statements, params = limited_claim_statements(
        "default", QUEUE, 10, "w", None, None, partitioned=True, partition_rate=(20, 1),
        partition_starts=True,
    )  # fmt: skip
    plan = _plan(statements[1], params[1:-5])
    read = [
        int(line.split("rows=")[2].split()[0])
        for line in plan.splitlines()
        if "on django_pgqueue_partitionstart" in line and "actual" in line
    ]
    assert read and max(read) < 100, f"the claim read {read} start rows:\n{plan}"


# --- the claim of a queue believed to have no partitions ------------------------------


def plain_claim(limit, queue=QUEUE):
    """One claim of ``queue`` as a worker makes it while it believes the
    queue has no partitions: (the messages, what the claim found)."""
    result = lifecycle.ack_and_claim_rows([], [queue], limit, "w", 60, plain_queues=[queue])
    messages = [lifecycle.message_from_row(row) for row in result.rows]
    return messages, result.partitioned


def test_a_plain_claim_of_a_queue_without_partitions_says_so():
    unkeyed = put(3)
    messages, partitioned = plain_claim(2)
    assert [m.pk for m in messages] == [m.pk for m in unkeyed[:2]]
    assert partitioned == {QUEUE: False}
    messages, partitioned = plain_claim(5)
    assert [m.pk for m in messages] == [unkeyed[2].pk]
    assert partitioned == {QUEUE: False}
    # A claim of none says nothing (the pick looked too, and found none).
    assert plain_claim(5) == ([], {})


def test_a_plain_claim_of_none_lets_the_pick_look():
    put(2, "A")
    messages, partitioned = plain_claim(5)
    assert keys(messages) == {"A": 2}
    assert partitioned == {QUEUE: True}


@pytest.mark.parametrize("ranked", [False, True], ids=["keyed", "ranked default rows"])
def test_a_plain_claim_finds_the_rows_it_cannot_see_and_the_pick_takes_them(ranked):
    """Keyed rows (and rows of the default partition with a round) are not
    in the claim index: the plain claim says they are there, and the same
    call claims the rest with the whole pick."""
    if ranked:
        put(1, "A")
        put(4)
        claim(1)  # the pick takes A's and gives the default partition's first left a round
        assert sum(tag is not None for tag in tags(Message.objects.all())) == 1
    else:
        put(2, "A")
        put(2)
    messages, partitioned = plain_claim(10)
    assert partitioned == {QUEUE: True}
    assert len(messages) == 4
    assert not Message.objects.filter(status=Status.WAITING).exists()


def test_a_plain_claim_reads_a_few_nodes_not_the_pick():
    put(3)
    sql, params = claim_statement("default", QUEUE, 2, "w", plain=True)
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "pgqueue_msg_claim_idx" in plan, plan
    assert "candidates" not in plan and "WindowAgg" not in plan, plan
    # Whether the queue has rows it cannot see: the head of each index.
    assert "pgqueue_msg_fair_idx" in plan and "pgqueue_msg_keyed_idx" in plan, plan
