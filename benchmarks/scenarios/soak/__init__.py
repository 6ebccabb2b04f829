"""The soak scenario's measurements: a million messages through a worker on a server
with autovacuum on.

- ``probe``: the claim of a fixed backlog, timed in this process (wall clock
  and the server backend's CPU time), with its plan;
- ``sizes``: the queue table's and the history's sizes and vacuum counters.
"""

from benchmarks.harness.db import MESSAGE_TABLE

QUEUE = "default"  # the queue the worker drains and the probe claims from
HISTORY_TABLE = "django_pgqueue_finishedmessage"
TABLES = (MESSAGE_TABLE, HISTORY_TABLE)
