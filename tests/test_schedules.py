"""Periodic schedules: the entries and their checks, the tick arithmetic with
fabricated time (``now`` is a parameter), DST both ways, backfill; and the
database side: one message per tick, pause and resume, run now, pruning.

The rounds run against the real database with a fabricated ``now``; the
real worker processes are tests/test_schedules_processes.py's.
"""

import datetime
import logging
import threading
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections, transaction
from django.test import override_settings

from django_pgqueue import handler, registry
from django_pgqueue.checks import check_schedules
from django_pgqueue.models import DeadLetter, Message, Schedule, ScheduleTick
from django_pgqueue.schedules import configured, overview, runs, state, ticks
from django_pgqueue.schedules.spec import InvalidSchedule, parse, problems
from django_pgqueue.worker import Worker

from .conftest import running_worker, wait_until

UTC = datetime.UTC
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def at(*args, tz=UTC):
    return datetime.datetime(*args, tzinfo=tz)


def spec(name="s", **entry):
    entry.setdefault("topic", "test.schedule")
    if "cron" not in entry and "every" not in entry:
        entry["every"] = 10
    return parse(name, entry)


def fields_of(found):
    return [(p.name, p.field) for p in found]


# --- entries ------------------------------------------------------------------------


def test_an_entry_is_parsed_with_its_defaults():
    s = parse("nightly", {"cron": "0 3 * * *", "topic": "reports.nightly"})
    assert (s.cron, s.every, s.topic, s.task) == ("0 3 * * *", None, "reports.nightly", None)
    assert s.timezone == "UTC"  # settings.TIME_ZONE
    assert (s.backfill, s.enabled, s.queue, s.priority) == (datetime.timedelta(0), True, None, None)
    assert s.describe() == "At 03:00 every day"


@pytest.mark.parametrize(
    "cron, expression",
    [
        ("@daily", "0 0 * * *"),
        ("@HOURLY", "0 * * * *"),
        ("@weekly", "0 0 * * 0"),
        ("@monthly", "0 0 1 * *"),
        ("@yearly", "0 0 1 1 *"),
        ("0  6 * * mon", "0 6 * * mon"),
    ],
)
def test_cron_names_and_spacing(cron, expression):
    assert spec(cron=cron).cron == expression


def test_every_takes_seconds_or_a_timedelta_and_says_it_in_words():
    assert spec(every=10).every == datetime.timedelta(seconds=10)
    assert spec(every=datetime.timedelta(minutes=5)).describe() == "Every 5 minutes"
    assert spec(every=1).describe() == "Every 1 second"
    assert spec(every=1.5).describe() == "Every 1.5 seconds"


@pytest.mark.parametrize(
    "entry, field, words",
    [
        ({"cron": "61 * * * *", "topic": "t"}, "cron", "not a valid cron expression"),
        ({"cron": "0 3 * *", "topic": "t"}, "cron", "4 fields, not five"),
        ({"cron": "0 0 3 * * *", "topic": "t"}, "cron", "6 fields, not five"),
        ({"cron": "@reboot", "topic": "t"}, "cron", "not five"),
        ({"cron": "0 0 30 2 *", "topic": "t"}, "cron", "not a valid cron expression"),
        ({"cron": "0 3 * * *", "every": 5, "topic": "t"}, "cron/every", "has both"),
        ({"topic": "t"}, "cron/every", "has neither"),
        ({"every": 5, "topic": "t", "task": "a.b"}, "topic/task", "has both"),
        ({"every": 5}, "topic/task", "has neither"),
        ({"every": 0.5, "topic": "t"}, "every", "at least 1 second"),
        ({"every": True, "topic": "t"}, "every", "at least 1 second"),
        ({"every": 5, "topic": "t", "timezone": "Mars/Olympus"}, "timezone", "not a known"),
        ({"every": 5, "topic": "t", "backfill": -1}, "backfill", "at least 0"),
        ({"every": 5, "topic": "t", "backfill": "1h"}, "backfill", "at least 0"),
        ({"every": 5, "topic": "bad topic"}, "topic", "may contain only"),
        ({"every": 5, "task": "nodots"}, "task", "dotted path"),
        ({"every": 5, "topic": "t", "args": [1]}, "args", "with 'task' only"),
        ({"every": 5, "task": "a.b", "payload": {}}, "payload", "with 'topic' only"),
        ({"every": 5, "topic": "t", "payload": {1: "x"}}, "payload", "not a string"),
        ({"every": 5, "topic": "t", "priority": 101}, "priority", "from -100 to 100"),
        ({"every": 5, "topic": "t", "queue": ""}, "queue", "must not be empty"),
        ({"every": 5, "topic": "t", "enabled": "yes"}, "enabled", "True or False"),
        ({"every": 5, "topic": "t", "evry": 5}, "evry", "not a schedule field"),
    ],
)
def test_a_bad_entry_names_the_schedule_and_the_field(entry, field, words):
    found = problems("nightly", entry)
    assert fields_of(found)[0] == ("nightly", field), found
    assert words in found[0].problem and found[0].hint
    with pytest.raises(InvalidSchedule, match=f"schedule 'nightly', field '{field}'"):
        parse("nightly", entry)


