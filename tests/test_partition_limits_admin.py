"""The limits of named partitions, set at run time, against the real
database: the writes of ``controls`` (``set_partition_limits``,
``clear_partition_limits``) with their NOTIFY, observed from a second
connection; ``pgqueue_queues partition-limits`` and ``list``; the admin's
partition limits page and the Queues page. Each bad input is refused before
anything is written. How the claim enforces them: the tests of the claim."""

import datetime
import io
import json

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings

from django_pgqueue import QueueControlError, controls
from django_pgqueue.conf import Limits, Rate
from django_pgqueue.models import PartitionLimit, QueueState
from django_pgqueue.sql import probe

from .conftest import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)

# A queue whose partitions the settings limit, and one they do not.
QUEUES = {"reports": {"concurrency": 20, "partition": {"concurrency": 2}}, "plain": {}}


def control_listener():
    conn = raw_connection(autocommit=True)
    conn.execute("LISTEN django_pgqueue_control")
    return conn


def received(conn, timeout=1.0):
    return [n.payload for n in conn.notifies(timeout=timeout, stop_after=10)]


def stored():
    """Every PartitionLimit row as (queue, key, concurrency, rate, changed_by)."""
    return sorted(
        PartitionLimit.objects.values_list(
            "queue", "partition_key", "concurrency", "rate", "changed_by"
        )
    )


def fingerprint():
    """The run-time state's fingerprint of an idle worker's poll (its last column)."""
    with connection.cursor() as cursor:
        cursor.execute(probe.probe_statement(connection), [["reports"]])
        return cursor.fetchone()[-1]


# --- controls ---------------------------------------------------------------------------


def test_set_update_and_clear_a_partitions_limits_tell_the_workers():
    with control_listener() as conn:
        controls.set_partition_limits("reports", "tenant:42", concurrency=5, rate="100/m", by="ops")
        assert received(conn) == ["queues"], "one NOTIFY, at the commit of the change"
        assert stored() == [("reports", "tenant:42", 5, "100/m", "ops")]

        controls.set_partition_limits("reports", "tenant:42", rate="5/s", by="alice")
        assert received(conn) == ["queues"]
        assert stored() == [("reports", "tenant:42", None, "5/s", "alice")], (
            "a second set replaces both limits (None: no concurrency limit), not only one"
        )

        assert controls.clear_partition_limits("reports", "tenant:42", by="ops") is True
        assert received(conn) == ["queues"]
        assert controls.clear_partition_limits("reports", "tenant:42") is False
        assert received(conn, 0.3) == [], "nothing removed, nothing to tell"
    assert stored() == []


def test_every_write_changes_the_fingerprint_of_the_workers_poll():
    controls.set_partition_limits("reports", "tenant:42", concurrency=5)
    first = fingerprint()
    controls.set_partition_limits("reports", "tenant:42", concurrency=5)
    second = fingerprint()
    assert second != first, "the same limits written again: updated_at is new"
    controls.clear_partition_limits("reports", "tenant:42")
    assert fingerprint() not in (first, second)


@pytest.mark.parametrize("key", [None, ""])
def test_none_and_the_empty_key_name_the_default_partition(key):
    controls.set_partition_limits("reports", key, concurrency=1)
    controls.set_partition_limits("reports", "" if key is None else None, concurrency=3)
    assert stored() == [("reports", "", 3, "", "")], "one row, for messages without a key"
    assert controls.clear_partition_limits("reports", key) is True


def test_partition_limits_are_listed_by_queue_and_key_and_mark_the_queue():
    controls.set_partition_limits("reports", "b", rate="1/s")
    controls.set_partition_limits("reports", None)  # none at all, whatever the settings say
    controls.set_partition_limits("alpha", "a", concurrency=4)
    rows = controls.partition_limits()
    assert [(row.queue, row.partition_key) for row in rows] == [
        ("alpha", "a"),
        ("reports", ""),
        ("reports", "b"),
    ]
    assert [row.partition_key for row in controls.partition_limits("reports")] == ["", "b"]
    assert controls.partition_limits_of(rows[2]) == Limits(None, Rate(1, 1))
    assert not controls.partition_limits_of(rows[1]), "no limit of either kind"
    with override_settings(PGQUEUE={"QUEUES": QUEUES}):
        limits = controls.current().limits
        assert limits["alpha"] == Limits(named_partitions=True)
        assert limits["reports"] == Limits(
            20, None, partition=Limits(2, None), named_partitions=True
        )
        assert "plain" not in limits
        assert controls.partition_limits_for("reports") == Limits(2, None)
        assert controls.partition_limits_for("plain") == Limits()
        assert controls.partition_limits_for("reports", rows[2]) == Limits(None, Rate(1, 1))


