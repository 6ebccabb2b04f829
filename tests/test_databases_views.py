"""Queues on several databases, seen from outside: pgqueue_status, the other
commands, the metrics, the health check and the admin cover every database,
each row saying which (issue 40).

The test project has two aliases, "default" and "other"; "bulk" lives on
"other" here (PGQUEUE["QUEUES"]["bulk"]["database"]).
"""

import datetime
import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_pgqueue import conf, enqueue, liveness
from django_pgqueue.models import (
    Category,
    DeadLetter,
    DeadLetterState,
    Message,
    WorkerHeartbeat,
)

from .conftest import unreachable

TWO = {"QUEUES": {"default": {}, "bulk": {"database": "other"}}}
BOTH = ["default", "other"]


@pytest.fixture
def two_databases(settings):
    settings.PGQUEUE = TWO
    assert conf.databases() == BOTH


def run(command, *args):
    """(exit status, stdout, stderr) of a command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command(command, *args, stdout=out, stderr=err)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue(), err.getvalue()


def enqueue_bulk(payload):
    """Enqueue to bulk (on "other") from a transaction on "other": the row
    is written at once (from default's, it waits for default's commit)."""
    enqueue("test.record", payload, queue="bulk", using="other")


def dead_letter(alias, topic="test.record", **fields):
    """A DeadLetter row fabricated on the database ``alias``."""
    fields.setdefault("message_id", 1)
    fields.setdefault("queue", "bulk" if alias == "other" else "default")
    return DeadLetter.objects.using(alias).create(
        topic=topic,
        payload={"n": 1},
        category=Category.TRANSIENT,
        reason="ConnectionError: down",
        attempts=5,
        **fields,
    )


def beat(alias, worker_id, queues):
    with conf.on_database(alias):
        liveness.heartbeat(
            liveness.Beat(
                worker_id=worker_id,
                hostname="host",
                pid=1,
                queues=queues,
                concurrency=1,
                alive_for=30.0,
                inflight=0,
                processed=0,
            )
        )


# --- pgqueue_status ----------------------------------------------------------------------


@pytest.mark.django_db(databases=BOTH)
def test_status_lists_the_queues_of_both_databases_each_saying_its_database(two_databases):
    enqueue("test.record", {"n": 1})
    enqueue_bulk({"n": 2})
    enqueue_bulk({"n": 3})
    assert Message.objects.using("other").count() == 2, "bulk's messages are on other"
    dead_letter("other")
    beat("other", "w-bulk", ["bulk"])

    code, out, err = run("pgqueue_status", "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["databases"] == BOTH
    queues = report["queues"]
    assert list(queues) == ["default", "bulk"]
    assert (queues["default"]["database"], queues["default"]["ready"]) == ("default", 1)
    assert (queues["bulk"]["database"], queues["bulk"]["ready"]) == ("other", 2)
    assert queues["bulk"]["workers_alive"] == 1, "a worker alive in other's table serves bulk"
    assert [(row["database"], row["state"]) for row in report["dead_letters"]] == [("other", "new")]
    assert [(row["database"], row["worker_id"]) for row in report["workers"]] == [
        ("other", "w-bulk")
    ]

    code, out, err = run("pgqueue_status")
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["DATABASE", "QUEUE"], "a DATABASE column with several"
    assert lines[2].split()[:3] == ["default", "default", "1"]
    assert ["other", "bulk", "2"] in [line.split()[:3] for line in lines]
    assert any(line.split()[:2] == ["other", "test.record"] for line in lines), (
        "the dead letters' rows say their database"
    )


@pytest.mark.django_db(databases=BOTH)
def test_status_database_option_limits_it_to_one_and_a_bad_alias_is_refused(two_databases):
    enqueue_bulk({"n": 1})

    code, out, _ = run("pgqueue_status", "--json", "--database", "other")
    report = json.loads(out)
    assert (code, report["databases"], list(report["queues"])) == (0, ["other"], ["bulk"])

    code, out, _ = run("pgqueue_status", "--database", "other")
    assert out.splitlines()[1].split()[0] == "QUEUE", "one database: no DATABASE column"

    with pytest.raises(CommandError, match="'nowhere' is not a database of the queues; choose"):
        run("pgqueue_status", "--database", "nowhere")
    with pytest.raises(CommandError, match="no --queue given lives on database 'default'"):
        run("pgqueue_status", "--queue", "bulk", "--database", "default")

    code, out, _ = run("pgqueue_status", "--json", "--queue", "bulk")
    report = json.loads(out)
    assert (report["databases"], report["queues"]["bulk"]["ready"]) == (["other"], 1)


@pytest.mark.django_db(databases=BOTH)
def test_status_min_workers_counts_the_workers_of_each_queues_database(two_databases):
    beat("default", "w-default", ["default"])
    code, _, err = run("pgqueue_status", "--min-workers", "1")
    assert code == 1
    assert err.strip() == "CRITICAL: queue 'bulk' has 0 live workers (minimum 1)"
    beat("other", "w-bulk", ["bulk"])
    assert run("pgqueue_status", "--min-workers", "1")[0] == 0


# --- the other commands ---------------------------------------------------------------


@pytest.mark.django_db(databases=BOTH)
def test_deadletters_list_and_revive_act_on_both_databases(two_databases):
    dead_letter("default", topic="a.topic")
    on_other = dead_letter("other", topic="b.topic")

    code, out, _ = run("pgqueue_deadletters", "list", "--json")
    rows = json.loads(out)
    assert sorted((row["database"], row["topic"]) for row in rows) == [
        ("default", "a.topic"),
        ("other", "b.topic"),
    ]
    code, out, _ = run("pgqueue_deadletters", "list")
    assert out.splitlines()[0].split()[:2] == ["DATABASE", "ID"]

    code, out, _ = run("pgqueue_deadletters", "revive", "--topic", "b.topic", "--by", "me")
    assert code == 0
    assert out.splitlines()[1].startswith("other: "), out
    on_other.refresh_from_db(using="other")
    assert on_other.state == DeadLetterState.REVIVED
    revived = Message.objects.using("other").get(pk=on_other.revived_message_id)
    assert (revived.queue, revived.topic) == ("bulk", "b.topic"), "revived on its database"
    assert not Message.objects.using("default").exists()

    with pytest.raises(CommandError, match="--ids names dead letters of one database"):
        run("pgqueue_deadletters", "list", "--ids", str(on_other.pk))
    code, out, _ = run(
        "pgqueue_deadletters", "list", "--ids", str(on_other.pk), "--database", "other"
    )
    assert "b.topic" in out and "DATABASE" not in out


@pytest.mark.django_db(databases=BOTH)
def test_prune_goes_through_both_databases(two_databases):
    code, out, err = run("pgqueue_prune", "--dry-run")
    assert (code, err) == (0, "")
    leads = {line.split(":")[0] for line in out.splitlines()}
    assert leads == {"default", "other"}, out
    code, out, _ = run("pgqueue_prune", "--dry-run", "--database", "other")
    assert out.splitlines()[0].startswith("finished messages (history): 0 due"), out
    with pytest.raises(CommandError, match="not a database of the queues"):
        run("pgqueue_prune", "--database", "elsewhere")


@pytest.mark.django_db(databases=BOTH)
def test_prune_deletes_what_is_due_on_each_database(two_databases):
    long_dead = timezone.now() - datetime.timedelta(days=30)
    for alias in BOTH:
        for name, expires_at in [("dead", long_dead), ("alive", timezone.now())]:
            WorkerHeartbeat.objects.using(alias).create(
                worker_id=f"{alias}-{name}",
                hostname="host",
                pid=1,
                queues=["default"],
                concurrency=1,
                expires_at=expires_at,
            )
    code, out, _ = run("pgqueue_prune")
    assert code == 0
    assert "default: rows of dead workers: 1 deleted" in out.splitlines()
    assert "other: rows of dead workers: 1 deleted" in out.splitlines()
    for alias in BOTH:
        kept = WorkerHeartbeat.objects.using(alias).values_list("worker_id", flat=True)
        assert list(kept) == [f"{alias}-alive"], alias


@pytest.mark.django_db(databases=BOTH)
def test_schedules_and_subscriptions_lists_say_their_database(two_databases):
    from django_pgqueue.models import Subscription

    Subscription.objects.using("other").create(name="on.other", stream="orders")
    code, out, _ = run("pgqueue_subscriptions", "list")
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["DATABASE", "NAME"]
    assert ["other", "on.other", "orders"] == lines[-1].split()[:3], lines
    code, out, _ = run("pgqueue_subscriptions", "pause", "on.other")
    assert out.strip() == "pause: 1 of 1 subscription(s) changed"
    assert Subscription.objects.using("other").get().state == "paused"
    code, out, _ = run("pgqueue_subscriptions", "list", "--database", "default")
    assert "on.other" not in out and "DATABASE" not in out

    code, out, _ = run("pgqueue_schedules", "list", "--json")
    assert all(row["database"] in BOTH for row in json.loads(out))
    code, out, _ = run("pgqueue_schedules", "list")
    assert out.splitlines()[0].split()[:2] == ["DATABASE", "NAME"]


@pytest.mark.django_db(databases=BOTH)
def test_queues_list_and_pause_follow_each_queues_database(two_databases):
    enqueue_bulk({"n": 1})
    code, out, _ = run("pgqueue_queues", "pause", "bulk", "--by", "me")
    assert out.strip() == "queue bulk paused"
    code, out, _ = run("pgqueue_queues", "list", "--json")
    rows = {row["queue"]: row for row in json.loads(out)}
    assert (rows["bulk"]["database"], rows["bulk"]["ready"], rows["bulk"]["paused"]) == (
        "other",
        1,
        True,
    )
    assert (rows["default"]["database"], rows["default"]["paused"]) == ("default", False)
    code, out, _ = run("pgqueue_queues", "list")
    assert out.splitlines()[0].split()[:2] == ["DATABASE", "QUEUE"]


@pytest.mark.django_db(databases=BOTH)
def test_messages_cancel_by_topic_reaches_both_databases(two_databases):
    enqueue("test.record", {"n": 1})
    enqueue_bulk({"n": 2})
    code, out, _ = run("pgqueue_messages", "cancel", "--topic", "test.record", "--dry-run")
    assert [line.split(":")[0] for line in out.splitlines()] == BOTH
    code, out, _ = run(
        "pgqueue_messages", "cancel", "--topic", "test.record", "--queue", "bulk", "--by", "me"
    )
    assert Message.objects.using("other").get().status == "cancelled"
    assert Message.objects.using("default").get().status == "waiting"


# --- metrics ----------------------------------------------------------------------------


def scrape():
    from django_pgqueue.observability.scrape import render_database_metrics

    body, _ = render_database_metrics()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


@pytest.mark.django_db(databases=BOTH)
def test_every_series_says_its_database(two_databases):
    enqueue("test.record", {"n": 1})
    enqueue_bulk({"n": 2})
    samples = scrape()
    for alias, queue in [("default", "default"), ("other", "bulk")]:
        key = (("database", alias), ("queue", queue), ("state", "ready"), ("topic", "test.record"))
        assert samples[("pgqueue_messages", key)] == 1
        labels = (("database", alias), ("queue", queue))
        assert samples[("pgqueue_workers_alive", labels)] == 0, "its configured queue, empty"
        assert samples[("pgqueue_database_up", (("database", alias),))] == 1
    assert ("pgqueue_workers_alive", (("database", "default"), ("queue", "bulk"))) not in samples, (
        "a queue is reported on its own database only"
    )
    assert all(dict(labels).get("database") in BOTH for _, labels in samples), (
        "every series has the label"
    )


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_a_database_that_is_down_reports_only_its_up_0(two_databases):
    enqueue("test.record", {"n": 1})
    with unreachable("other"):
        samples = scrape()
    assert samples[("pgqueue_database_up", (("database", "other"),))] == 0
    assert samples[("pgqueue_database_up", (("database", "default"),))] == 1
    assert {dict(labels)["database"] for _, labels in samples} == set(BOTH)
    assert [name for name, labels in samples if dict(labels)["database"] == "other"] == [
        "pgqueue_database_up"
    ]


# --- health -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=BOTH)
def test_health_has_a_part_per_database_and_a_database_down_fails_only_its_own(
    two_databases, client, settings
):
    settings.PGQUEUE = {**TWO, "HEALTH_ACCESS": "open"}
    beat("default", "w-default", ["default"])
    beat("other", "w-bulk", ["bulk"])
    response = client.get("/pgqueue/health")
    body = response.json()
    assert (response.status_code, body["status"], body["failing"]) == (200, "ok", [])
    assert body["databases"]["default"]["queues"] == {"default": {"workers_alive": 1}}
    assert body["databases"]["other"]["queues"] == {"bulk": {"workers_alive": 1}}

    with unreachable("other"):
        response = client.get("/pgqueue/health")
    body = response.json()
    assert (response.status_code, body["failing"]) == (503, ["other"])
    assert body["databases"]["default"]["status"] == "ok", "default's part still passes"
    assert body["databases"]["other"]["database"] == "unreachable"
    assert body["problems"] == ["database 'other': the queue database does not answer"]
    assert "127.0.0.1" not in json.dumps(body)


@pytest.mark.django_db(databases=BOTH)
def test_health_with_one_database_keeps_its_body():
    with override_settings(PGQUEUE={"HEALTH_ACCESS": "open"}):
        from django_pgqueue.observability.health import system_health

        healthy, body = system_health()
    assert not healthy
    assert set(body) == {"status", "database", "queues", "subscriptions", "problems"}


# --- the admin --------------------------------------------------------------------------

DEAD_LETTERS = "/admin/django_pgqueue/deadletter/"
MESSAGES = "/admin/django_pgqueue/message/"


@pytest.fixture
def operator(client, django_user_model):
    """A logged-in superuser's client."""
    client.force_login(django_user_model.objects.create_superuser("operator", "", "x"))
    return client


