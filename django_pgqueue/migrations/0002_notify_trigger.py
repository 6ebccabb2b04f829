"""The wake-up trigger: one NOTIFY per INSERT statement and queue, never per row.

A statement-level trigger with a transition table sees all rows of the
statement at once, so a bulk insert of 10,000 messages into one queue sends a
single notification. pg_notify() also folds identical (channel, payload)
pairs within a transaction. PostgreSQL delivers the notification at commit,
so a rolled-back insert wakes nobody.

The text is frozen here, as a migration must be; django_pgqueue.notify names
the channel and the trigger and switches the trigger on and off for
PGQUEUE["NOTIFY"].
"""

from django.db import migrations

CREATE = """
CREATE FUNCTION pgqueue_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('django_pgqueue', inserted.queue)
    FROM (SELECT DISTINCT queue FROM pgqueue_new_rows WHERE status = 'waiting') AS inserted;
    RETURN NULL;
END;
$$;

CREATE TRIGGER pgqueue_notify_insert
    AFTER INSERT ON django_pgqueue_message
    REFERENCING NEW TABLE AS pgqueue_new_rows
    FOR EACH STATEMENT
    EXECUTE FUNCTION pgqueue_notify_insert();
"""

DROP = """
DROP TRIGGER IF EXISTS pgqueue_notify_insert ON django_pgqueue_message;
DROP FUNCTION IF EXISTS pgqueue_notify_insert();
"""


class Migration(migrations.Migration):
    dependencies = [("django_pgqueue", "0001_initial")]

    operations = [migrations.RunSQL(CREATE, reverse_sql=DROP)]
