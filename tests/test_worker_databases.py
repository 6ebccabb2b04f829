"""One worker serving queues on several databases (issue 40): one engine
per database (``worker.engines``), each with its own connections, LISTEN,
leases, heartbeat row, maintenance, scheduler and stream delivery there.

The test project has two aliases, "default" and "other" (each test
database has all the app's tables); the worker processes put the queue
"bulk" on "other" through PGQUEUE["QUEUES"]. The demo handlers write their
ledger rows (demo.Handled) on "default" whatever the message's database, so
each database's messages get a topic of their own there.
"""

import json
import signal
import socket

import pytest
from demo.models import Handled
from django.core.management import call_command
from django.test import override_settings

from django_pgqueue import conf, enqueue, publish
from django_pgqueue.models import (
    Message,
    Schedule,
    ScheduleTick,
    Status,
    Subscription,
    WorkerHeartbeat,
)
from django_pgqueue.schedules import runs
from django_pgqueue.schedules.spec import parse
from django_pgqueue.worker import Worker, engines, threads

from .conftest import wait_until
from .test_metrics import http_get, worker_port

BOTH = ["default", "other"]
# "bulk" on the database "other"; every other queue on "default".
QUEUES = {"default": {}, "bulk": {"database": "other"}}
SETTINGS = {"QUEUES": QUEUES, "HEARTBEAT_INTERVAL": 0.5}
ON_OTHER = override_settings(PGQUEUE=SETTINGS)
BOTH_QUEUES = ("--queues", "default,bulk")


def handled(topic):
    return Handled.objects.filter(topic=topic)


def messages(alias, **filters):
    return Message.objects.using(alias).filter(**filters)


# --- the grouping, and one engine for one database ---------------------------------------


@ON_OTHER
def test_a_worker_is_an_engine_for_the_database_of_its_queues():
    assert Worker(queues=["bulk"]).config.database == "other"
    assert Worker(queues=["default"]).config.database == "default"
    assert Worker(database="other").queues == ["bulk"], "the configured queues on 'other'"
    assert Worker(queues=[], database="other").queues == [], "an engine for streams only"


@ON_OTHER
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({}, "the queues are on several databases (default: default; other: bulk)"),
        ({"queues": ["bulk", "default"]}, "several databases (default: default; other: bulk)"),
        ({"queues": ["default"], "database": "other"}, "queues of other databases (default:"),
        ({"database": "nowhere"}, "database 'nowhere': the alias"),
    ],
)
def test_a_worker_refuses_queues_of_several_databases(options, words):
    with pytest.raises(ValueError) as raised:
        Worker(**options)
    assert words in str(raised.value), f"the error should say {words!r}: {raised.value}"
    if "several" in words:
        assert "pgqueue_worker" in str(raised.value), "it tells what runs one engine each"


@override_settings(PGQUEUE={**SETTINGS, "STREAMS": {"test.events": {"database": "other"}}})
def test_the_plan_groups_queues_and_subscription_streams_by_database():
    assert engines.plan(None, "none") == {"default": None, "other": None}
    assert engines.plan(["bulk"], "none") == {"other": ["bulk"]}
    assert engines.plan(["default", "mail"], "none") == {"default": ["default", "mail"]}
    assert engines.plan({"default": 3, "bulk": 1}, "none") == {
        "default": {"default": 3},
        "other": {"bulk": 1},
    }
    # The stream of test.ledger is on "other": an engine there, serving no queue.
    assert engines.plan(["default"], ["test.ledger"]) == {"default": ["default"], "other": []}
    worker = Worker(queues=[], database="other", subscriptions="all")
    assert {spec.stream for spec in worker.subscriptions} == {"test.events"}
    on_default = Worker(queues=["default"], subscriptions="all").subscriptions
    assert on_default and "test.events" not in {spec.stream for spec in on_default}


@ON_OTHER
def test_an_engine_runs_the_schedules_whose_queue_is_on_its_database():
    specs = [
        parse("on-bulk", {"every": 60, "topic": "test.record", "queue": "bulk"}),
        parse("on-default", {"every": 60, "topic": "test.record"}),
    ]
    assert Worker(queues=["bulk"], schedules=specs)._scheduler.names == ["on-bulk"]
    assert Worker(queues=["default"], schedules=specs)._scheduler.names == ["on-default"]
    assert Worker(queues=["default"], schedules=specs[:1])._scheduler is None


def test_an_engines_threads_work_on_its_database():
    seen = []
    with conf.on_database("other"):
        thread = threads.start(lambda: seen.append(conf.database_alias()), "test-thread")
    thread.join()
    assert seen == ["other"], "a thread started in on_database('other') works on 'other'"
    assert conf.database_alias() == "default"


