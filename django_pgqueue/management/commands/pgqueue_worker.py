"""manage.py pgqueue_worker: run a worker until SIGTERM/SIGINT (or, with
--burst, until nothing is ready and its subscriptions have caught up).

When the queues it serves (and the streams of the subscriptions it delivers
to) are on several databases (``PGQUEUE["QUEUES"][name]["database"]``,
``PGQUEUE["STREAMS"]``), the process runs one engine per database, each with
its own connections, LISTEN, leases, heartbeat row, maintenance, scheduler
and stream delivery there; --concurrency, --async-concurrency, --batch-size,
--prefetch and --max-messages apply to each engine. A database that is down
stops only its own engine's work (it retries with backoff); the health port
tells which one fails."""

import argparse
import functools
import gc
import logging
import os
import sys
from collections.abc import Callable

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connections

from django_pgqueue import conf
from django_pgqueue.conf.problems import ASYNC_CONCURRENCY_MAX
from django_pgqueue.management.options import (
    http_host,
    non_negative_int,
    positive_int,
    queue_list,
    seconds,
    seconds_or_zero,
    up_to,
)
from django_pgqueue.models import Message
from django_pgqueue.observability import endpoints
from django_pgqueue.observability.endpoints import MetricsServer
from django_pgqueue.observability.health import WorkerHealthServer
from django_pgqueue.observability.metrics import WorkerMetrics
from django_pgqueue.worker import Worker, engines

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def port(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a port from 0 to 65535 (0: any free one), not {text}"
        )
    return value


def subscription_list(text):
    """--subscriptions: "all", "none" or comma-separated registered names."""
    from django_pgqueue.streams.subscribers import select

    text = text.strip()
    value = text if text in ("all", "none") else [n.strip() for n in text.split(",") if n.strip()]
    try:
        select(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def log_level(text):
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def prefetch_option(text):
    """--prefetch: 'auto' (None: Worker's default) or a whole number of at least 0."""
    if text.strip().lower() == "auto":
        return None
    try:
        return non_negative_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'auto')") from None


