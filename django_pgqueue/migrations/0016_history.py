"""The history of finished messages (FinishedMessage) and the per-minute
outcome counts the admin's overview draws (OutcomeCount).

The counts table is small and updated in place by every batch that
finishes messages: room on each page (fillfactor) keeps those updates HOT
(no index entry per update), and autovacuum visits it often so the dead
row versions do not pile up. The history is insert-mostly and deleted in
batches by maintenance: autovacuum's insert threshold keeps its visibility
map fresh and summarizes the new page ranges of its BRIN indexes.

Frozen text, as a migration must be.
"""

import django_pgqueue.fields
import django.core.serializers.json
from django.db import migrations, models

STORAGE = """
ALTER TABLE django_pgqueue_outcomecount SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0);
ALTER TABLE django_pgqueue_finishedmessage SET (
    autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_vacuum_scale_factor = 0.05);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0015_queue_controls"),
    ]

    operations = [
        migrations.CreateModel(
            name="FinishedMessage",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("message_id", models.BigIntegerField(help_text="The id it had in the queue.")),
                ("queue", models.CharField(max_length=100)),
                ("topic", models.CharField(max_length=200)),
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
                    "outcome",
                    models.CharField(
                        choices=[
                            ("done", "Done"),
                            ("cancelled", "Cancelled"),
                            ("dead_lettered", "Dead-lettered"),
                            ("retried", "Retried"),
                        ],
                        max_length=16,
                    ),
                ),
                ("attempts", models.IntegerField()),
                ("dedup_key", models.CharField(blank=True, max_length=255, null=True)),
                ("dead_letter_id", models.BigIntegerField(blank=True, null=True)),
                ("enqueued_at", models.DateTimeField()),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField()),
                ("worker", models.CharField(blank=True, max_length=255)),
            ],
            options={
                "verbose_name": "finished message",
                "indexes": [
                    django_pgqueue.fields.BrinIndex(
                        fields=["finished_at"],
                        name="pgqueue_hist_finished_brin",
                        pages_per_range=32,
                    ),
                    django_pgqueue.fields.BrinIndex(
                        fields=["message_id"], name="pgqueue_hist_message_brin", pages_per_range=32
                    ),
                    models.Index(
                        condition=models.Q(("dedup_key__isnull", False)),
                        fields=["dedup_key"],
                        name="pgqueue_hist_dedup_idx",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="OutcomeCount",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("minute", models.DateTimeField()),
                ("queue", models.CharField(max_length=100)),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("done", "Done"),
                            ("cancelled", "Cancelled"),
                            ("dead_lettered", "Dead-lettered"),
                            ("retried", "Retried"),
                        ],
                        max_length=16,
                    ),
                ),
                ("shard", models.IntegerField(db_default=0)),
                ("count", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "outcome count",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("minute", "queue", "outcome", "shard"),
                        name="pgqueue_count_minute_uniq",
                    )
                ],
            },
        ),
        migrations.RunSQL(STORAGE, migrations.RunSQL.noop),
    ]
