"""Message groups (group_key): one message of a group at a time, in enqueue
order, across workers; other groups and ungrouped messages in parallel."""

import collections
import random
import signal
import threading

import pytest
from demo.models import Handled
from django.db import IntegrityError, connection, transaction

from django_pgqueue import enqueue, enqueue_many, lifecycle, liveness
from django_pgqueue.groups import promote_groups
from django_pgqueue.models import Category, DeadLetter, GroupRelease, Message, Status
from django_pgqueue.sql.claim import claim_statement

from .claiming import ack_many
from .claiming import claim as claim_messages
from .conftest import raw_connection, running_worker, wait_until

WORKER = "test-worker"


def claim(limit=100, queues=("default",)):
    return claim_messages(list(queues), limit, WORKER, 60)


def statuses(messages):
    by_id = dict(
        Message.objects.filter(pk__in=[m.pk for m in messages]).values_list("pk", "status")
    )
    return [by_id.get(m.pk) for m in messages]


@pytest.mark.django_db
def test_grouped_messages_arrive_blocked_and_promotion_makes_the_oldest_the_head():
    first, second, third = (enqueue("test.record", {"n": n}, group_key="order-1") for n in range(3))
    assert [m.status for m in (first, second, third)] == [Status.BLOCKED] * 3
    assert statuses([first, second, third]) == [Status.BLOCKED] * 3
    assert GroupRelease.objects.filter(group_key="order-1").count() == 3
    assert claim() == [], "a blocked message was claimed"

    assert promote_groups() == 0
    assert statuses([first, second, third]) == [Status.WAITING, Status.BLOCKED, Status.BLOCKED]
    assert not GroupRelease.objects.exists(), "the releases were not consumed"
    assert promote_groups() == 0  # nothing to do: nothing changes
    assert statuses([first, second, third]) == [Status.WAITING, Status.BLOCKED, Status.BLOCKED]


@pytest.mark.django_db
def test_each_group_runs_its_messages_one_at_a_time_in_enqueue_order():
    ungrouped = enqueue_many([{"payload": {"n": n}} for n in range(3)], topic="test.record")
    grouped = {
        key: [enqueue("test.record", {"n": n}, group_key=key) for n in range(3)]
        for key in ("a", "b")
    }
    handled = []
    while True:
        result = lifecycle.ack_and_claim_rows([], ["default"], 100, WORKER, 60, promote=True)
        if not result.rows:
            break
        claimed = [lifecycle.message_from_row(row) for row in result.rows]
        # At most one message of each group in one claim, and never two at once.
        keys = [m.group_key for m in claimed if m.group_key]
        assert len(keys) == len(set(keys)), f"two messages of a group claimed together: {keys}"
        handled += [m.pk for m in claimed]
        ack_many(claimed)
    for messages in grouped.values():
        order = [pk for pk in handled if pk in {m.pk for m in messages}]
        assert order == [m.pk for m in messages]
    assert set(handled) >= {m.pk for m in ungrouped}
    assert not Message.objects.exists()
    # The first claim took every ungrouped message and both groups' heads.
    assert set(handled[:5]) == {m.pk for m in ungrouped} | {grouped["a"][0].pk, grouped["b"][0].pk}


@pytest.mark.django_db
def test_a_failing_message_blocks_its_group_while_it_waits_for_its_retry():
    first, second = (enqueue("test.record", {"n": n}, group_key="g") for n in range(2))
    promote_groups()
    (claimed,) = claim()
    assert lifecycle.retry_later(claimed, 0, Category.TRANSIENT, "boom")
    promote_groups()
    assert statuses([first, second]) == [Status.WAITING, Status.BLOCKED]
    (again,) = claim()
    assert again.pk == first.pk and again.attempts == 2, "the retry must come before the rest"


@pytest.mark.django_db
def test_a_dead_letter_releases_its_group_by_default():
    first, second = (enqueue("test.record", {"n": n}, group_key="g") for n in range(2))
    promote_groups()
    (claimed,) = claim()
    dead = lifecycle.dead_letter(claimed, Category.PERMANENT, "bad")
    assert dead.group_key == "g" and not dead.holds_group
    promote_groups()
    assert statuses([second]) == [Status.WAITING]


