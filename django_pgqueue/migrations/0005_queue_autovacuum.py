"""Autovacuum settings suited to a queue table.

Every message is inserted, updated a few times (claim, lease extensions) and
deleted: the table turns over its whole content, again and again, while
staying small. PostgreSQL's defaults vacuum a table after 20% of its rows
are dead, which for a queue holding a large delayed backlog means hundreds
of thousands of dead rows (bloat, slower claims) before the first vacuum.
Here vacuum starts after a fixed number of dead (or inserted) rows whatever
the table's size, and runs unthrottled (the table is small and hot, so a
throttled vacuum only lasts longer); ANALYZE follows the same rhythm so the
planner keeps choosing the partial indexes. ``fillfactor`` leaves room in
each page for the updated versions of its rows.

The dead-letter table is append-mostly: vacuum it after inserts (for the
visibility map), and keep its statistics fresh for the admin's filters.
"""

from django.db import migrations

MESSAGE_OPTIONS = (
    "fillfactor = 90, "
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000, "
    "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000, "
    "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 20000, "
    "autovacuum_vacuum_cost_delay = 0"
)
MESSAGE_RESET = (
    "fillfactor, autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold, "
    "autovacuum_analyze_scale_factor, autovacuum_analyze_threshold, autovacuum_vacuum_cost_delay"
)
DEAD_LETTER_OPTIONS = (
    "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 50000, "
    "autovacuum_analyze_scale_factor = 0.02"
)
DEAD_LETTER_RESET = (
    "autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold, "
    "autovacuum_analyze_scale_factor"
)


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0004_observability"),
    ]

    operations = [
        migrations.RunSQL(
            f"ALTER TABLE django_pgqueue_message SET ({MESSAGE_OPTIONS})",
            f"ALTER TABLE django_pgqueue_message RESET ({MESSAGE_RESET})",
        ),
        migrations.RunSQL(
            f"ALTER TABLE django_pgqueue_deadletter SET ({DEAD_LETTER_OPTIONS})",
            f"ALTER TABLE django_pgqueue_deadletter RESET ({DEAD_LETTER_RESET})",
        ),
    ]
