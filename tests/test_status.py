"""manage.py pgqueue_status: the report (text and JSON) on real rows, each
threshold crossed and not, bad options, an unreachable database, and the
real exit status of a manage.py process."""

import datetime
import io
import json
import os
import re
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.utils import timezone

from django_pgqueue import enqueue, liveness, publish, subscriber
from django_pgqueue.models import (
    Category,
    DeadLetterState,
    Subscription,
    SubscriptionState,
    WorkerHeartbeat,
)
from django_pgqueue.streams import subscribers

from .claiming import claim
from .conftest import MANAGE, database_url

NEW, REVIVED, RESOLVED = DeadLetterState.NEW, DeadLetterState.REVIVED, DeadLetterState.RESOLVED
CONFIGURED = {"QUEUES": ["default", "mail", "reports"]}
LONG_TOPIC = "very.long." + "x" * 150

# A queue that is not paused and has no limits (pgqueue_queues).
RUNNING = {"paused": False, "concurrency": None, "rate": None}
# A queue none of whose messages has a partition_key.
NO_PARTITIONS = {"partitions": None}


def ago(seconds):
    return timezone.now() - datetime.timedelta(seconds=seconds)


def run(*args):
    """Run the command in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("pgqueue_status", *args, stdout=out, stderr=err)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue(), err.getvalue()


def run_json(*args):
    """Run with --json: (exit status, the report, stderr). With one database,
    every queue and row says it is on "default"; that is checked here and
    taken out, so the tests compare the rest."""
    code, out, err = run("--json", *args)
    report = json.loads(out)
    if "databases" in report:
        assert report.pop("databases") == ["default"]
        rows = [*report["queues"].values()]
        rows += [row for key in ("dead_letters", "workers", "subscriptions", "schedules")
                 for row in report[key]]  # fmt: skip
        assert {row.pop("database") for row in rows} <= {"default"}
    return code, report, err


def subprocess_env(**extra):
    return {
        **os.environ,
        "DATABASE_URL": database_url("default"),
        "OTHER_DATABASE_URL": database_url("other"),
        "PGQUEUE_JSON": "{}",
        "PGQUEUE_LOG_LEVEL": "WARNING",
        **extra,
    }


def manage(*args, **env):
    return subprocess.run(
        [sys.executable, str(MANAGE), "pgqueue_status", *args],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        # A bound that stops a hung command, far above its normal seconds: a
        # loaded 2-core machine took over 60 s to start Django once.
        timeout=300,
    )


@pytest.fixture
def rows(settings, make_dead_letter):
    """Three configured queues (one empty), one queue in use that is not
    configured, dead letters in every state, a live worker and a stale one."""
    settings.PGQUEUE = CONFIGURED
    enqueue("orders.created", {}, run_at=ago(600))
    enqueue("orders.created", {}, run_at=ago(60))
    enqueue("orders.created", {}, delay=3600)
    enqueue(LONG_TOPIC, {}, run_at=ago(5))
    enqueue("mail.send", {}, queue="mail", run_at=ago(30))
    enqueue("mail.send", {}, queue="mail", run_at=ago(20))
    enqueue("orders.created", {}, queue="legacy", run_at=ago(5))
    [leased] = claim(["mail"], 1, "web-1:100:aaaaaa", 60)

    make_dead_letter("orders.created", category=Category.TRANSIENT, state=NEW)
    make_dead_letter("orders.created", category=Category.TRANSIENT, state=NEW)
    make_dead_letter("orders.created", category=Category.TRANSIENT, state=RESOLVED)
    make_dead_letter("mail.send", queue="mail", category=Category.DEPENDENCY, state=NEW)
    make_dead_letter("mail.send", queue="mail", category=Category.DEPENDENCY, state=REVIVED)

    liveness.heartbeat(
        liveness.Beat(
            worker_id="web-1:100:aaaaaa",
            hostname="web-1",
            pid=100,
            queues=["default", "mail"],
            concurrency=4,
            alive_for=60,
            inflight=1,
            processed=17,
        )
    )
    WorkerHeartbeat.objects.create(
        worker_id="web-2:200:bbbbbb",
        hostname="web-2",
        pid=200,
        queues=["default"],
        concurrency=2,
        started_at=ago(7200),
        heartbeat_at=ago(3630),
        expires_at=ago(3600),
        inflight=0,
        processed=5,
    )
    return leased


# --- the report ---------------------------------------------------------------------


@pytest.mark.django_db
def test_text_report_shows_queues_topics_dead_letters_and_workers(rows):
    code, out, err = run()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)

    queues = lines[: lines.index("")]
    assert queues[0] == "Queues"
    assert queues[1].split() == [
        "QUEUE", "/", "TOPIC", "READY", "DELAYED", "BLOCKED", "PROCESSING", "OLDEST", "READY",
        "WORKERS",
    ]  # fmt: skip
    assert re.fullmatch(r"default +3 +1 +0 +0 +10m 0\ds +1", queues[2]), queues[2]
    assert queues[3].split() == ["orders.created", "2", "1", "0", "0"]
    assert queues[4].startswith("  very.long.xxx") and queues[4].split()[1:] == ["1", "0", "0", "0"]
    assert queues[4].split()[0].endswith("…"), "a long topic is cut to its column"
    assert re.fullmatch(r"mail +1 +0 +0 +1 +2\ds +1", queues[5]), queues[5]
    assert queues[6].split() == ["mail.send", "1", "0", "0", "1"]
    assert queues[7].split() == ["reports", "0", "0", "0", "0", "0s", "0"], (
        "a configured queue is shown even when empty"
    )
    assert queues[8].split()[:5] == ["legacy", "1", "0", "0", "0"], (
        "a queue that holds messages is shown even when not configured"
    )
    assert queues[9].split() == ["orders.created", "1", "0", "0", "0"]
    assert len(queues) == 10

    dead = lines[len(queues) + 1 : len(queues) + 5]
    assert dead[0] == "Dead letters"
    assert dead[1].split() == ["TOPIC", "CATEGORY", "NEW", "REVIVED", "RESOLVED"]
    assert dead[2].split() == ["mail.send", "dependency", "1", "1", "0"]
    assert dead[3].split() == ["orders.created", "transient", "2", "0", "1"]

    workers = lines[len(queues) + len(dead) + 2 :]
    assert workers[0] == "Workers"
    assert workers[1].split() == [
        "ID", "HOST", "PID", "QUEUES", "STATE", "HEARTBEAT", "INFLIGHT", "PROCESSED"
    ]  # fmt: skip
    alive = workers[2].split()
    assert alive[:5] + alive[6:] == [
        "web-1:100:aaaaaa",
        "web-1",
        "100",
        "default,mail",
        "alive",
        "1",
        "17",
    ]
    assert re.fullmatch(r"\ds", alive[5]), f"heartbeat age {alive[5]!r}: a beat just now"
    assert workers[3].split() == [
        "web-2:200:bbbbbb", "web-2", "200", "default", "stale", "1h", "00m", "0", "5"
    ]  # fmt: skip
    # (Further sections may follow the schedules.) The demo project's
    # subscribers are declared, none started.
    declared = len(subscribers.registered())
    assert workers[4:6] == ["", "Subscriptions"]
    assert [line.split()[2:4] for line in workers[7 : 7 + declared]] == [
        ["not", "started"]
    ] * declared
    assert workers[7 + declared : 10 + declared] == ["", "Schedules", "no schedules"]


@pytest.mark.django_db
def test_json_report_has_every_count_age_and_worker(rows):
    code, report, err = run_json()
    assert (code, err) == (0, "")

    ages = {name: queue.pop("oldest_ready_age_seconds") for name, queue in report["queues"].items()}
    assert 600 <= ages["default"] < 605, ages
    assert 20 <= ages["mail"] < 25, ages
    assert 5 <= ages["legacy"] < 10, ages
    assert ages["reports"] == 0
    zero = {"ready": 0, "delayed": 0, "blocked": 0, "processing": 0}
    assert report["queues"] == {
        "default": {
            "ready": 3,
            "delayed": 1,
            "blocked": 0,
            "processing": 0,
            "workers_alive": 1,
            **RUNNING,
            **NO_PARTITIONS,
            "topics": {
                "orders.created": {"ready": 2, "delayed": 1, "blocked": 0, "processing": 0},
                LONG_TOPIC: {"ready": 1, "delayed": 0, "blocked": 0, "processing": 0},
            },
        },
        "mail": {
            "ready": 1,
            "delayed": 0,
            "blocked": 0,
            "processing": 1,
            "workers_alive": 1,
            **RUNNING,
            **NO_PARTITIONS,
            "topics": {"mail.send": {"ready": 1, "delayed": 0, "blocked": 0, "processing": 1}},
        },
        "reports": {**zero, "workers_alive": 0, **RUNNING, **NO_PARTITIONS, "topics": {}},
        "legacy": {
            "ready": 1,
            "delayed": 0,
            "blocked": 0,
            "processing": 0,
            "workers_alive": 0,
            **RUNNING,
            **NO_PARTITIONS,
            "topics": {"orders.created": {"ready": 1, "delayed": 0, "blocked": 0, "processing": 0}},
        },
    }
    assert list(report["queues"]) == ["default", "mail", "reports", "legacy"], (
        "configured queues first, in their configured order"
    )
    assert report["dead_letters"] == [
        {"topic": "mail.send", "category": "dependency", "state": "new", "count": 1},
        {"topic": "mail.send", "category": "dependency", "state": "revived", "count": 1},
        {"topic": "orders.created", "category": "transient", "state": "new", "count": 2},
        {"topic": "orders.created", "category": "transient", "state": "resolved", "count": 1},
    ]

    alive, stale = (
        WorkerHeartbeat.objects.get(pk=pk) for pk in ("web-1:100:aaaaaa", "web-2:200:bbbbbb")
    )
    # By the database's clock: the beat's now() against the read's statement time.
    heartbeat_ages = [worker.pop("heartbeat_age_seconds") for worker in report["workers"]]
    assert 0 <= heartbeat_ages[0] < 5 and 3630 <= heartbeat_ages[1] < 3640, heartbeat_ages
    assert report["workers"] == [
        {
            "worker_id": "web-1:100:aaaaaa",
            "hostname": "web-1",
            "pid": 100,
            "queues": ["default", "mail"],
            "concurrency": 4,
            "alive": True,
            "heartbeat_at": alive.heartbeat_at.isoformat(),
            "inflight": 1,
            "processed": 17,
            "started_at": alive.started_at.isoformat(),
        },
        {
            "worker_id": "web-2:200:bbbbbb",
            "hostname": "web-2",
            "pid": 200,
            "queues": ["default"],
            "concurrency": 2,
            "alive": False,
            "heartbeat_at": stale.heartbeat_at.isoformat(),
            "inflight": 0,
            "processed": 5,
            "started_at": stale.started_at.isoformat(),
        },
    ]
    assert report["thresholds"] == []
    assert report["ok"] is True


@pytest.mark.django_db
def test_an_empty_database_shows_the_default_queue_with_zeros():
    code, out, err = run()
    assert (code, err) == (0, "")
    assert out.splitlines()[2].split() == ["default", "0", "0", "0", "0", "0s", "0"]
    assert "\nDead letters\nno dead letters\n" in out
    assert "\nWorkers\nno workers\n\nSubscriptions\nNAME " in out
    assert "\n\nSchedules\nno schedules\n" in out

    code, report, err = run_json()
    history = report.pop("history")  # its table's size in bytes depends on the server
    assert (history["rows"], history["oldest_age_seconds"]) == (0, None)
    assert report == {
        "queues": {
            "default": {
                "ready": 0,
                "delayed": 0,
                "blocked": 0,
                "processing": 0,
                "oldest_ready_age_seconds": 0.0,
                "workers_alive": 0,
                **RUNNING,
                **NO_PARTITIONS,
                "topics": {},
            }
        },
        "dead_letters": [],
        "workers": [],
        "subscriptions": declared_not_started(),
        "schedules": [],
        "workflows": {"running": 0, "blocked": 0, "done": 0, "failed": 0, "cancelled": 0},
        "thresholds": [],
        "ok": True,
    }


@pytest.mark.django_db
def test_queue_option_limits_queues_dead_letters_and_workers(rows):
    code, report, err = run_json("--queue", "mail", "--queue", "nowhere", "--queue", "mail")
    assert (code, err) == (0, "")
    assert list(report["queues"]) == ["mail", "nowhere"], "only the named queues, once each"
    assert (report["queues"]["mail"]["ready"], report["queues"]["mail"]["processing"]) == (1, 1)
    assert report["queues"]["nowhere"] == {
        "ready": 0,
        "delayed": 0,
        "blocked": 0,
        "processing": 0,
        "oldest_ready_age_seconds": 0.0,
        "workers_alive": 0,
        **RUNNING,
        **NO_PARTITIONS,
        "topics": {},
    }
    assert [(d["topic"], d["state"]) for d in report["dead_letters"]] == [
        ("mail.send", "new"),
        ("mail.send", "revived"),
    ], "only the dead letters of the named queues"
    assert [w["worker_id"] for w in report["workers"]] == ["web-1:100:aaaaaa"], (
        "only the workers that serve a named queue"
    )


@pytest.mark.django_db
def test_names_and_hosts_reach_the_terminal_without_control_characters(make_dead_letter):
    make_dead_letter("evil\x1b[2Jtopic")
    WorkerHeartbeat.objects.create(
        worker_id="w\r1", hostname="h\x07", pid=1, queues=["default"], concurrency=1,
        expires_at=ago(-60),
    )  # fmt: skip
    code, out, err = run()
    assert "\x1b" not in out and "\r" not in out and "\x07" not in out
    assert "evil?[2Jtopic" in out and "w?1" in out and "h?" in out


def declared_not_started(*also):
    """The status report's rows of the subscriptions the code declares (the
    demo project's, and ``also``: (name, stream) pairs) that have no row."""
    rows = {(spec.name, spec.stream) for spec in subscribers.registered()} | set(also)
    return [
        {"name": name, "stream": stream, "state": "not started", "checkpoint_position": None,
         "head_position": None, "lag": None, "oldest_pending_age_seconds": None,
         "delivered": 0, "failing_position": None, "attempts": 0, "retry_at": None,
         "retry_in_seconds": None, "error": None}
        for name, stream in sorted(rows)
    ]  # fmt: skip


