"""A backend for Django's Tasks framework (``django.tasks``, Django 6.0+).

::

    TASKS = {"default": {"BACKEND": "django_pgqueue.tasks.PgQueueBackend"}}

A task is a message of the reserved topic ``pgqueue.task`` (``TASK_TOPIC``)
whose payload names the task and its arguments, plus a ``TaskRecord`` row
that holds its result. Both are written in the caller's transaction on the
queue's database (or, when the queue lives on another alias, together at the
caller's commit), so a task enqueued in a transaction that rolls back never
runs and never existed. ``pgqueue_worker`` runs it like any message: the
failure policy, retries, dead letters and admin triage are the messages'.

States (``get_result``): the record says SUCCESSFUL once the handler's
transaction committed; until then the state is read from the task's message
(waiting: READY, leased: RUNNING) or, once it has left the queue, from its
dead letter (FAILED; a revived dead letter points at the new message, READY
again).

Retries: ``max_attempts`` and ``backoff(exception, task_result) -> seconds |
None`` (the shape of django/new-features#142), given to ``@task`` on Django
6.1 (``PgQueueTask``) or as ``OPTIONS`` ``MAX_ATTEMPTS`` / ``BACKOFF`` of the
backend (every Django 6.x). Without them, the ``PGQUEUE`` settings apply, as
to any message.

The modules: ``backend`` (PgQueueBackend: validation, enqueue, get_result),
``runner`` (the handler that runs a task, and its start mark), ``failures``
(the failed attempts, recorded once the worker has recorded the message's
failure), ``results`` (a record read as a TaskResult), ``errors`` (the
TaskErrors of failed attempts), ``options`` (the task's topic and retries).

This package imports ``django.tasks``: only Django 6.0+ may import it (the
app's ``ready()`` does so when a ``TASKS`` backend is one of ours).
"""

# The runner's handler and the failures' receivers register on import.
from django_pgqueue.tasks import failures, runner  # noqa: F401
from django_pgqueue.tasks.backend import PgQueueBackend, PgQueueTask
from django_pgqueue.tasks.options import OPTION_NAMES, TASK_TOPIC
from django_pgqueue.tasks.results import MAX_REVIVE_CHAIN

__all__ = ["MAX_REVIVE_CHAIN", "OPTION_NAMES", "TASK_TOPIC", "PgQueueBackend", "PgQueueTask"]