def test_an_unknown_field_hints_at_the_known_one():
    (found,) = problems("x", {"every": 5, "topic": "t", "backfil": 3})
    assert found.hint.startswith("Did you mean 'backfill'?")


@override_settings(
    PGQUEUE={
        "SCHEDULES": {
            "good": {"every": 5, "topic": "t"},
            "bad-cron": {"cron": "0 25 * * *", "topic": "t"},
            "both": {"cron": "0 3 * * *", "every": 5, "topic": "t"},
            "zone": {"every": 5, "topic": "t", "timezone": "Nowhere/Land"},
            "task": {"every": 5, "task": "demo.tasks.no_such_task"},
            "backfill": {"every": 5, "topic": "t", "backfill": -5},
        }
    }
)
def test_the_system_check_reports_each_bad_schedule_and_field():
    errors = check_schedules()
    by_id = {}
    for error in errors:
        by_id.setdefault(error.id, []).append(error.msg)
    assert sorted(by_id["pgqueue.E110"]) == [
        "PGQUEUE['SCHEDULES']['backfill']['backfill']: must be a number of seconds (or a "
        "timedelta) of at least 0, not -5.",
        "PGQUEUE['SCHEDULES']['bad-cron']['cron']: '0 25 * * *' is not a valid cron "
        "expression (Bad hour).",
        "PGQUEUE['SCHEDULES']['both']['cron/every']: has both of 'cron' and 'every'.",
        "PGQUEUE['SCHEDULES']['zone']['timezone']: 'Nowhere/Land' is not a known time zone.",
    ]
    (task_error,) = by_id["pgqueue.E111"]
    assert task_error.startswith("PGQUEUE['SCHEDULES']['task']['task']: ")
    assert all(error.hint for error in errors)
    with pytest.raises(ImproperlyConfigured, match="schedule 'bad-cron', field 'cron'"):
        configured.configured()


@override_settings(PGQUEUE={"SCHEDULES": {"bad": {"cron": "nope", "topic": "t"}}})
def test_a_worker_refuses_to_start_on_a_bad_schedule():
    with pytest.raises(ImproperlyConfigured, match="schedule 'bad', field 'cron'"):
        Worker(burst=True)
    Worker(burst=True, schedules=False)  # --no-schedules: no scheduler, no complaint


@pytest.fixture
def weekly_handler():
    @handler("test.reports.weekly", schedule="0 6 * * mon")
    def weekly(message):
        pass

    yield registry.lookup("test.reports.weekly")
    registry.unregister("test.reports.weekly")


def test_a_handler_declares_a_schedule_named_after_its_topic(weekly_handler):
    s = weekly_handler.schedule
    assert (s.name, s.cron, s.topic) == (
        "test.reports.weekly",
        "0 6 * * mon",
        "test.reports.weekly",
    )
    assert s in configured.configured()
    with override_settings(
        PGQUEUE={"SCHEDULES": {"test.reports.weekly": {"every": 5, "topic": "t"}}}
    ):
        _, found = configured.load()
        assert "declared twice" in str(found[0])
        assert check_schedules()[0].id == "pgqueue.E110"


