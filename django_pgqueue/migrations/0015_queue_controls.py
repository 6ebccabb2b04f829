"""Run-time control of the queues: pause and resume, limits (QueueState), the
starts of rate-limited queues (QueueStart), and cancelled messages.

A cancelled message keeps its row, in the status "cancelled", until
CANCELLED_RETENTION has passed (an index of those rows serves the pruning);
``cancel_requested_at`` marks a processing message whose cancellation was
asked for. No index of the claim holds a cancelled row, and neither the
dedup key's nor the group head's unique index does (their conditions name
the unfinished statuses only).

A grouped message that is cancelled releases its group, as a deleted one
does (migration 0009's trigger function, on an UPDATE that cancels it).

Frozen text, as a migration must be.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

CREATE = """
CREATE TRIGGER pgqueue_group_cancel
    AFTER UPDATE OF status ON django_pgqueue_message
    FOR EACH ROW WHEN (
        OLD.group_key IS NOT NULL AND NEW.status = 'cancelled' AND OLD.status <> 'cancelled')
    EXECUTE FUNCTION pgqueue_group_release();

-- Inserted and deleted by every claim of a rate-limited queue: vacuumed
-- often, so the window's index range stays a few pages.
ALTER TABLE django_pgqueue_queuestart SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0);
"""

DROP = """
DROP TRIGGER IF EXISTS pgqueue_group_cancel ON django_pgqueue_message;
"""

# Going back: cancelled rows are not a status the older schema knows.
DELETE_CANCELLED = "DELETE FROM django_pgqueue_message WHERE status = 'cancelled'"


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0014_schedules"),
    ]

    operations = [
        migrations.CreateModel(
            name="QueueStart",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("queue", models.CharField(max_length=100)),
                ("started_at", models.DateTimeField()),
                ("count", models.IntegerField()),
            ],
            options={
                "verbose_name": "queue start",
                "indexes": [
                    models.Index(fields=["queue", "started_at"], name="pgqueue_start_window_idx")
                ],
            },
        ),
        migrations.CreateModel(
            name="QueueState",
            fields=[
                ("name", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("paused", models.BooleanField(db_default=False)),
                ("paused_at", models.DateTimeField(blank=True, null=True)),
                ("changed_by", models.CharField(blank=True, db_default="", max_length=150)),
                ("limits_set", models.BooleanField(db_default=False)),
                ("concurrency", models.IntegerField(blank=True, null=True)),
                ("rate", models.CharField(blank=True, db_default="", max_length=16)),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "queue",
                "permissions": [("pause_queuestate", "Can pause and resume queues")],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            ("concurrency__isnull", True),
                            models.Q(("concurrency__gte", 1), ("concurrency__lte", 1000000)),
                            _connector="OR",
                        ),
                        name="pgqueue_queue_concurrency_range",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("rate", ""),
                            ("rate__regex", "^[1-9][0-9]{0,8}/[smh]$"),
                            _connector="OR",
                        ),
                        name="pgqueue_queue_rate_format",
                    ),
                ],
            },
        ),
        migrations.AlterModelOptions(
            name="message",
            options={"permissions": [("cancel_message", "Can cancel messages")]},
        ),
        migrations.RemoveConstraint(
            model_name="message",
            name="pgqueue_msg_status_valid",
        ),
        # (Reversed: before the older constraint comes back.)
        migrations.RunSQL(migrations.RunSQL.noop, DELETE_CANCELLED),
        migrations.AddField(
            model_name="message",
            name="cancel_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="message",
            name="status",
            field=models.CharField(
                choices=[
                    ("waiting", "Waiting"),
                    ("blocked", "Blocked (behind its group)"),
                    ("processing", "Processing"),
                    ("done", "Done"),
                    ("cancelled", "Cancelled"),
                ],
                db_default="waiting",
                max_length=16,
            ),
        ),
        migrations.AddIndex(
            model_name="message",
            index=models.Index(
                condition=models.Q(("status", "cancelled")),
                fields=["updated_at"],
                name="pgqueue_msg_cancelled_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("status__in", ["waiting", "blocked", "processing", "done", "cancelled"])
                ),
                name="pgqueue_msg_status_valid",
            ),
        ),
        migrations.RunSQL(CREATE, DROP),
    ]
