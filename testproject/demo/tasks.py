"""Example tasks for Django's Tasks framework (Django 6.x only: this module
imports django.tasks). ``TASKS["default"]`` is django-pgqueue's backend
(testproject/settings.py); the tests run the same tasks on Django's
ImmediateBackend (``.using(backend="immediate")``) to compare the results.
"""

import django
from django.tasks import task

from .models import Handled


def no_wait(exception, task_result):
    """A backoff: retry at once (the tests need no waiting)."""
    return 0


def give_up(exception, task_result):
    """A backoff that refuses any retry."""
    return None


@task
def add(a, b):
    return a + b


@task(priority=10, queue_name="tasks")
def echo(*args, **kwargs):
    return {"args": args, "kwargs": kwargs}


@task
async def async_add(a, b):
    return a + b


@task(takes_context=True)
def whoami(context, label):
    return {
        "label": label,
        "attempt": context.attempt,
        "id": context.task_result.id,
        "status": context.task_result.status,
    }


@task
def fail(text):
    raise ValueError(text)


@task
def record(message_id, then_fail=False):
    """Write a ledger row, then fail if asked: the write must roll back with it."""
    Handled.objects.create(message_id=message_id, topic="demo.task", attempt=0, pid=0)
    if then_fail:
        raise ValueError("failed after writing")
    return message_id


# @task(max_attempts=..., backoff=...) needs Django 6.1, whose task() hands
# options it does not know to the backend's task_class (PgQueueTask); on 6.0
# retries come from the backend's OPTIONS (TASKS["retrying"]).
if django.VERSION >= (6, 1):

    @task(takes_context=True, max_attempts=4, backoff=no_wait)
    def flaky(context, failures):
        """Fails with ConnectionError on its first ``failures`` attempts."""
        if context.attempt <= failures:
            raise ConnectionError(f"down on attempt {context.attempt}")
        return context.attempt

    @task(max_attempts=5, backoff=give_up)
    def refused():
        raise ConnectionError("down, and the backoff gives up")


@task
def down():
    """Always fails (DEPENDENCY): its retries come from the backend it runs on."""
    raise ConnectionError("still down")


@task(takes_context=True)
def sleepy(context, seconds):
    import time

    time.sleep(seconds)
    return context.attempt


class Halt(BaseException):
    """A BaseException that is not an Exception, as some libraries raise."""


@task
def halt(kind):
    """Raises a BaseException that is not an Exception (SystemExit & co.)."""
    if kind == "exit":
        raise SystemExit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt("interrupted")
    raise Halt("halted")


@task(takes_context=True)
def kill_own_process(context, times):
    """Kills the worker process running it (SIGKILL) on its first ``times``
    attempts; then returns the attempt it is. Only for real worker processes."""
    import os
    import signal

    if context.attempt <= times:
        os.kill(os.getpid(), signal.SIGKILL)
    return context.attempt


@task
def drop_task_connections():
    """Terminates this process's connections for task bookkeeping (as a
    server restart or a pooler would): the next task must reconnect."""
    import os

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            [f"pgqueue_tasks#{os.getpid()}"],
        )
        return cursor.fetchone()[0]


@task(takes_context=True)
def total_of_results(context, extra=0):
    """A workflow's task step: the sum of the results of the steps it follows
    (its context's workflow, as a handler's message.workflow), plus extra."""
    return sum(context.workflow.results().values()) + extra
