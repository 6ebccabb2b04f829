"""Health checks: one for the system (the web endpoint in
``django_pgqueue.urls``) and one for a single worker process (its
``--health-port``).

- System: the queue database answers, and every configured queue
  (``PGQUEUE["QUEUES"]``) has at least one worker with a fresh heartbeat.
  With queues on several databases, one part per database, each judged
  alone (``system_health``).
  It lists every stream subscription with its state, those the code
  declares and no worker has started yet as "not started".
  For a load balancer or an uptime monitor: "is anything consuming?".
- Worker: its main loop goes round (and its stream delivery thread, when it
  serves subscriptions: ``Worker.health``) and its database connection
  works. For an orchestrator's liveness probe: "should this process be
  restarted?". A worker serving queues on several databases (one engine
  per database, ``worker.engines``) answers one part per database under
  ``"databases"``, each judged alone, and lists the failing ones under
  ``"failing"``: 503 while any fails (its engine retries meanwhile, the
  others go on).

Both answer 200 or 503 with a JSON body that says why. Database error texts
(host names, ports) are logged, not served: the body says what failed.
"""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler

from django.db import DatabaseError, connections

from django_pgqueue import conf
from django_pgqueue.observability import endpoints, stats

logger = logging.getLogger(__name__)


def _database_works(alias=None):
    """Run ``SELECT 1`` on this thread's connection to the queue database
    ``alias`` (default: ``PGQUEUE["DATABASE"]``); a broken connection is
    closed so the next check reconnects."""
    alias = alias or conf.get("DATABASE")
    connection = connections[alias]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except DatabaseError as exc:
        logger.warning("Health check: the queue database %s does not answer: %s", alias, exc)
        connection.close()
        return False


def system_health():
    """``(healthy, body)``: the database answers and each configured queue has
    a live worker. With queues on several databases, one part per database
    under ``"databases"``, each judged alone, the failing ones listed under
    ``"failing"`` and every problem, led by its database, under
    ``"problems"``: unhealthy while any part is (a database that is down
    fails its own part only)."""
    aliases = conf.databases()
    if len(aliases) == 1:
        return _database_health(aliases[0])
    parts = {alias: _database_health(alias) for alias in aliases}
    failing = [alias for alias, (healthy, _) in parts.items() if not healthy]
    return not failing, {
        "status": "unhealthy" if failing else "ok",
        "failing": failing,
        "databases": {alias: body for alias, (_, body) in parts.items()},
        "problems": [
            f"database {alias!r}: {problem}"
            for alias, (_, body) in parts.items()
            for problem in body["problems"]
        ],
    }


def _database_health(alias):
    """``(healthy, body)`` of the database ``alias``: it answers and each
    queue configured on it has a live worker (in its worker table)."""
    queues = [queue for queue in conf.queues() if conf.queue_database(queue) == alias]
    if not _database_works(alias):
        return False, {
            "status": "unhealthy",
            "database": "unreachable",
            "queues": {},
            "problems": ["the queue database does not answer"],
        }
    try:
        with conf.on_database(alias):
            live = stats.live_workers_by_queue()
            subscriptions = {
                name: row
                for name, row in stats.subscription_states().items()
                if row["state"] != stats.NOT_STARTED or conf.stream_database(row["stream"]) == alias
            }
    except DatabaseError as exc:
        logger.warning("Health check: the worker table of %s cannot be read: %s", alias, exc)
        return False, {
            "status": "unhealthy",
            "database": "error",
            "queues": {},
            "problems": ["the worker table cannot be read (has migrate run?)"],
        }
    problems = [
        f"no worker with a fresh heartbeat serves queue {queue!r}"
        for queue in queues
        if not live.get(queue)
    ]
    body = {
        "status": "unhealthy" if problems else "ok",
        "database": "ok",
        "queues": {queue: {"workers_alive": live.get(queue, 0)} for queue in queues},
        # Every subscription the code declares ("not started" until a worker
        # starts it): shown, not judged (a worker may serve none on purpose).
        "subscriptions": subscriptions,
        "problems": problems,
    }
    return not problems, body


def _engine_check(worker):
    """``(healthy, details)`` of one engine (a ``Worker``, on one database):
    its own ``health()``, and a ``SELECT 1`` on its database from this
    thread (``"database"``: "ok" or "unreachable")."""
    healthy, details = worker.health()
    database = _database_works(worker.config.database)
    details["database"] = "ok" if database else "unreachable"
    healthy = healthy and database
    details["status"] = "ok" if healthy else "unhealthy"
    return healthy, details


class WorkerHealthServer:
    """A worker's ``--health-port``: ``GET /`` (or ``/health``, ``/healthz``)
    answers 200 while ``worker.health()`` is good and a ``SELECT 1`` on the
    server's own connection works, else 503. One thread serves requests one
    at a time, so it keeps one database connection.

    It listens on ``host`` (default ``PGQUEUE["WORKER_HTTP_HOST"]``, loopback)
    and asks for the bearer token when HEALTH_ACCESS is "token" (see
    ``endpoints``)."""

    PATHS = ("/", "/health", "/healthz")

    def __init__(self, worker, port, host=None):
        self.worker = worker
        host = host or conf.get("WORKER_HTTP_HOST")
        self._server = endpoints.WorkerHTTPServer((host, port), self._handler_class())
        self._thread = threading.Thread(target=self._serve, name="pgqueue-health", daemon=True)

    @property
    def port(self):
        return self._server.server_port

    def start(self):
        self._thread.start()
        return self.port

    def close(self):
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def check(self):
        engines = getattr(self.worker, "engines", None)
        if engines is None:  # one database
            return _engine_check(self.worker)
        # Several databases (worker.engines.Engines): one part per database,
        # each judged alone; the worker is healthy while every part is.
        parts = {alias: _engine_check(engine) for alias, engine in engines.items()}
        failing = [alias for alias, (healthy, _) in parts.items() if not healthy]
        return not failing, {
            "status": "unhealthy" if failing else "ok",
            "worker_id": self.worker.worker_id,
            "failing": failing,
            "databases": {alias: details for alias, (_, details) in parts.items()},
        }

    def _serve(self):
        try:
            self._server.serve_forever(poll_interval=0.25)
        finally:
            connections.close_all()

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (the http.server API)
                # Before anything else, the path list of a 404 included.
                refusal = endpoints.worker_refusal(
                    "HEALTH_ACCESS", self.headers.get("Authorization")
                )
                if refusal is not None:
                    self._send(*refusal)
                    return
                if self.path.split("?", 1)[0] not in server.PATHS:
                    self._answer(404, {"status": "not found", "paths": list(server.PATHS)})
                    return
                try:
                    healthy, details = server.check()
                except Exception:  # a health check never kills the worker
                    logger.exception("Worker health check failed")
                    healthy, details = False, {"status": "unhealthy", "error": "check failed"}
                self._answer(200 if healthy else 503, details)

            def _answer(self, status, body):
                headers = [("Content-Type", "application/json"), ("Cache-Control", "no-store")]
                self._send(status, headers, json.dumps(body).encode())

            def _send(self, status, headers, data):
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format, *args):  # noqa: A002  (the http.server API)
                logger.debug("Health request: " + format, *args)

        return Handler