@ON_OTHER
@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_engines_in_burst_mode_drain_each_database_and_end_together():
    for n in range(5):
        enqueue("test.record", {"n": n})
        enqueue("test.record_nonatomic", {"n": n}, queue="bulk")
    # Async handlers on "other": on the event loop (its tasks, its settling
    # threads) and, atomic, in a handler thread's transaction there.
    enqueue("test.async_wait", {"seconds": 0.01}, queue="bulk")
    enqueue("test.async", {}, queue="bulk")
    assert messages("other").count() == 7 and messages("default").count() == 5
    served = engines.Engines(engines.plan(None, "none"), burst=True, concurrency=2, schedules=False)
    assert set(served.engines) == {"default", "other"}
    assert served.run() == 12
    assert not messages("default").exists() and not messages("other").exists()
    assert handled("test.record").count() == handled("test.record_nonatomic").count() == 5
    assert handled("test.async_wait").count() == handled("test.async").count() == 1


@ON_OTHER
@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_the_worker_command_runs_one_engine_per_database_only_when_it_needs_several(caplog):
    enqueue("test.record_nonatomic", {"n": 1}, queue="bulk")
    # One database ("other"): one Worker, on it, as before.
    call_command("pgqueue_worker", "--burst", "--queues", "bulk", "--subscriptions", "none")
    assert not messages("other").exists()
    assert "one engine per database" not in caplog.text
    assert "starting: database=other queues=bulk" in caplog.text
    enqueue("test.record", {"n": 2})
    enqueue("test.record_nonatomic", {"n": 3}, queue="bulk")
    call_command("pgqueue_worker", "--burst", *BOTH_QUEUES, "--subscriptions", "none")
    assert not messages("default").exists() and not messages("other").exists()
    assert "one engine per database: default (default); other (bulk)" in caplog.text
    assert handled("test.record").count() == 1 and handled("test.record_nonatomic").count() == 2


@ON_OTHER
@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_an_engine_that_crashes_stops_the_others_and_its_error_is_raised():
    served = engines.Engines(engines.plan(None, "none"), schedules=False, poll_interval=0.1)

    def crash():
        raise KeyError("boom")

    served.engines["other"].run = crash
    with pytest.raises(RuntimeError, match="the engine of database 'other' crashed: 'boom'"):
        served.run()  # not --burst: the engine on "default" ran until the crash stopped it


# --- real worker processes ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=BOTH)
@ON_OTHER
def test_a_worker_process_serves_a_queue_on_each_database(start_worker):
    worker = start_worker(*BOTH_QUEUES, "--poll-interval", "30", pgqueue=SETTINGS)
    # Its row on each database, with that database's queues, one worker id.
    rows = wait_until(
        lambda: (
            [
                row
                for alias in BOTH
                for row in WorkerHeartbeat.objects.using(alias).filter(pid=worker.pid)
            ]
            if all(WorkerHeartbeat.objects.using(a).filter(pid=worker.pid).exists() for a in BOTH)
            else None
        ),
        message="the worker's heartbeat row on each database",
    )
    assert [row.queues for row in rows] == [["default"], ["bulk"]]
    assert rows[0].worker_id == rows[1].worker_id
    assert "one engine per database: default (default); other (bulk)" in worker.log()
    # Enqueued now that it idles (a poll is 30 s away): the NOTIFY of each
    # database wakes its engine, so its LISTEN is on that database.
    for n in range(3):
        enqueue("test.record", {"n": n})
        enqueue("test.record_nonatomic", {"n": n}, queue="bulk")
    wait_until(
        lambda: (
            handled("test.record").count() == 3 and handled("test.record_nonatomic").count() == 3
        ),
        timeout=20,
        message="the messages of both databases handled, woken by their NOTIFY",
    )
    # Leases on each database, held by the same worker.
    slow = [
        enqueue("test.sleep", {"seconds": 1}),
        enqueue("test.sleep", {"seconds": 1}, queue="bulk"),
    ]
    for alias, message in zip(BOTH, slow, strict=True):
        row = wait_until(
            lambda a=alias, m=message: messages(a, pk=m.pk, status=Status.PROCESSING).first(),
            message=f"the slow message leased on {alias}",
        )
        assert (row.locked_by, row.lease_expires_at is not None) == (rows[0].worker_id, True)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
    assert not messages("default").exists() and not messages("other").exists()
    for alias in BOTH:
        assert not WorkerHeartbeat.objects.using(alias).exists(), f"its row left on {alias}"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=BOTH)
