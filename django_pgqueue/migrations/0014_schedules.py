"""Periodic schedules: the tick ledger (one row per enqueued tick, unique per
schedule and tick, so a tick is one message however many workers schedule)
and each schedule's run-time state (paused or resumed, skipped ticks)."""

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0013_lease_always_set_and_task_start"),
    ]

    operations = [
        migrations.CreateModel(
            name="Schedule",
            fields=[
                ("name", models.CharField(max_length=200, primary_key=True, serialize=False)),
                (
                    "enabled",
                    models.BooleanField(
                        blank=True,
                        help_text="Paused (False) or resumed (True) at run time; None follows "
                        "the setting.",
                        null=True,
                    ),
                ),
                ("changed_at", models.DateTimeField(blank=True, null=True)),
                ("changed_by", models.CharField(blank=True, db_default="", max_length=150)),
                ("skipped_through", models.DateTimeField(blank=True, null=True)),
                ("skipped", models.BigIntegerField(db_default=0)),
            ],
            options={
                "verbose_name": "schedule",
                "permissions": [
                    ("pause_schedule", "Can pause a schedule"),
                    ("resume_schedule", "Can resume a schedule"),
                    ("run_schedule", "Can run a schedule now"),
                ],
            },
        ),
        migrations.CreateModel(
            name="ScheduleTick",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("schedule", models.CharField(max_length=200)),
                ("tick", models.DateTimeField()),
                ("message_id", models.BigIntegerField(blank=True, null=True)),
                (
                    "enqueued_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "schedule tick",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("schedule", "tick"), name="pgqueue_schedule_tick_uniq"
                    )
                ],
            },
        ),
    ]
