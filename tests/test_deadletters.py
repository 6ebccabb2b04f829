"""Dead-letter triage: revive(), resolve(), categorize() and manage.py
pgqueue_deadletters. Rows are fabricated in the exact state needed, one call
is made, and the rows are read back, including rows that must stay untouched."""

import contextlib
import datetime
import io
import json
import logging
import threading
import time

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgqueue import categorize, conf, deadletters, resolve, revive
from django_pgqueue.deadletters import DeadLetterError
from django_pgqueue.models import Category, DeadLetter, DeadLetterState, Message, Status
from django_pgqueue.worker import Worker

from .conftest import raw_connection, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

NOW = timezone.now().replace(microsecond=0)
HOUR = datetime.timedelta(hours=1)
NEW, REVIVED, RESOLVED = DeadLetterState.NEW, DeadLetterState.REVIVED, DeadLetterState.RESOLVED


def reread(dead_letter):
    return DeadLetter.objects.get(pk=dead_letter.pk)


def snapshot():
    """Everything the triage functions may change, to show that nothing did."""
    return (
        list(DeadLetter.objects.order_by("pk").values()),
        list(Message.objects.order_by("pk").values()),
    )


# --- revive -------------------------------------------------------------------


def test_revive_puts_a_waiting_message_with_the_same_fields_and_records_the_audit(
    make_dead_letter,
):
    dead = make_dead_letter(
        payload={"order": 7, "items": [1, 2]},
        headers={"trace": "abc"},
        priority=5,
        queue="mail",
        group_key="customer-9",
        max_attempts=3,
        attempts=3,
        notes="looked at it",
    )
    untouched = make_dead_letter()

    result = revive([dead.pk], by="alice", note="payment service is back", now=NOW)

    assert (result.done, dict(result.skipped)) == (1, {})
    assert str(result) == "revived 1, skipped 0"
    message = Message.objects.get()
    # In its group (group_key), behind whatever the group holds: blocked until promoted.
    assert message.status == Status.BLOCKED
    assert message.attempts == 0, "a revived message starts its attempts again"
    assert (message.topic, message.queue, message.priority) == ("test.record", "mail", 5)
    assert message.payload == {"order": 7, "items": [1, 2]}
    assert message.headers == {"trace": "abc"}
    assert (message.group_key, message.max_attempts, message.dedup_key) == ("customer-9", 3, None)
    assert message.run_at <= timezone.now(), "a revived message is ready at once"

    row = reread(dead)
    assert row.state == REVIVED
    assert row.revived_at == NOW
    assert row.revive_count == 1
    assert row.revived_message_id == message.pk
    assert row.revived_by == "alice"
    assert row.notes == (
        f"looked at it\n[{NOW.isoformat()}] revived as message {message.pk} "
        "by alice: payment service is back"
    )
    assert reread(untouched).state == NEW, "a dead letter that was not asked for changed"


def test_revived_message_wakes_the_workers(make_dead_letter, listener):
    dead = make_dead_letter(queue="mail")
    revive([dead.pk])
    assert listener.wait_for(1) == [("django_pgqueue", "mail")], "no NOTIFY for the revival"


def test_revived_message_is_handled_by_a_real_worker(make_dead_letter):
    dead = make_dead_letter(topic="test.record", payload={"fixed": True})
    revive(DeadLetter.objects.filter(pk=dead.pk))
    message_id = reread(dead).revived_message_id

    Worker(burst=True).run()

    assert list(Handled.objects.values_list("message_id", "topic", "attempt")) == [
        (message_id, "test.record", 1)
    ]
    assert not Message.objects.exists(), "the revived message was not acknowledged"
    assert reread(dead).state == REVIVED