@ON_OTHER
def test_a_message_of_a_killed_worker_is_rescued_on_the_second_database(start_worker):
    message = enqueue("test.sleep", {"seconds": 60, "then": 0}, queue="bulk")
    args = (*BOTH_QUEUES, "--lease", "2", "--concurrency", "1", "--poll-interval", "0.5")
    victim = start_worker(*args, pgqueue=SETTINGS)
    wait_until(
        lambda: messages("other", pk=message.pk, status=Status.PROCESSING).exists(),
        message="the first worker to take the message on 'other'",
    )
    victim.signal(signal.SIGKILL)
    victim.wait(timeout=10)
    rescuer = start_worker(*args, pgqueue=SETTINGS)
    wait_until(
        lambda: handled("test.sleep").filter(attempt=2).exists(),
        message="the rescued message handled again",
    )
    wait_until(lambda: not messages("other").exists(), message="the message acknowledged")
    assert "rescued: worker lost" in rescuer.log()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_the_scheduler_ticks_a_schedule_of_a_queue_on_the_second_database(start_worker):
    # The ticks go to a queue on "other" that the worker does not serve: they
    # stay there, to be counted.
    settings = {
        **SETTINGS,
        "QUEUES": {**QUEUES, "ticks": {"database": "other"}},
        "SCHEDULES": {"every-second": {"every": 1, "topic": "test.record", "queue": "ticks"}},
    }
    worker = start_worker(*BOTH_QUEUES, pgqueue=settings)
    ticked = {"headers__contains": {runs.SCHEDULE_HEADER: "every-second"}}
    wait_until(lambda: messages("other", queue="ticks", **ticked).count() >= 2, message="ticks")
    assert ScheduleTick.objects.using("other").filter(schedule="every-second").exists()
    assert Schedule.objects.using("other").filter(name="every-second").exists()
    for model in (Message, ScheduleTick, Schedule):
        assert not model.objects.using("default").exists(), f"{model.__name__} on 'default'"
    assert worker.log().count("scheduler runs 1 schedule(s): every-second") == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_a_stream_on_the_second_database_is_delivered(start_worker):
    settings = {**SETTINGS, "STREAMS": {"test.events": {"database": "other"}}}
    worker = start_worker("--queues", "default", "--subscriptions", "test.ledger", pgqueue=settings)
    with override_settings(PGQUEUE=settings):
        events = [publish("test.events", {"n": n}) for n in range(3)]
    wait_until(
        lambda: handled("test.ledger").count() == 3, message="the events on 'other' delivered"
    )
    assert sorted(handled("test.ledger").values_list("message_id", flat=True)) == sorted(
        event.position for event in events
    )
    assert Subscription.objects.using("other").filter(name="test.ledger").exists()
    assert not Subscription.objects.using("default").exists()
    assert "one engine per database: default (default); other (no queue)" in worker.log()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_database_that_is_down_fails_only_its_own_queues(start_worker):
    with socket.socket() as free:  # a port where nothing listens
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    settings = {**SETTINGS, "QUEUES": {"default": {}, "bulk": {"database": "unreachable"}}}
    worker = start_worker(
        *BOTH_QUEUES,
        *("--poll-interval", "0.5", "--health-port", "0", "--http-host", "127.0.0.1"),
        pgqueue=settings,
        env={"UNREACHABLE_DATABASE_URL": f"postgres://postgres@127.0.0.1:{port}/nowhere"},
    )
    url = f"http://127.0.0.1:{worker_port(worker, 'health')}/"
    for n in range(3):
        enqueue("test.record", {"n": n})
    wait_until(
        lambda: handled("test.record").count() == 3,
        message="the queue on the database that is up handled",
    )
    assert WorkerHeartbeat.objects.filter(pid=worker.pid).exists()

    def failing():
        status, body = http_get(url)
        return (status, json.loads(body)) if status == 503 else None

    status, body = wait_until(failing, message="the health port to say which database fails")
    assert body["failing"] == ["unreachable"]
    assert body["status"] == "unhealthy"
    up, down = body["databases"]["default"], body["databases"]["unreachable"]
    assert (up["status"], up["database"], up["queues"]) == ("ok", "ok", ["default"])
    assert (down["status"], down["database"], down["queues"]) == (
        "unhealthy",
        "unreachable",
        ["bulk"],
    )
    assert "loop_error" in down
    # Still going on the database that is up.
    enqueue("test.record", {"n": 3})
    wait_until(lambda: handled("test.record").count() == 4, message="a later message handled")
    assert "database unreachable error" in worker.log(), "its engine says which database"
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, worker.log()
