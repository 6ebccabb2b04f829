"""The documentation site (docs/): the generated Reference covers the code,
and every Python snippet of the tutorial and the how-to guides runs.

The snippet runner: each ``.rst`` page under ``docs/tutorial/`` and
``docs/howto/`` is one test. Its ``.. code-block:: python`` (or ``.. code::
python``) blocks run in order, in one namespace of the page's own, against
the test database (committed for real: ``enqueue`` then a ``--burst`` worker
sees the rows). A block that cannot run (a settings fragment naming the
reader's app, a systemd unit) is preceded by the comment ``.. snippet: no-run
<reason>``. A page whose code needs a newer Django than the one under test
(``django.tasks`` is 6.0+) says so anywhere in it, ``.. snippet: needs
Django 6.0``, and is skipped on older ones. A failure names the page and the
line of the block.
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.dispatch import Signal

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import pgqueue_docs  # noqa: E402  (docs/_ext, put on the path above)
from pgqueue_docs.source import PLACEHOLDER  # noqa: E402

# --- the snippet runner ----------------------------------------------------------------------

SNIPPET_SECTIONS = ("tutorial", "howto")
PYTHON = frozenset({"python", "python3", "py", "py3"})
CODE_DIRECTIVE = re.compile(
    r"^(?P<indent>\s*)\.\. (?:code-block|code|sourcecode)::\s*(?P<lang>\S*)"
)
NO_RUN = re.compile(r"^\.\. snippet: no-run\b(?P<reason>.*)$")
NEEDS_DJANGO = re.compile(r"^\.\. snippet: needs Django (\d+)\.(\d+)\s*$", re.M)


class SnippetError(AssertionError):
    """A page's snippet failed, or a page is malformed: says page:line."""


@dataclass(frozen=True)
class Snippet:
    line: int  # the page's line (from 1) of the block's first line of code
    code: str  # dedented


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def snippets(page: Path, name: str) -> list[Snippet]:
    """The runnable Python blocks of ``page``, in order (``name``: how
    errors name the page)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    i = 0
    while i < len(lines):
        match = CODE_DIRECTIVE.match(lines[i])
        if not match:
            i += 1
            continue
        indent = len(match["indent"])
        previous = i - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        no_run = NO_RUN.match(lines[previous].strip()) if previous >= 0 else None
        if no_run and not no_run["reason"].strip():
            raise SnippetError(
                f"{name}:{previous + 1}: '.. snippet: no-run' needs a reason after it, "
                "e.g. '.. snippet: no-run a settings.py fragment'"
            )
        # The directive's options (":caption: ...") come first, then the body:
        # every line that is blank or indented deeper than the directive.
        j = i + 1
        while j < len(lines) and lines[j].strip().startswith(":") and _indent_of(lines[j]) > indent:
            j += 1
        body_start = j
        while j < len(lines) and (not lines[j].strip() or _indent_of(lines[j]) > indent):
            j += 1
        body = lines[body_start:j]
        while body and not body[0].strip():
            body.pop(0)
            body_start += 1
        if match["lang"].lower() in PYTHON and not no_run and "".join(body).strip():
            found.append(Snippet(line=body_start + 1, code=textwrap.dedent("\n".join(body))))
        i = j
    return found


def run_page(page: Path, name: str | None = None) -> int:
    """Run the page's snippets in order in one fresh namespace; the number
    run. Raises SnippetError naming ``page:line`` of the failing block and
    the failing line itself. Tracebacks show the page's own lines."""
    name = name or (str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page))
    blocks = snippets(page, name)
    # The blocks' code at their lines of the page, for tracebacks and
    # inspect.getsource (the handler registry names a handler's location).
    total = len(page.read_text(encoding="utf-8").splitlines())
    shown = [""] * total
    for block in blocks:
        for offset, text in enumerate(block.code.splitlines()):
            shown[block.line - 1 + offset] = text
    linecache.cache[name] = (0, None, [text + "\n" for text in shown], name)
    namespace = {"__name__": "docs_" + re.sub(r"\W", "_", name)}
    for block in blocks:
        try:
            code = compile("\n" * (block.line - 1) + block.code, name, "exec")
            exec(code, namespace)  # noqa: S102  (the documentation's own code)
        except Exception as exc:
            at = _failing_line(exc, name) or block.line
            raise SnippetError(
                f"{name}:{block.line}: the code block starting on this line failed at "
                f"{name}:{at}: {type(exc).__name__}: {exc}\n"
                + "".join(traceback.format_exception(exc))
            ) from exc
    return len(blocks)


