"""What the metrics and health endpoints share: the bearer-token check of the
URLs of ``django_pgqueue.urls`` (``views.py``) and of a worker's own
``--metrics-port`` and ``--health-port``, and the servers behind those ports
(the health port's own is ``health.WorkerHealthServer``).

A worker's port follows the URL's access setting (``METRICS_ACCESS``,
``HEALTH_ACCESS``) where it can: "token" asks for ``Authorization: Bearer
<ENDPOINT_TOKEN>`` (401 without it). It has no users, so "open" and "staff"
answer whoever can connect: the port listens on ``WORKER_HTTP_HOST`` (or
``--http-host``), loopback by default.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from http.server import HTTPServer
from socketserver import TCPServer, ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from django_pgqueue import conf
from django_pgqueue.observability.metrics import WorkerMetrics, client

logger = logging.getLogger(__name__)

AUTHENTICATE = 'Bearer realm="django-pgqueue"'
TOKEN_REQUIRED = "A valid bearer token is required.\n"


def token_matches(authorization):
    """Whether an ``Authorization`` header value is ``Bearer
    <ENDPOINT_TOKEN>`` (the scheme in any case), compared in constant time.
    Never true while no token is configured."""
    expected = conf.get("ENDPOINT_TOKEN") or ""
    scheme, _, given = (authorization or "").partition(" ")
    return bool(
        expected
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), expected.encode())
    )


def worker_refusal(setting, authorization):
    """For a request to a worker's port: None when it may be answered, else
    the answer, ``(status, headers, body)``. ``setting``: METRICS_ACCESS or
    HEALTH_ACCESS, read at each request as the views do."""
    if conf.get(setting) != "token" or token_matches(authorization):
        return None
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("WWW-Authenticate", AUTHENTICATE),
        ("Cache-Control", "no-store"),
    ]
    return 401, headers, TOKEN_REQUIRED.encode()


def is_private(host):
    """Whether ``host`` can be reached from this machine or a private network
    only: "localhost" or a loopback, private (RFC 1918, unique local) or
    link-local address. Not 0.0.0.0 or ::, which are every network of the
    host, nor another host name, which may resolve to anything."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return not address.is_unspecified and (
        address.is_loopback or address.is_private or address.is_link_local
    )


def url(host, port):
    """``http://host:port/`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class _AnyFamily(TCPServer):
    """A socketserver base: listens on an IPv4 or an IPv6 address, or on
    the first address a host name resolves to (the stdlib servers are
    IPv4-only). A name that does not resolve raises OSError (socket.gaierror)."""

    def __init__(self, server_address: tuple[str, int], *args: Any, **kwargs: Any) -> None:
        host, port = server_address
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        # A stream socket's address: (host, port), or IPv6's (host, port, flowinfo, scope).
        super().__init__(cast("tuple[str, int]", address), *args, **kwargs)


class WorkerHTTPServer(_AnyFamily, HTTPServer):
    """One thread serves requests one at a time (the health port)."""


class WorkerWSGIServer(_AnyFamily, ThreadingMixIn, WSGIServer):
    """A thread per request (the metrics port: one slow scrape does not hold
    up the next)."""

    daemon_threads = True


class QuietWSGIRequestHandler(WSGIRequestHandler):
    """Requests are logged at DEBUG, not written to stderr."""

    def log_message(self, format, *args):  # noqa: A002  (the http.server API)
        logger.debug("Metrics request: " + format, *args)


def guarded_wsgi_app(app, setting):
    """``app`` behind the worker port's access rule (``worker_refusal``)."""

    def guarded(environ, start_response):
        refusal = worker_refusal(setting, environ.get("HTTP_AUTHORIZATION"))
        if refusal is None:
            return app(environ, start_response)
        status, headers, body = refusal
        start_response(f"{status} Unauthorized", [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return guarded


class MetricsServer:
    """A worker's ``--metrics-port``: its WorkerMetrics' registry over HTTP,
    served on a daemon thread, a thread per request.

    It listens on ``host`` (default ``PGQUEUE["WORKER_HTTP_HOST"]``, loopback)
    and asks for the bearer token when METRICS_ACCESS is "token".
    prometheus_client's own server cannot check a token, so its WSGI app is
    served behind that check."""

    def __init__(self, metrics: WorkerMetrics, port: int, host: str | None = None) -> None:
        app = guarded_wsgi_app(client().make_wsgi_app(metrics.registry), "METRICS_ACCESS")
        self._server = WorkerWSGIServer(
            (host or conf.get("WORKER_HTTP_HOST"), port), QuietWSGIRequestHandler
        )
        self._server.set_app(app)
        threading.Thread(
            target=self._server.serve_forever, name="pgqueue-metrics", daemon=True
        ).start()

    @property
    def port(self) -> int:
        return self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