def test_a_handlers_schedule_takes_an_interval_or_a_dict_and_refuses_a_bad_one():
    @handler("test.every", schedule=datetime.timedelta(seconds=30))
    def every(message):
        pass

    @handler("test.dict", schedule={"cron": "@hourly", "payload": {"x": 1}, "backfill": 60})
    def as_dict(message):
        pass

    try:
        assert registry.lookup("test.every").schedule.every == datetime.timedelta(seconds=30)
        s = registry.lookup("test.dict").schedule
        assert (s.cron, s.payload, s.backfill.total_seconds()) == ("0 * * * *", {"x": 1}, 60)
    finally:
        registry.unregister("test.every")
        registry.unregister("test.dict")
    with pytest.raises(ValueError, match="schedule 'test.bad', field 'cron'"):
        handler("test.bad", schedule="every day")
    with pytest.raises(ValueError, match="field 'topic'"):
        handler("test.bad", schedule={"every": 5, "topic": "other"})
    assert registry.lookup("test.bad") is None


# --- the tick arithmetic -----------------------------------------------------------


def test_every_ticks_at_multiples_of_the_interval_since_the_epoch():
    s = spec(every=10)
    got = list(ticks.ticks_after(s, at(2026, 1, 1, 12, 0, 3), at(2026, 1, 1, 12, 0, 30)))
    assert got == [at(2026, 1, 1, 12, 0, 10), at(2026, 1, 1, 12, 0, 20), at(2026, 1, 1, 12, 0, 30)]
    # Strictly after: a tick is not its own successor.
    assert ticks.next_tick(s, at(2026, 1, 1, 12, 0, 10)) == at(2026, 1, 1, 12, 0, 20)


def test_cron_ticks_in_the_schedules_time_zone():
    s = spec(cron="0 3 * * *", timezone="Europe/Berlin")
    tick = ticks.next_tick(s, at(2026, 1, 10, 12, 0))
    assert tick == at(2026, 1, 11, 3, 0, tz=BERLIN) == at(2026, 1, 11, 2, 0)


def test_a_new_schedule_starts_with_its_latest_tick_if_on_time_never_a_backfill():
    s = spec(every=10, backfill=3600)
    now = at(2026, 1, 1, 12, 0, 5)
    due = ticks.due(s, None, now)
    assert due.ticks == (at(2026, 1, 1, 12),)
    assert (due.skipped, due.skipped_through) == (0, None)
    # A worker started at 03:00:20 still runs the 03:00 job; at 03:01, not.
    nightly = spec(cron="0 3 * * *", backfill=3600)
    assert ticks.due(nightly, None, at(2026, 1, 1, 3, 0, 20)).ticks == (at(2026, 1, 1, 3),)
    assert ticks.due(nightly, None, at(2026, 1, 1, 3, 1)).ticks == ()


def test_due_ticks_after_the_last_one_up_to_now():
    s = spec(every=10)
    due = ticks.due(s, at(2026, 1, 1, 12, 0, 0), at(2026, 1, 1, 12, 0, 20))
    assert due.ticks == (at(2026, 1, 1, 12, 0, 10), at(2026, 1, 1, 12, 0, 20))
    assert ticks.due(s, at(2026, 1, 1, 12, 0, 20), at(2026, 1, 1, 12, 0, 29)).ticks == ()


def test_after_downtime_old_ticks_are_skipped_and_those_within_backfill_enqueued_oldest_first():
    s = spec(every=60, backfill=300)
    last = at(2026, 1, 1, 10, 0)
    now = at(2026, 1, 1, 12, 0, 30)  # two hours down
    due = ticks.due(s, last, now)
    # Within 300 s of now: 11:56, 11:57, 11:58, 11:59, 12:00 (11:55:30 is the limit).
    assert due.ticks == tuple(
        at(2026, 1, 1, h, m) for h, m in [(11, 56), (11, 57), (11, 58), (11, 59), (12, 0)]
    )
    # 10:01 ... 11:55: 115 ticks missed for good; the cursor moves past them.
    assert due.skipped == 115 and due.counted_all
    assert (
        due.skipped_through
        < at(2026, 1, 1, 11, 56)
        <= due.skipped_through + datetime.timedelta(seconds=300)
    )
    # A restart within ON_TIME (30 s) loses nothing even with backfill 0.
    quick = ticks.due(spec(every=10), at(2026, 1, 1, 12), at(2026, 1, 1, 12, 0, 25))
    assert (
        quick.ticks == (at(2026, 1, 1, 12, 0, 10), at(2026, 1, 1, 12, 0, 20)) and not quick.skipped
    )