def listed(response):
    assert response.status_code == 200, response.content[:500]
    return [(obj._state.db, obj.pk) for obj in response.context["cl"].result_list]


@pytest.mark.django_db(databases=BOTH)
def test_dead_letters_changelist_chooses_its_database_with_a_filter(two_databases, operator):
    here = dead_letter("default", topic="a.topic")
    there = dead_letter("other", topic="b.topic")

    response = operator.get(DEAD_LETTERS)
    assert listed(response) == [("default", here.pk)], "the first database by default"
    filters = [spec.title for spec in response.context["cl"].filter_specs]
    assert filters[0] == "database"
    page = response.content.decode()
    assert "By database" in page and 'class="column-database_column"' in page

    response = operator.get(DEAD_LETTERS + "?database=other")
    assert listed(response) == [("other", there.pk)]
    choices = list(response.context["cl"].filter_specs[0].choices(response.context["cl"]))
    assert [(c["display"], c["selected"]) for c in choices] == [
        ("default", False),
        ("other", True),
    ]
    # The object links keep the database (Django's preserved filters).
    change = f"{DEAD_LETTERS}{there.pk}/change/?_changelist_filters=database%3Dother"
    assert change in response.content.decode()
    response = operator.get(change)
    assert response.status_code == 200
    assert response.context["original"].topic == "b.topic"


