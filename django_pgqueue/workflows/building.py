"""Building a workflow in memory: ``Workflow.add`` and ``add_task``, and
Celery's canvas (``step``, ``chain``, ``group``, ``chord``) on the same
graph. Everything a step is given is checked when it is added
(``steps.make_step``); the graph as a whole (names that ``after`` gives,
cycles) when it is enqueued. Nothing is written before
``Workflow.enqueue()``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from asgiref.sync import sync_to_async

from django_pgqueue.exceptions import WorkflowError
from django_pgqueue.models.workflows import NAME_MAX_LENGTH
from django_pgqueue.workflows import storing
from django_pgqueue.workflows.runs import WorkflowRun
from django_pgqueue.workflows.steps import Step, find_cycle, make_step


class Workflow:
    """Steps and what each waits for, enqueued together:

    .. code-block:: python

        wf = Workflow(name="import 42")
        fetch = wf.add("etl.fetch", {"file": 42}, name="fetch")
        parts = [wf.add("etl.parse", {"part": i}, after=[fetch]) for i in range(8)]
        wf.add("etl.report", {}, name="report", after=parts)
        run = wf.enqueue()
    """

    def __init__(self, name: str = "") -> None:
        if not isinstance(name, str):
            raise WorkflowError(f"a workflow's name is a string, not {name!r}")
        if len(name) > NAME_MAX_LENGTH:
            raise WorkflowError(f"a workflow's name is at most {NAME_MAX_LENGTH} characters")
        self.name = name
        self.steps: dict[str, Step] = {}

    def __repr__(self) -> str:
        return f"<Workflow {self.name!r}: {len(self.steps)} step(s)>"

    def add(
        self,
        topic: str,
        payload: Any = None,
        *,
        name: str | None = None,
        after: Iterable[Step | str] | Step | str = (),
        allow_failed: bool = False,
        **options: Any,
    ) -> Step:
        """Add a step: a message for ``topic`` (``options``: enqueue()'s
        keywords but ``dedup_key``) that runs once every step of ``after``
        (steps of this workflow, or their names) has finished; if one of
        them failed, it is cancelled, unless ``allow_failed``. Returns the
        step, for later steps' ``after``."""
        built = make_step(
            topic, payload, name=name, after=after, allow_failed=allow_failed, **options
        )
        return self._attach(built)

    def add_task(
        self,
        task: Any,
        *args: Any,
        name: str | None = None,
        after: Iterable[Step | str] | Step | str = (),
        allow_failed: bool = False,
        **kwargs: Any,
    ) -> Step:
        """Add a Django task (``django.tasks``, on django-pgqueue's backend)
        as a step, called with ``args`` and ``kwargs``; its result is the
        task's return value."""
        # Duck-typed: this layer does not import the Tasks backend (a duty,
        # above it); its workflow_step() checks the task as enqueue() would.
        backend = task.get_backend() if callable(getattr(task, "get_backend", None)) else None
        workflow_step = getattr(backend, "workflow_step", None)
        if workflow_step is None:
            raise WorkflowError(
                f"add_task() takes a Django task (@task) of a django_pgqueue.tasks.PgQueueBackend "
                f"backend, not {task!r}"
            )
        task_result, message, write_record = workflow_step(task, list(args), kwargs)
        fields = dict(message)
        built = make_step(
            fields.pop("topic"),
            fields.pop("payload"),
            name=name,
            after=after,
            allow_failed=allow_failed,
            **fields,
        )
        built.task_result, built.write_record = task_result, write_record
        return self._attach(built)

    def _attach(self, built: Step) -> Step:
        """Make ``built`` a step of this workflow (named, if it was not)."""
        if built.workflow is not None and built.workflow is not self:
            raise WorkflowError(f"{built!r} is a step of another workflow already")
        if built.name is None:
            built.name = self._generated_name(built.topic)
            built.generated_name = True
        elif built.name in self.steps:
            raise WorkflowError(f"this workflow has a step named {built.name!r} already")
        for item in built.after:
            if isinstance(item, Step) and item.workflow is not self:
                raise WorkflowError(
                    f"step {built.name!r} follows {item!r}, which is not a step of this workflow"
                )
        built.workflow = self
        self.steps[built.name] = built
        return built

    def _generated_name(self, topic: str) -> str:
        n = len(self.steps) + 1
        while f"{topic}-{n}" in self.steps:
            n += 1
        return f"{topic}-{n}"

    def enqueue(self, using: str | None = None) -> WorkflowRun:
        """Write the workflow and all its steps, in the caller's transaction
        (``using``: its alias): a commit publishes every step, a rollback
        none. The steps that follow none are ready at once; the others are
        held until every step they follow has finished."""
        graph = self.graph()
        run = WorkflowRun(None, storing.database_of(list(self.steps.values())))

        def written(pk: int) -> None:
            run.pk = pk

        storing.write(self.name, list(self.steps.values()), graph, using, written)
        return run

    async def aenqueue(self, using: str | None = None) -> WorkflowRun:
        """``enqueue()`` for async code: the same argument, checks, errors
        (``WorkflowError``, ``InvalidMessage``) and ``WorkflowRun``. It runs
        ``enqueue()`` through ``sync_to_async(thread_sensitive=True)``, on
        the connection of your sync ORM code: in the transaction that sync
        code opened there, else committed at once (docs: *Async code*)."""
        return await sync_to_async(self.enqueue, thread_sensitive=True)(using)

    def graph(self) -> dict[str, list[str]]:
        """{step name: names of the steps it follows}, checked: every name
        known, no step following itself, no cycle."""
        if not self.steps:
            raise WorkflowError("a workflow needs at least one step")
        graph: dict[str, list[str]] = {}
        for name, built in self.steps.items():
            names: dict[str, None] = {}  # in order, each once (a join may follow thousands)
            for item in built.after:
                other = str(item.name) if isinstance(item, Step) else item
                if other not in self.steps:
                    raise WorkflowError(
                        f"step {name!r} follows {other!r}, which is not a step of this workflow"
                    )
                names[other] = None
            graph[name] = list(names)
        cycle = find_cycle(graph)
        if cycle:
            raise WorkflowError("the steps wait for each other in a cycle: " + " -> ".join(cycle))
        return graph

    # The canvas's view of a workflow: where it starts and where it ends.
    def entries(self) -> list[Step]:
        return [s for s in self.steps.values() if not s.after]

    def exits(self) -> list[Step]:
        followed = {
            item.name if isinstance(item, Step) else item
            for s in self.steps.values()
            for item in s.after
        }
        return [s for s in self.steps.values() if s.name not in followed]


