"""Periodic schedules with real ``manage.py pgqueue_worker`` processes: three
workers run the scheduler of one ``every: 1`` schedule, one of them is
killed with kill -9 once four ticks have come and the others go on for
four more, and every tick is one message: none missed, none doubled.

The workers serve another queue than the schedule's, so the tick messages
stay in the queue table, where each one can be counted by the tick its
headers name.
"""

import collections
import datetime
import signal
import time

import pytest
from django.db import connection

from django_pgqueue.models import Message, ScheduleTick
from django_pgqueue.schedules import runs

from .conftest import wait_until

pytestmark = pytest.mark.slow

SCHEDULE = {"every": 1, "topic": "test.record", "queue": "scheduled"}
TICKS_EACH_SIDE = 4  # ticks before the kill, and after it


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def ticks_seen():
    """{tick: how many messages name it} of the schedule "every-second"."""
    headers = Message.objects.filter(
        headers__contains={runs.SCHEDULE_HEADER: "every-second"}
    ).values_list("headers", "run_at")
    seen = collections.Counter()
    for header, run_at in headers:
        tick = datetime.datetime.fromisoformat(header[runs.SCHEDULED_AT_HEADER])
        assert tick == run_at, "a tick's message runs at the tick"
        seen[tick] += 1
    return seen


def test_three_workers_one_killed_give_one_message_per_tick(start_worker, capsys):
    pgqueue = {"SCHEDULES": {"every-second": SCHEDULE}}
    workers = [
        start_worker("--queues", "default", "--concurrency", "1", pgqueue=pgqueue) for _ in range(3)
    ]
    wait_until(ticks_seen, message="the first tick's message")
    started = db_now()

    def ticks_after(moment):
        return len([tick for tick in ticks_seen() if tick > moment])

    wait_until(
        lambda: ticks_after(started) >= TICKS_EACH_SIDE,
        message=f"{TICKS_EACH_SIDE} ticks before the kill",
    )
    # Killed a hair after a tick: when the schedulers' rounds for it run
    # (the database is on this host: its clock is this one's).
    time.sleep(1.012 - time.time() % 1)
    victim = workers[0]
    victim.signal(signal.SIGKILL)
    assert victim.wait(timeout=60) == -signal.SIGKILL
    killed = db_now()
    wait_until(
        lambda: ticks_after(killed) >= TICKS_EACH_SIDE,
        message=f"{TICKS_EACH_SIDE} ticks after the kill",
    )
    ended = db_now()
    # The tick of the last whole second is enqueued within a moment.
    last = ended.replace(microsecond=0)
    wait_until(lambda: last in ticks_seen(), message=f"the tick of {last}")
    for worker in workers[1:]:
        worker.signal(signal.SIGTERM)
    for worker in workers[1:]:
        assert worker.wait(timeout=60) == 0, worker.log()

    seen = ticks_seen()
    first = started.replace(microsecond=0) + datetime.timedelta(seconds=1)
    expected = [
        first + datetime.timedelta(seconds=n)
        for n in range(int((last - first).total_seconds()) + 1)
    ]
    missed = [tick for tick in expected if tick not in seen]
    doubled = {tick: count for tick, count in seen.items() if count > 1}
    with capsys.disabled():
        print(
            f"\nschedule every 1 s, 3 workers, 1 killed -9 midway: ticks expected "
            f"{len(expected)}, seen {len(seen)} (from {min(seen).time()} to "
            f"{max(seen).time()}), doubled {len(doubled)}, missed {len(missed)}"
        )
    assert len(expected) >= 2 * TICKS_EACH_SIDE
    assert not doubled, f"ticks with more than one message: {doubled}"
    assert not missed, f"ticks without a message: {missed}"
    # Nor a gap anywhere, from the very first tick to the last.
    span = int((max(seen) - min(seen)).total_seconds()) + 1
    assert sorted(seen) == [min(seen) + datetime.timedelta(seconds=n) for n in range(span)]
    # The ledger agrees: one row per tick, pointing at that tick's message.
    ledger = dict(
        ScheduleTick.objects.filter(schedule="every-second").values_list("tick", "message_id")
    )
    messages = dict(Message.objects.filter(queue="scheduled").values_list("run_at", "pk"))
    assert ledger == messages
    # Every worker ran the scheduler; the survivors' rounds went on after the kill.
    for worker in workers:
        assert "scheduler runs 1 schedule(s): every-second" in worker.log()


def test_a_worker_refuses_to_start_on_a_bad_schedule(start_worker):
    worker = start_worker(
        "--burst",
        pgqueue={"SCHEDULES": {"nightly": {"cron": "0 25 * * *", "topic": "t", "every": 5}}},
    )
    assert worker.wait(timeout=60) != 0
    log = worker.log()
    assert "pgqueue.E110" in log
    assert "PGQUEUE['SCHEDULES']['nightly']['cron']: '0 25 * * *' is not a valid cron" in log
    assert "PGQUEUE['SCHEDULES']['nightly']['cron/every']: has both" in log
    assert "HINT: Five fields: minute hour day-of-month month day-of-week" in log