def test_a_second_revive_skips_what_is_revived_and_force_revives_again(make_dead_letter):
    dead = make_dead_letter()
    revive([dead.pk])
    first = reread(dead).revived_message_id

    again = revive([dead.pk])
    assert (again.done, dict(again.skipped)) == (0, {deadletters.ALREADY_REVIVED: 1})
    assert str(again) == "revived 0, skipped 1 (already revived: 1)"
    assert Message.objects.count() == 1 and reread(dead).revive_count == 1

    forced = revive([dead.pk], force=True)
    assert forced.done == 1
    row = reread(dead)
    assert row.revive_count == 2
    assert row.revived_message_id != first
    assert Message.objects.count() == 2, "force revives once more"


def test_resolved_dead_letters_are_revived_only_with_force(make_dead_letter):
    dead = make_dead_letter(state=RESOLVED, resolved_by="bob", resolved_at=NOW - HOUR)
    assert dict(revive([dead.pk]).skipped) == {deadletters.IS_RESOLVED: 1}
    assert not Message.objects.exists()

    assert revive([dead.pk], force=True).done == 1
    row = reread(dead)
    assert row.state == REVIVED and Message.objects.count() == 1
    assert (row.resolved_by, row.resolved_at) == ("bob", NOW - HOUR), "the history stays"


def test_revive_to_another_queue_and_topic(make_dead_letter):
    dead = make_dead_letter(topic="test.fail", queue="default")
    revive([dead], queue="urgent", topic="test.record_nonatomic", by="carol", now=NOW)
    message = Message.objects.get()
    assert (message.queue, message.topic) == ("urgent", "test.record_nonatomic")
    row = reread(dead)
    assert (row.queue, row.topic) == ("default", "test.fail"), "the dead letter keeps its own"
    assert row.notes == (
        f"[{NOW.isoformat()}] revived as message {message.pk} "
        "(queue default -> urgent, topic test.fail -> test.record_nonatomic) by carol"
    )


@contextlib.contextmanager
def failing_dead_letter_updates(fail):
    """Run the queue connection's UPDATEs of dead letters through
    ``fail(n)`` (n: 1 for the first one...), which raises to make one fail."""
    updates = []

    def wrapper(execute, sql, params, many, context):
        if sql.startswith(f'UPDATE "{DeadLetter._meta.db_table}"'):
            updates.append(sql)
            fail(len(updates))
        return execute(sql, params, many, context)

    with connections[conf.database_alias()].execute_wrapper(wrapper):
        yield


def test_revive_is_atomic_the_insert_and_the_dead_letter_update_commit_together(
    make_dead_letter,
):
    dead = make_dead_letter()

    def fail(n):
        assert Message.objects.count() == 1, "the message should be inserted by now"
        raise RuntimeError("the update failed")

    with failing_dead_letter_updates(fail), pytest.raises(RuntimeError, match="the update failed"):
        revive([dead.pk])
    assert not Message.objects.exists(), "a message was left without its dead letter's update"
    assert reread(dead).state == NEW


def test_a_failing_chunk_rolls_back_alone(make_dead_letter):
    dead = [make_dead_letter() for _ in range(4)]

    def fail_second(n):
        if n == 2:
            raise RuntimeError("the second chunk failed")

    with failing_dead_letter_updates(fail_second), pytest.raises(RuntimeError):
        revive(DeadLetter.objects.all(), chunk_size=2)
    assert [reread(d).state for d in dead] == [REVIVED, REVIVED, NEW, NEW]
    assert Message.objects.count() == 2


