"""contrib/: the Prometheus alert rules and the Grafana dashboard.

The metric names and labels they may use are not written down here: they are
collected from the real code (a ``WorkerMetrics`` that recorded one of
everything, and the ``DatabaseCollector`` over real rows), so renaming a
metric in ``django_pgqueue/metrics.py`` without updating contrib/ fails here.
When ``promtool`` is installed (Debian: the ``prometheus`` package), the rules
are also checked and unit-tested with it, and the dashboard's queries parsed.
"""

import datetime
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from django.utils import timezone

from django_pgqueue import enqueue
from django_pgqueue.models import DeadLetterState, Status
from django_pgqueue.observability.metrics import DEAD_LETTERED, DONE, RETRIED, WorkerMetrics
from django_pgqueue.observability.scrape import DatabaseCollector

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
RULES = CONTRIB / "prometheus" / "pgqueue-alerts.yml"
DASHBOARD = CONTRIB / "grafana" / "django-pgqueue.json"

EXPECTED_ALERTS = {
    "PgQueueDatabaseDown",
    "PgQueueBacklogHigh",
    "PgQueueOldestMessageTooOld",
    "PgQueueDeadLettersGrowing",
    "PgQueueNoLiveWorker",
    "PgQueueLowSuccessRatio",
    "PgQueueWorkerReconnecting",
}
SEVERITIES = {"critical", "warning", "info"}

# Families the dashboard leaves out on purpose, each with the reason. None
# today: every metric django-pgqueue exports has a panel. Add one here only
# with a reason a reader of the dashboard would accept.
NOT_ON_DASHBOARD = {}

# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}

