"""Ordered streams (the transactional outbox): the event table and the
subscriptions' checkpoints.

``StreamEvent`` takes its position (a bigint identity) and the id of the
inserting transaction (``pg_current_xact_id()``, an ``xid8``) from database
defaults, so another program can publish with a plain INSERT.

Autovacuum: the event table is append-only, and maintenance deletes its
oldest rows in batches once every subscription has passed them. Vacuum it
after a fixed number of inserted rows (so the visibility map stays set and
the lag counts stay index-only scans) and of deleted rows (after each
retention round), whatever its size; ANALYZE on the same rhythm keeps the
planner on the stream index. Its rows are never updated: the default
fillfactor (100) packs them.

The subscription table has one row per subscription, updated by every
delivery (the checkpoint): leave half of each page free so the updates stay
HOT (no indexed column changes), and vacuum it after a fixed number of dead
rows.

The SQL is frozen here, as a migration's must be.
"""

import django.core.serializers.json
import django.db.models.functions.datetime
from django.db import migrations, models

import django_pgqueue.stream_models

EVENT_OPTIONS = (
    "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000, "
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 20000, "
    "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 20000"
)
EVENT_RESET = (
    "autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold, "
    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_analyze_scale_factor, autovacuum_analyze_threshold"
)
SUBSCRIPTION_OPTIONS = (
    "fillfactor = 50, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_vacuum_cost_delay = 0"
)
SUBSCRIPTION_RESET = (
    "fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_vacuum_cost_delay"
)


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0009_message_groups"),
    ]

    operations = [
        migrations.CreateModel(
            name="StreamEvent",
            fields=[
                ("position", models.BigAutoField(primary_key=True, serialize=False)),
                ("stream", models.CharField(max_length=200)),
                (
                    "key",
                    models.CharField(
                        blank=True,
                        help_text="What the event is about (an order id, say); handed to subscribers.",
                        max_length=255,
                        null=True,
                    ),
                ),
                (
                    "payload",
                    models.JSONField(encoder=django.core.serializers.json.DjangoJSONEncoder),
                ),
                (
                    "headers",
                    models.JSONField(
                        blank=True,
                        db_default={},
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                    ),
                ),
                (
                    "xid",
                    django_pgqueue.stream_models.TransactionIdField(
                        db_default=models.Func(function="pg_current_xact_id"),
                        help_text="The id of the transaction that published it.",
                    ),
                ),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "stream event",
                "indexes": [
                    models.Index(
                        fields=["stream", "xid", "position"], name="pgqueue_event_stream_idx"
                    )
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(("stream", ""), _negated=True),
                        name="pgqueue_event_stream_not_empty",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Subscription",
            fields=[
                ("id", models.AutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=100, unique=True)),
                ("stream", models.CharField(max_length=200)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("active", "Active"),
                            ("retrying", "Retrying"),
                            ("blocked", "Blocked"),
                            ("paused", "Paused"),
                        ],
                        db_default="active",
                        max_length=16,
                    ),
                ),
                (
                    "checkpoint_xid",
                    django_pgqueue.stream_models.TransactionIdField(
                        db_default=0,
                        help_text="Transaction id of the last event passed (0: none yet).",
                    ),
                ),
                (
                    "checkpoint_position",
                    models.BigIntegerField(
                        db_default=0, help_text="Position of the last event passed (0: none yet)."
                    ),
                ),
                (
                    "attempts",
                    models.IntegerField(db_default=0, help_text="Failed attempts at the next event."),
                ),
                (
                    "failing_position",
                    models.BigIntegerField(
                        blank=True,
                        help_text="The event that failed (retrying or blocked).",
                        null=True,
                    ),
                ),
                ("last_error", models.TextField(blank=True, db_default="")),
                (
                    "retry_at",
                    models.DateTimeField(blank=True, help_text="Next try (retrying).", null=True),
                ),
                (
                    "delivered",
                    models.BigIntegerField(
                        db_default=0,
                        help_text="Events passed (handled or dead-lettered) since it was created.",
                    ),
                ),
                (
                    "delivered_at",
                    models.DateTimeField(blank=True, help_text="Last checkpoint move.", null=True),
                ),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "permissions": [
                    ("pause_subscription", "Can pause and resume subscriptions"),
                    ("reset_subscription", "Can reset the checkpoint of subscriptions"),
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            ("state__in", ["active", "retrying", "blocked", "paused"])
                        ),
                        name="pgqueue_sub_state_valid",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("attempts__gte", 0)),
                        name="pgqueue_sub_attempts_gte_0",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("checkpoint_position__gte", 0)),
                        name="pgqueue_sub_position_gte_0",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("name", ""), _negated=True),
                            models.Q(("stream", ""), _negated=True),
                        ),
                        name="pgqueue_sub_names_not_empty",
                    ),
                ],
            },
        ),
        migrations.RunSQL(
            f"ALTER TABLE django_pgqueue_streamevent SET ({EVENT_OPTIONS})",
            f"ALTER TABLE django_pgqueue_streamevent RESET ({EVENT_RESET})",
        ),
        migrations.RunSQL(
            f"ALTER TABLE django_pgqueue_subscription SET ({SUBSCRIPTION_OPTIONS})",
            f"ALTER TABLE django_pgqueue_subscription RESET ({SUBSCRIPTION_RESET})",
        ),
    ]
