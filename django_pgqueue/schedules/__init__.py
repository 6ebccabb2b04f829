"""Periodic schedules: cron and interval ticks, one message per tick however
many workers run the scheduler.

The parts, from the ground up:

- ``spec``: an entry of ``PGQUEUE["SCHEDULES"]`` (or a handler's
  ``schedule=``) checked and parsed into a frozen ``ScheduleSpec``;
- ``configured``: every schedule of the project (settings and handlers);
- ``ticks``: the tick arithmetic, pure functions of the spec and ``now``
  (which ticks are due, which were missed for good, the next one);
- ``state``: the database side: the run-time state rows (pause, resume,
  reset), the tick ledger's look-ups and pruning, and "this tick, once";
- ``runs``: a scheduler round (every due tick of every schedule enqueued
  once, in the transaction that records it) and "run now".

This package module imports nothing, so that each part can be imported on
its own floor of the layers (ARCHITECTURE.rst).
"""