@pytest.mark.django_db
def test_a_dead_letter_that_blocks_its_group_holds_it_until_revived_and_then_runs_first(settings):
    settings.PGQUEUE = {"DEAD_LETTER_BLOCKS_GROUP": True}
    first, second = (enqueue("test.record", {"n": n}, group_key="g") for n in range(2))
    promote_groups()
    (claimed,) = claim()
    dead = lifecycle.dead_letter(claimed, Category.PERMANENT, "bad")
    assert dead.holds_group
    promote_groups()
    assert statuses([second]) == [Status.BLOCKED], "the group went on past its dead letter"
    later = enqueue("test.record", {"n": 2}, group_key="g")
    promote_groups()
    assert statuses([second, later]) == [Status.BLOCKED, Status.BLOCKED]

    from django_pgqueue import revive

    assert revive(DeadLetter.objects.filter(pk=dead.pk)).done == 1
    dead.refresh_from_db()
    assert not dead.holds_group
    revived = Message.objects.get(pk=dead.revived_message_id)
    assert revived.status == Status.WAITING, "the revived message must lead its group"
    promote_groups()
    assert statuses([second, later]) == [Status.BLOCKED, Status.BLOCKED]
    order = []
    while claimed := claim():
        order += [m.pk for m in claimed]
        ack_many(claimed)
        promote_groups()
    assert order == [revived.pk, second.pk, later.pk]


@pytest.mark.django_db
def test_resolving_or_deleting_the_dead_letter_that_holds_a_group_releases_it(settings):
    settings.PGQUEUE = {"DEAD_LETTER_BLOCKS_GROUP": True}
    from django_pgqueue import resolve

    for how in ("resolve", "delete"):
        key = f"g-{how}"
        first, second = (enqueue("test.record", {"n": n}, group_key=key) for n in range(2))
        promote_groups()
        (claimed,) = claim()
        dead = lifecycle.dead_letter(claimed, Category.BUSINESS, "refused")
        promote_groups()
        assert statuses([second]) == [Status.BLOCKED]
        if how == "resolve":
            assert resolve(DeadLetter.objects.filter(pk=dead.pk), note="handled by hand").done == 1
        else:
            dead.delete()
        promote_groups()
        assert statuses([second]) == [Status.WAITING], how
        ack_many(claim())


@pytest.mark.django_db
def test_a_handler_option_overrides_the_setting():
    from django_pgqueue.policy import dead_letter_blocks_group
    from django_pgqueue.registry import lookup

    hold, fail = lookup("test.group_hold"), lookup("test.group_fail")
    grouped = Message(group_key="g")
    assert dead_letter_blocks_group(grouped, hold) is True
    assert dead_letter_blocks_group(grouped, fail) is False
    assert dead_letter_blocks_group(Message(group_key=None), hold) is False


def test_the_handler_option_is_validated():
    from django_pgqueue import handler

    with pytest.raises(ValueError, match="dead_letter_blocks_group must be True, False or None"):
        handler("test.bad_option", dead_letter_blocks_group="yes")


@pytest.mark.django_db
def test_deleting_a_head_by_hand_releases_its_group():
    first, second = (enqueue("test.record", {"n": n}, group_key="g") for n in range(2))
    promote_groups()
    with connection.cursor() as cursor:  # another program's SQL, or the admin
        cursor.execute("DELETE FROM django_pgqueue_message WHERE id = %s", [first.pk])
    promote_groups()
    assert statuses([second]) == [Status.WAITING]


@pytest.mark.django_db
def test_raw_sql_inserts_are_grouped_too_and_the_database_refuses_a_second_head():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_pgqueue_message (topic, payload, group_key)"
            " VALUES ('test.record', '{}', 'raw'), ('test.record', '{}', 'raw') RETURNING id"
        )
        first, second = sorted(row[0] for row in cursor.fetchall())
    promote_groups()
    assert dict(Message.objects.values_list("pk", "status")) == {
        first: Status.WAITING,
        second: Status.BLOCKED,
    }
    with pytest.raises(IntegrityError, match="pgqueue_msg_group_head_uniq"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "UPDATE django_pgqueue_message SET status = 'waiting' WHERE id = %s", [second]
            )


