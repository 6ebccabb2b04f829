"""A queue's partitions seen (issue 38): how many have ready messages and
the busiest by ready and by running messages, in ``pgqueue_status`` (text
and JSON), ``pgqueue_queues list`` and the admin's Queues page; no metric
label per partition (their number has no bound)."""

import datetime
import io
import json

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_pgqueue import enqueue, enqueue_many, lifecycle
from django_pgqueue.observability import stats

pytestmark = pytest.mark.django_db(transaction=True)

QUEUE = "tenants"


def fill():
    """tenant:b 3 (2 of them then claimed: running), tenant:a 5 ready,
    tenant:c 1 delayed, and 3 without a key (not a partition here)."""
    enqueue_many([{"payload": {"i": i}} for i in range(3)], topic="t.b", queue=QUEUE,
                 partition_key="tenant:b")  # fmt: skip
    lifecycle.ack_and_claim_rows([], [QUEUE], 2, "worker-1", 60.0)
    enqueue_many([{"payload": {"i": i}} for i in range(5)], topic="t.a", queue=QUEUE,
                 partition_key="tenant:a")  # fmt: skip
    enqueue("t.c", {}, queue=QUEUE, partition_key="tenant:c", delay=3600)
    enqueue_many([{"payload": {"i": i}} for i in range(3)], topic="t.none", queue=QUEUE)


def test_partitions_by_queue_counts_the_ready_ones_and_names_the_busiest():
    fill()
    enqueue("plain", {}, queue="plain")
    found = stats.partitions_by_queue()
    assert set(found) == {QUEUE}  # a queue without keys has no partitions
    partitions = found[QUEUE]
    assert partitions.ready == 2  # a and b; c is delayed
    assert partitions.top_ready == [("tenant:a", 5), ("tenant:b", 1)]
    assert partitions.top_running == [("tenant:b", 2)]
    # An hour later c is ready too.
    later = stats.partitions_by_queue(now=timezone.now() + datetime.timedelta(hours=2))
    assert later[QUEUE].ready == 3 and ("tenant:c", 1) in later[QUEUE].top_ready


def test_only_the_busiest_five_are_named():
    for i in range(7):
        enqueue_many([{}] * (i + 1), topic="t", queue=QUEUE, partition_key=f"p{i}")
    partitions = stats.partitions_by_queue()[QUEUE]
    assert partitions.ready == 7
    assert partitions.top_ready == [(f"p{i}", i + 1) for i in range(6, 1, -1)]
    assert partitions.top_running == []


def test_status_and_queues_list_show_them():
    fill()
    out = io.StringIO()
    call_command("pgqueue_status", "--queue", QUEUE, stdout=out)
    assert (
        "  partitions: 2 with ready messages; most ready: tenant:a (5), tenant:b (1); "
        "most running: tenant:b (2)"
    ) in out.getvalue()
    out = io.StringIO()
    call_command("pgqueue_status", "--queue", QUEUE, "--json", stdout=out)
    assert json.loads(out.getvalue())["queues"][QUEUE]["partitions"] == {
        "ready": 2,
        "top_ready": [{"partition": "tenant:a", "count": 5}, {"partition": "tenant:b", "count": 1}],
        "top_running": [{"partition": "tenant:b", "count": 2}],
    }
    out = io.StringIO()
    call_command("pgqueue_queues", "list", "--json", stdout=out)
    rows = {row["queue"]: row for row in json.loads(out.getvalue())}
    assert rows[QUEUE]["partitions"]["top_running"] == [{"partition": "tenant:b", "count": 2}]
    assert rows["default"]["partitions"] is None


def test_the_queues_page_shows_them(admin_client):
    fill()
    page = admin_client.get("/admin/django_pgqueue/queuestate/").content.decode()
    assert "2 with ready messages" in page
    assert "most ready: tenant:a (5), tenant:b (1)" in page
    assert "most running: tenant:b (2)" in page