def test_backfill_0_skips_every_missed_tick_of_a_cron_and_counts_them():
    s = spec(cron="*/15 * * * *")
    due = ticks.due(s, at(2026, 1, 1, 0, 0), at(2026, 1, 2, 0, 0, 10))
    assert due.ticks == (at(2026, 1, 2),)  # 10 s late: on time
    assert due.skipped == 24 * 4 - 1  # 00:15 ... 23:45


def test_a_long_backfill_is_enqueued_a_round_at_a_time():
    s = spec(every=1, backfill=3600)
    due = ticks.due(s, at(2026, 1, 1, 11), at(2026, 1, 1, 12), limit=100)
    assert len(due.ticks) == 100 and due.more
    assert due.ticks[0] == at(2026, 1, 1, 11, 0, 1)


def test_count_ticks_of_a_cron_stops_at_its_limit():
    s = spec(cron="* * * * *")
    assert ticks.count_ticks(s, at(2026, 1, 1), at(2026, 1, 1, 1), 1000) == (59, True)
    assert ticks.count_ticks(s, at(2026, 1, 1), at(2026, 1, 2), 100) == (100, False)
    assert ticks.count_ticks(spec(every=7), at(2026, 1, 1), at(2026, 1, 2), 1) == (12342, True)


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York"])
def test_a_fixed_time_job_runs_once_when_the_clock_skips_its_time(zone):
    # Spring forward: 02:00 -> 03:00 local; 02:30 does not exist that night.
    day = {"Europe/Berlin": (2026, 3, 29), "America/New_York": (2026, 3, 8)}[zone]
    s = spec(cron="30 2 * * *", timezone=zone)
    tz = ZoneInfo(zone)
    got = list(
        ticks.ticks_after(s, at(*day, tz=tz) - datetime.timedelta(days=1), at(*day, 23, tz=tz))
    )
    assert len(got) == 2  # the day before at 02:30, and this night once
    assert (
        got[-1].astimezone(tz).strftime("%Y-%m-%d %H:%M")
        == f"{day[0]}-{day[1]:02}-{day[2]:02} 03:00"
    )
    assert got[-1] - got[0] == datetime.timedelta(hours=23, minutes=30)


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York"])
def test_a_fixed_time_job_runs_once_at_the_first_0230_when_the_clock_repeats_it(zone):
    # Fall back: 03:00 -> 02:00 local (Berlin), 02:00 -> 01:00 (New York).
    day, hour = {"Europe/Berlin": ((2026, 10, 25), 2), "America/New_York": ((2026, 11, 1), 1)}[zone]
    s = spec(cron=f"30 {hour} * * *", timezone=zone)
    tz = ZoneInfo(zone)
    start = at(*day, tz=tz)
    got = list(ticks.ticks_after(s, start, start + datetime.timedelta(hours=30)))
    first = at(*day, hour, 30, tz=tz)  # fold=0: the first of the two, summer time
    # (Python never finds an instant of a repeated hour equal to one of
    # another zone: compare in UTC.)
    assert got[0] == first.astimezone(UTC)
    assert first.utcoffset() > at(*day, 12, tz=tz).utcoffset()
    assert got[1] == at(day[0], day[1], day[2] + 1, hour, 30, tz=tz)
    # A scheduler that looks again in the second pass of the repeated hour
    # (its cursor at the first 02:30) finds nothing due: no second run.
    second_pass = first.astimezone(UTC) + datetime.timedelta(hours=1, minutes=15)
    assert second_pass.astimezone(tz).hour == hour
    assert ticks.due(s, first.astimezone(UTC), second_pass).ticks == ()
    assert ticks.due(s, None, second_pass).ticks == ()


def test_a_wildcard_job_follows_the_real_clock_across_both_changes():
    s = spec(cron="*/30 * * * *", timezone="Europe/Berlin")
    for start in (at(2026, 3, 29, 0, tz=BERLIN), at(2026, 10, 25, 0, tz=BERLIN)):
        got = list(ticks.ticks_after(s, start, start + datetime.timedelta(hours=5)))
        gaps = {b - a for a, b in zip(got, got[1:], strict=False)}
        assert gaps == {datetime.timedelta(minutes=30)}  # none skipped, none doubled


# --- the database side -------------------------------------------------------------


def messages_of(name):
    return list(
        Message.objects.filter(headers__contains={runs.SCHEDULE_HEADER: name}).order_by("run_at")
    )


