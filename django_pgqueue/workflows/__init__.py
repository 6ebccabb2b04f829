"""Workflows: steps that wait for other steps (chains, fan-out, fan-in),
results passed along, and dead-letter triage that resumes them.

- ``steps``: a step in memory, checked when it is made;
- ``building``: ``Workflow`` in memory, and Celery's canvas (``step``,
  ``chain``, ``group``, ``chord``);
- ``storing``: a workflow written in the caller's transaction;
- ``runs``: the handle on a stored workflow (``WorkflowRun``, ``workflow``);
- ``bookkeeping``: the steps moved with their messages (acknowledged,
  dead-lettered, revived, given up), in the same transaction;
- ``tasks``: a Django task as a step.
"""

from django_pgqueue.workflows.building import Workflow, chain, chord, group, step
from django_pgqueue.workflows.runs import WorkflowRun, workflow
from django_pgqueue.workflows.steps import Step

__all__ = ["Step", "Workflow", "WorkflowRun", "chain", "chord", "group", "step", "workflow"]