METRIC = re.compile(r"\bpgqueue_[a-z0-9_]+\b")
SELECTOR = re.compile(r"\b(pgqueue_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*(pgqueue_[a-z0-9_]+)\s*,\s*(\w+)\s*\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
ANNOTATION_LABEL = re.compile(r"\$labels\.(\w+)")


# --- what the app exports ---------------------------------------------------


class Exported:
    """Sample names (``_total``, ``_bucket``... included) with their labels
    and the values seen, and the family each sample belongs to."""

    def __init__(self, families):
        self.samples = {}  # sample name -> {label: {values}}
        self.family_of = {}  # sample name -> family name
        for family in families:
            for sample in family.samples:
                labels = self.samples.setdefault(sample.name, {})
                for label, value in sample.labels.items():
                    labels.setdefault(label, set()).add(value)
                self.family_of[sample.name] = family.name
        self.families = set(self.family_of.values())


@pytest.fixture
def exported(db, make_message, make_dead_letter):
    # Rows in every state the database collector reports.
    enqueue("test.record", {"n": 1})  # ready
    enqueue("test.record", {"n": 2}, delay=60)  # delayed
    make_message(status=Status.PROCESSING)
    for state in DeadLetterState.values:
        make_dead_letter(state=state)
    database = list(DatabaseCollector().collect())
    up = {family.name: family for family in database}["pgqueue_database_up"]
    assert up.samples[0].value == 1, "the database collector could not read the test database"

    # One of everything a worker records.
    worker = WorkerMetrics()
    message = SimpleNamespace(
        topic="test.record",
        queue="default",
        run_at=timezone.now() - datetime.timedelta(seconds=1),
    )
    worker.claimed(3, 0.002)
    worker.started(message)
    for outcome in (DONE, RETRIED, DEAD_LETTERED):
        worker.finished(message, outcome, duration=0.01)
    worker.reconnected("loop")
    worker.track_inflight(lambda: 1)
    worker.workflows(2, ["done", "failed"])
    return Exported([*database, *worker.registry.collect()])


# --- what contrib/ uses -----------------------------------------------------


@dataclass
class Query:
    where: str
    expr: str
    shown: tuple = ()  # labels shown in a legend or an annotation


def load_rules():
    return yaml.safe_load(RULES.read_text())


def load_dashboard():
    return json.loads(DASHBOARD.read_text())


def all_rules(rules):
    return [rule for group in rules["groups"] for rule in group["rules"]]


def all_panels(dashboard):
    """Every panel, including those inside rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def rule_queries():
    queries = []
    for rule in all_rules(load_rules()):
        texts = " ".join(str(value) for value in rule.get("annotations", {}).values())
        shown = tuple(sorted(set(ANNOTATION_LABEL.findall(texts))))
        queries.append(Query(f"alert {rule.get('alert')}", rule["expr"], shown))
    return queries


def dashboard_queries():
    dashboard = load_dashboard()
    queries = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel['title']!r}, target {target.get('refId')}"
            shown = tuple(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            queries.append(Query(where, target["expr"], shown))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            queries.append(Query(f"variable ${variable['name']}", text))
    return queries


def labels_of(clause):
    return {label.strip() for label in clause.split(",") if label.strip()}


def metric_problems(query, exported):
    names = METRIC.findall(query.expr)
    if not names:
        return [f"{query.where}: uses no pgqueue_ metric: {query.expr}"]
    return [
        f"{query.where}: {name} is not a sample django-pgqueue exports "
        f"(exported: {', '.join(sorted(exported.samples))})"
        for name in names
        if name not in exported.samples
    ]


def label_problems(query, exported):
    """Labels in selectors, by/on clauses, label_values(), legends and
    annotations must exist on the metrics the query reads (or be added by
    Prometheus); a label matched with = must match a value the app reports;
    a label shown after an aggregation must be one it keeps."""
    problems = []
    names = [name for name in METRIC.findall(query.expr) if name in exported.samples]
    available = TARGET_LABELS.union(*(exported.samples[name] for name in names))
    for name, body in SELECTOR.findall(query.expr):
        labels = exported.samples.get(name)
        if labels is None:
            continue  # reported by metric_problems
        for label, op, value in MATCHER.findall(body):
            if label in TARGET_LABELS:
                continue
            if label not in labels:
                problems.append(
                    f"{query.where}: {name} has no label {label!r} (it has {sorted(labels)})"
                )
            elif op == "=" and "$" not in value and value not in labels[label]:
                problems.append(
                    f"{query.where}: {name}{{{label}={value!r}}} matches nothing the app "
                    f"reports ({label} is one of {sorted(labels[label])})"
                )
    for clause in GROUPING.findall(query.expr):
        for label in sorted(labels_of(clause) - available):
            problems.append(f"{query.where}: groups by {label!r}, which none of {names} has")
    for name, label in LABEL_VALUES.findall(query.expr):
        if label not in exported.samples.get(name, {}):
            problems.append(f"{query.where}: label_values of {name} by {label!r}: no such label")
    by_clauses = BY.findall(query.expr)
    kept = set().union(*map(labels_of, by_clauses)) if by_clauses else available
    for label in query.shown:
        if label not in kept:
            problems.append(
                f"{query.where}: shows {label!r}, which the query does not keep "
                f"(it keeps {sorted(kept)})"
            )
    return problems


# --- the alert rules --------------------------------------------------------


def test_rules_file_has_the_expected_alerts():
    rules = load_rules()
    assert rules["groups"], "pgqueue-alerts.yml has no rule group"
    names = [rule.get("alert") for rule in all_rules(rules)]
    assert len(names) == len(set(names)), f"alert names repeat: {names}"
    assert EXPECTED_ALERTS <= set(names), f"missing alerts: {EXPECTED_ALERTS - set(names)}"


def test_every_rule_is_complete():
    for rule in all_rules(load_rules()):
        name = rule.get("alert")
        assert name, f"a rule without 'alert' (recording rules do not belong here): {rule}"
        assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), f"{name}: no expr"
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for"))), f"{name}: no 'for: <duration>'"
        severity = rule.get("labels", {}).get("severity")
        assert severity in SEVERITIES, f"{name}: labels.severity must be one of {SEVERITIES}"
        annotations = rule.get("annotations", {})
        for key in ("summary", "description"):
            assert annotations.get(key), f"{name}: no annotations.{key}"


def test_rules_use_only_exported_metrics_and_labels(exported):
    problems = []
    for query in rule_queries():
        problems += metric_problems(query, exported)
        problems += label_problems(query, exported)
    assert not problems, "contrib/prometheus/pgqueue-alerts.yml:\n" + "\n".join(problems)


# --- the dashboard ----------------------------------------------------------


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard.get("id") is None, "an exported dashboard must not carry a database id"
    panels = list(all_panels(dashboard))
    ids = [panel.get("id") for panel in panels]
    assert all(isinstance(id_, int) for id_ in ids), f"panels without an integer id: {ids}"
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"

    cells = {}
    for panel in panels:
        where = f"panel {panel['id']} {panel.get('title')!r}"
        grid = panel.get("gridPos")
        assert grid and all(isinstance(grid.get(k), int) for k in "hwxy"), f"{where}: gridPos"
        assert grid["w"] > 0 and grid["h"] > 0 and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{where} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", f"{where}: fixed data source"
        targets = panel.get("targets")
        assert targets, f"{where}: no query"
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), f"{where}: refIds repeat"
        assert all(target.get("expr", "").strip() for target in targets), f"{where}: empty expr"

    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    queue = variables["queue"]["query"]
    assert re.fullmatch(r"label_values\(pgqueue_\w+, queue\)", queue["query"])


def test_dashboard_uses_only_exported_metrics_and_labels(exported):
    problems = []
    for query in dashboard_queries():
        problems += metric_problems(query, exported)
        problems += label_problems(query, exported)
    assert not problems, "contrib/grafana/django-pgqueue.json:\n" + "\n".join(problems)


def test_dashboard_shows_every_exported_family(exported):
    used = {
        exported.family_of[name]
        for query in dashboard_queries()
        for name in METRIC.findall(query.expr)
        if name in exported.family_of
    }
    missing = exported.families - used - set(NOT_ON_DASHBOARD)
    assert not missing, (
        f"metrics with no panel in contrib/grafana/django-pgqueue.json: {sorted(missing)}; "
        "add a panel, or list them in NOT_ON_DASHBOARD with the reason"
    )
    stale = set(NOT_ON_DASHBOARD) & used | set(NOT_ON_DASHBOARD) - exported.families
    assert not stale, f"NOT_ON_DASHBOARD lists shown or unknown families: {sorted(stale)}"


# --- promtool, when installed -----------------------------------------------


def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def run_promtool(*args):
    result = subprocess.run(
        [promtool(), *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"promtool {args[0]} {args[1]}:\n{result.stdout}{result.stderr}"


def test_promtool_checks_the_rules():
    run_promtool("check", "rules", RULES)


def test_promtool_parses_the_dashboard_queries(tmp_path):
    """Each panel query, its variables replaced, as a recording rule: promtool
    parses its PromQL."""
    rules = []
    for panel in all_panels(load_dashboard()):
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "5m")
            expr = re.sub(r"\$\w+", ".*", expr)
            rules.append(
                {"record": f"dashboard:panel{panel['id']}_{target['refId']}", "expr": expr}
            )
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool("check", "rules", path)


def series(name, values, **labels):
    selector = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def fires(at, alert, *labels_list):
    return {
        "eval_time": at,
        "alertname": alert,
        "exp_alerts": [{"exp_labels": labels} for labels in labels_list],
    }


WORKER = {"instance": "worker-1:9808", "job": "pgqueue-worker"}
WEB = {"instance": "www.example.com:443", "job": "pgqueue-web"}
WARNING, CRITICAL = {"severity": "warning"}, {"severity": "critical"}

# promtool unit tests: input series minute by minute, and which alerts fire
# when, with which labels. Values: "1x30" is 1 for 31 minutes, "0+60x30" a
# counter growing 60 a minute, "_x20" no sample for 20 minutes.
ALERT_TESTS = [
    # A healthy system: nothing fires.
    {
        "input_series": [
            series("pgqueue_database_up", "1x40", **WEB),
            series("pgqueue_messages", "5x40", queue="default", topic="a", state="ready", **WEB),
            series("pgqueue_oldest_ready_age_seconds", "3x40", queue="default", **WEB),
            series("pgqueue_workers_alive", "2x40", queue="default", **WEB),
            series("pgqueue_dead_letters", "4x40", topic="a", category="transient", state="new"),
            series("pgqueue_worker_messages_total", "0+60x40", topic="a", outcome="done", **WORKER),
            series("pgqueue_worker_reconnects_total", "0 1x39", connection="loop", **WORKER),
        ],
        "alert_rule_test": [fires("30m", alert) for alert in sorted(EXPECTED_ALERTS)],
    },
    # The database stops answering at minute 6.
    {
        "input_series": [series("pgqueue_database_up", "1x5 0x10", **WEB)],
        "alert_rule_test": [
            fires("7m", "PgQueueDatabaseDown"),
            fires("9m", "PgQueueDatabaseDown", {**WEB, **CRITICAL}),
        ],
    },
    # The metrics URL is not scraped at all.
    {
        "input_series": [series("pgqueue_worker_inflight", "0x10", **WORKER)],
        "alert_rule_test": [
            fires("1m", "PgQueueDatabaseDown"),
            fires("3m", "PgQueueDatabaseDown", CRITICAL),
        ],
    },
    # Queue "default" has 1200 ready messages (two topics), "bulk" 900 ready
    # and many delayed, which do not count.
    {
        "input_series": [
            series("pgqueue_messages", "600x30", queue="default", topic="a", state="ready"),
            series("pgqueue_messages", "600x30", queue="default", topic="b", state="ready"),
            series("pgqueue_messages", "900x30", queue="bulk", topic="c", state="ready"),
            series("pgqueue_messages", "5000x30", queue="bulk", topic="c", state="delayed"),
        ],
        "alert_rule_test": [
            fires("9m", "PgQueueBacklogHigh"),
            fires("11m", "PgQueueBacklogHigh", {"queue": "default", **WARNING}),
        ],
    },
    # The same backlog and age in a queue an operator paused ("mail", from
    # the start; "sms" from minute 5): no alert while it is paused.
    {
        "input_series": [
            series("pgqueue_messages", "2000x30", queue="mail", topic="m", state="ready"),
            series("pgqueue_queue_paused", "1x30", queue="mail"),
            series("pgqueue_oldest_ready_age_seconds", "900x30", queue="mail"),
            series("pgqueue_oldest_ready_age_seconds", "900x30", queue="sms"),
            series("pgqueue_queue_paused", "0x4 1x25", queue="sms"),
        ],
        "alert_rule_test": [
            fires("11m", "PgQueueBacklogHigh"),
            fires("12m", "PgQueueOldestMessageTooOld"),
        ],
    },
    # Queue "default"'s oldest ready message is 400s old from minute 6.
    {
        "input_series": [
            series("pgqueue_oldest_ready_age_seconds", "0x5 400x10", queue="default"),
            series("pgqueue_oldest_ready_age_seconds", "200x15", queue="bulk"),
        ],
        "alert_rule_test": [
            fires("10m", "PgQueueOldestMessageTooOld"),
            fires("12m", "PgQueueOldestMessageTooOld", {"queue": "default", **WARNING}),
        ],
    },
    # Old dead letters (already there when scraping began) stay quiet; the
    # first two of orders/transient at minute 20 fire for 15 minutes; revived
    # ones (the count drops) and resolved ones do not fire.
    {
        "input_series": [
            series("pgqueue_database_up", "1x60"),
            series("pgqueue_dead_letters", "3x60", topic="old", category="permanent", state="new"),
            series(
                "pgqueue_dead_letters",
                "_x20 2x40",
                topic="orders",
                category="transient",
                state="new",
            ),
            series(
                "pgqueue_dead_letters",
                "5x20 2x40",
                topic="refunds",
                category="business",
                state="new",
            ),
            series(
                "pgqueue_dead_letters",
                "0+1x60",
                topic="old",
                category="permanent",
                state="resolved",
            ),
        ],
        "alert_rule_test": [
            fires("10m", "PgQueueDeadLettersGrowing"),
            fires("19m", "PgQueueDeadLettersGrowing"),
            fires(
                "21m",
                "PgQueueDeadLettersGrowing",
                {"topic": "orders", "category": "transient", **WARNING},
            ),
            fires("40m", "PgQueueDeadLettersGrowing"),
        ],
    },
    # Queue "default" has no live worker; "bulk" has one.
    {
        "input_series": [
            series("pgqueue_workers_alive", "0x10", queue="default"),
            series("pgqueue_workers_alive", "1x10", queue="bulk"),
        ],
        "alert_rule_test": [
            fires("1m", "PgQueueNoLiveWorker"),
            fires("3m", "PgQueueNoLiveWorker", {"queue": "default", **CRITICAL}),
        ],
    },
    # Success ratios by topic: flaky 50%, broken 0% (no "done" series at all),
    # split 33% across two workers, fine 95%, quiet 0% but only 15 runs in 15m.
    {
        "input_series": [
            series("pgqueue_worker_messages_total", "0+30x40", topic="flaky", outcome="done"),
            series("pgqueue_worker_messages_total", "0+30x40", topic="flaky", outcome="retried"),
            series(
                "pgqueue_worker_messages_total", "0+10x40", topic="broken", outcome="dead_lettered"
            ),
            series(
                "pgqueue_worker_messages_total", "0+10x40", topic="split", outcome="done", **WORKER
            ),
            series(
                "pgqueue_worker_messages_total",
                "0+20x40",
                topic="split",
                outcome="retried",
                instance="worker-2:9808",
                job="pgqueue-worker",
            ),
            series("pgqueue_worker_messages_total", "0+95x40", topic="fine", outcome="done"),
            series("pgqueue_worker_messages_total", "0+5x40", topic="fine", outcome="retried"),
            series(
                "pgqueue_worker_messages_total", "0+1x40", topic="quiet", outcome="dead_lettered"
            ),
        ],
        "alert_rule_test": [
            fires(
                "25m",
                "PgQueueLowSuccessRatio",
                {"topic": "broken", **WARNING},
                {"topic": "flaky", **WARNING},
                {"topic": "split", **WARNING},
            ),
        ],
    },
    # worker-1 reconnects every minute; worker-2 twice.
    {
        "input_series": [
            series("pgqueue_worker_reconnects_total", "0+1x30", connection="loop", **WORKER),
            series(
                "pgqueue_worker_reconnects_total",
                "0 1 2x28",
                connection="listener",
                instance="worker-2:9808",
                job="pgqueue-worker",
            ),
        ],
        "alert_rule_test": [
            fires(
                "20m",
                "PgQueueWorkerReconnecting",
                {"instance": WORKER["instance"], "connection": "loop", **WARNING},
            ),
        ],
    },
]


def test_promtool_unit_tests_of_the_alerts(tmp_path):
    """The alerts' logic, by promtool's rule unit tests. Annotations are left
    out (promtool would compare their rendered text; "check rules" validates
    their templates)."""
    rules = load_rules()
    for rule in all_rules(rules):
        rule.pop("annotations", None)
    rules_path = tmp_path / "rules.yml"
    rules_path.write_text(yaml.safe_dump(rules))
    tests = [{"interval": "1m", **test} for test in ALERT_TESTS]
    tests_path = tmp_path / "tests.yml"
    tests_path.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules_path)], "evaluation_interval": "1m", "tests": tests}
        )
    )
    run_promtool("test", "rules", tests_path)