def test_a_dedup_key_held_by_an_unfinished_message_skips_the_revival(
    make_dead_letter, make_message
):
    holder = make_message(topic="test.record", dedup_key="order-1", status=Status.PROCESSING)
    held = make_dead_letter(dedup_key="order-1")
    other_topic = make_dead_letter(topic="test.fail", dedup_key="order-1")
    make_message(topic="test.record", dedup_key="order-2", status=Status.DONE)
    finished = make_dead_letter(dedup_key="order-2")
    twin_a = make_dead_letter(dedup_key="order-3")
    twin_b = make_dead_letter(dedup_key="order-3")
    ids = [held.pk, other_topic.pk, finished.pk, twin_a.pk, twin_b.pk]

    dry = revive(ids, dry_run=True)
    result = revive(ids)

    assert (result.done, dict(result.skipped)) == (3, {deadletters.DUPLICATE: 2})
    assert (dry.done, dict(dry.skipped)) == (3, {deadletters.DUPLICATE: 2}), "dry run differs"
    assert reread(held).state == NEW, "the unfinished message already carries that work"
    assert [reread(d).state for d in (other_topic, finished, twin_a, twin_b)] == [
        REVIVED,
        REVIVED,
        REVIVED,
        NEW,
    ]
    revived = Message.objects.get(pk=reread(finished).revived_message_id)
    assert revived.dedup_key == "order-2", "a revived message keeps its dedup_key"

    Message.objects.filter(pk=holder.pk).delete()  # the holder finished
    assert revive([held.pk]).done == 1


def test_a_skipped_duplicate_is_logged_with_the_holder(make_dead_letter, make_message, caplog):
    holder = make_message(topic="test.record", dedup_key="order-1")
    dead = make_dead_letter(dedup_key="order-1")
    with caplog.at_level(logging.INFO, logger="django_pgqueue.deadletters"):
        revive([dead.pk])
    assert caplog.messages == [
        f"Dead letter id={dead.pk} topic=test.record not revived (duplicate): "
        f"message id={holder.pk} holds its dedup_key"
    ]
    assert caplog.records[0].skipped == deadletters.DUPLICATE


def test_a_dead_letter_the_producer_rejects_is_skipped_and_logged(make_dead_letter, caplog):
    bad = make_dead_letter(topic="has space")  # a raw-SQL producer's topic
    good = make_dead_letter()
    with caplog.at_level(logging.INFO, logger="django_pgqueue.deadletters"):
        result = revive([bad.pk, good.pk])
    assert (result.done, dict(result.skipped)) == (1, {deadletters.INVALID: 1})
    assert reread(bad).state == NEW
    assert (
        f"Dead letter id={bad.pk} topic=has space not revived (invalid): topic 'has space'"
        in caplog.text
    )
    assert revive([bad.pk], topic="test.record").done == 1, "another topic= revives it"


def test_revive_logs_one_line_per_revival_with_the_ids(make_dead_letter, caplog):
    dead = make_dead_letter(message_id=41)
    with caplog.at_level(logging.INFO, logger="django_pgqueue.deadletters"):
        revive([dead.pk], by="alice")
    message_id = reread(dead).revived_message_id
    [record] = caplog.records
    assert record.getMessage() == (
        f"Dead letter id={dead.pk} topic=test.record revived as message id={message_id} "
        "queue=default topic=test.record by alice"
    )
    assert (record.dead_letter_id, record.message_id, record.revived_message_id) == (
        dead.pk,
        41,
        message_id,
    )
    assert (record.state, record.actor) == (REVIVED, "alice")


def test_two_operators_cannot_revive_the_same_dead_letter_twice(make_dead_letter):
    dead = make_dead_letter()
    results = []
    with raw_connection() as other:
        # Another operator's revive holds the row...
        other.execute("SELECT 1 FROM django_pgqueue_deadletter WHERE id = %s FOR UPDATE", [dead.pk])

        def run():
            try:
                results.append(revive([dead.pk]))
            finally:
                connections.close_all()

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(
            lambda: other.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'"
            ).fetchone()[0],
            message="our revive to wait for the other operator's lock",
        )
        # ...and commits its revival.
        other.execute(
            "UPDATE django_pgqueue_deadletter SET state = 'revived', revive_count = 1 "
            "WHERE id = %s",
            [dead.pk],
        )
        other.commit()
        thread.join(timeout=10)
    assert (results[0].done, dict(results[0].skipped)) == (0, {deadletters.ALREADY_REVIVED: 1})
    assert not Message.objects.exists(), "revived twice"
    assert reread(dead).revive_count == 1


