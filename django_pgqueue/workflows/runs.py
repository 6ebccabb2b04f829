"""A stored workflow's handle (``WorkflowRun``): what ``Workflow.enqueue()``
returns, ``workflow(pk)`` loads, and a step's handler finds as
``message.workflow`` (then it also knows its step: the results of the steps
it follows, and the steps it adds)."""

from __future__ import annotations

from typing import Any

from django.db import connections, transaction

from django_pgqueue import conf
from django_pgqueue.exceptions import WorkflowError
from django_pgqueue.lifecycle.cancel import CancelResult
from django_pgqueue.models import Message, Status
from django_pgqueue.models.workflows import StepState, Workflow, WorkflowDependency, WorkflowStep
from django_pgqueue.sql import workflows as workflows_sql
from django_pgqueue.workflows.steps import Step, after_list, find_cycle, make_step


class WorkflowRun:
    """A handle on a stored workflow. ``pk`` is None until the workflow is
    written (on another database than the caller's: at its commit)."""

    def __init__(self, pk: int | None, using: str | None = None, step_id: int | None = None):
        self._pk = pk
        self.using = using or conf.database_alias()
        # Inside a step's handler: that step, and the steps its handler adds
        # (written with its acknowledgement: worker's bookkeeping.finish).
        self.step_id = step_id
        self.added: list[Step] = []
        self._taken: set[str | None] = set()  # the names of the added steps
        self._names: dict[str, str] | None = None  # the stored steps' names and states
        self._step_name: str | None = None

    @classmethod
    def of_step(cls, step_id: int, using: str | None = None) -> WorkflowRun:
        """The handle a step's handler finds as ``message.workflow``: its
        workflow's id is looked up when first needed."""
        return cls(None, using, step_id)

    @property
    def pk(self) -> int | None:
        if self._pk is None and self.step_id is not None:
            self._pk = (
                WorkflowStep.objects.using(self.using)
                .filter(pk=self.step_id)
                .values_list("workflow_id", flat=True)
                .first()
            )
        return self._pk

    @pk.setter
    def pk(self, value: int | None) -> None:
        self._pk = value

    def __repr__(self) -> str:
        return f"<WorkflowRun {self.pk}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkflowRun) and other.pk == self.pk and self.pk is not None

    def __hash__(self) -> int:
        return hash(("WorkflowRun", self.pk))

    def _stored(self) -> Workflow:
        found = Workflow.objects.using(self.using).filter(pk=self._id()).first()
        if found is None:
            raise WorkflowError(f"no workflow with id {self.pk} (finished ones are pruned)")
        return found

    def _id(self) -> int:
        pk = self.pk
        if pk is None:
            raise WorkflowError("the workflow is written at the caller's commit; it has no id yet")
        return pk

    @property
    def name(self) -> str:
        return self._stored().name

    def status(self) -> str:
        """ "running", "blocked", "done", "failed" or "cancelled"."""
        return self._stored().status

    def steps(self) -> dict[str, str]:
        """{step name: state}: "held", "waiting" (ready or delayed),
        "processing", "done", "dead_lettered" or "cancelled"."""
        pk = self._stored().pk
        rows = WorkflowStep.objects.using(self.using).filter(workflow_id=pk).order_by("id")
        states: dict[str, str] = dict(rows.values_list("name", "state"))
        released: dict[int, str] = {
            message_id: name
            for message_id, name in rows.filter(state=StepState.RELEASED).values_list(
                "message_id", "name"
            )
            if message_id is not None
        }
        processing = set(
            Message.objects.using(self.using)
            .filter(pk__in=list(released), status=Status.PROCESSING)
            .values_list("pk", flat=True)
        )
        for message_id, name in released.items():
            states[name] = "processing" if message_id in processing else "waiting"
        return states

    def cancel(self, *, by: str = "") -> CancelResult:
        """Cancel every step that has not ended: held and dead-lettered ones
        at once, those in the queue as ``cancel()`` does (running ones are
        told). Returns the counts, as cancel() does."""
        from django_pgqueue.deadletters.resolution import resolve
        from django_pgqueue.lifecycle.cancel import cancel

        self._stored()
        result = CancelResult()
        with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
            cursor.execute(workflows_sql.CANCEL_SQL, [self.pk])
            if cursor.fetchone() is None:
                return result  # ended already: nothing to cancel (all counts 0)
            cursor.execute(workflows_sql.UNFINISHED_STEPS_SQL, [self.pk])
            step_ids = [row[0] for row in cursor.fetchall()]
            cursor.execute(workflows_sql.DEAD_LETTERS_OF_STEPS_SQL, [step_ids])
            dead_letters = [row[0] for row in cursor.fetchall()]
            cursor.execute(workflows_sql.GIVEN_UP_SQL, [step_ids])
            in_queue = cursor.fetchone()[0] or []
            if dead_letters:
                # Their steps have ended: the dead letters are closed with
                # them (a revive would run a step of no workflow any more).
                resolve(dead_letters, note=f"workflow {self.pk} cancelled", by=by)
        result.cancelled = len(step_ids) - len(in_queue)
        if in_queue:
            # Their steps have ended as cancelled; now their messages.
            messages = cancel(in_queue, by=by)
            result.cancelled += messages.cancelled
            result.requested += messages.requested
            result.already += messages.already
            result.finished += messages.finished
        return result

    # Inside a step's handler.

    @property
    def step_name(self) -> str:
        """In a step's handler: the name of its step (for ``after=``)."""
        if self.step_id is None:
            raise WorkflowError("only a step's handler has a step of its own (message.workflow)")
        if self._step_name is None:
            self._step_name = (
                WorkflowStep.objects.using(self.using)
                .filter(pk=self.step_id)
                .values_list("name", flat=True)
                .get()
            )
        return self._step_name

    def results(self) -> dict[str, Any]:
        """{step name: result} of the steps this step follows that are done
        (one that failed, for a step that allows it, has no entry)."""
        if self.step_id is None:
            raise WorkflowError("results() is for a step's handler; use result(name)")
        followed = WorkflowDependency.objects.using(self.using).filter(step_id=self.step_id)
        return dict(
            WorkflowStep.objects.using(self.using)
            .filter(pk__in=followed.values("after_id"), state=StepState.DONE)
            .values_list("name", "result")
        )

    def result(self, name: str) -> Any:
        """The result of the finished step ``name``."""
        self._stored()
        found = (
            WorkflowStep.objects.using(self.using)
            .filter(workflow_id=self._id(), name=name)
            .values_list("state", "result")
            .first()
        )
        if found is None:
            raise WorkflowError(f"workflow {self.pk} has no step named {name!r}")
        state, value = found
        if state != StepState.DONE:
            raise WorkflowError(f"step {name!r} of workflow {self.pk} is not done ({state})")
        return value

    def add(
        self,
        topic: str,
        payload: Any = None,
        *,
        name: str | None = None,
        after: Any = (),
        allow_failed: bool = False,
        **options: Any,
    ) -> Step:
        """From a step's handler: add a step to this workflow, written with
        the handler's acknowledgement (rolled back with it). ``after`` may
        name the steps added so far, this step, or steps that are done."""
        current = self.step_name
        built = make_step(
            topic, payload, name=name, after=after_list(after), allow_failed=allow_failed, **options
        )
        taken = self._taken
        if built.name is None:
            built.name = self._generated_name(built.topic, taken)
        home = conf.queue_database(built.row.options.queue)
        if home != self.using:
            raise WorkflowError(
                f"step {built.name!r} is on queue {built.row.options.queue!r}, whose database "
                f"is {home!r}; workflow {self.pk} is on {self.using!r}, and a workflow's steps "
                "are all on queues of one database"
            )
        existing = self._existing()
        if built.name in taken or built.name in existing:
            raise WorkflowError(f"workflow {self.pk} has a step named {built.name!r} already")
        for other in self._after_names(built):
            if other in taken or other == current:
                continue
            state = existing.get(other)
            if state is None:
                raise WorkflowError(
                    f"step {built.name!r} follows {other!r}, which is not a step of workflow "
                    f"{self.pk} (nor one added by this handler)"
                )
            if state != StepState.DONE:
                raise WorkflowError(
                    f"step {built.name!r} may follow steps added here, this step, or done "
                    f"ones; {other!r} is {state}"
                )
        taken.add(built.name)
        self.added.append(built)
        return built

    def _existing(self) -> dict[str, str]:
        """{name: state} of the workflow's stored steps, read once per
        handle (a handler adding thousands of steps checks each in memory)."""
        if self._names is None:
            self._names = dict(
                WorkflowStep.objects.using(self.using)
                .filter(workflow_id=self._id())
                .values_list("name", "state")
            )
        return self._names

    def _after_names(self, built: Step) -> list[str]:
        return [str(item.name) if isinstance(item, Step) else item for item in built.after]

    def _generated_name(self, topic: str, taken: set[str | None]) -> str:
        base = f"{self.step_name}/{topic}"
        n = len(taken) + 1
        while f"{base}-{n}" in taken:
            n += 1
        return f"{base}-{n}"

    def added_graph(self) -> dict[str, list[str]]:
        """The added steps' edges by name, checked for a cycle among them."""
        graph = {str(s.name): self._after_names(s) for s in self.added}
        cycle = find_cycle({n: [a for a in f if a in graph] for n, f in graph.items()})
        if cycle:
            raise WorkflowError(
                "the added steps wait for each other in a cycle: " + " -> ".join(cycle)
            )
        return graph


def workflow(pk: int, using: str | None = None) -> WorkflowRun:
    """The stored workflow ``pk`` (a handle, as ``Workflow.enqueue()``
    returns it)."""
    if not isinstance(pk, int) or isinstance(pk, bool) or pk < 1:
        raise WorkflowError(f"a workflow id is a whole number of at least 1, not {pk!r}")
    run = WorkflowRun(pk, using)
    run._stored()
    return run
