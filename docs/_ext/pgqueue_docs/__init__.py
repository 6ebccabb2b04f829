"""The generated half of the Reference section: directives that write reST
from the code itself, so the pages cannot drift from it.

=========================  ===================================================
``pgqueue-settings``       every ``PGQUEUE`` key: ``DEFAULTS`` of
                           ``conf/defaults.py`` (key, default, the comment
                           above it) and what its check in
                           ``conf/problems.py`` says of a wrong value
``pgqueue-api``            autodoc of every name of ``django_pgqueue``'s lazy
                           public map (``_API``), in the sections its
                           comments draw
``pgqueue-tasks-backend``  autodoc of the Django Tasks backend (Django 6)
``pgqueue-signals``        each signal of ``signals.py`` with the comment
                           above it, and the sender and arguments of every
                           call that sends it
``pgqueue-commands``       every management command, from its argparse parser
``pgqueue-checks``         every system check id (``pgqueue.E001``...) in the
                           package's source, with its messages and hints; a
                           message made of a problem object (``E110``'s
                           ``InvalidSchedule``) shows each problem the
                           check's code can find (``problems.py``)
``pgqueue-metrics``        the Prometheus metrics of ``metrics.py`` (a
                           worker's port) and ``scrape.py`` (the URL)
``pgqueue-endpoints``      the URLs of ``django_pgqueue.urls`` and a worker's
                           ports, with the setting that guards each
``pgqueue-models``         every model's columns
=========================  ===================================================

Each generator is a plain function returning reST lines, importable without
Sphinx (``tests/test_docs.py`` checks their output), in a module of this
package by subject; ``source.py`` holds what they share. ``setup()`` turns
them into directives. Code is read with ``ast`` and ``tokenize``, never with
regular expressions, but for finding check ids anywhere in the source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pgqueue_docs.api import (
    api_groups,
    api_rst,
    signal_names,
    signal_sends,
    signals_rst,
    tasks_rst,
)
from pgqueue_docs.checks import check_ids_in_source, check_messages, checks_rst
from pgqueue_docs.commands import COMMON_OPTIONS, commands, commands_rst
from pgqueue_docs.models import models_rst
from pgqueue_docs.observability import endpoints_rst, metrics, metrics_rst
from pgqueue_docs.settings import settings, settings_rst
from pgqueue_docs.source import source_of

__all__ = [
    "COMMON_OPTIONS",
    "GENERATORS",
    "api_groups",
    "api_rst",
    "check_ids_in_source",
    "check_messages",
    "checks_rst",
    "commands",
    "commands_rst",
    "endpoints_rst",
    "metrics",
    "metrics_rst",
    "models_rst",
    "settings",
    "settings_rst",
    "setup",
    "signal_names",
    "signal_sends",
    "signals_rst",
    "tasks_rst",
]

GENERATORS: dict[str, tuple[Callable[[], list[str]], list[str]]] = {
    # directive: (generator, the modules it reads, for rebuilds)
    "pgqueue-settings": (
        settings_rst,
        ["django_pgqueue.conf.defaults", "django_pgqueue.conf.problems"],
    ),
    "pgqueue-api": (api_rst, ["django_pgqueue"]),
    "pgqueue-tasks-backend": (tasks_rst, ["django_pgqueue.tasks.backend"]),
    "pgqueue-signals": (signals_rst, ["django_pgqueue.signals"]),
    "pgqueue-commands": (commands_rst, ["django_pgqueue.management.commands"]),
    "pgqueue-models": (models_rst, ["django_pgqueue.models"]),
    "pgqueue-checks": (
        checks_rst,
        [
            "django_pgqueue.checks",
            "django_pgqueue.conf.problems",
            "django_pgqueue.schedules.spec",
            "django_pgqueue.schedules.configured",
        ],
    ),
    "pgqueue-metrics": (
        metrics_rst,
        ["django_pgqueue.observability.metrics", "django_pgqueue.observability.scrape"],
    ),
    "pgqueue-endpoints": (
        endpoints_rst,
        ["django_pgqueue.urls", "django_pgqueue.observability.views"],
    ),
}


def setup(app: Any) -> dict[str, Any]:
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.parsing import nested_parse_to_nodes

    class Generated(SphinxDirective):
        """Parses what a generator wrote as if it stood in the page."""

        generate: Callable[[], list[str]]
        reads: list[str]

        def run(self) -> list[Any]:
            for module in self.reads:
                path = source_of(module)[1]
                # A package: its modules (the commands, the models).
                for read in (
                    sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]
                ):
                    self.env.note_dependency(str(read))
            lines = self.generate()
            content = StringList(lines, source=f"<{self.name} in {self.env.docname}>")
            return nested_parse_to_nodes(self.state, content, allow_section_headings=True)

    for name, (generate, reads) in GENERATORS.items():
        attributes = {"generate": staticmethod(generate), "reads": reads}
        app.add_directive(name, type(f"Generated_{name}", (Generated,), attributes))
    # Targets for :setting:`MAX_ATTEMPTS`, :check:`pgqueue.E003` and
    # :metric:`pgqueue_messages` anywhere in the docs, and index entries.
    app.add_crossref_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_crossref_type("check", "check", indextemplate="pair: %s; system check")
    app.add_crossref_type("metric", "metric", indextemplate="pair: %s; metric")
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
