"""Workflows: steps that wait for other steps (models.workflows).

A message may run a workflow step (``Message.workflow_step_id``). The
functions below move steps in the transaction that moves their message:
its acknowledgement, dead letter, revival or cancellation. Each locks the
workflows concerned first, in id order: the bookkeeping of one workflow is
serialized (a fan-in's counter is never decremented by two transactions
from the same value), and two bookkeepers never deadlock. A held step is not
in the queue table; its release inserts its message. The message's id is
drawn from the queue table's own sequence when the step is written
(sql.workflows.INSERT_STEPS_SQL): the step and its message name each other
from the start, and a release changes no indexed column of the step.

Frozen text, as a migration must be.
"""

import django.core.serializers.json
import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models


CREATE = """
-- Room on each page for the new versions of the rows that the bookkeeping
-- updates (a step released, then done; a fan-in's count; a workflow's
-- counts): updates that change no indexed column then stay on the page
-- (HOT), with no index entry to add. Half a page: a fan-out's release
-- updates every step of a page at once.
ALTER TABLE django_pgqueue_workflowstep SET (fillfactor = 50);
ALTER TABLE django_pgqueue_workflow SET (fillfactor = 50);

CREATE FUNCTION pgqueue_workflow_lock(step_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM django_pgqueue_workflow
    WHERE id IN (SELECT workflow_id FROM django_pgqueue_workflowstep WHERE id = ANY(step_ids))
    ORDER BY id FOR UPDATE;
END;
$$;

CREATE FUNCTION pgqueue_workflow_status(
    status text, unfinished integer, active integer, dead integer, failed integer
) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN status = 'cancelled' THEN 'cancelled'
        WHEN unfinished = 0 THEN CASE WHEN failed > 0 THEN 'failed' ELSE 'done' END
        WHEN active = 0 AND dead > 0 THEN 'blocked'
        ELSE 'running'
    END
$$;

-- Add to the counts of workflow wf and settle its status (and finished_at).
CREATE FUNCTION pgqueue_workflow_count(
    wf bigint, total integer, unfinished integer, active integer, dead integer, failed integer
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE django_pgqueue_workflow AS w SET
        steps_total = w.steps_total + total,
        steps_unfinished = w.steps_unfinished + unfinished,
        steps_active = w.steps_active + active,
        steps_dead = w.steps_dead + dead,
        steps_failed = w.steps_failed + failed,
        status = pgqueue_workflow_status(
            w.status, w.steps_unfinished + unfinished, w.steps_active + active,
            w.steps_dead + dead, w.steps_failed + failed),
        finished_at = CASE WHEN w.steps_unfinished + unfinished = 0
                           THEN coalesce(w.finished_at, now()) END
    WHERE w.id = wf;
END;
$$;

-- The messages of the steps step_ids, just released (their message_id
-- drawn): inserted into the queue, in step order.
CREATE FUNCTION pgqueue_workflow_insert_messages(step_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO django_pgqueue_message (
        id, queue, topic, payload, headers, priority, run_at, max_attempts,
        group_key, workflow_step_id)
    SELECT s.message_id, s.queue, s.topic, s.payload, s.headers, s.priority,
        coalesce(s.run_at, now() + make_interval(secs => s.delay_seconds)),
        s.max_attempts, s.group_key, s.id
    FROM django_pgqueue_workflowstep AS s WHERE s.id = ANY(step_ids) ORDER BY s.id;
END;
$$;

-- Release the held steps among candidates that wait for nothing: insert
-- their messages. Returns how many were released.
CREATE FUNCTION pgqueue_workflow_release(candidates bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    released bigint[] := '{}';
    per_workflow record;
    total integer := 0;
BEGIN
    IF candidates IS NULL OR cardinality(candidates) = 0 THEN
        RETURN 0;
    END IF;
    FOR per_workflow IN
        WITH ready AS (
            UPDATE django_pgqueue_workflowstep AS s
            SET state = 'released'
            WHERE s.id = ANY(candidates) AND s.state = 'held' AND s.waiting_for = 0
            RETURNING s.id, s.workflow_id
        )
        SELECT workflow_id AS wf, array_agg(id) AS steps, count(*)::integer AS n
        FROM ready GROUP BY workflow_id
    LOOP
        PERFORM pgqueue_workflow_count(per_workflow.wf, 0, 0, per_workflow.n, 0, 0);
        released := released || per_workflow.steps;
        total := total + per_workflow.n;
    END LOOP;
    PERFORM pgqueue_workflow_insert_messages(released);
    RETURN total;
END;
$$;

-- One less to wait for, for each step after the ended steps ended_ids;
-- returns the steps that waited and are held (those the caller may release
-- or cancel), with whether each runs after a failed step.
CREATE FUNCTION pgqueue_workflow_followers(ended_ids bigint[])
RETURNS TABLE (step_id bigint, allow_failed boolean) LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
    counts integer[];
BEGIN
    SELECT array_agg(c.id), array_agg(c.n) INTO ids, counts FROM (
        SELECT d.step_id AS id, count(*)::integer AS n
        FROM django_pgqueue_workflowdependency AS d
        WHERE d.after_id = ANY(ended_ids)
        GROUP BY d.step_id
    ) AS c;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    -- Joined to the ids' array, not to a subquery: one index probe per
    -- follower, whatever the (perhaps never analysed) statistics say.
    RETURN QUERY
    UPDATE django_pgqueue_workflowstep AS t SET waiting_for = t.waiting_for - v.n
    FROM unnest(ids, counts) AS v(id, n)
    WHERE t.id = v.id
    RETURNING t.id, t.allow_failed;
END;
$$;

-- Steps done (their messages acknowledged in this transaction), with their
-- results (a JSON object: each step's by its id): the steps after them that
-- wait for nothing more are released, in the same statement that counts
-- them down (one pass over the followers: a fan-out of thousands is
-- released at enqueue_many's pace). Returns how many were released, and
-- the status of each workflow that this finished (its last steps were
-- among them).
CREATE FUNCTION pgqueue_workflow_steps_done(
    step_ids bigint[], results jsonb, OUT released integer, OUT finished text[]
) LANGUAGE plpgsql AS $$
DECLARE
    done_ids bigint[];
    done_workflows bigint[];  -- each done step's
    follower_ids bigint[];
    follower_counts integer[];
    ready_ids bigint[];
    ready_workflows bigint[];  -- each released step's
    per_workflow record;
BEGIN
    released := 0;
    finished := '{}';
    PERFORM pgqueue_workflow_lock(step_ids);
    -- By the ids' array alone, not joined to the results: the steps'
    -- statistics may date from when none was released, and a join was
    -- planned as a loop over every pair.
    WITH done AS (
        UPDATE django_pgqueue_workflowstep AS s
        SET state = 'done', result = results -> s.id::text, finished_at = now()
        WHERE s.id = ANY(step_ids) AND s.state = 'released'
        RETURNING s.id, s.workflow_id
    )
    SELECT array_agg(id), array_agg(workflow_id) INTO done_ids, done_workflows FROM done;
    IF done_ids IS NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(c.id), array_agg(c.n) INTO follower_ids, follower_counts FROM (
        SELECT d.step_id AS id, count(*)::integer AS n
        FROM django_pgqueue_workflowdependency AS d
        WHERE d.after_id = ANY(done_ids)
        GROUP BY d.step_id
    ) AS c;
    WITH moved AS (
        -- (SET sees the row as it was: held, waiting for exactly n more.)
        UPDATE django_pgqueue_workflowstep AS t SET
            waiting_for = t.waiting_for - v.n,
            state = CASE WHEN t.state = 'held' AND t.waiting_for = v.n
                         THEN 'released' ELSE t.state END
        FROM unnest(follower_ids, follower_counts) AS v(id, n)
        WHERE t.id = v.id
        RETURNING t.id, t.state, t.workflow_id
    )
    -- A step after one that has just ended was held until now: one that
    -- reads released here was released by this statement.
    SELECT coalesce(array_agg(id) FILTER (WHERE state = 'released'), '{}'),
        coalesce(array_agg(workflow_id) FILTER (WHERE state = 'released'), '{}')
    INTO ready_ids, ready_workflows FROM moved;
    IF cardinality(ready_ids) > 0 THEN
        PERFORM pgqueue_workflow_insert_messages(ready_ids);
    END IF;
    released := cardinality(ready_ids);
    FOR per_workflow IN
        SELECT wf, sum(done)::integer AS done, sum(counted.released)::integer AS released
        FROM (
            SELECT unnest(done_workflows) AS wf, 1 AS done, 0 AS released
            UNION ALL
            SELECT unnest(ready_workflows), 0, 1
        ) AS counted
        GROUP BY wf
    LOOP
        PERFORM pgqueue_workflow_count(
            per_workflow.wf, 0, -per_workflow.done, per_workflow.released - per_workflow.done,
            0, 0);
    END LOOP;
    finished := ARRAY(
        SELECT status FROM django_pgqueue_workflow
        WHERE steps_unfinished = 0 AND id = ANY(done_workflows));
END;
$$;

-- The steps of messages message_ids moved to the dead letters: they wait
-- there, and so do the steps after them.
CREATE FUNCTION pgqueue_workflow_steps_dead(message_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    step_ids bigint[] := ARRAY(
        SELECT id FROM django_pgqueue_workflowstep WHERE message_id = ANY(message_ids));
    per_workflow record;
BEGIN
    PERFORM pgqueue_workflow_lock(step_ids);
    FOR per_workflow IN
        WITH dead AS (
            UPDATE django_pgqueue_workflowstep SET state = 'dead_lettered'
            WHERE id = ANY(step_ids) AND state = 'released'
            RETURNING workflow_id
        )
        SELECT workflow_id AS wf, count(*)::integer AS n FROM dead GROUP BY workflow_id
    LOOP
        PERFORM pgqueue_workflow_count(per_workflow.wf, 0, 0, -per_workflow.n, per_workflow.n, 0);
    END LOOP;
END;
$$;

-- Dead-lettered steps revived: their message old_ids[i] runs again as the
-- message new_ids[i] (which is marked as the step's).
CREATE FUNCTION pgqueue_workflow_steps_revived(old_ids bigint[], new_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    step_ids bigint[] := ARRAY(
        SELECT id FROM django_pgqueue_workflowstep WHERE message_id = ANY(old_ids));
    per_workflow record;
BEGIN
    PERFORM pgqueue_workflow_lock(step_ids);
    FOR per_workflow IN
        WITH revived AS (
            UPDATE django_pgqueue_workflowstep AS s
            SET state = 'released', message_id = v.new_id
            FROM unnest(old_ids, new_ids) AS v(old_id, new_id)
            WHERE s.id = ANY(step_ids) AND s.message_id = v.old_id AND s.state = 'dead_lettered'
            RETURNING s.id, s.workflow_id, v.new_id
        ), marked AS (
            UPDATE django_pgqueue_message AS m SET workflow_step_id = r.id
            FROM revived AS r WHERE m.id = r.new_id
            RETURNING 1
        )
        SELECT workflow_id AS wf, count(*)::integer AS n FROM revived GROUP BY workflow_id
    LOOP
        PERFORM pgqueue_workflow_count(per_workflow.wf, 0, 0, per_workflow.n, -per_workflow.n, 0);
    END LOOP;
END;
$$;

-- Steps given up: step_ids (held, released or dead-lettered) are cancelled,
-- and so, transitively, is every step after them, except those that
-- allow_failed: those run once nothing else holds them. Returns the ids of
-- the released steps' messages among step_ids (the caller cancels them).
CREATE FUNCTION pgqueue_workflow_steps_given_up(step_ids bigint[]) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    frontier bigint[] := step_ids;
    cancelled bigint[];
    tolerant bigint[];
    running bigint[];
    per_workflow record;
BEGIN
    PERFORM pgqueue_workflow_lock(step_ids);
    running := ARRAY(
        SELECT message_id FROM django_pgqueue_workflowstep
        WHERE id = ANY(step_ids) AND state = 'released');
    WHILE cardinality(frontier) > 0 LOOP
        -- Cancel the frontier's steps that have not ended...
        cancelled := '{}';
        FOR per_workflow IN
            WITH ended AS (
                UPDATE django_pgqueue_workflowstep AS s SET state = 'cancelled', finished_at = now()
                FROM django_pgqueue_workflowstep AS before
                WHERE s.id = ANY(frontier) AND before.id = s.id
                  AND s.state IN ('held', 'released', 'dead_lettered')
                RETURNING s.id, s.workflow_id, before.state AS was
            )
            SELECT workflow_id AS wf, array_agg(id) AS ids, count(*)::integer AS n,
                count(*) FILTER (WHERE was = 'released')::integer AS active,
                count(*) FILTER (WHERE was = 'dead_lettered')::integer AS dead
            FROM ended GROUP BY workflow_id
        LOOP
            PERFORM pgqueue_workflow_count(
                per_workflow.wf, 0, -per_workflow.n, -per_workflow.active, -per_workflow.dead,
                per_workflow.n);
            cancelled := cancelled || per_workflow.ids;
        END LOOP;
        -- ... then the held steps after them: cancelled in turn, or (allow_failed)
        -- released once they wait for nothing more.
        SELECT
            coalesce(array_agg(f.step_id) FILTER (WHERE f.allow_failed), '{}'),
            coalesce(array_agg(f.step_id) FILTER (WHERE NOT f.allow_failed), '{}')
        INTO tolerant, frontier
        FROM pgqueue_workflow_followers(cancelled) AS f
        JOIN django_pgqueue_workflowstep AS s ON s.id = f.step_id AND s.state = 'held';
        PERFORM pgqueue_workflow_release(tolerant);
    END LOOP;
    RETURN running;
END;
$$;
"""

