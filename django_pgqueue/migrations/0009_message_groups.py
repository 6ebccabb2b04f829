"""Message groups: messages with the same group_key run one at a time, in order.

A grouped message is inserted *blocked* (a row trigger); exactly one message
of a group, its head, is ever waiting or processing (a partial unique index
refuses a second one). When a head leaves the table (acknowledged,
dead-lettered, deleted), or a grouped message arrives, a trigger writes a
``GroupRelease`` row in the same transaction; a worker's claim round trip
calls ``pgqueue_promote_groups()``, which turns each released group's oldest
blocked message into its new head unless the group still has one, or a dead
letter holds it (``DeadLetter.holds_group``). The claim itself is unchanged:
it never sees a blocked row, so its cost does not depend on how many groups
or blocked messages there are.

Why triggers: every way a head can leave, including the admin's delete and
another program's SQL, must release its group, or the group would wait
forever. Why promotion under an advisory lock: two promoters of one group
must not both see "no head"; a transaction-scoped lock taken before the
check (READ COMMITTED: the check's statement then sees what the previous
holder committed) serializes them, and works behind PgBouncer.

Messages that were waiting in a group when this migration runs keep their
order: all but each group's oldest become blocked. Stop the workers first:
two messages of one group running at once cannot be fixed here.

Frozen text, as a migration must be.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

# Existing groups: keep each group's running message(s), or else its oldest
# waiting one, and block the rest.
BLOCK_EXISTING = """
DO $$
BEGIN
    UPDATE django_pgqueue_message AS m SET status = 'blocked'
    WHERE m.group_key IS NOT NULL AND m.status = 'waiting'
      AND EXISTS (
        SELECT 1 FROM django_pgqueue_message AS o
        WHERE o.group_key = m.group_key
          AND (o.status = 'processing' OR (o.status = 'waiting' AND o.id < m.id)));
    IF EXISTS (
        SELECT 1 FROM django_pgqueue_message WHERE group_key IS NOT NULL AND status = 'processing'
        GROUP BY group_key HAVING count(*) > 1) THEN
        RAISE EXCEPTION 'django_pgqueue: messages of one group are running at once; '
            'stop the workers, then migrate again';
    END IF;
END;
$$;
"""
UNBLOCK_EXISTING = "UPDATE django_pgqueue_message SET status = 'waiting' WHERE status = 'blocked'"

CREATE = """
CREATE FUNCTION pgqueue_group_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Every grouped message arrives blocked; the promotion decides whether
    -- it is its group's head (it sees the committed state of the group).
    IF NEW.status = 'waiting' THEN
        NEW.status := 'blocked';
    END IF;
    INSERT INTO django_pgqueue_grouprelease (group_key) VALUES (NEW.group_key);
    RETURN NEW;
END;
$$;

CREATE TRIGGER pgqueue_group_insert
    BEFORE INSERT ON django_pgqueue_message
    FOR EACH ROW WHEN (NEW.group_key IS NOT NULL)
    EXECUTE FUNCTION pgqueue_group_insert();

CREATE FUNCTION pgqueue_group_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO django_pgqueue_grouprelease (group_key) VALUES (OLD.group_key);
    RETURN NULL;
END;
$$;

CREATE TRIGGER pgqueue_group_delete
    AFTER DELETE ON django_pgqueue_message
    FOR EACH ROW WHEN (OLD.group_key IS NOT NULL)
    EXECUTE FUNCTION pgqueue_group_release();

CREATE TRIGGER pgqueue_group_unhold
    AFTER UPDATE OF holds_group ON django_pgqueue_deadletter
    FOR EACH ROW WHEN (OLD.holds_group AND NOT NEW.holds_group)
    EXECUTE FUNCTION pgqueue_group_release();

CREATE TRIGGER pgqueue_group_unhold_delete
    AFTER DELETE ON django_pgqueue_deadletter
    FOR EACH ROW WHEN (OLD.holds_group)
    EXECUTE FUNCTION pgqueue_group_release();