@pytest.mark.django_db(databases=BOTH)
def test_an_admin_action_on_the_other_database_acts_there(two_databases, operator):
    there = dead_letter("other", topic="b.topic")
    same_id = dead_letter("default", topic="a.topic", message_id=2)
    post = {"action": "revive", "index": 0, "_selected_action": [there.pk]}
    response = operator.post(DEAD_LETTERS + "?database=other", post, follow=True)
    assert response.status_code == 200
    there.refresh_from_db(using="other")
    assert there.state == DeadLetterState.REVIVED
    assert Message.objects.using("other").get(pk=there.revived_message_id).topic == "b.topic"
    same_id.refresh_from_db(using="default")
    assert same_id.state == DeadLetterState.NEW, "default's rows are left alone"
    assert response.redirect_chain[-1][0].endswith("?database=other"), response.redirect_chain


@pytest.mark.django_db(databases=BOTH)
def test_messages_changelist_shows_the_other_databases_messages(two_databases, operator):
    enqueue("test.record", {"n": 1})
    enqueue_bulk({"n": 2})
    assert [db for db, _ in listed(operator.get(MESSAGES))] == ["default"]
    rows = listed(operator.get(MESSAGES + "?database=other"))
    assert [db for db, _ in rows] == ["other"]
    message = Message.objects.using("other").get()
    response = operator.get(f"{MESSAGES}{message.pk}/change/?_changelist_filters=database%3Dother")
    assert (response.status_code, response.context["original"].queue) == (200, "bulk")