@pytest.mark.django_db
def test_dedup_keys_cover_blocked_messages():
    first = enqueue("test.record", {"n": 1}, group_key="g", dedup_key="k")
    again = enqueue("test.record", {"n": 2}, group_key="g", dedup_key="k")
    assert again.pk == first.pk and not again.created
    assert Message.objects.count() == 1


@pytest.mark.django_db
def test_the_probe_reports_released_groups():
    assert not liveness.probe(["default"]).groups_released
    enqueue("test.record", {}, group_key="g")
    assert liveness.probe(["default"]).groups_released
    promote_groups()
    found = liveness.probe(["default"])
    assert not found.groups_released and found.ready


@pytest.mark.django_db
def test_promotion_takes_a_bounded_number_of_releases_per_call():
    enqueue_many([{"payload": {}, "group_key": f"g{n}"} for n in range(30)], topic="test.record")
    assert promote_groups(limit=10) == 1, "more releases are left: say so"
    assert Message.objects.filter(status=Status.WAITING).count() == 10
    while promote_groups(limit=10):
        pass
    assert Message.objects.filter(status=Status.WAITING).count() == 30


@pytest.mark.django_db(transaction=True)
def test_concurrent_promoters_never_make_two_heads():
    """Many connections promote the same groups at once, while grouped
    messages keep arriving and heads keep finishing: every group has at most
    one head at any moment (the unique index would raise otherwise) and,
    at the end, exactly one."""
    keys = [f"g{n}" for n in range(5)]
    errors = []
    stop = threading.Event()

    def promoter():
        try:
            with raw_connection(autocommit=True) as conn:
                while not stop.is_set():
                    conn.execute("SELECT pgqueue_promote_groups(50, false)")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def finisher():
        try:
            with raw_connection(autocommit=True) as conn:
                while not stop.is_set():
                    conn.execute(
                        "DELETE FROM django_pgqueue_message WHERE id IN (SELECT id FROM"
                        " django_pgqueue_message WHERE status = 'waiting' LIMIT 3"
                        " FOR UPDATE SKIP LOCKED)"
                    )
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=promoter) for _ in range(4)]
    threads.append(threading.Thread(target=finisher))
    for thread in threads:
        thread.start()
    try:
        with raw_connection(autocommit=True) as conn:
            for n in range(300):
                conn.execute(
                    "INSERT INTO django_pgqueue_message (topic, payload, group_key)"
                    " VALUES ('test.record', '{}', %s)",
                    [keys[n % len(keys)]],
                )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors, errors[:3]
    while promote_groups():
        pass
    heads = collections.Counter(
        Message.objects.filter(status=Status.WAITING).values_list("group_key", flat=True)
    )
    blocked = set(Message.objects.filter(status=Status.BLOCKED).values_list("group_key", flat=True))
    assert set(heads.values()) <= {1}
    assert blocked <= set(heads), f"groups left without a head: {blocked - set(heads)}"


@pytest.mark.django_db
def test_the_claim_plan_does_not_read_blocked_messages():
    enqueue_many(
        [{"payload": {}, "group_key": f"g{n % 10}"} for n in range(2000)], topic="test.record"
    )
    promote_groups()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE django_pgqueue_message")
        sql, params = claim_statement("default", "default", 100, WORKER)
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0][0]
    text = repr(plan)
    assert "pgqueue_msg_claim_idx" in text or "pgqueue_msg_due_idx" in text, text
    assert "pgqueue_msg_group_next_idx" not in text
    assert len(claim()) == 0, "EXPLAIN ANALYZE ran the claim: it took the heads"


# --- real worker processes --------------------------------------------------------


