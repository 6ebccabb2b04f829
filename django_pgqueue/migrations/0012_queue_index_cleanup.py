"""Every vacuum of the queue table cleans its indexes.

PostgreSQL 14 and later skip the index pass of a vacuum that finds dead rows
on fewer than 2% of the table's pages (``vacuum_index_cleanup = auto``). A
queue holding a large delayed backlog is exactly that case after every burst
of handled messages: their dead entries stay at the head of the claim index,
which every claim then reads past. ``on`` makes each vacuum remove them.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0011_lease_index_by_expiry"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE django_pgqueue_message SET (vacuum_index_cleanup = on)",
            "ALTER TABLE django_pgqueue_message RESET (vacuum_index_cleanup)",
        ),
    ]