def test_revive_works_in_chunks_of_locked_rows(make_dead_letter):
    DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=n,
            queue="default",
            topic="test.record",
            payload={"n": n},
            category=Category.TRANSIENT,
            reason="x",
        )
        for n in range(1200)
    )
    connection = connections["default"]
    with CaptureQueriesContext(connection) as queries:
        result = revive(DeadLetter.objects.filter(state=NEW))
    assert result.done == 1200
    assert Message.objects.count() == 1200
    assert sorted(Message.objects.values_list("payload__n", flat=True)) == list(range(1200))
    locks = [q["sql"] for q in queries if "FOR UPDATE" in q["sql"]]
    assert len(locks) == 3, f"expected 3 chunks of at most 500 locked rows, saw {len(locks)}"
    assert not DeadLetter.objects.exclude(state=REVIVED).exists()


def test_rate_sleeps_between_chunks_on_a_monotonic_clock(make_dead_letter):
    for _ in range(5):
        make_dead_letter()
    now = [100.0]
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    result = revive(DeadLetter.objects.all(), rate=2, clock=lambda: now[0], sleep=sleep)
    assert result.done == 5
    assert sleeps == [1.0, 1.0], "2 per second: chunks of 2, 2 and 1, a second apart"

    sleeps.clear()
    DeadLetter.objects.update(state=NEW)
    revive(DeadLetter.objects.all(), rate=0.5, force=True, clock=lambda: now[0], sleep=sleep)
    assert sleeps == [2.0] * 4, "one message every two seconds"


def test_rate_counts_only_revived_messages_and_work_takes_off_the_wait(make_dead_letter):
    for state in (REVIVED, REVIVED, NEW, NEW, NEW):
        make_dead_letter(state=state)
    now = [0.0]
    sleeps = []

    def clock():
        now[0] += 0.25  # each chunk's work takes a quarter of a second
        return now[0]

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    result = revive(DeadLetter.objects.all(), rate=2, clock=clock, sleep=sleep)
    assert (result.done, dict(result.skipped)) == (3, {deadletters.ALREADY_REVIVED: 2})
    # Chunks: [revived, revived] (nothing revived: no wait), [new, new], [new].
    assert sleeps == [0.75]


def test_a_long_revive_does_not_revive_dead_letters_that_arrive_meanwhile(make_dead_letter):
    first = [make_dead_letter() for _ in range(2)]
    arrived = []

    def sleep(seconds):  # a revived message fails again while we wait
        assert len(arrived) < 3, "the run keeps reviving the dead letters it causes"
        arrived.append(make_dead_letter())

    result = revive(DeadLetter.objects.filter(state=NEW), rate=1, sleep=sleep)
    assert result.done == 2 and len(arrived) == 1
    assert [reread(d).state for d in first] == [REVIVED, REVIVED]
    assert reread(arrived[0]).state == NEW, "a newcomer was revived by the run that caused it"


def test_a_slice_of_a_queryset_revives_that_many(make_dead_letter):
    dead = [make_dead_letter(message_id=n) for n in (1, 4, 3, 5, 2)]
    # The first three by message_id are dead[0], dead[4], dead[2]. Chunks of
    # 1: a slice evaluated again per chunk would take in dead[1] once the
    # first has been revived.
    result = revive(DeadLetter.objects.filter(state=NEW).order_by("message_id")[:3], chunk_size=1)
    assert result.done == 3
    assert [reread(d).state for d in dead] == [REVIVED, NEW, REVIVED, NEW, REVIVED]


def test_a_dead_letter_deleted_meanwhile_is_counted_as_gone(make_dead_letter):
    first, second = make_dead_letter(), make_dead_letter()

    def sleep(seconds):  # someone purges the second one while we wait
        DeadLetter.objects.filter(pk=second.pk).delete()

    result = revive([first.pk, second.pk], rate=1, sleep=sleep)
    assert (result.done, dict(result.skipped)) == (1, {deadletters.GONE: 1})
    assert Message.objects.count() == 1