@pytest.mark.slow
def test_four_workers_keep_the_order_of_200_groups_of_50_and_run_groups_in_parallel(
    start_worker,
):
    rng = random.Random(8)
    groups, per_group = 200, 50
    # Interleaved enqueue: each group's messages in order, the groups shuffled.
    slots = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(slots)
    items, seq = [], collections.Counter()
    for g in slots:
        topic = "test.group" if g % 2 else "test.group_nonatomic"
        delay = rng.choice([0, 0, 0.001, 0.002, 0.005])
        items.append(
            {"topic": topic, "payload": {"delay": delay, "seq": seq[g]}, "group_key": f"g{g}"}
        )
        seq[g] += 1
    messages = enqueue_many(items)
    group_of = {m.pk: m.group_key for m in messages}
    enqueued = collections.defaultdict(list)
    for m in messages:
        enqueued[m.group_key].append(m.pk)

    workers = [
        start_worker("--concurrency", "4", "--batch-size", "50", "--log-level", "WARNING")
        for _ in range(4)
    ]
    wait_until(
        lambda: Handled.objects.count() >= len(messages),
        timeout=240,
        interval=0.2,
        message="every grouped message handled",
    )
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(timeout=60) == 0, worker.log()

    rows = list(Handled.objects.order_by("pk").values_list("message_id", "pid", "handled_at"))
    assert len(rows) == len(messages), "a message was handled twice"
    handled = collections.defaultdict(list)
    for message_id, _pid, _at in rows:
        handled[group_of[message_id]].append(message_id)
    wrong = [key for key in enqueued if handled[key] != enqueued[key]]
    assert not wrong, f"{len(wrong)} group(s) out of order, e.g. {wrong[0]}"
    assert not Message.objects.exists() and not DeadLetter.objects.exists()

    # Real parallelism: all four processes handled messages, and at the
    # busiest moment many groups were being handled at once. A handling
    # spans [handled_at - delay, handled_at]; count the overlaps.
    assert len({pid for _, pid, _ in rows}) == 4
    delay_of = {m.pk: m.payload["delay"] for m in messages}
    events = []
    for message_id, _pid, at in rows:
        end = at.timestamp()
        events += [(end - delay_of[message_id] - 0.0005, 1), (end, -1)]
    running = busiest = 0
    for _, step in sorted(events):
        running += step
        busiest = max(busiest, running)
    # More groups at once than one worker has threads (4): the groups ran in
    # parallel across processes. (The peak itself depends on the machine's
    # load: 6 to 16 were seen.)
    assert busiest > 4, f"at most {busiest} group(s) handled at once"
    ends = [at.timestamp() for _, _, at in rows]
    print(
        f"\n{len(rows):,} grouped messages handled over {max(ends) - min(ends):.1f} s by 4"
        f" workers, their sleeps adding up to {sum(delay_of.values()):.1f} s;"
        f" at most {busiest} at once"
    )


@pytest.mark.django_db
def test_status_and_metrics_count_blocked_messages_as_their_own_state():
    from django_pgqueue.observability import stats

    enqueue_many([{"payload": {}, "group_key": "g"} for _ in range(3)], topic="test.record")
    promote_groups()
    counts = {state: n for _, _, state, n in stats.messages_by_queue_topic_state()}
    assert counts == {stats.READY: 1, stats.BLOCKED: 2}


@pytest.mark.django_db(transaction=True)
def test_the_migration_blocks_all_but_the_head_of_existing_groups():
    from django.db.migrations.executor import MigrationExecutor

    before = [("django_pgqueue", "0008_task_record")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_pgqueue")
    executor.migrate(before)
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_pgqueue_message (topic, payload, group_key, status)"
                " VALUES ('t', '{}', 'a', 'waiting'), ('t', '{}', 'a', 'waiting'),"
                " ('t', '{}', 'b', 'processing'), ('t', '{}', 'b', 'waiting'),"
                " ('t', '{}', NULL, 'waiting') RETURNING id"
            )
            ids = sorted(row[0] for row in cursor.fetchall())
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(latest)
    got = dict(Message.objects.values_list("pk", "status"))
    assert [got[pk] for pk in ids] == [
        Status.WAITING,
        Status.BLOCKED,
        Status.PROCESSING,
        Status.BLOCKED,
        Status.WAITING,
    ]


