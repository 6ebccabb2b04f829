"""A message's partition of its queue: ``partition_key`` (issue 38).

A nullable column, last in each table so the columns before it keep their
positions: on the queue (NULL: the queue's default partition), on the dead
letters (a dead letter keeps its message's key, and its revival goes back
into that partition), and on the workflow steps (a step's message gets the
key at its release: migration 0018's ``pgqueue_workflow_insert_messages``
is replaced by one that copies it). Not on the history: a finished message
does not need it. No index: the claim's use of the key brings its own.

Adding a nullable column without a default rewrites no table; each CHECK
reads its table once (every row is NULL then).

Frozen text, as a migration must be; the reverse restores migration 0018's
function.
"""

from django.db import migrations, models

FORWARD = """
CREATE OR REPLACE FUNCTION pgqueue_workflow_insert_messages(step_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO django_pgqueue_message (
        id, queue, topic, payload, headers, priority, run_at, max_attempts,
        group_key, workflow_step_id, partition_key)
    SELECT s.message_id, s.queue, s.topic, s.payload, s.headers, s.priority,
        coalesce(s.run_at, now() + make_interval(secs => s.delay_seconds)),
        s.max_attempts, s.group_key, s.id, s.partition_key
    FROM django_pgqueue_workflowstep AS s WHERE s.id = ANY(step_ids) ORDER BY s.id;
END;
$$;
"""

BACKWARD = """
CREATE OR REPLACE FUNCTION pgqueue_workflow_insert_messages(step_ids bigint[]) RETURNS void
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
"""


def _partition_key() -> models.CharField:
    return models.CharField(blank=True, max_length=255, null=True)


def _not_empty(name: str) -> models.CheckConstraint:
    return models.CheckConstraint(condition=~models.Q(partition_key=""), name=name)


class Migration(migrations.Migration):
    dependencies = [
        ("django_pgqueue", "0018_workflows"),
    ]

    operations = [
        migrations.AddField(model_name="message", name="partition_key", field=_partition_key()),
        migrations.AddField(model_name="deadletter", name="partition_key", field=_partition_key()),
        migrations.AddField(
            model_name="workflowstep", name="partition_key", field=_partition_key()
        ),
        migrations.AddConstraint(
            model_name="message", constraint=_not_empty("pgqueue_msg_partition_key_not_empty")
        ),
        migrations.AddConstraint(
            model_name="deadletter", constraint=_not_empty("pgqueue_dl_partition_key_not_empty")
        ),
        migrations.AddConstraint(
            model_name="workflowstep",
            constraint=_not_empty("pgqueue_wfstep_partition_key_not_empty"),
        ),
        # After the step's column: the function names it (checked when it runs).
        migrations.RunSQL(FORWARD, reverse_sql=BACKWARD),
    ]