@pytest.mark.django_db(databases=BOTH)
def test_a_bad_database_choice_falls_back_to_the_first(two_databases, operator):
    dead_letter("default")
    response = operator.get(DEAD_LETTERS + "?database=nowhere")
    assert [db for db, _ in listed(response)] == ["default"]


@pytest.mark.django_db(databases=BOTH)
def test_the_queues_and_overview_pages_show_both_databases(two_databases, operator):
    enqueue("test.record", {"n": 1})
    enqueue_bulk({"n": 2})
    dead_letter("other")
    response = operator.get("/admin/django_pgqueue/queuestate/")
    assert response.status_code == 200
    rows = {row.name: (row.database, row.ready) for row, _ in response.context["rows"]}
    assert rows == {"default": ("default", 1), "bulk": ("other", 1)}
    assert '<td class="pgqueue-database">other</td>' in response.content.decode()

    response = operator.get("/admin/django_pgqueue/queuestate/bulk/pause/")
    assert response.status_code == 405, "pausing is a POST"
    operator.post("/admin/django_pgqueue/queuestate/bulk/pause/")
    from django_pgqueue.models import QueueState

    assert QueueState.objects.using("other").get(name="bulk").paused, "kept on bulk's database"
    assert not QueueState.objects.using("default").filter(name="bulk").exists()

    response = operator.get("/admin/django_pgqueue/finishedmessage/overview/")
    assert response.status_code == 200
    queues = [(q["database"], q["name"], q["depth"]["ready"]) for q in response.context["queues"]]
    assert queues == [("default", "default", 1), ("other", "bulk", 1)]
    assert response.context["total"]["depth"]["ready"] == 2
    assert ("other", "transient", 1) in response.context["dead_by_category"]
    assert "Queue bulk (database other)" in response.content.decode()


@pytest.mark.django_db(databases=BOTH)
def test_with_one_database_there_is_no_database_filter_nor_column(operator):
    dead_letter("default")
    response = operator.get(DEAD_LETTERS)
    assert "database" not in [spec.title for spec in response.context["cl"].filter_specs]
    assert "column-database_column" not in response.content.decode()