def _failing_line(exc: BaseException, name: str) -> int | None:
    if isinstance(exc, SyntaxError) and exc.filename == name:
        return exc.lineno
    line = None
    for frame, number in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename == name:
            line = number
    return line


def _signals() -> list[Signal]:
    from django_pgqueue import signals

    return [value for value in vars(signals).values() if isinstance(value, Signal)]


@contextlib.contextmanager
def isolated():
    """What a page registers stays with the page: handlers, subscribers and
    signal receivers are put back as they were when the block ends."""
    from django_pgqueue import registry
    from django_pgqueue.streams import subscribers

    handlers = {spec.topic: spec for spec in registry._handlers.all()}
    subs = {spec.name: spec for spec in subscribers.registered()}
    receivers = {signal: list(signal.receivers) for signal in _signals()}
    try:
        yield
    finally:
        for spec in registry._handlers.all():
            if handlers.get(spec.topic) is not spec:
                registry.unregister(spec.topic)
        for spec in subscribers.registered():
            if subs.get(spec.name) is not spec:
                subscribers.unregister(spec.name)
        for topic, spec in handlers.items():
            if registry.lookup(topic) is not spec:
                registry.register(spec)
        for name, spec in subs.items():
            if subscribers.lookup(name) is not spec:
                subscribers.register(spec)
        for signal, saved in receivers.items():
            signal.receivers = saved
            signal.sender_receivers_cache.clear()


def why_not_run(page: Path, name: str) -> str | None:
    """Why the page's snippets are not run here, or None."""
    import django

    if not snippets(page, name):
        return "no Python code block to run"
    needs = NEEDS_DJANGO.search(page.read_text(encoding="utf-8"))
    if needs and django.VERSION[:2] < (int(needs[1]), int(needs[2])):
        return f"the page needs Django {needs[1]}.{needs[2]}"
    return None


PAGES = sorted(
    page.relative_to(DOCS).as_posix()
    for section in SNIPPET_SECTIONS
    for page in (DOCS / section).rglob("*.rst")
)


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("page", PAGES)
def test_the_snippets_of_the_page_run(page):
    reason = why_not_run(DOCS / page, f"docs/{page}")
    if reason:
        pytest.skip(reason)
    with isolated():
        run_page(DOCS / page)


# The runner itself, on pages written here.

PASSING_PAGE = """\
A page
======

.. code-block:: python

   from django.core.management import call_command

   from django_pgqueue import enqueue, handler

   seen = []

   @handler("docs.selftest.echo")
   def echo(message):
       seen.append(message.payload["n"])

Prose between the blocks.

.. snippet: no-run it needs a project of its own

.. code-block:: python

   raise RuntimeError("a no-run block ran")

.. code-block:: console

   $ python -c 'raise SystemExit(1)'

.. code:: python
   :caption: enqueue, then a worker in burst mode

   enqueue("docs.selftest.echo", {"n": 7})
   call_command("pgqueue_worker", "--burst", "--log-level", "ERROR")
   assert seen == [7], seen
"""

FAILING_PAGE = """\
A page
======

.. code-block:: python

   total = 1

- A list item with a block of its own:

  .. code-block:: python

     total += 1
     total / 0
"""


@pytest.mark.django_db(transaction=True)
def test_the_runner_runs_a_pages_blocks_in_order_in_one_namespace(tmp_path):
    from django_pgqueue import registry
    from django_pgqueue.signals import message_done

    page = tmp_path / "passing.rst"
    page.write_text(PASSING_PAGE + RECEIVER_BLOCK)
    assert [s.line for s in snippets(page, "passing.rst")] == [6, 31, 37]
    before = list(message_done.receivers)
    with isolated():
        assert run_page(page) == 3
        assert registry.lookup("docs.selftest.echo") is not None
        assert len(message_done.receivers) == len(before) + 1
    # What the page registered does not reach the next page.
    assert registry.lookup("docs.selftest.echo") is None
    assert message_done.receivers == before


