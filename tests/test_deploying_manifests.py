"""docs/howto/deploying.rst, "On Kubernetes", and docs/howto/autoscaling.rst:
every manifest there, checked.

Each ``.. code-block:: yaml`` of the section is parsed, and what it says is
held against the code it describes: the worker Deployment's arguments parse
with ``pgqueue_worker``'s own parser and its probes reach the health
server's path on a port the container declares; each KEDA ScaledObject
scales that Deployment; the ``postgresql`` trigger's query runs on the test
database and counts exactly the ready messages of the Deployment's queues;
the ``prometheus`` trigger's query selects a metric the project exports, by
labels it has, and (evaluated over the exported samples) counts the same.

KEDA is not installed here: the trigger fields allowed are the ones its
scalers read (``postgreSQLMetadata`` in kedacore/keda
``pkg/scalers/postgresql_scaler.go``, and the parameter list of the
Prometheus scaler's page at keda.sh), listed below, so that a field KEDA
would not read fails here rather than in a cluster.
"""

import datetime
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from django.db import connection
from django.utils import timezone

from django_pgqueue.management.commands.pgqueue_worker import Command as WorkerCommand
from django_pgqueue.models import Message, Status
from django_pgqueue.observability import stats
from django_pgqueue.observability.health import WorkerHealthServer
from django_pgqueue.observability.scrape import DatabaseCollector

HOWTO = Path(__file__).resolve().parent.parent / "docs" / "howto"
PAGE = HOWTO / "deploying.rst"
SECTION = "On Kubernetes"
# The ScaledObjects: every YAML block of this page scales PAGE's Deployment.
AUTOSCALING = HOWTO / "autoscaling.rst"

# The trigger metadata and TriggerAuthentication parameters each scaler reads.
KEDA_FIELDS = {
    "postgresql": {
        "metadata": {
            "query", "targetQueryValue", "activationTargetQueryValue", "connectionFromEnv",
            "host", "port", "userName", "dbName", "sslmode", "passwordFromEnv",
        },
        "auth": {"connection", "password", "host", "port", "userName", "dbName", "sslmode"},
    },
    "prometheus": {
        "metadata": {
            "serverAddress", "query", "threshold", "activationThreshold", "namespace",
            "customHeaders", "ignoreNullValues", "queryParameters", "unsafeSsl", "authModes",
        },
        "auth": {
            "bearerToken", "username", "password", "ca", "cert", "key",
            "customAuthHeader", "customAuthValue",
        },
    },
}  # fmt: skip

CODE_BLOCK = re.compile(r"^(?P<indent>\s*)\.\. code-block::\s*(?P<lang>\S+)\s*$")
SELECTOR = re.compile(r"\b(pgqueue_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
LIMIT = re.compile(r"\bLIMIT\s+(\d+)", re.IGNORECASE)


def section_lines(text, title):
    """The lines of the section ``title`` (a ``===`` heading), up to the next one."""
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines[:-1]) if line == title and set(lines[i + 1]) == {"="}),
        None,
    )
    assert start is not None, f"{PAGE.name} has no section {title!r}"
    end = next(
        (
            i
            for i in range(start + 2, len(lines) - 1)
            if lines[i] and set(lines[i + 1]) == {"="} and len(lines[i + 1]) >= len(lines[i])
        ),
        len(lines),
    )
    return start, lines[start:end]


def yaml_blocks():
    """``[(where, text), ...]``: each YAML block of the section and of the
    autoscaling page, dedented, with the page and line of its directive."""
    start, lines = section_lines(PAGE.read_text(encoding="utf-8"), SECTION)
    blocks = [(f"{PAGE.name}:{line}", text) for line, text in blocks_of(lines, start)]
    page = AUTOSCALING.read_text(encoding="utf-8").splitlines()
    blocks += [(f"{AUTOSCALING.name}:{line}", text) for line, text in blocks_of(page, 0)]
    return blocks


def blocks_of(lines, start):
    """``[(line, text), ...]``: each YAML block of ``lines`` (which start at
    line ``start + 1`` of their page), dedented."""
    blocks = []
    for i, line in enumerate(lines):
        match = CODE_BLOCK.match(line)
        if not match or match["lang"] != "yaml":
            continue
        indent = len(match["indent"])
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            body.append(following)
        blocks.append((start + i + 1, textwrap.dedent("\n".join(body)).strip("\n")))
    return blocks


@pytest.fixture(scope="module")
def manifests():
    """Every Kubernetes object of the section, by kind, each with its line."""
    found = {}
    blocks = yaml_blocks()
    assert len(blocks) >= 4, "expected the Deployment, the scrape config and two ScaledObjects"
    for line, text in blocks:
        for document in yaml.safe_load_all(text):
            assert document, f"{line}: an empty YAML document"
            if "kind" in document:
                found.setdefault(document["kind"], []).append((line, document))
    return found


@pytest.fixture(scope="module")
def deployment(manifests):
    (line, found), *others = manifests["Deployment"]
    assert not others, "the section shows one worker Deployment"
    return found


@pytest.fixture(scope="module")
def worker_options(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command, *args = container["args"]
    assert command == "pgqueue_worker"
    return WorkerCommand().create_parser("manage.py", command).parse_args(args)


def triggers(manifests, kind):
    return [
        (line, scaled, trigger)
        for line, scaled in manifests["ScaledObject"]
        for trigger in scaled["spec"]["triggers"]
        if trigger["type"] == kind
    ]


def test_the_probes_reach_the_health_server(deployment, worker_options):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["health"] == worker_options.health_port
    assert ports["metrics"] == worker_options.metrics_port
    assert worker_options.http_host == "0.0.0.0", "the kubelet reaches the pod on its IP"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] in ports or get["port"] in ports.values(), (
            f"{probe} asks port {get['port']!r}, which the container does not declare"
        )
        assert get["path"] in WorkerHealthServer.PATHS, f"{probe}: no such health path"