@pytest.mark.django_db
def test_a_round_enqueues_each_due_tick_once_with_its_headers():
    s = spec(
        "ping",
        every=10,
        payload={"kind": "ping"},
        queue="sched",
        priority=5,
        timezone="Europe/Berlin",
    )
    now = at(2026, 1, 1, 12, 0, 5)
    result = runs.run_round([s], now=now)
    assert result.enqueued == {"ping": 1} and result.now == now
    assert result.next_tick == at(2026, 1, 1, 12, 0, 10)
    got = messages_of("ping")
    assert [m.run_at for m in got] == [at(2026, 1, 1, 12)]
    last = got[-1]
    assert (last.topic, last.payload, last.queue, last.priority) == (
        "test.schedule",
        {"kind": "ping"},
        "sched",
        5,
    )
    assert last.headers == {
        "pgqueue-schedule": "ping",
        "pgqueue-scheduled-at": "2026-01-01T13:00:00+01:00",
    }
    # Again at the same instant, or a moment later: nothing new.
    assert runs.run_round([s], now=now).enqueued == {}
    assert runs.run_round([s], now=now + datetime.timedelta(seconds=4)).enqueued == {}
    assert runs.run_round([s], now=now + datetime.timedelta(seconds=5)).enqueued == {"ping": 1}
    ledger = ScheduleTick.objects.filter(schedule="ping").order_by("tick")
    assert [t.message_id for t in ledger] == [m.pk for m in messages_of("ping")]


@pytest.mark.django_db
def test_the_ledger_records_a_tick_once_whoever_tries():
    tick = at(2026, 1, 1, 12)
    first = state.record_ticks("x", [tick, tick + datetime.timedelta(seconds=1)])
    assert [t for _, t in first] == [tick, tick + datetime.timedelta(seconds=1)]
    assert state.record_ticks("x", [tick]) == []
    assert [
        t for _, t in state.record_ticks("x", [tick, tick + datetime.timedelta(seconds=2)])
    ] == [tick + datetime.timedelta(seconds=2)]