@pytest.mark.slow
def test_a_worker_killed_on_a_groups_head_loses_nothing_and_the_group_keeps_its_order(
    start_worker,
):
    # test.sleep writes its ledger row, then sleeps 60 s on its first attempt:
    # the kill lands while the head's write is uncommitted.
    head = enqueue("test.sleep", {"seconds": 60, "then": 0}, group_key="g")
    rest = [enqueue("test.group", {"n": n}, group_key="g") for n in range(3)]
    victim = start_worker("--lease", "2", "--concurrency", "2")
    wait_until(
        lambda: Message.objects.filter(pk=head.pk, status=Status.PROCESSING).exists(),
        timeout=60,
        message="the first worker to take the group's head",
    )
    assert statuses(rest) == [Status.BLOCKED] * 3
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    survivor = start_worker("--lease", "2", "--concurrency", "2", pgqueue={"POLL_INTERVAL": 0.5})
    wait_until(
        lambda: Handled.objects.count() >= 4, timeout=60, message="the group handled to its end"
    )
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0, survivor.log()
    ledger = list(Handled.objects.order_by("pk").values_list("message_id", "attempt"))
    assert ledger == [(head.pk, 2), *((m.pk, 1) for m in rest)]
    assert not Message.objects.exists()


@pytest.mark.slow
def test_a_release_left_behind_is_promoted_by_a_polling_worker(start_worker):
    """A head's acknowledgement committed, its worker died before promoting:
    the release row is there, nobody is notified. A worker's poll finds it."""
    messages = [enqueue("test.group", {"n": n}, group_key="g") for n in range(2)]
    promote_groups()
    with connection.cursor() as cursor:  # the head finished; its release is committed
        cursor.execute("DELETE FROM django_pgqueue_message WHERE id = %s", [messages[0].pk])
    assert GroupRelease.objects.count() == 1
    worker = start_worker("--concurrency", "1", pgqueue={"NOTIFY": False, "POLL_INTERVAL": 0.5})
    wait_until(
        lambda: Handled.objects.filter(message_id=messages[1].pk).exists(),
        timeout=60,
        message="the group's next message handled",
    )
    # Its acknowledgement releases the group again (now empty): the worker's
    # next poll promotes that release away. Wait for it, not for a poll's time.
    wait_until(
        lambda: not GroupRelease.objects.exists(),
        timeout=60,
        message=f"the last release promoted away; worker log:\n{worker.log()}",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()


@pytest.mark.django_db(transaction=True)
def test_promotion_refuses_to_run_above_read_committed():
    import psycopg

    enqueue("test.record", {}, group_key="g")
    with raw_connection() as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(psycopg.errors.RaiseException, match="not repeatable read"):
            conn.execute("SELECT pgqueue_promote_groups(10, false)")
    assert [m.status for m in Message.objects.all()] == [Status.BLOCKED]
    assert GroupRelease.objects.count() == 1, "the release waits for a promotion that can run"


@pytest.mark.django_db(transaction=True)
def test_a_failed_promotion_is_tried_again_and_the_group_goes_on(caplog):
    """The promotion fails (an injected error on the release table) in the
    worker's claim round trip, three times: the claim is rolled back with it,
    the worker retries, and the group is handled in order, each message once."""
    with raw_connection(autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE test_promote_failures")
        conn.execute(
            "CREATE FUNCTION test_fail_promote() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN IF nextval('test_promote_failures') <= 3 THEN"
            " RAISE EXCEPTION 'promotion failure (injected)'; END IF; RETURN OLD; END $$"
        )
        conn.execute(
            "CREATE TRIGGER test_fail_promote BEFORE DELETE ON django_pgqueue_grouprelease"
            " FOR EACH ROW EXECUTE FUNCTION test_fail_promote()"
        )
    try:
        messages = [enqueue("test.group", {"n": n}, group_key="g") for n in range(3)]
        with running_worker(concurrency=1, poll_interval=0.2):
            wait_until(
                lambda: Handled.objects.count() >= 3, timeout=60, message="the group handled"
            )
        assert list(Handled.objects.order_by("pk").values_list("message_id", flat=True)) == [
            m.pk for m in messages
        ]
        assert "promotion failure (injected)" in caplog.text
        assert not Message.objects.exists()
    finally:
        with raw_connection(autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_fail_promote ON django_pgqueue_grouprelease")
            conn.execute("DROP FUNCTION test_fail_promote()")
            conn.execute("DROP SEQUENCE test_promote_failures")