def started(rows):
    """The report's subscriptions that have a row (a worker started them)."""
    return [row for row in rows if row["state"] != "not started"]


@pytest.fixture
def declared():
    """A subscriber that this test's code declares and no worker starts."""
    subscriber("orders", name="status.fresh")(lambda event: None)
    yield "status.fresh"
    subscribers.unregister("status.fresh")


@pytest.mark.django_db
def test_every_declared_subscription_is_listed_those_not_started_as_such(declared):
    publish("orders", {})
    Subscription.objects.create(name="status.started", stream="orders")  # a worker's
    code, report, err = run_json()
    assert (code, err) == (0, "")
    started = [row for row in report["subscriptions"] if row["state"] != "not started"]
    assert [row["name"] for row in started] == ["status.started"], "no longer declared: kept"
    assert [row for row in report["subscriptions"] if row["state"] == "not started"] == (
        declared_not_started((declared, "orders"))
    )
    names = [row["name"] for row in report["subscriptions"]]
    assert names == sorted(names) and declared in names

    code, out, err = run()
    lines = out.splitlines()
    section = lines[lines.index("Subscriptions") + 2 : lines.index("Schedules") - 1]
    rows = {line.split()[0]: line for line in section}
    assert set(rows) == set(names)
    assert re.fullmatch(r"status\.fresh +orders +not started +- +-", rows[declared]), rows[declared]
    assert rows["status.started"].split()[1:5] == ["orders", "active", "0", "1"]