-- Promote the next message of released groups. Returns how many releases
-- are left for a later call: groups another transaction is promoting right
-- now, and whatever lay past max_releases.
CREATE FUNCTION pgqueue_promote_groups(max_releases integer, notify boolean) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    released record;
    picked integer := 0;
    left_over integer := 0;
    head_queue text;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'django_pgqueue: message groups are promoted under READ COMMITTED, not %',
            current_setting('transaction_isolation')
            USING HINT = 'Do not set another isolation level on the workers'' database connection.';
    END IF;
    FOR released IN
        SELECT r.group_key, array_agg(r.id) AS ids
        FROM (SELECT id, group_key FROM django_pgqueue_grouprelease
              ORDER BY id LIMIT max_releases FOR UPDATE SKIP LOCKED) AS r
        GROUP BY r.group_key
    LOOP
        picked := picked + cardinality(released.ids);
        -- One promoter per group until it commits. The statements below run
        -- after the lock is held, each with a fresh snapshot, so they see
        -- the head an earlier holder promoted.
        IF NOT pg_try_advisory_xact_lock(1885827431, hashtext(released.group_key)) THEN
            left_over := left_over + 1;
            CONTINUE;
        END IF;
        DELETE FROM django_pgqueue_grouprelease WHERE id = ANY(released.ids);
        IF NOT EXISTS (
                SELECT 1 FROM django_pgqueue_message
                WHERE group_key = released.group_key AND status IN ('waiting', 'processing'))
            AND NOT EXISTS (
                SELECT 1 FROM django_pgqueue_deadletter
                WHERE group_key = released.group_key AND holds_group) THEN
            UPDATE django_pgqueue_message SET status = 'waiting', updated_at = now()
            WHERE id = (
                SELECT id FROM django_pgqueue_message
                WHERE group_key = released.group_key AND status = 'blocked'
                ORDER BY id LIMIT 1)
            RETURNING queue INTO head_queue;
            IF FOUND AND notify THEN
                PERFORM pg_notify('django_pgqueue', head_queue);
            END IF;
        END IF;
    END LOOP;
    IF picked >= max_releases THEN
        left_over := left_over + 1;
    END IF;
    RETURN left_over;
END;
$$;

-- Wake-ups: a grouped insert wakes the workers on a channel of its own
-- (they promote, then claim); the others as before.
CREATE OR REPLACE FUNCTION pgqueue_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- PostgreSQL folds identical notifications within a transaction: one
    -- per queue (and one for all groups) reaches the listeners.
    PERFORM CASE WHEN status = 'blocked' THEN pg_notify('django_pgqueue_groups', '')
                 ELSE pg_notify('django_pgqueue', queue) END
    FROM pgqueue_new_rows WHERE status IN ('waiting', 'blocked');
    RETURN NULL;
END;
$$;

ALTER TABLE django_pgqueue_grouprelease SET (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0);
"""

DROP = """
CREATE OR REPLACE FUNCTION pgqueue_notify_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('django_pgqueue', queue)
    FROM pgqueue_new_rows WHERE status = 'waiting';
    RETURN NULL;
END;
$$;
DROP FUNCTION IF EXISTS pgqueue_promote_groups(integer, boolean);
DROP TRIGGER IF EXISTS pgqueue_group_unhold_delete ON django_pgqueue_deadletter;
DROP TRIGGER IF EXISTS pgqueue_group_unhold ON django_pgqueue_deadletter;
DROP TRIGGER IF EXISTS pgqueue_group_delete ON django_pgqueue_message;
DROP FUNCTION IF EXISTS pgqueue_group_release();
DROP TRIGGER IF EXISTS pgqueue_group_insert ON django_pgqueue_message;
DROP FUNCTION IF EXISTS pgqueue_group_insert();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0008_task_record"),
    ]

    operations = [
        migrations.CreateModel(
            name="GroupRelease",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("group_key", models.CharField(max_length=255)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
            options={
                "verbose_name": "group release",
            },
        ),
        migrations.RemoveConstraint(
            model_name="message",
            name="pgqueue_msg_status_valid",
        ),
        migrations.RemoveConstraint(
            model_name="message",
            name="pgqueue_msg_dedup_uniq",
        ),
        migrations.AddField(
            model_name="deadletter",
            name="holds_group",
            field=models.BooleanField(
                db_default=False,
                help_text="Its group stays blocked until it is revived, resolved or deleted.",
            ),
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
                ],
                db_default="waiting",
                max_length=16,
            ),
        ),
        migrations.AddIndex(
            model_name="deadletter",
            index=models.Index(
                condition=models.Q(("holds_group", True)),
                fields=["group_key"],
                name="pgqueue_dl_holds_group_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="message",
            index=models.Index(
                condition=models.Q(("status", "blocked")),
                fields=["group_key", "id"],
                name="pgqueue_msg_group_next_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.UniqueConstraint(
                condition=models.Q(
                    ("dedup_key__isnull", False),
                    ("status__in", ["waiting", "blocked", "processing"]),
                ),
                fields=("topic", "dedup_key"),
                name="pgqueue_msg_dedup_uniq",
            ),
        ),
        migrations.RunSQL(BLOCK_EXISTING, reverse_sql=UNBLOCK_EXISTING),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.UniqueConstraint(
                condition=models.Q(
                    ("group_key__isnull", False), ("status__in", ["waiting", "processing"])
                ),
                fields=("group_key",),
                name="pgqueue_msg_group_head_uniq",
            ),
        ),
        migrations.AddConstraint(
            model_name="message",
            constraint=models.CheckConstraint(
                condition=models.Q(("status__in", ["waiting", "blocked", "processing", "done"])),
                name="pgqueue_msg_status_valid",
            ),
        ),
        migrations.RunSQL(CREATE, reverse_sql=DROP),
    ]
