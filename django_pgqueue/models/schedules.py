"""The periodic schedules' tables (``PGQUEUE["SCHEDULES"]``, ``@handler(schedule=)``).

- ``ScheduleTick``: the tick ledger, one row per tick that was enqueued. Its
  unique (schedule, tick) constraint is what makes a tick one message however
  many workers run the scheduler: the row and the message are written in one
  transaction, and a second writer's row conflicts.
- ``Schedule``: what is decided at run time about a schedule (paused or
  resumed, which wins over the setting's ``enabled`` until reset) and where
  its ticks were skipped. Its row is also what the schedulers lock, so that
  one at a time works on a schedule.

The schedules themselves (expression, topic, time zone...) live in the
settings and the code, never in these tables.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.fields import DateTimeField

# A schedule declared on a handler is named after its topic.
SCHEDULE_NAME_MAX_LENGTH = conf.TOPIC_MAX_LENGTH


class Schedule(models.Model):
    """A schedule's run-time state: one row per schedule that a scheduler,
    the admin or a command has seen (the admin's Schedules page lists them).

    ``enabled`` None: the setting's ``enabled`` decides. False (paused) or
    True (resumed) was set from the admin or ``pgqueue_schedules`` and wins
    over the setting until it is reset; it survives restarts and deploys.

    ``skipped_through``: every tick up to this instant was skipped on
    purpose, because it was older than the schedule's backfill when a
    scheduler got to it (after downtime) or fell due while the schedule was
    paused; the next tick enqueued comes after it. ``skipped`` counts the
    ticks skipped after downtime (not those of a pause).
    """

    name = models.CharField(max_length=SCHEDULE_NAME_MAX_LENGTH, primary_key=True)
    enabled = models.BooleanField(
        null=True,
        blank=True,
        help_text="Paused (False) or resumed (True) at run time; None follows the setting.",
    )
    changed_at = DateTimeField(null=True, blank=True)
    changed_by = models.CharField(max_length=150, blank=True, db_default="")
    skipped_through = DateTimeField(null=True, blank=True)
    skipped = models.BigIntegerField(db_default=0)

    class Meta:
        verbose_name = "schedule"
        permissions = [
            ("pause_schedule", "Can pause a schedule"),
            ("resume_schedule", "Can resume a schedule"),
            ("run_schedule", "Can run a schedule now"),
        ]

    def __str__(self) -> str:
        return self.name


class ScheduleTick(models.Model):
    """A tick of a schedule that was enqueued, with its message's id.

    Kept per schedule for the newest ticks (the admin's "last tick") and for
    as long as a scheduler may still try to enqueue the tick (its backfill
    window); older rows are pruned by the schedulers.
    """

    schedule = models.CharField(max_length=SCHEDULE_NAME_MAX_LENGTH)
    tick = DateTimeField()
    message_id = models.BigIntegerField(null=True, blank=True)
    enqueued_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = "schedule tick"
        constraints = [
            # One message per tick, whoever enqueues it. It also serves the
            # look-ups of a schedule's latest tick and the pruning.
            models.UniqueConstraint(fields=["schedule", "tick"], name="pgqueue_schedule_tick_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.tick.isoformat()}"