@pytest.fixture
def subscription_rows():
    """Five events of stream "orders" and a subscription in each situation:
    caught up, lagging, blocked, retrying, paused. Returns the positions."""
    events = [publish("orders", {"n": n}) for n in range(5)]
    positions = [event.position for event in events]

    def make(name, after, **fields):
        Subscription.objects.create(
            name=name,
            stream="orders",
            checkpoint_xid=events[after].xid if after is not None else 0,
            checkpoint_position=positions[after] if after is not None else 0,
            **fields,
        )

    make("search.orders", 4, delivered=5)
    make("mail.orders", 1, delivered=2, last_error="ValueError: long since resolved")
    make(
        "crm.orders", 2, delivered=3, state=SubscriptionState.BLOCKED,
        failing_position=positions[3], attempts=5,
        last_error="KeyError: 'status'\nTraceback (most recent call last): ...",
    )  # fmt: skip
    make(
        "audit.orders", None, state=SubscriptionState.RETRYING, failing_position=positions[0],
        attempts=1, last_error="ConnectionError: downstream is down", retry_at=ago(-300),
    )  # fmt: skip
    make("report.orders", 0, delivered=1, state=SubscriptionState.PAUSED)
    return positions


@pytest.mark.django_db
def test_subscriptions_show_state_checkpoint_lag_and_why_one_does_not_deliver(subscription_rows):
    p = subscription_rows
    code, report, err = run_json()
    assert (code, err) == (0, "")
    # The demo project's declared subscriptions: not started (the test above).
    report["subscriptions"] = started(report["subscriptions"])
    audit = report["subscriptions"][0]
    retrying = {key: audit.pop(key) for key in ("retry_at", "retry_in_seconds")}
    assert retrying["retry_at"] == Subscription.objects.get(name=audit["name"]).retry_at.isoformat()
    assert 290 < retrying["retry_in_seconds"] <= 300
    # Ages by the database's clock: the events were published a moment ago.
    ages = [row.pop("oldest_pending_age_seconds") for row in report["subscriptions"]]
    assert all(0 <= age < 5 for age in ages[:4]) and ages[4] is None, ages
    common = {"stream": "orders", "head_position": p[4]}
    not_retrying = {"retry_at": None, "retry_in_seconds": None}
    assert report["subscriptions"] == [
        {
            **common,
            "name": "audit.orders", "state": "retrying", "checkpoint_position": 0, "lag": 5,
            "delivered": 0, "failing_position": p[0],
            "attempts": 1, "error": "ConnectionError: downstream is down",
        },
        {
            **common,
            "name": "crm.orders", "state": "blocked", "checkpoint_position": p[2], "lag": 2,
            **not_retrying, "delivered": 3, "failing_position": p[3],
            "attempts": 5,
            "error": "KeyError: 'status'\nTraceback (most recent call last): ...",
        },
        {
            **common,
            "name": "mail.orders", "state": "active", "checkpoint_position": p[1], "lag": 3,
            **not_retrying, "delivered": 2, "failing_position": None,
            "attempts": 0, "error": None,
        },
        {
            **common,
            "name": "report.orders", "state": "paused", "checkpoint_position": p[0], "lag": 4,
            **not_retrying, "delivered": 1, "failing_position": None,
            "attempts": 0, "error": None,
        },
        {
            **common,
            "name": "search.orders", "state": "active", "checkpoint_position": p[4], "lag": 0,
            **not_retrying, "delivered": 5, "failing_position": None,
            "attempts": 0, "error": None,
        },
    ]  # fmt: skip

    code, out, err = run()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    section = lines[lines.index("Subscriptions") : lines.index("Schedules") - 1]
    assert section[1].split() == ["NAME", "STREAM", "STATE", "CHECKPOINT", "LAG", "OLDEST", "WHY"]
    rows = [line.split(None, 6) for line in section[2:] if " not started " not in line]
    # The OLDEST column: seconds since the fixture published (as in the JSON
    # above, under 5 s however loaded the machine), shown here as "0s".
    for cells in rows[:4]:
        assert re.fullmatch(r"[0-4]s", cells[5]), cells
        cells[5] = "0s"
    assert rows[0][:6] == ["audit.orders", "orders", "retrying", "0", "5", "0s"]
    assert re.fullmatch(
        rf"event {p[0]}, attempt 2 in 4m 5\ds: ConnectionError: downstream is down", rows[0][6]
    ), rows[0][6]
    assert rows[1] == [
        "crm.orders", "orders", "blocked", str(p[2]), "2", "0s",
        f"event {p[3]} failed 5 attempts: KeyError: 'status'",
    ]  # fmt: skip
    assert rows[2] == ["mail.orders", "orders", "active", str(p[1]), "3", "0s"], (
        "an old error of a subscription that recovered is not shown"
    )
    assert rows[3] == [
        "report.orders", "orders", "paused", str(p[0]), "4", "0s", "paused by an operator"
    ]  # fmt: skip
    assert rows[4] == ["search.orders", "orders", "active", str(p[4]), "0"]
    assert len(rows) == 5

    code, report, err = run_json("--queue", "mail")
    assert len(started(report["subscriptions"])) == 5, (
        "streams belong to no queue: --queue keeps them"
    )


