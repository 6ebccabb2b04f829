"""The wake-up trigger without its DISTINCT: one pg_notify() call per waiting row.

PostgreSQL folds identical (channel, payload) notifications within a
transaction itself (through a hash table once there are more than a few), so
the trigger's ``SELECT DISTINCT`` did the same work again, and its
sort-or-hash set-up was paid by every one-message enqueue (13 of 186
microseconds in one measurement with synchronous_commit off; within the
noise of a WAL flush with it on), for no change in what is delivered. A bulk insert
of 50,000 rows into one queue still sends one notification, as fast as
before (benchmarks: the README's Performance section).

Frozen text, as a migration must be; the reverse restores migration 0002's
function.
"""

from django.db import migrations

FORWARD = """
CREATE OR REPLACE FUNCTION pgqueue_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- PostgreSQL folds identical notifications within a transaction: one
    -- per queue reaches the listeners however many rows named it.
    PERFORM pg_notify('django_pgqueue', queue)
    FROM pgqueue_new_rows WHERE status = 'waiting';
    RETURN NULL;
END;
$$;
"""

BACKWARD = """
CREATE OR REPLACE FUNCTION pgqueue_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('django_pgqueue', inserted.queue)
    FROM (SELECT DISTINCT queue FROM pgqueue_new_rows WHERE status = 'waiting') AS inserted;
    RETURN NULL;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("django_pgqueue", "0006_dedup_index_keys_only")]

    operations = [migrations.RunSQL(FORWARD, reverse_sql=BACKWARD)]