def test_a_rate_limited_revive_refuses_to_sleep_inside_a_transaction(make_dead_letter):
    dead = make_dead_letter()
    with transaction.atomic(), pytest.raises(DeadLetterError, match="outside transaction"):
        revive([dead.pk], rate=10)
    assert reread(dead).state == NEW


# --- resolve and categorize ------------------------------------------------------


def test_resolve_sets_the_audit_fields_and_skips_what_is_closed(make_dead_letter, caplog):
    new = make_dead_letter(notes="first look")
    revived = make_dead_letter(state=REVIVED)
    resolved = make_dead_letter(state=RESOLVED, resolved_by="bob", resolved_at=NOW - HOUR)

    class User:
        def get_username(self):
            return "dana"

    with caplog.at_level(logging.INFO, logger="django_pgqueue.deadletters"):
        result = resolve(
            [new.pk, revived.pk, resolved.pk], note="customer\n  refunded ", by=User(), now=NOW
        )
    assert (result.done, dict(result.skipped)) == (
        1,
        {deadletters.ALREADY_RESOLVED: 1, deadletters.IS_REVIVED: 1},
    )
    row = reread(new)
    assert (row.state, row.resolved_at, row.resolved_by) == (RESOLVED, NOW, "dana")
    assert row.notes == f"first look\n[{NOW.isoformat()}] resolved by dana: customer refunded"
    assert reread(revived).state == REVIVED
    assert (reread(resolved).resolved_by, reread(resolved).notes) == ("bob", "")
    assert not Message.objects.exists()
    assert caplog.messages == [f"Dead letter id={new.pk} topic=test.record resolved by dana"]


def test_resolve_needs_a_note(make_dead_letter):
    dead = make_dead_letter()
    with pytest.raises(DeadLetterError, match="needs a note"):
        resolve([dead.pk], note="  ")
    assert reread(dead).state == NEW


def test_categorize_sets_the_category_and_notes_who_and_what_it_was(make_dead_letter, caplog):
    transient = make_dead_letter(category=Category.TRANSIENT)
    unknown = make_dead_letter(category=Category.UNKNOWN, state=RESOLVED, notes="old")
    already = make_dead_letter(category=Category.BUSINESS)

    with caplog.at_level(logging.INFO, logger="django_pgqueue.deadletters"):
        result = categorize(
            DeadLetter.objects.all(), "business", note="price rule", by="erin", now=NOW
        )
    assert (result.done, dict(result.skipped)) == (2, {deadletters.UNCHANGED: 1})
    stamp = f"[{NOW.isoformat()}]"
    row = reread(transient)
    assert row.category == Category.BUSINESS
    assert (row.category_set_by, row.category_set_at) == ("erin", NOW)
    assert row.notes == f"{stamp} category set to business (was transient) by erin: price rule"
    row = reread(unknown)
    assert (row.category, row.state) == (Category.BUSINESS, RESOLVED)
    assert row.notes == f"old\n{stamp} category set to business (was unknown) by erin: price rule"
    assert (reread(already).notes, reread(already).category_set_by) == ("", "")
    assert reread(already).category_set_at is None, "an unchanged category got a timestamp"
    assert (
        f"Dead letter id={transient.pk} topic=test.record category transient -> business by erin"
        in (caplog.messages)
    )


def test_dry_run_changes_nothing_and_counts_the_same(make_dead_letter):
    for state in (NEW, NEW, REVIVED, RESOLVED):
        make_dead_letter(state=state)
    everything = DeadLetter.objects.all()
    before = snapshot()
    dry = [
        revive(everything, dry_run=True),
        resolve(everything, note="n", dry_run=True),
        categorize(everything, "permanent", dry_run=True),
    ]
    assert snapshot() == before, "a dry run wrote something"
    assert [str(r) for r in dry] == [
        "dry run: would revive 2, would skip 2 (already revived: 1, resolved: 1)",
        "dry run: would resolve 2, would skip 2 (already resolved: 1, revived: 1)",
        "dry run: would categorize 4, would skip 0",
    ]