# --- thresholds ---------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "critical"),
    [
        (["--max-ready", "3"], None),
        (["--max-ready", "2"], re.escape("queue 'default' has 3 ready messages (limit 2)")),
        (["--max-ready", "0", "--queue", "reports"], None),
        (["--max-age", "900"], None),
        (
            ["--max-age", "300"],
            r"queue 'default' has a message ready for 60\d(\.\d+)? seconds "
            r"and not yet claimed \(limit 300\)",
        ),
        (["--max-age", "0", "--queue", "reports"], None),
        (["--max-dead-letters", "3"], None),
        (["--max-dead-letters", "2"], re.escape("3 new dead letters (limit 2)")),
        (
            ["--max-dead-letters", "0", "--queue", "mail"],
            re.escape("1 new dead letter in queue 'mail' (limit 0)"),
        ),
        (["--max-dead-letters", "1", "--queue", "mail", "--queue", "x"], None),
        (["--min-workers", "1", "--queue", "default", "--queue", "mail"], None),
        (["--min-workers", "1"], re.escape("queue 'reports' has 0 live workers (minimum 1)")),
        (
            ["--min-workers", "2", "--queue", "mail"],
            re.escape("queue 'mail' has 1 live worker (minimum 2)"),
        ),
    ],
)
def test_each_threshold_crossed_or_not(rows, args, critical):
    code, out, err = run(*args)
    assert out.startswith("Queues\n") and "\nWorkers\n" in out, "the report is written either way"
    if critical is None:
        assert (code, err) == (0, "")
    else:
        assert code == 1
        [line] = err.splitlines()
        assert re.fullmatch("CRITICAL: " + critical, line), line