# Celery's canvas on the same machinery.


def step(
    topic: str,
    payload: Any = None,
    *,
    name: str | None = None,
    allow_failed: bool = False,
    **options: Any,
) -> Step:
    """A step not in any workflow yet, for ``chain``, ``group`` and
    ``chord`` (Celery's signature, ``task.s()``)."""
    return make_step(topic, payload, name=name, allow_failed=allow_failed, **options)


Part = Step | Workflow


def chain(*parts: Part, name: str = "") -> Workflow:
    """Each part after the one before (Celery's ``chain``): a part is a step
    or a workflow (a group, a chord, another chain)."""
    return _compose(parts, name, sequential=True)


def group(*parts: Part, name: str = "") -> Workflow:
    """The parts side by side (Celery's ``group``)."""
    return _compose(parts, name, sequential=False)


def chord(header: Part | Sequence[Part], body: Part, name: str = "") -> Workflow:
    """``body`` after every part of ``header`` (Celery's ``chord``); the
    header is a group, or a list of parts to run side by side."""
    first = group(*header) if isinstance(header, list | tuple) else header
    if not isinstance(first, Step | Workflow):
        raise WorkflowError(f"chord() takes a group or a list of steps first, not {header!r}")
    return chain(first, body, name=name)


def _compose(parts: Sequence[Part], name: str, sequential: bool) -> Workflow:
    if not parts:
        raise WorkflowError("chain() and group() need at least one step")
    composed = Workflow(name=name)
    previous_exits: list[Step] = []
    for part in parts:
        entries, exits = _merge(composed, part)
        if sequential:
            for entry in entries:
                entry.after = [*entry.after, *previous_exits]
            previous_exits = exits
        else:
            previous_exits += exits
    return composed


def _merge(into: Workflow, part: Part) -> tuple[list[Step], list[Step]]:
    """Copy ``part``'s steps into ``into``; returns the copies of its entries
    and exits. A step may appear in one composition only once."""
    if isinstance(part, Step):
        if part.workflow is not None:
            raise WorkflowError(f"{part!r} is a step of a workflow already")
        copy = _copy(part, [])
        into._attach(copy)
        return [copy], [copy]
    if not isinstance(part, Workflow):
        raise WorkflowError(
            f"chain(), group() and chord() take steps (step(...)) and workflows, not {part!r}"
        )
    part.graph()  # checked as it is: names known, no cycle
    entries = {s.name for s in part.entries()}
    exits = {s.name for s in part.exits()}
    renamed: dict[str, Step] = {}
    for original in part.steps.values():
        copy = _copy(original, [])
        if original.name in into.steps:
            if not original.generated_name:
                raise WorkflowError(
                    f"two steps are named {original.name!r}: names are unique in a workflow"
                )
            copy.name = None  # a generated name: generated again here
        into._attach(copy)
        renamed[str(original.name)] = copy
    for original in part.steps.values():
        renamed[str(original.name)].after = [
            renamed[str(item.name) if isinstance(item, Step) else item] for item in original.after
        ]
    return [renamed[n] for n in renamed if n in entries], [
        renamed[n] for n in renamed if n in exits
    ]


def _copy(original: Step, after: list[Step | str]) -> Step:
    return Step(
        row=original.row,
        name=original.name,
        after=after,
        allow_failed=original.allow_failed,
        task_result=original.task_result,
        write_record=original.write_record,
        generated_name=original.generated_name,
    )