BAD_CALLS = [
    # (function, arguments, keywords, words of the error)
    (revive, (["5"],), {}, "ids are whole numbers of at least 1, not '5'"),
    (revive, ([1.5],), {}, "not 1.5"),
    (revive, ([True],), {}, "not True"),
    (revive, ([0],), {}, "not 0"),
    (revive, (7,), {}, "an iterable of dead-letter ids .* not int"),
    (revive, ("12",), {}, "not str"),
    (revive, (Message.objects.all(),), {}, "a DeadLetter queryset, not one of Message"),
    (revive, ([],), {"queue": "bad name"}, "queue 'bad name' may contain only"),
    (revive, ([],), {"topic": ""}, "topic must not be empty"),
    (revive, ([],), {"rate": -1}, "rate must be a number of messages per second > 0"),
    (revive, ([],), {"rate": 0}, "rate must be"),
    (revive, ([],), {"rate": float("nan")}, "rate must be"),
    (revive, ([],), {"rate": "fast"}, "rate must be"),
    (revive, ([],), {"by": "x" * 151}, "by is 151 characters long; the limit is 150"),
    (revive, ([],), {"by": 42}, "by must be a name or a user"),
    (revive, ([],), {"chunk_size": 0}, "chunk_size must be"),
    (resolve, ([],), {"note": None}, "needs a note"),
    (resolve, ([],), {"note": 5}, "note must be a string"),
    (resolve, ([],), {"note": "a\x00b"}, "note: must not contain a NUL character"),
    (resolve, ([],), {"note": "a\udcff"}, "note: .* is not valid UTF-8 text"),
    (revive, ([],), {"by": "ops\x00"}, "by: must not contain a NUL character"),
    (categorize, ([], "oops"), {}, "unknown category 'oops'; one of transient, dependency"),
    (categorize, ([], None), {}, "unknown category None"),
]


@pytest.mark.parametrize(("function", "args", "kwargs", "words"), BAD_CALLS)
def test_bad_input_raises_a_clear_error_and_changes_nothing(
    make_dead_letter, function, args, kwargs, words
):
    make_dead_letter()
    before = snapshot()
    with pytest.raises(DeadLetterError, match=words):
        function(*args, **kwargs)
    assert snapshot() == before


@pytest.mark.parametrize(
    ("filters", "words"),
    [
        ({"categories": ["oops"]}, "unknown category 'oops'; one of transient"),
        ({"states": "open"}, "unknown state 'open'; one of new, revived, resolved"),
        ({"since": datetime.datetime(2026, 1, 1)}, "since must be an aware datetime"),
        ({"since": "2h"}, "since must be an aware datetime"),
        ({"ids": ["1"]}, "ids are whole numbers"),
        ({"topics": ["a\x00b"]}, "topics: must not contain a NUL character"),
        ({"topics": "a\udcff"}, "topics: .* is not valid UTF-8 text"),
        ({"topics": [3]}, "topics must be strings, not int"),
        ({"ids": [987654321]}, "no dead letter has the id 987654321"),
    ],
)
def test_select_rejects_bad_filters(filters, words):
    with pytest.raises(DeadLetterError, match=words):
        deadletters.select(**filters)


@pytest.mark.parametrize("function", [revive, resolve, categorize])
def test_an_id_that_does_not_exist_fails_before_any_change(make_dead_letter, function):
    dead = make_dead_letter()
    before = snapshot()
    kwargs = {"note": "n"} if function is resolve else {}
    args = ([dead.pk, 987654321, 987654322],) + (("permanent",) if function is categorize else ())
    with pytest.raises(DeadLetterError, match="no dead letter has the id 987654321, 987654322"):
        function(*args, **kwargs)
    assert snapshot() == before, "the existing id was changed although another was missing"


# --- manage.py pgqueue_deadletters -------------------------------------------------


def run(*args):
    out = io.StringIO()
    call_command("pgqueue_deadletters", *args, stdout=out)
    return out.getvalue()