@pytest.mark.parametrize(
    ("queue", "key", "limits", "says"),
    [
        ("bad name", "t", {"concurrency": 1}, "may contain only letters"),
        ("", "t", {}, "queue name must not be empty"),
        ("reports", "x" * 256, {}, "256 characters long; the limit is 255"),
        ("reports", 42, {}, "partition_key must be a non-empty string"),
        ("reports", "a\x00b", {}, "partition_key must not contain a NUL"),
        ("reports", "t", {"concurrency": 0}, "concurrency must be a whole number from 1"),
        ("reports", "t", {"concurrency": True}, "concurrency must be a whole number"),
        ("reports", "t", {"concurrency": 1_000_001}, "concurrency must be"),
        ("reports", "t", {"rate": "fast"}, "rate must be a rate like"),
        ("reports", "t", {"rate": ""}, "rate must be a rate like"),
        ("reports", "t", {"rate": "0/s"}, "rate must be a rate like"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written_nor_told(queue, key, limits, says):
    controls.set_partition_limits("reports", "kept", concurrency=7)
    with control_listener() as conn:
        with pytest.raises(QueueControlError, match=says):
            controls.set_partition_limits(queue, key, **limits)
        if not limits:
            with pytest.raises(QueueControlError, match=says):
                controls.clear_partition_limits(queue, key)
        assert received(conn, 0.3) == []
    assert stored() == [("reports", "kept", 7, "", "")]


@override_settings(PGQUEUE={"NOTIFY": False})
def test_poll_only_mode_sends_no_notification():
    with control_listener() as conn:
        controls.set_partition_limits("reports", "t", concurrency=1)
        controls.clear_partition_limits("reports", "t")
        assert received(conn, 0.3) == []


# --- pgqueue_queues -----------------------------------------------------------------------


def run(*args):
    out = io.StringIO()
    call_command("pgqueue_queues", *args, stdout=out)
    return out.getvalue()


@override_settings(PGQUEUE={"QUEUES": QUEUES})
def test_the_command_sets_shows_and_clears_a_partitions_limits():
    out = run("partition-limits", "reports", "tenant:42", "--concurrency", "5", "--rate", "30/m")
    assert out == "queue reports, partition tenant:42: limits concurrency 5, rate 30/m (run time)\n"
    assert stored()[0][4], "by: the login name when --by is not given"
    assert run("partition-limits", "reports", "--default-partition", "--none", "--by", "ops") == (
        "queue reports, the default partition: limits none (run time)\n"
    )
    assert [row[:4] for row in stored()] == [
        ("reports", "", None, ""),
        ("reports", "tenant:42", 5, "30/m"),
    ]
    assert run("partition-limits", "reports", "other") == (
        "queue reports, partition other: limits concurrency 2 (settings)\n"
    ), "a partition without limits of its own has the settings' for each"

    table = run("partition-limits").splitlines()
    assert table[0].split() == ["QUEUE", "PARTITION", "LIMITS", "FROM"]
    assert [line.split()[:2] for line in table[1:]] == [
        ["reports", "(each)"],
        ["reports", "(default)"],
        ["reports", "tenant:42"],
    ]
    assert "concurrency 2" in table[1] and table[1].rstrip().endswith("settings")
    assert "run time, by ops" in table[2]
    assert run("partition-limits", "plain").splitlines()[1].split() == [
        "plain",
        "(each)",
        "none",
        "settings",
    ]

    assert run("partition-limits", "reports", "tenant:42", "--settings") == (
        "queue reports, partition tenant:42: limits concurrency 2 (settings)\n"
    )
    assert run("partition-limits", "reports", "tenant:42", "--settings") == (
        "queue reports: partition tenant:42 had no limits of its own\n"
        "queue reports, partition tenant:42: limits concurrency 2 (settings)\n"
    )
    assert stored() == [("reports", "", None, "", "ops")]


@override_settings(PGQUEUE={"QUEUES": QUEUES})
def test_list_shows_each_queues_partition_limits():
    for number in range(7):
        controls.set_partition_limits("reports", f"t{number}", concurrency=number + 1)
    controls.set_partition_limits("elsewhere", None, rate="9/h", by="ops")
    lines = run("list").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("reports"))
    assert "each partition concurrency 2" in lines[at]
    assert lines[at + 1] == (
        "  partitions' own limits: t0: concurrency 1; t1: concurrency 2; t2: concurrency 3; "
        "t3: concurrency 4; t4: concurrency 5; and 2 more"
    )
    assert "  partitions' own limits: (default): rate 9/h" in lines, (
        "a queue known only by its partition limits is listed too"
    )

    rows = {row["queue"]: row for row in json.loads(run("list", "--json"))}
    assert rows["reports"]["partition"] == {"concurrency": 2, "rate": None}
    assert [p["partition"] for p in rows["reports"]["partition_limits"]] == [
        f"t{n}" for n in range(7)
    ]
    (default,) = rows["elsewhere"]["partition_limits"]
    assert (default["partition"], default["concurrency"], default["rate"]) == (None, None, "9/h")
    assert default["changed_by"] == "ops" and datetime.datetime.fromisoformat(default["updated_at"])
    assert rows["plain"]["partition"] is None and rows["plain"]["partition_limits"] == []


def test_settings_is_the_subcommands_option_not_djangos_from_the_shell(capsys):
    """manage.py reads its own --settings (the settings module) from the
    options it is given: a subcommand's --settings flag must not land where
    Django looks for it."""
    from django.core.management import ManagementUtility

    controls.set_limits("reports", concurrency=1)
    controls.set_partition_limits("reports", "t", concurrency=1)
    for args in (
        ["limit", "reports", "--settings"],
        ["partition-limits", "reports", "t", "--settings"],
    ):
        ManagementUtility(["manage.py", "pgqueue_queues", *args]).execute()
    assert capsys.readouterr().out.splitlines() == [
        "queue reports: limits none",
        "queue reports, partition t: limits none (settings)",
    ]
    assert stored() == [] and not QueueState.objects.get(name="reports").limits_set


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("reports", "t", "--rate", "fast"), "must be a rate like"),
        (("reports", "t", "--concurrency", "0"), "must be a whole number from 1"),
        (("reports", "t", "--concurrency", "x"), "'x' is not a whole number"),
        (("reports", "--rate", "5/s"), "name the queue and the partition to change"),
        (("--none",), "name the queue and the partition to change"),
        (("--default-partition",), "name the queue: NAME --default-partition"),
        (("reports", "t", "--default-partition", "--none"), "KEY or --default-partition"),
        (("reports", "t", "--none", "--settings"), "one of the three"),
        (("reports", "t", "--rate", "5/s", "--none"), "one of the three"),
        (("reports", "", "--none"), "must not be empty \\(the default partition"),
        (("reports", "x" * 256, "--none"), "256 characters long"),
        (("reports", "a\x00b", "--none"), "NUL"),
        (("bad name", "t", "--none"), "may contain only letters"),
    ],
)
def test_the_command_refuses_bad_input_and_writes_nothing(args, says):
    with pytest.raises(CommandError, match=says):
        run("partition-limits", *args)
    assert stored() == []
    assert not QueueState.objects.exists()


