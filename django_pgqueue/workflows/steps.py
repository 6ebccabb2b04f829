"""A workflow's step in memory (``Step``), checked when it is made
(``make_step``: enqueue()'s checks of its message, its name, what it
follows), the cycle check of a graph of steps, and a step's result as the
JSON that is stored."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django_pgqueue.exceptions import InvalidMessage, WorkflowError
from django_pgqueue.models.workflows import NAME_MAX_LENGTH
from django_pgqueue.validation import FIELD_NAMES, Row, validate

# enqueue()'s keywords a step does not take: a step is its workflow's own
# message, never one that a dedup_key would merge with another's; its
# database is its workflow's.
REFUSED_OPTIONS = {
    "dedup_key": "a step is its workflow's own message, never merged with another by a dedup_key",
    "using": "a step is written with its workflow: pass using= to Workflow.enqueue()",
}


@dataclass(eq=False)
class Step:
    """One step: its message (validated), its name, the steps it follows
    (``Step`` objects or names) and whether it runs after a failed one."""

    row: Row
    name: str | None
    after: list[Step | str] = field(default_factory=list)
    allow_failed: bool = False
    workflow: object = None  # the building.Workflow it was added to
    generated_name: bool = False  # named by the workflow (a composition may rename it)
    # A task step (Workflow.add_task): its django.tasks result, and the
    # writer of its task record, called in the workflow's transaction.
    task_result: Any = None
    write_record: Callable[[str], None] | None = None

    @property
    def topic(self) -> str:
        return self.row.options.topic

    def __repr__(self) -> str:
        return f"<Step {self.name!r} {self.topic}>"


def make_step(
    topic: str,
    payload: Any = None,
    *,
    name: str | None = None,
    after: Iterable[Step | str] | Step | str = (),
    allow_failed: bool = False,
    **options: Any,
) -> Step:
    """A checked Step, not in any workflow yet."""
    for option, why in REFUSED_OPTIONS.items():
        if option in options:
            raise InvalidMessage(f"a workflow step takes no {option}: {why}")
    unknown = sorted(set(options) - FIELD_NAMES)
    if unknown:
        raise InvalidMessage(
            f"unknown step option(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(FIELD_NAMES - set(REFUSED_OPTIONS) - {'topic', 'payload'}))}"
        )
    if name is not None:
        check_name(name)
    if not isinstance(allow_failed, bool):
        raise WorkflowError(f"allow_failed must be True or False, not {allow_failed!r}")
    row = validate({"topic": topic, "payload": payload, **options})
    return Step(row=row, name=name, after=after_list(after), allow_failed=allow_failed)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise WorkflowError(f"a step's name is a non-empty string, not {name!r}")
    if len(name) > NAME_MAX_LENGTH:
        raise WorkflowError(
            f"a step's name is at most {NAME_MAX_LENGTH} characters: {name[:40]!r}..."
        )
    return name


def after_list(after: object) -> list[Step | str]:
    """``after=`` as a list: a step, a name, or an iterable of them."""
    if isinstance(after, Step | str):
        return [after]
    if isinstance(after, dict | bytes) or not isinstance(after, Iterable):
        raise WorkflowError(f"after= takes steps or step names (or a list of them), not {after!r}")
    items = list(after)
    for item in items:
        if not isinstance(item, Step | str):
            raise WorkflowError(f"after= takes steps or step names, not {item!r}")
    return items


def find_cycle(graph: dict[str, list[str]]) -> list[str]:
    """A cycle of ``graph`` (``a -> b``: a follows b) as the names on it, the
    first repeated at the end; [] if there is none. Iterative: a workflow of
    ten thousand steps in a chain is no recursion limit."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in graph:
        if start in state:
            continue
        path: list[str] = []
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            node, index = stack.pop()
            if index == 0:
                state[node] = 1
                path.append(node)
            followed = graph[node]
            if index < len(followed):
                stack.append((node, index + 1))
                nxt = followed[index]
                if state.get(nxt) == 1:
                    return [*path[path.index(nxt) :], nxt][::-1]
                if nxt not in state:
                    stack.append((nxt, 0))
            else:
                state[node] = 2
                path.pop()
    return []


def result_json(value: object) -> str:
    """A step's result as JSON text; a value JSON cannot hold is an error
    that fails the step like any handler's."""
    from django.core.serializers.json import DjangoJSONEncoder

    try:
        return json.dumps(value, cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"a workflow step's result must be JSON-serialisable, not {type(value).__name__} "
            f"({exc})"
        ) from exc
