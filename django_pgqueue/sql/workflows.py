"""Workflows: the steps' INSERT, and the calls of the functions that move
steps with their messages (migration 0018: each locks the workflows it
changes first, in id order, and settles their status with their counts)."""

from __future__ import annotations

# The steps of one enqueue (or of a handler's message.workflow.add) in one
# statement, whatever their number: one JSON array of arrays (see
# storing.step_document for the order), and the edges as [step, after]
# name pairs, resolved against the new steps and, for a handler's additions,
# the workflow's existing ones. Each step's message id is drawn now, in
# step order, from the queue table's sequence (migration 0018: the release
# then changes no indexed column of the step).
INSERT_STEPS_SQL = """
WITH input AS (
    SELECT r, n FROM jsonb_array_elements(%(steps)s::jsonb) WITH ORDINALITY AS i(r, n)
), inserted AS (
    INSERT INTO django_pgqueue_workflowstep (
        workflow_id, name, state, waiting_for, allow_failed, queue, topic, payload, headers,
        priority, run_at, delay_seconds, max_attempts, group_key, partition_key, created_at,
        message_id)
    SELECT %(workflow)s, r->>0, 'held', (r->>1)::integer, (r->>2)::boolean, r->>3, r->>4, r->5,
        r->6, (r->>7)::smallint, (r->>8)::timestamptz, (r->>9)::float8, (r->>10)::integer,
        r->>11, r->>12, now(), nextval(seq.ids)
    FROM input, (SELECT pg_get_serial_sequence('django_pgqueue_message', 'id')::regclass AS ids)
        AS seq
    ORDER BY n
    RETURNING id, name, waiting_for
), edges AS (
    INSERT INTO django_pgqueue_workflowdependency (step_id, after_id)
    SELECT s.id, coalesce(a.id, old.id)
    FROM jsonb_array_elements(%(edges)s::jsonb) AS e
    JOIN inserted AS s ON s.name = e->>0
    LEFT JOIN inserted AS a ON a.name = e->>1
    LEFT JOIN django_pgqueue_workflowstep AS old
        ON a.id IS NULL AND old.workflow_id = %(workflow)s AND old.name = e->>1
    RETURNING 1
)
SELECT coalesce(array_agg(id) FILTER (WHERE waiting_for = 0), '{}'),
    count(*), (SELECT count(*) FROM edges)
FROM inserted
"""

INSERT_WORKFLOW_SQL = """
INSERT INTO django_pgqueue_workflow (
    name, status, steps_total, steps_unfinished, steps_active, steps_dead, steps_failed,
    created_at)
VALUES (%s, 'running', 0, 0, 0, 0, 0, now())
RETURNING id
"""

COUNT_SQL = "SELECT pgqueue_workflow_count(%s, %s, %s, 0, 0, 0)"
RELEASE_SQL = "SELECT pgqueue_workflow_release(%s::bigint[])"
# The steps' ids as an array literal, their results as one JSON object
# (each step's by its id): bookkeeping.done_params.
DONE_SQL = "SELECT released, finished FROM pgqueue_workflow_steps_done(%s::bigint[], %s::jsonb)"
# DONE_SQL right after the acknowledgement of the steps' messages, in the
# same round trip (lifecycle.ack_then): of the steps given, those whose
# message the acknowledgement deleted. A message whose lease was lost is
# still in the queue, or ran again elsewhere; its step is not this
# acknowledgement's to move.
ACKED_DONE_SQL = """
SELECT released, finished FROM pgqueue_workflow_steps_done(ARRAY(
    SELECT s.id FROM django_pgqueue_workflowstep AS s
    WHERE s.id = ANY(%s::bigint[])
      AND NOT EXISTS (SELECT FROM django_pgqueue_message AS m WHERE m.id = s.message_id)
), %s::jsonb)
"""
DEAD_SQL = "SELECT pgqueue_workflow_steps_dead(%s::bigint[])"
REVIVED_SQL = "SELECT pgqueue_workflow_steps_revived(%s::bigint[], %s::bigint[])"
GIVEN_UP_SQL = "SELECT pgqueue_workflow_steps_given_up(%s::bigint[])"

# A workflow's cancel: its row locked (and marked), then every step that has
# not ended given up; returns the messages of those that were in the queue.
CANCEL_SQL = """
UPDATE django_pgqueue_workflow SET status = 'cancelled', finished_at = CASE
    WHEN steps_unfinished = 0 THEN coalesce(finished_at, now()) END
WHERE id = %s AND status NOT IN ('done', 'failed', 'cancelled')
RETURNING id
"""
UNFINISHED_STEPS_SQL = """
SELECT id FROM django_pgqueue_workflowstep
WHERE workflow_id = %s AND state IN ('held', 'released', 'dead_lettered')
ORDER BY id
"""
# The steps waiting in the dead letters dead_letter_ids, given up.
GIVEN_UP_DEAD_LETTERS_SQL = """
SELECT pgqueue_workflow_steps_given_up(ARRAY(
    SELECT s.id FROM django_pgqueue_workflowstep AS s
    JOIN django_pgqueue_deadletter AS d ON d.message_id = s.message_id
    WHERE d.id = ANY(%s::bigint[]) AND s.state = 'dead_lettered'))
"""

# Finished workflows past their retention, with their steps and edges.
DELETE_SQL = """
WITH gone AS (
    DELETE FROM django_pgqueue_workflow WHERE id = ANY(%s::bigint[]) RETURNING id
), steps AS (
    DELETE FROM django_pgqueue_workflowstep WHERE workflow_id IN (SELECT id FROM gone)
    RETURNING id
), edges AS (
    DELETE FROM django_pgqueue_workflowdependency WHERE step_id IN (SELECT id FROM steps)
    RETURNING 1
)
SELECT count(*) FROM gone
"""

# The dead letters that the dead-lettered steps among step_ids wait in.
DEAD_LETTERS_OF_STEPS_SQL = """
SELECT d.id FROM django_pgqueue_deadletter AS d
JOIN django_pgqueue_workflowstep AS s ON s.message_id = d.message_id
WHERE s.id = ANY(%s::bigint[]) AND s.state = 'dead_lettered' AND d.state = 'new'
ORDER BY d.id
"""
