"""Every ``PGQUEUE`` key with its default and what it means, and the limits
that the models and the checks of names and settings share."""

from __future__ import annotations

import re
from typing import Any

# Names of queues and topics travel in NOTIFY payloads, log lines, metric
# labels and URLs: keep them to a plain, printable alphabet. \Z, not $: "$"
# also matches before a trailing newline ("default\n").
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]*\Z")
QUEUE_MAX_LENGTH = 100
TOPIC_MAX_LENGTH = 200
KEY_MAX_LENGTH = 255  # dedup_key, group_key

# Priority: higher runs first. A bounded range keeps the claim index small and
# leaves room above and below the default.
PRIORITY_MIN = -100
PRIORITY_MAX = 100

# PostgreSQL's timeouts are whole milliseconds up to INT_MAX.
DB_TIMEOUT_MAX = 2_147_483.0

# Events per stream delivery transaction (STREAM_BATCH_SIZE, batch_size=):
# the whole batch is read in one query and held in memory.
STREAM_BATCH_SIZE_MAX = 10_000

ACCESS_CHOICES = ("open", "staff", "token")
ALERT_TOPIC = "pgqueue.alert"

DEFAULTS: dict[str, Any] = {
    # Alias of the database that holds the queue tables. When it differs from
    # the caller's alias, enqueue defers the insert to the caller's commit.
    "DATABASE": "default",
    # Streams kept on another database than DATABASE: {stream: {"database":
    # alias}}. A queue names its database in QUEUES ({"bulk": {"database":
    # "queues_2"}}). Every alias named holds the app's tables (migrate with
    # django_pgqueue.routers.QueueRouter).
    "STREAMS": None,
    # Send a NOTIFY wake-up from the insert trigger. Turn off (poll-only mode)
    # behind PgBouncer in transaction pooling, or at very high insert rates:
    # every notifying transaction takes a cluster-wide lock at commit. The
    # trigger is enabled or disabled to match when ``migrate`` runs.
    "NOTIFY": True,
    # Queue used when enqueue() is given none.
    "DEFAULT_QUEUE": "default",
    # Attempts before a message becomes a dead letter (a handler's
    # max_attempts, or a message's, takes precedence).
    "MAX_ATTEMPTS": 5,
    # Retry backoff: the delay before attempt n+1 is drawn from
    # [0, min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (n - 1))] (full jitter), or is
    # exactly that bound when BACKOFF_JITTER is False. Seconds.
    "BACKOFF_BASE": 2.0,
    "BACKOFF_CAP": 3600.0,
    "BACKOFF_JITTER": True,
    # DEPENDENCY failures (a downstream service is down) back off this many
    # times longer than the others.
    "DEPENDENCY_BACKOFF_FACTOR": 5.0,
    # Message groups (group_key): when a message of a group is dead-lettered,
    # False lets the group go on with its next message; True keeps the group
    # blocked until the dead letter is revived (it then runs first),
    # resolved or deleted. A handler's dead_letter_blocks_group overrides it.
    "DEAD_LETTER_BLOCKS_GROUP": False,
    # Classification rules tried before the built-in ones, first match wins.
    # Each is a dict with "category" and one or more conditions: "exception"
    # (a class or dotted path; subclasses match), "message" (a substring of
    # str(exc)), "regex" (searched in str(exc)), "topic" (equal), "payload"
    # (a callable or dotted path: payload -> bool).
    "CLASSIFY_RULES": [],
    # A callable (or dotted path) (exc, message) -> category or None, asked
    # before the rules.
    "CLASSIFIER": None,
    # Lease (visibility timeout) in seconds. The worker's heartbeat extends it
    # every quarter lease while a handler runs; a crashed worker's messages
    # come back after about one lease. A run cut off by the worker's lost
    # database connection (a failover, a network cut) does not wait for it:
    # the worker hands the message back once it reaches the database again.
    "LEASE_SECONDS": 60.0,
    # Seconds between polls when no notification arrives (jittered +-10%).
    "POLL_INTERVAL": 5.0,
    # The most async handlers (``async def``, atomic=False) a worker runs at
    # once on its event loop, beside its handler threads (pgqueue_worker
    # --async-concurrency): they wait on the network together, in one thread.
    "ASYNC_CONCURRENCY": 100,
    # The queues this project runs workers for. Health checks expect a live
    # worker for each, status and metrics report each even when empty, and
    # pgqueue_worker serves them when given no --queues. None: [DEFAULT_QUEUE].
    #
    # A list of names, or a dict of names to their limits, which hold for all
    # workers on all hosts together (enforced in the claim, in the database):
    # "concurrency", how many of the queue's messages may be processing at
    # once; "rate", how many may start in any second, minute or hour ("20/s",
    # "100/m", "500/h"). {"default": {}, "payments": {"concurrency": 3},
    # "emails": {"rate": "100/m"}}. The Queues page of the admin and
    # "pgqueue_queues limit" override them at run time; a queue without
    # limits costs its claims nothing. A queue's dict may also hold a
    # "weight" (1 to 1000): a worker given no --queues then shares its
    # claims between its queues by weight while they all have work (a queue
    # without a weight: 1), rather than in the order listed.
    #
    # A queue whose messages have a partition_key is claimed round-robin
    # between the partitions with ready messages (the messages without a
    # key share the default partition), priority still first; "fair":
    # False keeps strict priority, run_at, id order. "partition": {
    # "concurrency": 2, "rate": "30/m"} limits each partition the same way,
    # all workers together; set_partition_limits() (and the Queues page,
    # "pgqueue_queues") gives a named partition its own.
    # {"reports": {"concurrency": 20, "partition": {"concurrency": 2}}}.
    #
    # "database": an alias of DATABASES puts the queue on that database
    # instead of DATABASE: {"bulk": {"database": "queues_2"}}. Its messages,
    # dead letters, history, controls and schedules live there; enqueue()
    # writes there (in the caller's transaction on that alias, else at its
    # commit), and a worker serves it with connections of that database.
    "QUEUES": None,
    # Seconds a cancelled message stays in the queue table (status
    # "cancelled", for the record) before maintenance deletes it. None keeps
    # them.
    "CANCELLED_RETENTION": 7 * 24 * 3600.0,
    # The worker vacuums the queue table itself (VACUUM (SKIP_LOCKED), after
    # the maintenance round's transaction, and each second while it is busy)
    # when more than this many of its rows are dead, and more than it holds
    # live ones: autovacuum comes by at
    # most once per autovacuum_naptime (a minute by default), and a busy
    # worker leaves hundreds of thousands of dead rows in a minute. The
    # workers' database role must own the table (or the database). None:
    # never, leave it to autovacuum.
    "VACUUM_DEAD_ROWS": 50_000,
    # Seconds a finished message is kept in the history (the admin's
    # "Finished messages", the queue overview's charts): topic, queue,
    # payload, headers, outcome (done, cancelled, dead-lettered), attempts,
    # its times and worker. Written in the transaction that finishes it, by
    # the same statement as the acknowledgement; maintenance deletes older
    # rows in batches. 0 turns the history and the overview's counts off
    # (the acknowledgement is then the bare DELETE). One day, as River's
    # default: long enough to answer "did yesterday's e-mail go out?", and
    # the table holds one day of traffic at most (docs: the history how-to
    # gives the measured cost).
    "KEEP_FINISHED": 24 * 3600.0,
    # Seconds a resolved or revived dead letter is kept after it was
    # resolved (revived); then maintenance deletes it. New dead letters are
    # never deleted automatically. None keeps them all.
    "KEEP_RESOLVED_DEAD_LETTERS": 30 * 24 * 3600.0,
    # Seconds the result of a finished Django Task (TaskRecord, successful or
    # failed) is kept after it finished; then maintenance deletes it (the
    # default of django-tasks' prune_db_task_results). None keeps them all.
    "KEEP_TASK_RESULTS": 14 * 24 * 3600.0,
    # Seconds between a worker's heartbeats (its row in the worker table). A
    # worker counts as alive until three intervals pass without one.
    "HEARTBEAT_INTERVAL": 10.0,
    # Seconds between a worker's summary lines at INFO: how many messages it
    # finished (done, retried, dead-lettered, cancelled) and the rate. An
    # interval in which nothing finished writes none. 0 turns it off. (The
    # line per claimed and per done message is at DEBUG.)
    "LOG_SUMMARY_INTERVAL": 60.0,
    # Limits on the worker's own statements that may wait for a lock (an
    # atomic handler's acknowledgement, lease extension, heartbeat and poll,
    # retries and dead-lettering, maintenance, the stream delivery thread's
    # reads of its subscriptions and events and its checkpoint's moves, never
    # a subscriber's queries), in seconds; None keeps the
    # server's setting. The claim and the batched acknowledgements of
    # atomic=False handlers never wait for a lock (SKIP LOCKED) and carry
    # none. Set per transaction (SET LOCAL), so they never reach a handler's
    # own queries and hold behind PgBouncer in transaction pooling.
    #
    # LOCK_TIMEOUT: how long one of them waits for a row or table lock that
    # another transaction holds before it fails and is retried.
    #
    # STATEMENT_TIMEOUT: the longest one may run; they take milliseconds, so
    # one that runs this long is stuck.
    "LOCK_TIMEOUT": 5.0,
    "STATEMENT_TIMEOUT": 60.0,
    # Who may read the metrics and health URLs of django_pgqueue.urls:
    # "open" (anyone), "staff" (a logged-in staff user) or "token" (an
    # "Authorization: Bearer <ENDPOINT_TOKEN>" header).
    "METRICS_ACCESS": "staff",
    "HEALTH_ACCESS": "open",
    "ENDPOINT_TOKEN": None,
    # Address a worker's --metrics-port and --health-port listen on (its
    # --http-host option overrides it). Loopback by default: those ports
    # answer everyone who can reach them unless the matching *_ACCESS is
    # "token"; "0.0.0.0" or "::" opens them to every network of the host.
    "WORKER_HTTP_HOST": "127.0.0.1",
    # Dead-letter alerts: a JSON POST to this URL (None: no alerts), at most
    # one per topic and category per ALERT_WINDOW seconds (the next one tells
    # how many were held back). Sent by a worker as a message of its own
    # (topic "pgqueue.alert"), so a slow or failing webhook never holds up
    # other messages; tried 1 + ALERT_WEBHOOK_RETRIES times.
    "ALERT_WEBHOOK_URL": None,
    # Extra request headers, e.g. {"Authorization": "Bearer ..."}. Their
    # values are secrets: never logged, never shown in the admin.
    "ALERT_WEBHOOK_HEADERS": {},
    # Seconds one webhook request may take, at most 50 (the alert message's
    # own handler timeout is 60).
    "ALERT_WEBHOOK_TIMEOUT": 5.0,
    # Retries of a failed webhook request (a 5xx, 408, 425 or 429 answer, a
    # timeout, a connection error), with the message's backoff: the alert
    # is tried 1 + ALERT_WEBHOOK_RETRIES times before it is dead-lettered.
    "ALERT_WEBHOOK_RETRIES": 3,
    # Seconds during which further alerts of the same topic and category are
    # held back; the next alert after the window counts them.
    "ALERT_WINDOW": 300.0,
    # Scheme and host the alert's admin link starts with, e.g.
    # "https://ops.example.com". None: the link is a path only.
    "ALERT_SITE_URL": None,
    # Streams (the transactional outbox): seconds a stream event is kept once
    # every subscription of its stream has passed it (a stream without
    # subscriptions: once it is this old); then the maintenance round
    # deletes it. None keeps every event.
    "STREAM_RETENTION": 7 * 24 * 3600.0,
    # Events a worker delivers to a subscription in one transaction, unless
    # its @subscriber(batch_size=...) says otherwise: fewer round trips per
    # event the larger it is. A batch also ends once 50 of its events have
    # run queries (each such event has a savepoint; past 64 that write,
    # PostgreSQL's snapshots overflow to pg_subtrans) or it has run for a
    # second. From 1 to STREAM_BATCH_SIZE_MAX (10,000).
    "STREAM_BATCH_SIZE": 500,
    # Periodic schedules: a dict of schedule names to entries; each tick of
    # a schedule becomes exactly one message, however many workers run
    # (every pgqueue_worker runs the scheduler unless --no-schedules).
    # An entry has exactly one of "cron" (five fields, or @hourly, @daily,
    # @weekly, @monthly, @yearly) or "every" (seconds or a timedelta, at
    # least 1), and exactly one of "topic" (with an optional "payload") or
    # "task" (a Django Task's dotted path, with optional "args" and
    # "kwargs", enqueued through PgQueueBackend), and may add: "queue",
    # "priority", "timezone" (cron's time zone; default: TIME_ZONE),
    # "backfill" (seconds: after downtime, missed ticks at most this old are
    # still enqueued, oldest first, older ones are skipped; default 0) and
    # "enabled" (default True; pgqueue_schedules pause/resume override it).
    # {"nightly-report": {"cron": "0 3 * * *", "topic": "reports.nightly",
    # "timezone": "Europe/Berlin"}, "ping": {"every": 10, "topic": "ping"}}
    "SCHEDULES": {},
    # OpenTelemetry tracing (the "otel" extra): enqueue(), enqueue_many() and
    # publish() run in a PRODUCER span and put its trace context
    # (traceparent, tracestate) into the message's headers; the worker runs
    # each handler and subscriber in a CONSUMER span that continues it.
    # None: on when opentelemetry-api can be imported; False: off (nothing
    # of OpenTelemetry is imported); True: on, and an error without it.
    "TRACING": None,
}

# Settings whose values are secrets: never echoed in check messages or logs
# (a webhook URL may carry a token in its path or query string).
SECRET_KEYS = frozenset({"ENDPOINT_TOKEN", "ALERT_WEBHOOK_HEADERS", "ALERT_WEBHOOK_URL"})