class Command(BaseCommand):
    help = "Run a django-pgqueue worker: claim messages and run their handlers."

    def add_arguments(self, parser):
        parser.add_argument(
            "--queues",
            type=queue_list,
            default=None,
            help="comma-separated queues to work on, in claim order; with weights "
            "(default=3,bulk=1) the claims are shared by weight while they all have work "
            "(default: PGQUEUE['QUEUES'] and its weights, else PGQUEUE['DEFAULT_QUEUE'])",
        )
        parser.add_argument(
            "--concurrency",
            type=up_to(1000, "one thread and database connection each"),
            default=4,
            help="handler threads, each with its own database connection (default: 4); "
            "with queues on several databases, per database",
        )
        parser.add_argument(
            "--async-concurrency",
            type=up_to(ASYNC_CONCURRENCY_MAX, "one coroutine and message each"),
            default=None,
            help="async handlers (async def, atomic=False) run at once on the worker's event "
            "loop, beside its threads (default: PGQUEUE['ASYNC_CONCURRENCY'], 100)",
        )
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="most messages claimed in one transaction, and run by one handler thread in "
            "one shared transaction for atomic handlers (default: 200)",
        )
        parser.add_argument(
            "--prefetch",
            type=prefetch_option,
            default=None,
            help="messages claimed ahead of the running ones, so claims stay batches while "
            "every thread is busy; handed back at shutdown. 'auto' (the default): what the "
            "threads finish in about 0.1 s at the handlers' recent durations, at most two "
            "batches",
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="exit 0 when no message is ready and the stream subscriptions it serves have "
            "delivered every event that is due",
        )
        parser.add_argument(
            "--max-messages",
            type=positive_int,
            default=None,
            help="exit after claiming this many messages (with queues on several databases: "
            "each database's engine this many)",
        )
        parser.add_argument(
            "--shutdown-timeout",
            type=seconds_or_zero,
            default=30.0,
            help="seconds in-flight handlers get to finish after SIGTERM/SIGINT (default: 30)",
        )
        parser.add_argument(
            "--poll-interval",
            type=seconds,
            default=None,
            help="seconds between polls when no notification arrives "
            "(default: PGQUEUE['POLL_INTERVAL'])",
        )
        parser.add_argument(
            "--lease",
            type=seconds,
            default=None,
            help="lease (visibility timeout) in seconds (default: PGQUEUE['LEASE_SECONDS'])",
        )
        parser.add_argument(
            "--metrics-port",
            type=port,
            default=None,
            help="serve this worker's Prometheus metrics on this port "
            "(needs the [prometheus] extra; 0: any free port, logged)",
        )
        parser.add_argument(
            "--health-port",
            type=port,
            default=None,
            help="answer GET / with 200 while this worker's loop and database connection "
            "work, else 503 (0: any free port, logged); with queues on several databases, "
            "one part per database, and the failing ones named",
        )
        parser.add_argument(
            "--http-host",
            type=http_host,
            default=None,
            help="address the metrics and health ports listen on, e.g. a private "
            "interface's or 0.0.0.0 (default: PGQUEUE['WORKER_HTTP_HOST'], 127.0.0.1: "
            "this host only)",
        )
        parser.add_argument(
            "--subscriptions",
            type=subscription_list,
            default="all",
            help="stream subscriptions to deliver to: 'all' (default), 'none', or "
            "comma-separated subscription names",
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="do not run the scheduler of the periodic schedules (PGQUEUE['SCHEDULES'], "
            "@handler(schedule=)) in this worker; by default every worker runs it, and each "
            "tick is one message however many do",
        )
        parser.add_argument(
            "--log-level",
            type=log_level,
            default="INFO",
            help=f"one of {', '.join(LOG_LEVELS)} (default: INFO)",
        )

    def handle(self, *args, **options):
        self._configure_logging(options["log_level"])
        metrics = None
        if options["metrics_port"] is not None:
            try:
                metrics = WorkerMetrics()
            except ImproperlyConfigured as exc:
                raise CommandError(f"--metrics-port: {exc}") from None
        _name_connections(f"pgqueue_worker#{os.getpid()}")
        databases = engines.plan(options["queues"], options["subscriptions"])
        _require_tables(databases)
        make: Callable[..., Worker | engines.Engines] = (
            functools.partial(engines.Engines, databases)  # one engine per database
            if len(databases) > 1
            else functools.partial(Worker, queues=options["queues"])
        )
        worker = make(
            concurrency=options["concurrency"],
            async_concurrency=options["async_concurrency"],
            batch_size=options["batch_size"],
            prefetch=options["prefetch"],
            burst=options["burst"],
            max_messages=options["max_messages"],
            shutdown_timeout=options["shutdown_timeout"],
            poll_interval=options["poll_interval"],
            lease_seconds=options["lease"],
            metrics=metrics,
            subscriptions=options["subscriptions"],
            schedules=not options["no_schedules"],
        )
        servers = []
        try:
            host = options["http_host"] or conf.get("WORKER_HTTP_HOST")
            if metrics is not None:
                served = _listen(
                    "--metrics-port", lambda: MetricsServer(metrics, options["metrics_port"], host)
                )
                servers.append(served)
                _announce(worker, "metrics", host, served.port, "METRICS_ACCESS")
            if options["health_port"] is not None:
                health = _listen(
                    "--health-port",
                    lambda: WorkerHealthServer(worker, options["health_port"], host),
                )
                servers.append(health)
                health.start()
                _announce(worker, "health", host, health.port, "HEALTH_ACCESS")
            # This process is a worker from here on: keep its start-up heap
            # (Django, the project's modules) out of the cyclic collector's
            # full scans, which otherwise walk it again and again for nothing.
            gc.collect()
            gc.freeze()
            try:
                worker.run(install_signals=True)
            finally:
                gc.unfreeze()  # (call_command in a longer-lived process)
        finally:
            for server in servers:
                server.close()
        if options["burst"] and worker.stream_delivery_died:
            # Exit 0 would tell a script that every due event was delivered.
            raise CommandError(
                f"stream delivery stopped ({worker.stream_delivery_died}); the events after "
                "the subscriptions' checkpoints were not all delivered"
            )

    def _configure_logging(self, level):
        logger = logging.getLogger("django_pgqueue")
        logger.setLevel(level)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
            )
            logger.addHandler(handler)


worker_log = logging.getLogger("django_pgqueue.worker")


def _listen(option, bind):
    """Run ``bind`` (which opens a listening socket); a port that cannot be
    used is a clear command error, not a traceback."""
    try:
        return bind()
    except OSError as exc:
        raise CommandError(f"{option}: cannot listen ({exc.strerror or exc})") from None


def _announce(worker, kind, host, port, access):
    """Log where a port listens, and warn when it answers every network
    without asking for the token."""
    worker_log.info("Worker %s: %s on %s", worker.worker_id, kind, endpoints.url(host, port))
    if not endpoints.is_private(host) and conf.get(access) != "token":
        worker_log.warning(
            "Worker %s: the %s port on %s answers anyone who can reach it: set PGQUEUE[%r] "
            "to 'token' (with ENDPOINT_TOKEN), or listen on a loopback or private address "
            "(--http-host, PGQUEUE['WORKER_HTTP_HOST'])",
            worker.worker_id,
            kind,
            host,
            access,
        )


def _require_tables(aliases):
    """CommandError for a queue database that answers but lacks the app's
    tables: its engine would fail every claim, for ever. (One that does not
    answer yet is left to its engine, which retries until it does.)"""
    table = Message._meta.db_table
    for alias in aliases:
        try:
            tables = connections[alias].introspection.table_names()
        except DatabaseError:
            continue
        finally:
            connections[alias].close()  # (this thread's; the engines open their own)
        if table not in tables:
            raise CommandError(
                f"The queue database {alias!r} has no django-pgqueue tables: run "
                f"manage.py migrate --database {alias} (docs: Queues on several databases)."
            )


def _name_connections(application_name):
    """Make every database connection of this process show up as the worker in
    pg_stat_activity (unless the project names its connections itself)."""
    for alias in connections:
        options = connections[alias].settings_dict.setdefault("OPTIONS", {})
        options.setdefault("application_name", application_name)
    connections.close_all()
