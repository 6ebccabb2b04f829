"""The metrics and HTTP endpoints reference: the metric definitions of
``observability/metrics.py`` and ``scrape.py``, the URLs of
``django_pgqueue.urls`` and a worker's ports.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pgqueue_docs.source import (
    UNKNOWN,
    Messages,
    enclosing_function,
    heading,
    rst_text,
)

METRIC_CONSTRUCTORS = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "_histogram": "histogram",
    "_gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "CounterMetricFamily": "counter",
}
SAMPLE_SUFFIXES = {
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count"],
    "summary": ["_sum", "_count"],
    "gauge": [""],
}


@dataclass
class Metric:
    name: str
    kind: str
    documentation: str
    labels: list[str]
    module: str

    @property
    def samples(self) -> list[str]:
        return [self.name + suffix for suffix in SAMPLE_SUFFIXES[self.kind]]


def metrics(module_name: str) -> list[Metric]:
    """The metric definitions of a module: calls of a prometheus_client
    constructor (or the module's own wrapper) whose name is a string."""
    module = importlib.import_module(module_name)
    messages = Messages(module)
    found = []
    calls = [n for n in ast.walk(messages.tree) if isinstance(n, ast.Call)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        callee = (
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        )
        if callee not in METRIC_CONSTRUCTORS or len(node.args) < 2:
            continue
        name = node.args[0]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue  # the wrapper's own definition (its name is a parameter)
        scope = enclosing_function(messages.tree, node)
        keywords = {k.arg: k.value for k in node.keywords}
        labels_node = keywords.get("labels") or keywords.get("labelnames")
        position = _labels_position(messages.tree, callee)
        if labels_node is None and len(node.args) > position:
            labels_node = node.args[position]
        found.append(
            Metric(
                name=name.value,
                kind=METRIC_CONSTRUCTORS[callee],
                documentation=messages.render(node.args[1], {}, scope)[0],
                labels=_labels(messages, labels_node, scope),
                module=module_name,
            )
        )
    return found


def _labels_position(tree: ast.AST, callee: str) -> int:
    """Where the label names go among a metric constructor's positional
    arguments: prometheus_client's third (``labelnames``), or a wrapper's
    (a function of the module) ``labels`` or ``labelnames`` parameter."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == callee:
            names = [a.arg for a in node.args.args if a.arg != "self"]
            for wanted in ("labels", "labelnames"):
                if wanted in names:
                    return names.index(wanted)
    return 2


def _labels(messages: Messages, node: ast.expr | None, scope: ast.AST | None) -> list[str]:
    if node is None:
        return []
    known = messages.literal_locals(scope) if isinstance(scope, ast.FunctionDef) else {}
    value = messages.evaluate(node, known)
    if value is UNKNOWN or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{messages.path}:{node.lineno}: cannot read the metric's labels")
    return list(value)


def metrics_rst() -> list[str]:
    sections = [
        ("django_pgqueue.observability.scrape", "From the database (the ``metrics`` URL)",
         "Read from the queue tables when Prometheus scrapes the ``metrics`` URL of "
         "``django_pgqueue.urls``: the same figures whatever the number of workers, so "
         "scrape one web process, not every worker."),
        ("django_pgqueue.observability.metrics", "From each worker (``--metrics-port``)",
         "What one worker process did, on the port that ``pgqueue_worker --metrics-port`` "
         "opens. Prometheus adds the ``instance`` label that tells the workers apart."),
    ]  # fmt: skip
    lines = []
    for module, title, intro in sections:
        lines += heading(title, "=") + [intro, ""]
        for metric in metrics(module):
            lines += [f".. metric:: {metric.name}", ""]
            lines += heading(f"``{metric.name}``", "-")
            lines += [rst_text(metric.documentation, link_settings=False), ""]
            lines += [
                f":Type: {metric.kind}",
                ":Labels: " + (", ".join(f"``{label}``" for label in metric.labels) or "none"),
                ":Samples: " + ", ".join(f"``{s}``" for s in metric.samples),
                "",
            ]
    return lines


# --- HTTP endpoints --------------------------------------------------------------------------


def _access_setting(function: Callable[..., Any]) -> str | None:
    """The PGQUEUE key a view passes to its access check (``"..._ACCESS"``)."""
    from django_pgqueue.conf import DEFAULTS

    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and node.value in DEFAULTS
            and str(node.value).endswith("_ACCESS")
        ):
            return node.value
    return None


def endpoints_rst() -> list[str]:
    from django.urls import URLPattern

    from django_pgqueue import urls
    from django_pgqueue.observability.endpoints import MetricsServer
    from django_pgqueue.observability.health import WorkerHealthServer

    lines = [
        f'``django_pgqueue.urls`` (``app_name = "{urls.app_name}"``), included at a prefix '
        'of your choosing, e.g. ``path("pgqueue/", include("django_pgqueue.urls"))``:',
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 15 20 45 20",
        "",
        "   * - Path",
        "     - URL name",
        "     - Answers",
        "     - Access",
    ]
    for pattern in urls.urlpatterns:
        assert isinstance(pattern, URLPattern)
        view = pattern.callback
        doc = " ".join((inspect.getdoc(view) or "").split())
        setting = _access_setting(view)
        lines += [
            f"   * - ``<prefix>/{pattern.pattern}``",
            f"     - ``{urls.app_name}:{pattern.name}``",
            f"     - {rst_text(doc)}",
            f"     - :setting:`{setting}`" if setting else "     - (open)",
        ]
    lines += [
        "",
        "A worker's own ports (``pgqueue_worker --metrics-port``, ``--health-port``), which "
        "listen on :setting:`WORKER_HTTP_HOST` (or ``--http-host``):",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 15 20 45 20",
        "",
        "   * - Port",
        "     - Paths",
        "     - Answers",
        "     - Access",
    ]
    servers = [
        ("``--metrics-port``", "any", MetricsServer, "METRICS_ACCESS"),
        ("``--health-port``", ", ".join(f"``{p}``" for p in WorkerHealthServer.PATHS),
         WorkerHealthServer, "HEALTH_ACCESS"),
    ]  # fmt: skip
    for port, paths, server, setting in servers:
        source = inspect.getsource(server)
        assert f'"{setting}"' in source or setting in source, (server, setting)
        doc = " ".join((inspect.getdoc(server) or "").split("\n\n")[0].split())
        lines += [
            f"   * - {port}",
            f"     - {paths}",
            f"     - {rst_text(doc)}",
            f'     - :setting:`{setting}`: ``"token"`` asks for the token; ``"open"`` '
            'and ``"staff"`` answer whoever can connect (a port has no users)',
        ]
    return lines + [""]