@pytest.mark.django_db
def test_thresholds_in_json_name_each_queue_and_every_crossing_is_reported(rows):
    code, report, err = run_json(
        "--max-ready", "1", "--max-dead-letters", "5", "--min-workers", "1", "--max-age", "60"
    )
    assert code == 1
    assert report["ok"] is False
    thresholds = report["thresholds"]
    for threshold in thresholds:
        if threshold["name"] == "max_age":
            assert isinstance(threshold.pop("value"), float)
    assert thresholds == [
        {"name": "max_ready", "limit": 1, "value": 3, "queue": "default", "crossed": True},
        {"name": "max_ready", "limit": 1, "value": 1, "queue": "mail", "crossed": False},
        {"name": "max_ready", "limit": 1, "value": 0, "queue": "reports", "crossed": False},
        {"name": "max_ready", "limit": 1, "value": 1, "queue": "legacy", "crossed": False},
        {"name": "max_age", "limit": 60.0, "queue": "default", "crossed": True},
        {"name": "max_age", "limit": 60.0, "queue": "mail", "crossed": False},
        {"name": "max_age", "limit": 60.0, "queue": "reports", "crossed": False},
        {"name": "max_age", "limit": 60.0, "queue": "legacy", "crossed": False},
        {"name": "max_dead_letters", "limit": 5, "value": 3, "crossed": False},
        {"name": "min_workers", "limit": 1, "value": 1, "queue": "default", "crossed": False},
        {"name": "min_workers", "limit": 1, "value": 1, "queue": "mail", "crossed": False},
        {"name": "min_workers", "limit": 1, "value": 0, "queue": "reports", "crossed": True},
    ], "min-workers applies to the configured queues only, not to 'legacy'"
    lines = err.splitlines()
    assert [line.split(" has ")[0] for line in lines] == [
        "CRITICAL: queue 'default'",
        "CRITICAL: queue 'default'",
        "CRITICAL: queue 'reports'",
    ]