# --- the admin ----------------------------------------------------------------------------

QUEUES_PAGE = "/admin/django_pgqueue/queuestate/"
PAGE = f"{QUEUES_PAGE}reports/partition-limits/"


@pytest.fixture
def staff():
    """A client logged in as the staff user "ops" with exactly the given
    permissions (codenames)."""

    def make(*codenames):
        user, _ = User.objects.get_or_create(username="ops", defaults={"is_staff": True})
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        client = Client()
        client.force_login(user)
        return client

    return make


def logged():
    return list(
        LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(PartitionLimit))
        .order_by("pk")
        .values_list("action_flag", "object_repr", "change_message")
    )


def messages_of(response):
    return [str(m) for m in response.context["messages"]]


def test_without_the_change_permission_nothing_is_shown_nor_written(staff):
    client = staff("view_queuestate")
    assert client.get(PAGE).status_code == 403
    post = {"partition_key": "t", "source": "set", "concurrency": "3"}
    assert client.post(PAGE, post).status_code == 403
    assert stored() == []
    controls.set_partition_limits("reports", "<b>t</b>", concurrency=3)
    html = client.get(QUEUES_PAGE).content.decode()
    assert "partitions' own: &lt;b&gt;t&lt;/b&gt;: concurrency 3" in html, (
        "anyone who sees the page sees them, escaped"
    )
    assert "/partition-limits/" not in html, "the link needs the change permission"


