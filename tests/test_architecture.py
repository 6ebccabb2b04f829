"""The package's shape, checked: the rules of the architecture page
(docs/explanation/architecture.rst) that a reader would otherwise have to
trust.

- no module over 500 lines and no class over 300 (migrations aside: they
  are generated and never rewritten);
- no import circle between the package's modules;
- dependencies point one way: each module sits in a layer and imports only
  from its own layer or the layers below it (``LAYERS``).

Imports are read from the source with ``ast`` (every import, those inside
functions too: an import deferred to call time is still a dependency).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_pgqueue"
NAME = "django_pgqueue"
# The page that draws the layers (the documentation's Explanation section).
PAGE_NAME = "docs/explanation/architecture.rst"
ARCHITECTURE_PAGE = PACKAGE.parent / PAGE_NAME

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300

# From the ground up; a module belongs to the first prefix that matches it,
# longest prefix first. A module may import its own layer and those below.
LAYERS = [
    # 1. what everything else stands on: settings, errors, signals, fields,
    #    cursors; the models
    (
        "foundation",
        [
            "django_pgqueue",  # the lazy public face (importlib, no imports)
            "django_pgqueue.conf",
            "django_pgqueue.exceptions",
            "django_pgqueue.signals",
            "django_pgqueue.fields",
            "django_pgqueue.db",
            "django_pgqueue.models",
            "django_pgqueue.stream_models",  # migration 0010's import path
        ],
    ),
    # 2. pure decisions, handler lookup, statements, wake-ups, input checks
    (
        "rules",
        [
            "django_pgqueue.policy",
            "django_pgqueue.registry",
            # sql/: the statements the ORM cannot say, a module per concern (claim,
            # limited, acks, history, insert, timeouts, probe, wakeups, groups...)
            "django_pgqueue.sql",
            "django_pgqueue.running",  # cancel_requested(): what a handler asks of its run
            "django_pgqueue.tracing",  # OpenTelemetry spans: enqueue, worker, streams call it
            "django_pgqueue.notify",
            "django_pgqueue.validation",
            # schedules: the entries, the project's schedules, the tick arithmetic
            "django_pgqueue.schedules",
        ],
    ),
    # 3. the operations: every state change of a message, a dead letter, a
    #    stream subscription, and the metrics the worker reports through
    (
        "operations",
        [
            "django_pgqueue.enqueuing",
            "django_pgqueue.enqueuing_async",  # aenqueue(), aenqueue_many(): for async code
            "django_pgqueue.lifecycle",
            "django_pgqueue.controls",  # pause, resume, limits (QueueState)
            "django_pgqueue.groups",
            "django_pgqueue.liveness",
            "django_pgqueue.deadletters",
            "django_pgqueue.schedules.state",  # the ledger and pause/resume
            "django_pgqueue.schedules.overview",  # what the admin and commands show
            "django_pgqueue.streams",
            "django_pgqueue.subscriptions",  # the documented path, re-exported
            # workflows: built, written, and their steps moved with their messages
            "django_pgqueue.workflows",
            "django_pgqueue.observability.metrics",
        ],
    ),
    # 4. background duties and the Tasks backend (built on the operations)
    (
        "duties",
        [
            "django_pgqueue.maintenance",
            "django_pgqueue.vacuum",  # the queue table's VACUUM when its dead rows pile up
            "django_pgqueue.retention",  # what is past its retention, deleted in batches
            "django_pgqueue.tasks",
            "django_pgqueue.schedules.runs",  # a scheduler round, run now
        ],
    ),
    # 5. the worker process, its stream-delivery thread included
    ("worker", ["django_pgqueue.worker"]),
    # 6. what people and machines look at and run: admin, health and stats,
    #    alerts, views and URLs, commands, checks, the app config
    (
        "interfaces",
        [
            "django_pgqueue.admin",
            "django_pgqueue.templatetags",  # the admin pages' tags
            "django_pgqueue.observability",
            "django_pgqueue.management",
            "django_pgqueue.checks",
            "django_pgqueue.handlers",
            "django_pgqueue.urls",
            "django_pgqueue.apps",
            # users' tests: drain() assembles the worker's parts; the pytest fixture
            "django_pgqueue.testing",
            "django_pgqueue.pytest_plugin",
        ],
    ),
]


def _modules():
    """{dotted name: path} for every module of the package but migrations."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "migrations" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module, path):
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module, path):
    """The package's modules that ``module`` imports (a name imported from a
    package counts as an import of the submodule of that name, if one exists)."""
    tree = ast.parse(path.read_text(), str(path))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in MODULES else source)
    return {t for t in targets if t in MODULES and t != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    return None if best is None else best[0]


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def test_every_module_sits_in_a_layer():
    missing = sorted(m for m in MODULES if _layer(m) is None)
    assert not missing, f"add these modules to LAYERS (and to {PAGE_NAME}): {missing}"


def test_no_import_circle():
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other in a loop: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles
    )


def test_dependencies_point_down_the_layers():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if _layer(target) > _layer(module):
                upward.append(
                    f"{module} ({LAYERS[_layer(module)][0]}) imports "
                    f"{target} ({LAYERS[_layer(target)][0]})"
                )
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_the_architecture_page_names_every_layer():
    page = ARCHITECTURE_PAGE.read_text()
    for name, _ in LAYERS:
        assert name in page, f"{PAGE_NAME} does not describe the layer {name!r}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_classes_stay_small(module):
    path = MODULES[module]
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most "
        f"{MAX_MODULE_LINES}): split it by concern"
    )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= MAX_CLASS_LINES, (
                f"class {node.name} in {path.relative_to(PACKAGE.parent)} has {size} lines "
                f"(at most {MAX_CLASS_LINES}): give its concerns parts of their own"
            )