@pytest.mark.django_db(transaction=True)
def test_concurrent_rounds_of_many_schedulers_enqueue_each_tick_once():
    s = spec("race", every=1)
    now = at(2026, 1, 1, 12)
    runs.run_round([s], now=now)  # its first tick; then six schedulers at once
    barrier = threading.Barrier(6)
    errors = []

    def scheduler(offset):
        try:
            barrier.wait()
            for second in range(0, 20, 2):
                runs.run_round([s], now=now + datetime.timedelta(seconds=second + offset))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=scheduler, args=(i % 2,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    # A round that found the schedule locked left its ticks to the holder,
    # whose clock may have been a second behind; the scheduler looks again
    # a moment later (worker.scheduler.BUSY_WAIT), as this last round does.
    runs.run_round([s], now=now + datetime.timedelta(seconds=19))
    ticks_seen = [m.run_at for m in messages_of("race")]
    expected = [now + datetime.timedelta(seconds=n) for n in range(20)]
    assert ticks_seen == expected  # every tick from the first round's to the last, once


@pytest.mark.django_db
def test_after_downtime_a_round_skips_logs_and_counts_then_backfills(caplog):
    s = spec("report", every=60, backfill=180)
    state.ensure(["report"])
    state.record_ticks("report", [at(2026, 1, 1, 10)])
    with caplog.at_level(logging.WARNING, logger="django_pgqueue.schedules.runs"):
        result = runs.run_round([s], now=at(2026, 1, 1, 12, 0, 1))
    # 10:01 ... 11:57 are older than 180 s (11:57 by one second): skipped.
    assert result.skipped == {"report": 117} and result.enqueued == {"report": 3}
    assert (
        "Schedule 'report': skipped 117 missed tick(s), more than 180s late (backfill: 180s)"
        in caplog.text
    )
    assert [m.run_at for m in messages_of("report")] == [
        at(2026, 1, 1, 11, 58),
        at(2026, 1, 1, 11, 59),
        at(2026, 1, 1, 12),
    ]
    row = Schedule.objects.get(name="report")
    assert row.skipped == 117 and at(2026, 1, 1, 11, 57) < row.skipped_through < at(
        2026, 1, 1, 11, 58
    )
    caplog.clear()
    assert runs.run_round([s], now=at(2026, 1, 1, 12, 0, 2)).skipped == {}
    assert not caplog.records


@pytest.mark.django_db
def test_a_paused_schedule_runs_no_tick_and_resumes_without_the_paused_ones():
    s = spec("pausable", every=10, backfill=3600)
    t0 = at(2026, 1, 1, 12)
    assert runs.run_round([s], now=t0).enqueued == {"pausable": 1}
    state.set_enabled("pausable", False, by="alice")
    assert runs.run_round([s], now=t0 + datetime.timedelta(minutes=10)).enqueued == {}
    row = Schedule.objects.get(name="pausable")
    assert (row.enabled, row.changed_by) == (False, "alice")
    state.set_enabled("pausable", True)
    result = runs.run_round([s], now=t0 + datetime.timedelta(minutes=10, seconds=15))
    # Only the tick after the pause ended (12:10:10), not the hour of backfill.
    assert result.enqueued == {"pausable": 1} and not result.skipped
    assert messages_of("pausable")[-1].run_at == t0 + datetime.timedelta(minutes=10, seconds=10)


@pytest.mark.django_db
def test_the_run_time_override_wins_over_the_setting_until_reset():
    s = spec("off", every=10, enabled=False)
    t0 = at(2026, 1, 1, 12)
    assert runs.run_round([s], now=t0).enqueued == {}
    state.set_enabled("off", True)
    assert runs.run_round([s], now=t0 + datetime.timedelta(seconds=10)).enqueued == {"off": 1}
    state.set_enabled("off", None)
    assert runs.run_round([s], now=t0 + datetime.timedelta(seconds=20)).enqueued == {}


@pytest.mark.django_db
def test_run_now_enqueues_one_message_outside_the_ticks():
    s = spec("manual", cron="0 3 * * *", payload={"n": 1})
    state.set_enabled("manual", False)  # paused: run now still runs
    message = runs.run_now(s, by="bob")
    assert message.created and message.payload == {"n": 1}
    assert (
        message.headers[runs.SCHEDULE_HEADER] == "manual"
        and message.headers[runs.RUN_NOW_HEADER] is True
    )
    assert datetime.datetime.fromisoformat(message.headers[runs.SCHEDULED_AT_HEADER])
    assert not ScheduleTick.objects.filter(schedule="manual").exists()


@pytest.mark.django_db
def test_a_schedule_whose_enqueue_fails_spares_the_others(caplog):
    bad = spec("bad", every=10, payload={"x": 1})
    object.__setattr__(bad, "payload", {"x": object()})  # not JSON: enqueue refuses it
    good = spec("good", every=10)
    result = runs.run_round([bad, good], now=at(2026, 1, 1, 12))
    assert "payload is not JSON-serializable" in result.failed["bad"]
    assert result.enqueued == {"good": 1}
    assert not ScheduleTick.objects.filter(schedule="bad").exists()  # tried again next round


@pytest.mark.django_db
def test_pruning_keeps_the_newest_ticks_and_those_a_scheduler_may_still_try():
    base = at(2026, 1, 1)
    state.record_ticks("busy", [base + datetime.timedelta(seconds=n) for n in range(300)])
    state.record_ticks("gone", [base - datetime.timedelta(days=40), base])
    horizon = base + datetime.timedelta(seconds=250)
    deleted = state.prune({"busy": horizon}, now=base + datetime.timedelta(days=1))
    kept = list(
        ScheduleTick.objects.filter(schedule="busy").values_list("tick", flat=True).order_by("tick")
    )
    assert len(kept) == state.KEEP_TICKS and kept[0] == base + datetime.timedelta(seconds=200)
    # The other schedule is no longer configured: only its 40-day-old tick goes.
    assert deleted == 201
    assert ScheduleTick.objects.filter(schedule="gone").count() == 1
    # Never a tick younger than the horizon, even beyond KEEP_TICKS.
    assert state.prune({"busy": base}, now=base) == 0


@pytest.mark.django_db
def test_the_overview_shows_next_and_last_tick_and_the_last_messages_state():
    s = spec("shown", cron="*/15 * * * *", timezone="Europe/Berlin")
    now = at(2026, 1, 1, 12, 0, 5)
    runs.run_round([s], now=now)
    (row,) = [r for r in overview.rows([s], now=now) if r.name == "shown"]
    assert (row.last_tick, row.next_tick) == (at(2026, 1, 1, 12), at(2026, 1, 1, 12, 15))
    assert row.last_message_state == "waiting" and not row.paused
    data = row.as_json()
    assert (
        data["next_tick"] == "2026-01-01T13:15:00+01:00"
        and data["description"] == "Every 15th minute of every hour"
    )
    message = Message.objects.get(pk=row.last_message_id)
    DeadLetter.objects.create(
        message_id=message.pk,
        queue="default",
        topic=message.topic,
        payload={},
        category="permanent",
        reason="x",
        attempts=1,
    )
    message.delete()
    assert overview.rows([s], now=now)[0].last_message_state == "dead-lettered"
    DeadLetter.objects.all().delete()
    assert overview.rows([s], now=now)[0].last_message_state == "finished"
    state.set_enabled("shown", False)
    row = overview.rows([s], now=now)[0]
    assert row.paused and row.next_tick is None and row.override is False


@pytest.mark.django_db(transaction=True)
def test_a_burst_worker_runs_one_round_and_works_off_the_ticks():
    from demo.models import Handled

    s = parse("burst", {"every": 3600, "topic": "test.record", "backfill": 7200})
    state.ensure(["burst"])
    Worker(burst=True, schedules=[s]).run()
    # A new schedule: only a tick on time (none, unless the hour just began).
    before = Handled.objects.count()
    ScheduleTick.objects.all().delete()
    state.skip("burst", datetime.datetime.now(UTC) - datetime.timedelta(hours=3), 0)
    Worker(burst=True, schedules=[s]).run()
    # Backfill of two hours: the two whole hours before now, each handled once.
    assert Handled.objects.count() - before == 2
    assert not Message.objects.exists()


def test_the_scheduler_sleeps_until_the_next_tick_by_the_database_clock():
    from django_pgqueue.worker.scheduler import BUSY_WAIT, MARGIN, MAX_WAIT, Scheduler

    now = at(2026, 1, 1, 12)

    def result(**fields):
        return runs.RoundResult(now=now, **fields)

    wait = Scheduler._wait(result(next_tick=now + datetime.timedelta(seconds=2)), 0.5)
    assert wait == pytest.approx(1.5 + MARGIN)
    assert Scheduler._wait(result(next_tick=now + datetime.timedelta(hours=1)), 0) == MAX_WAIT
    assert (
        Scheduler._wait(result(next_tick=now + datetime.timedelta(hours=1), busy=("x",)), 0)
        == BUSY_WAIT
    )
    assert Scheduler._wait(result(next_tick=now, more=True), 0) == 0
    assert Scheduler._wait(result(next_tick=now - datetime.timedelta(seconds=1)), 0) == MARGIN


@pytest.mark.django_db(transaction=True)
def test_a_rounds_own_transaction_is_ended_by_the_server_should_it_idle():
    def idle_limit():
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            return cursor.fetchone()[0]

    with transaction.atomic():
        state.lock(["x"])
        assert idle_limit() == "30s"  # a client that vanished frees the locks then
    assert idle_limit() == "0"  # only that transaction's
    with transaction.atomic():
        runs.run_round([spec("x")])  # inside a caller's transaction: left alone
        assert idle_limit() == "0"


@pytest.mark.django_db(transaction=True)
def test_a_running_worker_enqueues_each_tick_and_reports_its_scheduler():
    s = parse("live", {"every": 1, "topic": "test.record", "queue": "live"})
    with running_worker(queues=["default"], schedules=[s]) as worker:
        wait_until(lambda: len(messages_of("live")) >= 3, timeout=60, message="three ticks")
        healthy, details = worker.health()
    assert healthy and details["scheduler"]["schedules"] == ["live"]
    assert details["scheduler"]["rounds"] >= 3
    got = [m.run_at for m in messages_of("live")]
    assert got == [got[0] + datetime.timedelta(seconds=n) for n in range(len(got))]


@pytest.mark.parametrize("value", [[{"every": 5, "topic": "t"}], {1: {"every": 5, "topic": "t"}}])
def test_schedules_that_are_not_a_dict_of_names_are_one_settings_error(value):
    from django_pgqueue.checks import check_settings

    with override_settings(PGQUEUE={"SCHEDULES": value}):
        (error,) = check_settings()
        assert error.id == "pgqueue.E003" and "a dict of schedule names" in error.msg
        assert check_schedules() == []
        with pytest.raises(ImproperlyConfigured):
            configured.configured()