# --- bad input, no database -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-ready", "-1"], "--max-ready: must be zero or more, not -1"),
        (["--max-ready", "lots"], "--max-ready: 'lots' is not a whole number"),
        (["--max-dead-letters", "1.5"], "--max-dead-letters: '1.5' is not a whole number"),
        (["--max-age", "-0.5"], "--max-age: must be zero or more seconds, not -0.5"),
        (["--max-age", "nan"], "--max-age: must be zero or more seconds, not nan"),
        (["--max-age", "inf"], "--max-age: must be zero or more seconds, not inf"),
        (["--max-age", "soon"], "--max-age: 'soon' is not a number of seconds"),
        (["--min-workers", "0"], "--min-workers: must be at least 1, not 0"),
        (["--queue", "not ok"], "--queue: queue name 'not ok' may contain only"),
        (["--queue", ""], "--queue: queue name must not be empty"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_bad_options_get_a_clear_error(args, words):
    with pytest.raises(CommandError, match=re.escape(words)):
        call_command("pgqueue_status", *args)


@pytest.fixture(params=[{"PORT": "1"}, {"NAME": "postgres"}], ids=["closed-port", "no-tables"])
def broken_queue_database(request, settings, django_db_blocker):
    """The queue on alias "other", pointed at a closed port or at a database
    without the queue tables; the alias is restored afterwards."""
    connection = connections["other"]
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(request.param)
    settings.PGQUEUE = {"DATABASE": "other"}
    try:
        with django_db_blocker.unblock():
            yield request.param
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def test_a_broken_database_is_exit_status_2_with_a_clear_message(broken_queue_database):
    with pytest.raises(CommandError) as raised:
        call_command("pgqueue_status", "--max-ready", "0", stdout=io.StringIO())
    assert raised.value.returncode == 2
    if "PORT" in broken_queue_database:
        assert str(raised.value).startswith("cannot reach the queue database 'other': ")
        assert "port 1 failed" in str(raised.value)
    else:
        assert str(raised.value).startswith(
            "cannot read the queue tables in database 'other' (has manage.py migrate run?): "
        )
        assert 'relation "django_pgqueue_' in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_failing_system_check_is_exit_status_2_not_1(settings):
    settings.PGQUEUE = {"MAX_ATTEMPTS": 0}
    with pytest.raises(CommandError, match="pgqueue.E003") as raised:
        call_command("pgqueue_status", skip_checks=False, stderr=io.StringIO())
    assert raised.value.returncode == 2


# --- a real manage.py process -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("limit", "status"), [("0", 1), ("1", 0)])
def test_manage_py_exit_status_follows_the_threshold(limit, status):
    enqueue("orders.created", {})
    process = manage("--json", "--max-ready", limit)
    assert process.returncode == status, process.stderr
    report = json.loads(process.stdout)
    assert report["queues"]["default"]["ready"] == 1
    assert report["ok"] is (status == 0)
    if status:
        assert process.stderr == "CRITICAL: queue 'default' has 1 ready message (limit 0)\n"
    else:
        assert process.stderr == ""


def test_manage_py_exit_status_is_2_for_a_bad_option_or_no_database():
    process = manage("--max-age", "-1")
    assert process.returncode == 2
    assert "--max-age: must be zero or more seconds, not -1" in process.stderr

    process = manage(DATABASE_URL="postgres://postgres@127.0.0.1:1/nowhere")
    assert process.returncode == 2
    assert process.stdout == ""
    assert process.stderr.startswith("CommandError: cannot reach the queue database 'default': ")
    assert "Traceback" not in process.stderr