def test_list_shows_the_matching_dead_letters_newest_first(make_dead_letter):
    old = make_dead_letter(dead_lettered_at=NOW - 48 * HOUR, topic="test.fail")
    mid = make_dead_letter(dead_lettered_at=NOW - HOUR, category=Category.PERMANENT)
    new = make_dead_letter(dead_lettered_at=NOW, state=RESOLVED)

    lines = run("list").splitlines()
    assert lines[0].split() == [
        "ID",
        "DEAD-LETTERED",
        "STATE",
        "CATEGORY",
        "TOPIC",
        "QUEUE",
        "ATT",
        "REASON",
    ]
    assert [int(line.split()[0]) for line in lines[1:-1]] == [new.pk, mid.pk, old.pk]
    assert "ConnectionError: downstream is down" in lines[1]
    assert "more lines" not in lines[1], "the reason's first line only"
    assert lines[-1] == "3 dead letters"

    def listed(*filters):
        return [int(line.split()[0]) for line in run("list", *filters).splitlines()[1:-1]]

    assert listed("--topic", "test.fail") == [old.pk]
    assert listed("--topic", "test.fail,test.record") == [new.pk, mid.pk, old.pk]
    assert listed("--category", "permanent,business") == [mid.pk]
    assert listed("--state", "resolved") == [new.pk]
    assert listed("--since", "2h") == [new.pk, mid.pk]
    assert listed("--since", (NOW - 3 * HOUR).isoformat()) == [new.pk, mid.pk]
    assert listed("--since", (NOW - 72 * HOUR).date().isoformat()) == [new.pk, mid.pk, old.pk]
    assert listed("--ids", f"{old.pk},{new.pk}") == [new.pk, old.pk]
    assert listed("--topic", "test.record", "--state", "new") == [mid.pk]
    assert (
        run("list", "--limit", "1").splitlines()[-1] == "1 of 3 dead letters (--limit shows more)"
    )
    assert run("list", "--topic", "nothing.here") == "no dead letters\n"


def test_list_json_has_every_field(make_dead_letter):
    dead = make_dead_letter(payload={"a": [1, "<b>"]}, headers={"h": 1})
    [row] = json.loads(run("list", "--json"))
    assert row["id"] == dead.pk
    assert (row["payload"], row["headers"], row["state"]) == ({"a": [1, "<b>"]}, {"h": 1}, "new")
    assert row["reason"] == dead.reason
    assert "traceback" in row and "notes" in row


def test_revive_command_revives_the_selection_and_prints_one_summary(make_dead_letter):
    mine = [make_dead_letter(topic="test.fail") for _ in range(2)]
    done = make_dead_letter(topic="test.fail", state=REVIVED)
    other = make_dead_letter(topic="test.record")

    assert run("revive", "--topic", "test.fail", "--dry-run") == (
        "dry run: would revive 2, would skip 1 (already revived: 1)\n"
    )
    assert not Message.objects.exists()

    out = run("revive", "--topic", "test.fail", "--by", "ops", "--note", "fixed")
    assert out == "revived 2, skipped 1 (already revived: 1)\n"
    assert [reread(d).state for d in mine] == [REVIVED, REVIVED]
    assert "by ops: fixed" in reread(mine[0]).notes
    assert reread(other).state == NEW
    assert reread(done).revive_count == 0

    out = run("revive", "--ids", str(done.pk), "--force", "--queue", "q2", "--topic-to", "t.x")
    assert out == "revived 1, skipped 0\n"
    assert Message.objects.get(pk=reread(done).revived_message_id).queue == "q2"
    assert Message.objects.get(pk=reread(done).revived_message_id).topic == "t.x"


