"""A leased message always has its lease; a task's run is RUNNING from its start.

- ``pgqueue_msg_processing_has_lease``: a ``processing`` row without a lease
  token or expiry (written by hand, by an older version, or restored from a
  dump) was never rescued, since the rescue finds a dead worker's rows by
  their expiry. Any such row is given a lease that expires now (the rescue
  returns it to the queue on its next round, counting the lost attempt),
  then the constraint keeps the state from being written again.
- ``TaskRecord.started_lease``: the lease of the run whose task function
  began, written when it begins; a claimed task whose function has not begun
  yet reads READY, not RUNNING.
"""

from django.db import migrations, models

EXPIRE_LEASELESS_ROWS = """
UPDATE django_pgqueue_message
   SET lease_token = COALESCE(lease_token, gen_random_uuid()),
       lease_expires_at = COALESCE(lease_expires_at, now())
 WHERE status = 'processing' AND (lease_token IS NULL OR lease_expires_at IS NULL)
"""


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0012_queue_index_cleanup"),
    ]

    operations = [
        migrations.AddField(
            model_name="taskrecord",
            name="started_lease",
            field=models.UUIDField(
                blank=True,
                help_text="The lease of the latest run whose task function began: its message "
                "reads RUNNING only while it holds this lease (a claimed run that has not "
                "begun is still READY).",
                null=True,
            ),
        ),
        migrations.RunSQL(EXPIRE_LEASELESS_ROWS, migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.CheckConstraint(
                condition=~models.Q(status="processing")
                | models.Q(lease_token__isnull=False, lease_expires_at__isnull=False),
                name="pgqueue_msg_processing_has_lease",
            ),
        ),
    ]