RECEIVER_BLOCK = """
.. code-block:: python

   from django.dispatch import receiver
   from django_pgqueue.signals import message_done

   @receiver(message_done)
   def count(sender, message, **kwargs):
       pass
"""


def test_a_failing_block_is_reported_with_the_page_and_its_line(tmp_path):
    page = tmp_path / "failing.rst"
    page.write_text(FAILING_PAGE)
    with pytest.raises(SnippetError) as caught:
        run_page(page, name="docs/howto/failing.rst")
    first_line = str(caught.value).splitlines()[0]
    assert first_line == (
        "docs/howto/failing.rst:12: the code block starting on this line failed at "
        "docs/howto/failing.rst:13: ZeroDivisionError: division by zero"
    )
    # The traceback shows the page's own line.
    assert "total / 0" in str(caught.value)


def test_a_syntax_error_is_reported_with_the_page_and_its_line(tmp_path):
    page = tmp_path / "broken.rst"
    page.write_text(".. code-block:: python\n\n   x = 1\n   def f(:\n")
    with pytest.raises(SnippetError, match=r"^broken\.rst:3: .* at broken\.rst:4: SyntaxError"):
        run_page(page, name="broken.rst")


def test_a_page_that_needs_a_newer_django_is_not_run_on_older_ones(tmp_path):
    import django

    page = tmp_path / "tasks.rst"
    code = ".. code-block:: python\n\n   from django.tasks import task\n"
    page.write_text(f".. snippet: needs Django {django.VERSION[0] + 1}.0\n\n{code}")
    assert why_not_run(page, "tasks.rst") == f"the page needs Django {django.VERSION[0] + 1}.0"
    page.write_text(f".. snippet: needs Django {django.VERSION[0]}.{django.VERSION[1]}\n\n{code}")
    assert why_not_run(page, "tasks.rst") is None
    page.write_text("No code here.\n")
    assert why_not_run(page, "tasks.rst") == "no Python code block to run"


def test_a_no_run_marker_needs_a_reason(tmp_path):
    page = tmp_path / "reasonless.rst"
    page.write_text("Text.\n\n.. snippet: no-run\n\n.. code-block:: python\n\n   import x\n")
    with pytest.raises(SnippetError, match=r"^reasonless\.rst:3: '\.\. snippet: no-run' needs"):
        snippets(page, "reasonless.rst")


# --- the generated reference covers the code ---------------------------------------------------


def test_every_setting_is_in_the_reference_with_a_description():
    from django_pgqueue.conf import DEFAULTS

    documented = {s.key: s for s in pgqueue_docs.settings()}
    page = "\n".join(pgqueue_docs.settings_rst())
    missing = [key for key in DEFAULTS if f".. setting:: {key}\n" not in page + "\n"]
    assert not missing, f"settings missing from the settings reference: {missing}"
    undescribed = [key for key in DEFAULTS if not "".join(documented[key].description).strip()]
    assert not undescribed, (
        f"{undescribed}: write a comment right above each of these keys in "
        "django_pgqueue/conf/defaults.py (the settings reference shows it)"
    )


def test_a_settings_check_is_shown_in_its_own_words():
    documented = {s.key: s for s in pgqueue_docs.settings()}
    assert documented["MAX_ATTEMPTS"].problems == ["must be a whole number of at least 1"]
    assert documented["NOTIFY"].problems == ["must be True or False"]
    assert documented["LOCK_TIMEOUT"].problems == [
        "must be a number of seconds from 0.001 to 2147483, or None"
    ]
    assert "names a queue twice" in documented["QUEUES"].problems
    # Keys under one comment share it; a key's own line comment stays its own.
    assert documented["BACKOFF_CAP"].group == "BACKOFF_BASE"
    assert documented["BACKOFF_CAP"].description == documented["BACKOFF_BASE"].description


