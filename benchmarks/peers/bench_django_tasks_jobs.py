"""The tasks of benchmarks/compare.py's django.tasks side (Django's @task)."""

import _common
from django.tasks import task


@task
def noop(n):
    pass


@task
def latency(key):
    _common.record_start(key)
