"""A leased message's lease ends at a date: ``pgqueue_msg_processing_lease_finite``.

The rescue finds a dead worker's rows by their lease's expiry, so a
``processing`` row whose lease ends at 'infinity' (or past year 9999, the
last date Python reads; see ``fields.TIMESTAMP_MAX``) would wait in
"processing" forever. Only another client's SQL writes one (a worker's
leases are now plus LEASE_SECONDS). Any such row is given a lease that
expires now, as migration 0013 does for a row without a lease: the rescue
returns it to the queue on its next round (the attempt it was claimed for
counts as lost), and nothing is deleted. Then the constraint refuses the
state at the write that tries it.

Frozen text, as a migration must be.
"""

import datetime

from django.db import migrations, models

# fields.TIMESTAMP_MAX when this was written.
LATEST = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)

EXPIRE_ENDLESS_LEASES = """
UPDATE django_pgqueue_message
   SET lease_expires_at = now()
 WHERE status = 'processing' AND lease_expires_at > '9999-12-31 00:00:00+00'::timestamptz
"""


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0016_history"),
    ]

    operations = [
        migrations.RunSQL(EXPIRE_ENDLESS_LEASES, migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.CheckConstraint(
                condition=~models.Q(status="processing")
                | models.Q(lease_expires_at__lte=LATEST),
                name="pgqueue_msg_processing_lease_finite",
            ),
        ),
    ]