def test_every_check_id_in_the_source_is_on_the_checks_page():
    in_source = pgqueue_docs.check_ids_in_source()
    assert {"pgqueue.E001", "pgqueue.W107"} <= in_source  # the scan finds them at all
    page = "\n".join(pgqueue_docs.checks_rst())
    missing = sorted(i for i in in_source if f".. check:: {i}\n" not in page)
    assert not missing, f"check ids missing from the system checks reference: {missing}"
    with_message = {m.id for m in pgqueue_docs.check_messages()}
    unexplained = sorted(in_source - with_message)
    assert not unexplained, (
        f"{unexplained}: no checks.Error/Warning(..., id=...) or (id, message, hint) "
        "found for these ids; the checks reference cannot show their message"
    )


# One entry for each problem a schedule entry can have (schedules.spec); the
# schedule declared twice (configured) is added by the test.
BAD_SCHEDULES = {
    "bad name": {"every": 5, "topic": "t"},
    "not-a-dict": 5,
    "unknown": {"every": 5, "topic": "t", "evry": 5},
    "both": {"cron": "0 3 * * *", "every": 5, "topic": "t", "task": "a.b"},
    "neither": {"queue": "q"},
    "cron-type": {"cron": 5, "topic": "t"},
    "cron-fields": {"cron": "0 3 * *", "topic": "t"},
    "cron-bad": {"cron": "0 25 * * *", "topic": "t"},
    "every": {"every": 0.5, "topic": "t"},
    "topic": {"every": 5, "topic": ""},
    "task": {"every": 5, "task": "nodots"},
    "payload-task": {"every": 5, "task": "a.b", "payload": {}},
    "payload-json": {"every": 5, "topic": "t", "payload": {1: "x"}},
    "args-topic": {"every": 5, "topic": "t", "args": [1]},
    "args-type": {"every": 5, "task": "a.b", "args": 1},
    "kwargs-topic": {"every": 5, "topic": "t", "kwargs": {}},
    "kwargs-type": {"every": 5, "task": "a.b", "kwargs": {1: 2}},
    "queue": {"every": 5, "topic": "t", "queue": "bad queue"},
    "priority": {"every": 5, "topic": "t", "priority": 101},
    "zone-type": {"every": 5, "topic": "t", "timezone": ""},
    "zone": {"every": 5, "topic": "t", "timezone": "Nowhere/Land"},
    "backfill": {"every": 5, "topic": "t", "backfill": -5},
    "enabled": {"every": 5, "topic": "t", "enabled": "yes"},
}


def _shown_as(form, text):
    """Whether ``text`` is what the reference's ``form`` shows, each ``…``
    standing for a value known only when the check runs."""
    pattern = ".*".join(re.escape(part) for part in form.split(PLACEHOLDER))
    return re.fullmatch(pattern, text, re.S) is not None


def test_the_schedule_check_is_shown_with_every_problem_it_reports():
    """pgqueue.E110's message is made of the problem the schedule has: the
    reference shows each problem and its hint, not a placeholder, and every
    error the check really makes is one of the forms shown."""
    from django.test import override_settings

    from django_pgqueue import handler, registry
    from django_pgqueue.checks import check_schedules

    documented = [m for m in pgqueue_docs.check_messages() if m.id == "pgqueue.E110"]
    forms = [(text, m.hint.split(" / ")) for m in documented for text in m.messages]
    bare = [text for text, _ in forms if text.endswith(f"]: {PLACEHOLDER}.")]
    assert not bare, f"E110 shown without its problem: {bare}"
    assert PLACEHOLDER not in [h for _, hints in forms for h in hints]

    @handler("twice", schedule=60)
    def twice(message):
        pass

    try:
        schedules = {**BAD_SCHEDULES, "twice": {"every": 5, "topic": "t"}}
        with override_settings(PGQUEUE={"SCHEDULES": schedules}):
            errors = [e for e in check_schedules() if e.id == "pgqueue.E110"]
    finally:
        registry.unregister("twice")
    assert len(errors) >= len(schedules), [e.msg for e in errors]
    unshown = [
        (error.msg, error.hint)
        for error in errors
        if not any(
            _shown_as(text, error.msg) and any(_shown_as(h, error.hint) for h in hints)
            for text, hints in forms
        )
    ]
    assert not unshown, f"E110 errors the reference does not show: {unshown}"