def test_the_grace_period_covers_the_shutdown_timeout(deployment, worker_options):
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > worker_options.shutdown_timeout, (
        "Kubernetes would kill the worker before it hands back its messages"
    )


def test_each_scaled_object_scales_the_deployment(manifests, deployment):
    scaled_objects = manifests["ScaledObject"]
    assert {
        trigger["type"] for _, scaled in scaled_objects for trigger in scaled["spec"]["triggers"]
    } == {
        "postgresql",
        "prometheus",
    }
    auths = {found["metadata"]["name"]: found for _, found in manifests["TriggerAuthentication"]}
    for line, scaled in scaled_objects:
        spec = scaled["spec"]
        where = line
        assert scaled["apiVersion"] == "keda.sh/v1alpha1", where
        assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"], (
            f"{where}: scaleTargetRef names no Deployment of the section"
        )
        assert 0 <= spec.get("minReplicaCount", 0) <= spec["maxReplicaCount"], where
        for trigger in spec["triggers"]:
            fields = KEDA_FIELDS[trigger["type"]]
            metadata = trigger["metadata"]
            assert set(metadata) <= fields["metadata"], (
                f"{where}: KEDA's {trigger['type']} scaler reads no "
                f"{sorted(set(metadata) - fields['metadata'])}"
            )
            # KEDA's trigger metadata is a map of strings: a bare number is refused.
            assert all(isinstance(value, str) for value in metadata.values()), (
                f"{where}: quote every value under metadata"
            )
            if "authenticationRef" in trigger:
                auth = auths[trigger["authenticationRef"]["name"]]
                assert auth["apiVersion"] == "keda.sh/v1alpha1"
                parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
                assert parameters <= fields["auth"], f"{where}: {parameters - fields['auth']}"


@pytest.fixture
def messages(db, make_message):
    """Rows in every state around the queues the Deployment serves; the
    ready ones of ``default`` and ``mail`` are 3 + 2."""
    now = timezone.now()
    past, future = now - datetime.timedelta(minutes=1), now + datetime.timedelta(hours=1)
    for queue, ready in (("default", 3), ("mail", 2), ("bulk", 4)):
        for _ in range(ready):
            make_message(queue=queue, run_at=past)
        make_message(queue=queue, run_at=future)  # delayed
        make_message(queue=queue, run_at=past, status=Status.PROCESSING)
        make_message(queue=queue, run_at=past, status=Status.BLOCKED, group_key=f"g-{queue}")
        make_message(queue=queue, run_at=past, status=Status.CANCELLED)
    assert Message.objects.count() == 9 + 3 * 4


def ready_of(queues):
    """The ready messages of ``queues`` as the project counts them (metrics, status)."""
    return sum(
        count
        for queue, _topic, state, count in stats.messages_by_queue_topic_state()
        if queue in queues and state == stats.READY
    )


def test_the_postgresql_query_counts_the_ready_messages(messages, manifests, worker_options):
    (line, scaled, trigger), *others = triggers(manifests, "postgresql")
    assert not others
    query = trigger["metadata"]["query"]
    queues = list(worker_options.queues)
    assert ready_of(queues) == 5
    with connection.cursor() as cursor:
        cursor.execute(query)
        rows = cursor.fetchall()
    assert rows == [(5,)], f"{line}: the query returned {rows}, not one row [(5,)]"

    # The bound: as many as the most replicas are targeted at, no fewer.
    (limit,) = LIMIT.findall(query)
    spec = scaled["spec"]
    assert int(limit) >= spec["maxReplicaCount"] * float(trigger["metadata"]["targetQueryValue"])


def test_the_postgresql_query_reads_the_due_index(messages, manifests):
    ((_, _, trigger),) = triggers(manifests, "postgresql")
    with connection.cursor() as cursor:
        # The table is tiny: forbid the sequential scan to see the index
        # the planner would take on a large one.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + trigger["metadata"]["query"])
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "pgqueue_msg_due_idx" in plan, plan


def test_the_prometheus_query_selects_an_exported_metric(messages, manifests, worker_options):
    ((line, _, trigger),) = triggers(manifests, "prometheus")
    families = {family.name: family for family in DatabaseCollector().collect()}
    selectors = SELECTOR.findall(trigger["metadata"]["query"])
    assert len(selectors) == 1, f"{line}: expected one pgqueue_ selector"
    ((name, matchers),) = selectors
    assert name in families, f"{line}: the project exports no {name}"
    samples = families[name].samples
    labels = set().union(*(sample.labels for sample in samples))
    selected = samples
    for label, op, value in MATCHER.findall(matchers):
        assert label in labels, f"{line}: {name} has no label {label!r}"
        assert op in ("=", "=~"), "the check below evaluates = and =~ only"
        pattern = re.compile(value if op == "=~" else re.escape(value))
        selected = [s for s in selected if pattern.fullmatch(s.labels[label])]
    queues = list(worker_options.queues)
    total = sum(sample.value for sample in selected)
    assert total == ready_of(queues) == 5, (
        f"{line}: {name}{{{matchers}}} sums to {total}, not the 5 ready messages of {queues}"
    )
