"""Room on each page of the message table for the claim's new version of
every row it holds (fillfactor 50, was 90).

A claim updates every message it leases, and the update is never HOT (it
changes the status, which the partial indexes' predicates read). When the
new version does not fit on the row's page, PostgreSQL writes it to
another page, and logs an extra lock record for the old version while it
looks for one; when it fits, the WAL record holds only the bytes that
changed. Measured with pg_walinspect around a burst drain of 20,000 plain
messages (full-page images left out): 852 -> 773 bytes of WAL per message
with atomic=False handlers, 784 -> 710 with atomic=True (docs:
*Performance*, where each byte goes). The cost: a backlog of waiting
messages takes twice the pages.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0020_fair_claim"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE django_pgqueue_message SET (fillfactor = 50)",
            "ALTER TABLE django_pgqueue_message SET (fillfactor = 90)",
        ),
    ]