def test_every_signal_is_documented_with_where_it_is_sent():
    from django_pgqueue import signals

    names = pgqueue_docs.signal_names()
    assert sorted(names) == sorted(
        name for name, value in vars(signals).items() if isinstance(value, Signal)
    )
    page = "\n".join(pgqueue_docs.signals_rst())
    sent = {send.signal for send in pgqueue_docs.signal_sends()}
    for name in names:
        assert f".. data:: {name}\n   :module: django_pgqueue.signals\n" in page
    assert not set(names) - sent, f"no send of {set(names) - sent} found in the package"


def test_every_public_name_is_in_the_api_reference():
    import django_pgqueue

    page = "\n".join(pgqueue_docs.api_rst())
    for name in django_pgqueue.__all__:
        assert re.search(rf"^\.\. auto\w+:: django_pgqueue\.{name}$", page, re.M), name


def test_every_command_option_is_in_the_commands_reference():
    import argparse

    page = "\n".join(pgqueue_docs.commands_rst())

    def options(parser, program):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    yield from options(subparser, f"{program} {sub}")
            elif action.dest not in pgqueue_docs.COMMON_OPTIONS:
                yield program, (action.option_strings or [action.metavar or action.dest])[-1]

    count = 0
    for name, command in pgqueue_docs.commands():
        assert f".. program:: {name}\n" in page
        for program, option in options(command.create_parser("manage.py", name), name):
            block = page.split(f".. program:: {program}\n", 1)[1].split(".. program::", 1)[0]
            assert re.search(rf"^\.\. option:: .*{re.escape(option)}\b", block, re.M), (
                program,
                option,
            )
            count += 1
    assert count > 20


def test_the_worker_metrics_in_the_reference_are_those_a_worker_serves():
    pytest.importorskip("prometheus_client")
    from django_pgqueue.observability.metrics import WorkerMetrics

    documented = {
        m.name: (m.kind, m.labels)
        for m in pgqueue_docs.metrics("django_pgqueue.observability.metrics")
    }
    served = {}
    metrics = WorkerMetrics()
    for collector in vars(metrics).values():
        if hasattr(collector, "_labelnames"):
            served[collector._name] = (collector._type, list(collector._labelnames))
    assert documented == served


@pytest.mark.django_db
def test_the_database_metrics_in_the_reference_are_those_a_scrape_serves(make_message):
    pytest.importorskip("prometheus_client")
    from django_pgqueue.observability.scrape import DatabaseCollector

    make_message()  # one labelled sample at least
    documented = {
        m.name: (m.kind, m.labels)
        for m in pgqueue_docs.metrics("django_pgqueue.observability.scrape")
    }
    served = {}
    for family in DatabaseCollector().collect():
        labels = sorted({key for sample in family.samples for key in sample.labels})
        served[family.name] = (family.type, labels)
    assert set(documented) == set(served)
    for name, (kind, labels) in served.items():
        assert documented[name][0] == kind, name
        if labels:  # a family with no sample shows no label
            assert sorted(documented[name][1]) == labels, name


def test_every_url_is_in_the_endpoints_reference():
    from django_pgqueue import urls

    page = "\n".join(pgqueue_docs.endpoints_rst())
    for pattern in urls.urlpatterns:
        assert f"``{urls.app_name}:{pattern.name}``" in page
    assert ":setting:`METRICS_ACCESS`" in page and ":setting:`HEALTH_ACCESS`" in page


def test_prose_from_the_code_is_escaped_and_linked_for_rest():
    from pgqueue_docs.source import rst_text

    text = (
        "unless the matching *_ACCESS is `token`; see name_ and MAX_ATTEMPTS, "
        "PGQUEUE['QUEUES'], PGQUEUE['QUEUES'][0], ``literal_ *x*`` and --burst or --queues=a,b"
    )
    assert rst_text(text) == (
        r"unless the matching \*_ACCESS is \`token\`; see name\_ and :setting:`MAX_ATTEMPTS`, "
        ":setting:`PGQUEUE['QUEUES'] <QUEUES>`, PGQUEUE['QUEUES'][0], ``literal_ *x*`` "
        "and ``--burst`` or ``--queues=a,b``"
    )
    # A setting's own text does not link to itself (NOTIFY is also SQL's).
    assert rst_text("Send a NOTIFY wake-up", own="NOTIFY") == "Send a NOTIFY wake-up"