DROP = """
DROP FUNCTION pgqueue_workflow_steps_given_up(bigint[]);
DROP FUNCTION pgqueue_workflow_steps_revived(bigint[], bigint[]);
DROP FUNCTION pgqueue_workflow_steps_dead(bigint[]);
DROP FUNCTION pgqueue_workflow_steps_done(bigint[], jsonb);
DROP FUNCTION pgqueue_workflow_followers(bigint[]);
DROP FUNCTION pgqueue_workflow_release(bigint[]);
DROP FUNCTION pgqueue_workflow_insert_messages(bigint[]);
DROP FUNCTION pgqueue_workflow_count(bigint, integer, integer, integer, integer, integer);
DROP FUNCTION pgqueue_workflow_status(text, integer, integer, integer, integer);
DROP FUNCTION pgqueue_workflow_lock(bigint[]);
"""


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0017_processing_lease_finite"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="workflow_step_id",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name="Workflow",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(blank=True, db_default="", max_length=200)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("running", "Running"),
                            ("blocked", "Blocked"),
                            ("done", "Done"),
                            ("failed", "Failed"),
                            ("cancelled", "Cancelled"),
                        ],
                        db_default="running",
                        max_length=16,
                    ),
                ),
                ("steps_total", models.IntegerField(db_default=0)),
                ("steps_unfinished", models.IntegerField(db_default=0)),
                ("steps_active", models.IntegerField(db_default=0)),
                ("steps_dead", models.IntegerField(db_default=0)),
                ("steps_failed", models.IntegerField(db_default=0)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "permissions": [
                    ("cancel_workflow", "Can cancel workflows"),
                    ("revive_workflow", "Can revive the dead-lettered steps of workflows"),
                ],
                "indexes": [
                    models.Index(fields=["status", "-created_at"], name="pgqueue_wf_status_idx"),
                    models.Index(
                        condition=models.Q(("finished_at__isnull", False)),
                        fields=["finished_at"],
                        name="pgqueue_wf_finished_idx",
                    ),
                ],
                "constraints": [
                    models.CheckConstraint(
                        condition=models.Q(
                            ("status__in", ["running", "blocked", "done", "failed", "cancelled"])
                        ),
                        name="pgqueue_wf_status_valid",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="WorkflowStep",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=200)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("held", "Held"),
                            ("released", "Released"),
                            ("done", "Done"),
                            ("dead_lettered", "Dead-lettered"),
                            ("cancelled", "Cancelled"),
                        ],
                        db_default="held",
                        max_length=16,
                    ),
                ),
                ("waiting_for", models.IntegerField(db_default=0)),
                ("allow_failed", models.BooleanField(db_default=False)),
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
                ("priority", models.SmallIntegerField(db_default=0)),
                ("run_at", models.DateTimeField(blank=True, null=True)),
                ("delay_seconds", models.FloatField(db_default=0.0)),
                ("max_attempts", models.IntegerField(blank=True, null=True)),
                ("group_key", models.CharField(blank=True, max_length=255, null=True)),
                ("message_id", models.BigIntegerField(blank=True, null=True)),
                (
                    "result",
                    models.JSONField(
                        blank=True,
                        encoder=django.core.serializers.json.DjangoJSONEncoder,
                        null=True,
                    ),
                ),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "workflow",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="steps",
                        to="django_pgqueue.workflow",
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="WorkflowDependency",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "after",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="django_pgqueue.workflowstep",
                    ),
                ),
                (
                    "step",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="django_pgqueue.workflowstep",
                    ),
                ),
            ],
        ),
        migrations.AddIndex(
            model_name="workflowstep",
            index=models.Index(
                condition=models.Q(("message_id__isnull", False)),
                fields=["message_id"],
                name="pgqueue_wfstep_message_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowstep",
            constraint=models.UniqueConstraint(
                fields=("workflow", "name"), name="pgqueue_wfstep_name_uniq"
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowstep",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("state__in", ["held", "released", "done", "dead_lettered", "cancelled"])
                ),
                name="pgqueue_wfstep_state_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowstep",
            constraint=models.CheckConstraint(
                condition=models.Q(("waiting_for__gte", 0)), name="pgqueue_wfstep_waiting_for_gte_0"
            ),
        ),
        migrations.AddConstraint(
            model_name="workflowdependency",
            constraint=models.UniqueConstraint(fields=("step", "after"), name="pgqueue_wfdep_uniq"),
        ),
        migrations.RunSQL(CREATE, reverse_sql=DROP),
    ]