@override_settings(PGQUEUE={"QUEUES": QUEUES})
def test_the_form_sets_changes_and_clears_a_partitions_limits_and_logs_each(staff):
    client = staff("view_queuestate", "change_queuestate")
    queues = client.get(QUEUES_PAGE).content.decode()
    assert f'href="{PAGE}"' in queues

    page = client.get(PAGE)
    assert page.status_code == 200
    assert "The settings give each partition of queue reports: concurrency 2." in (
        page.content.decode()
    )
    assert page.context["form"]["source"].value() == "settings"

    response = client.post(
        PAGE,
        {"partition_key": "tenant:42", "source": "set", "concurrency": "5", "rate": "30/m"},
        follow=True,
    )
    assert response.redirect_chain == [(PAGE, 302)]
    assert messages_of(response) == [
        "Queue reports, partition tenant:42: limits concurrency 5, rate 30/m (run time)."
    ]
    assert stored() == [("reports", "tenant:42", 5, "30/m", "ops")]
    assert [(row.partition_key, str(limits)) for row, limits in response.context["own"]] == [
        ("tenant:42", "concurrency 5, rate 30/m")
    ]
    html = response.content.decode()
    assert 'href="?partition=tenant%3A42"' in html

    change = client.get(PAGE, {"partition": "tenant:42"}).context["form"]
    assert [change[f].value() for f in ("partition_key", "source", "concurrency", "rate")] == [
        "tenant:42",
        "set",
        5,
        "30/m",
    ]
    response = client.post(PAGE, {"partition_key": "", "source": "set"}, follow=True)
    assert messages_of(response) == [
        "Queue reports, the default partition: limits none (run time)."
    ], "an empty key: the default partition; empty limits: none"
    assert stored()[0] == ("reports", "", None, "", "ops")

    response = client.post(PAGE, {"partition_key": "tenant:42", "source": "settings"}, follow=True)
    assert messages_of(response) == [
        "Queue reports, partition tenant:42: limits concurrency 2 (settings)."
    ]
    assert stored() == [("reports", "", None, "", "ops")]
    again = client.post(PAGE, {"partition_key": "tenant:42", "source": "settings"}, follow=True)
    assert messages_of(again) == ["Queue reports: partition tenant:42 had no limits of its own."]

    assert logged() == [
        (CHANGE, "reports: tenant:42", "Limits of partition tenant:42 set: concurrency 5, "
         "rate 30/m (admin)"),
        (CHANGE, "reports: (default partition)", "Limits of the default partition set: "
         "concurrency None, rate None (admin)"),
        (DELETION, "reports: tenant:42", "Limits of partition tenant:42 from the settings "
         "(admin)"),
    ]  # fmt: skip

    queues = client.get(QUEUES_PAGE)
    (row,) = [row for row, _age in queues.context["rows"] if row.name == "reports"]
    assert row.partition_limits_text == "(default): none"


@pytest.mark.parametrize(
    ("post", "field", "says"),
    [
        ({"source": "set", "rate": "lots"}, "rate", "The rate must be a rate like"),
        ({"source": "set", "concurrency": "0"}, "concurrency", "greater than or equal to 1"),
        ({"source": "set", "concurrency": "x"}, "concurrency", "Enter a whole number"),
        ({"source": "maybe"}, "source", "Select a valid choice"),
        ({"source": "set", "partition_key": "x" * 256}, "partition_key", "at most 255"),
        ({"source": "set", "partition_key": "a\x00b"}, "partition_key", "Null characters"),
    ],
)
def test_bad_form_input_shows_the_error_and_writes_nothing(staff, post, field, says):
    client = staff("view_queuestate", "change_queuestate")
    response = client.post(PAGE, {"partition_key": "t", **post})
    assert response.status_code == 200, "the form again, with its error"
    errors = response.context["form"].errors
    assert says in " ".join(errors[field]), errors
    assert stored() == [] and logged() == []


def test_a_bad_queue_name_in_the_address_is_not_found(staff):
    client = staff("view_queuestate", "change_queuestate")
    response = client.post(
        f"{QUEUES_PAGE}bad%20name/partition-limits/",
        {"partition_key": "t", "source": "set"},
    )
    assert response.status_code == 404
    assert stored() == []