def test_resolve_and_categorize_commands(make_dead_letter):
    a = make_dead_letter(category=Category.UNKNOWN)
    b = make_dead_letter(category=Category.UNKNOWN, topic="test.fail")

    assert run("categorize", "--category", "unknown", "--to", "permanent", "--dry-run") == (
        "dry run: would categorize 2, would skip 0\n"
    )
    assert reread(a).category == Category.UNKNOWN
    out = run("categorize", "--ids", str(a.pk), "--to", "permanent", "--note", "bad sku")
    assert out == "categorized 1, skipped 0\n"
    assert reread(a).category == Category.PERMANENT and "bad sku" in reread(a).notes

    assert run("resolve", "--all", "--note", "gone", "--dry-run") == (
        "dry run: would resolve 2, would skip 0\n"
    )
    out = run("resolve", "--topic", "test.fail", "--note", "obsolete", "--by", "frank")
    assert out == "resolved 1, skipped 0\n"
    row = reread(b)
    assert (row.state, row.resolved_by) == (RESOLVED, "frank")
    assert reread(a).state == NEW


def test_an_action_without_a_filter_is_refused_unless_all(make_dead_letter):
    dead = make_dead_letter()
    for action in (["revive"], ["resolve", "--note", "n"], ["categorize", "--to", "business"]):
        with pytest.raises(CommandError, match=f"refusing to {action[0]} every dead letter"):
            run(*action)
    assert reread(dead).state == NEW and not Message.objects.exists()
    assert run("revive", "--all") == "revived 1, skipped 0\n"


def test_revive_rate_trickles_in_real_time(make_dead_letter):
    for _ in range(4):
        make_dead_letter()
    started = time.monotonic()
    assert run("revive", "--all", "--rate", "2") == "revived 4, skipped 0\n"
    elapsed = time.monotonic() - started
    # Chunks of 2: the first at once, the second a second later.
    assert elapsed >= 0.95, f"4 messages at 2 per second took only {elapsed:.2f}s"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "the following arguments are required: ACTION"),
        (["purge"], "invalid choice: 'purge'"),
        (["list", "--category", "oops"], "--category: unknown category 'oops'; one of transient"),
        (["list", "--state", "open"], "--state: unknown state 'open'; one of new, revived"),
        (["list", "--since", "yesterday"], "--since: 'yesterday' is not a date"),
        (["list", "--since", "2026-13-01"], "--since: '2026-13-01' is not a date"),
        (["list", "--since=-2h"], "--since: '-2h' is not a date"),
        (["list", "--since", "999999999w"], "--since: '999999999w' reaches back before year 1"),
        (["list", "--ids", "1,x"], "--ids: 'x' is not a whole number"),
        (["list", "--ids", "0"], "--ids: ids are at least 1, not 0"),
        (["list", "--ids", ","], "--ids: give at least one value"),
        (["list", "--ids", "987654321"], "no dead letter has the id 987654321"),
        (["list", "--topic", ","], "--topic: give at least one value"),
        (["list", "--limit", "0"], "--limit: must be at least 1, not 0"),
        (["list", "--rate", "2"], "unrecognized arguments: --rate"),
        (["revive", "--all", "--rate", "-1"], "--rate: must be more than zero messages per"),
        (["revive", "--all", "--rate", "0"], "--rate: must be more than zero"),
        (["revive", "--all", "--rate", "inf"], "--rate: must be more than zero"),
        (["revive", "--all", "--rate", "fast"], "--rate: 'fast' is not a number"),
        (["revive", "--all", "--queue", "bad name"], "--queue: queue name 'bad name' may"),
        (["revive", "--all", "--topic-to", ""], "--topic-to: topic name must not be empty"),
        (["revive", "--all", "--by", "x" * 151], "by is 151 characters long"),
        (["resolve", "--all"], "the following arguments are required: --note"),
        (["resolve", "--all", "--note", " "], "--note: must not be empty"),
        (["categorize", "--all"], "the following arguments are required: --to"),
        (["categorize", "--all", "--to", "oops"], "--to: unknown category 'oops'"),
        (["categorize", "--all", "--to", "business,permanent"], "--to: unknown category"),
    ],
)
def test_bad_filters_and_options_get_a_clear_error_and_change_nothing(
    make_dead_letter, args, words
):
    make_dead_letter()
    before = snapshot()
    with pytest.raises(CommandError, match=words):
        run(*args)
    assert snapshot() == before
