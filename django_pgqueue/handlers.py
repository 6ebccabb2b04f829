"""django-pgqueue's own handlers, found by the same autodiscovery as every
other app's ``handlers`` module.

``pgqueue.alert`` (``conf.ALERT_TOPIC``) delivers a dead-letter alert that
``alerts.py`` queued: one JSON POST to ``ALERT_WEBHOOK_URL``, with
``Content-Type: application/json``, ``User-Agent: django-pgqueue/<version>``
and the ``ALERT_WEBHOOK_HEADERS``. Not atomic: its effect is outside the
database. Its tries come from the message (``1 + ALERT_WEBHOOK_RETRIES``, set
when the alert was queued).

Outcomes:

- any 2xx answer: delivered;
- 5xx, 408, 425 or 429, a timeout (``ALERT_WEBHOOK_TIMEOUT``) or a
  connection error: ``WebhookUnavailable``, a ``ConnectionError``, which the
  failure policy classifies as DEPENDENCY: retried with backoff, then
  dead-lettered;
- any other answer: ``Permanent``, dead-lettered at once. 3xx: redirects
  are not followed (urllib would re-send the POST as a GET, and would carry
  the secret headers to whatever host the redirect names). 4xx: the request
  itself is refused (a wrong URL or token, a payload the receiver rejects);
  the same request would be refused again, so the dead letter waits for the
  settings to be fixed and a revive;
- ``ALERT_WEBHOOK_URL`` unset since the alert was queued: dropped (logged).

An undeliverable alert's dead letter raises no alert of its own.

The header values are secrets: no log line and no exception message (which
becomes ``last_error`` and the dead letter's reason) contains them, nor the
webhook URL (it may carry a token too): logs name its scheme and host only.
"""

import http.client
import json
import logging
import urllib.error
import urllib.request
from urllib.parse import unquote_plus, urlsplit

from django_pgqueue import __version__, conf
from django_pgqueue.exceptions import Permanent, PgQueueError
from django_pgqueue.registry import handler

logger = logging.getLogger(__name__)

# The handler's timeout (registry reads it at import, so it is fixed), and
# the most an HTTP timeout may be so that a delivery ends with its own error
# before the worker abandons the handler.
DELIVERY_TIMEOUT = 60.0
HTTP_TIMEOUT_MAX = 50.0

# Answers worth trying again: the server is failing, overloaded or slow.
RETRYABLE_STATUSES = frozenset({408, 425, 429})

USER_AGENT = f"django-pgqueue/{__version__ or 'dev'}"


class WebhookUnavailable(ConnectionError):
    """The webhook did not take the alert (5xx, 408, 425, 429, a timeout or a
    connection error). A ConnectionError, so the failure policy classifies it
    as DEPENDENCY: retried with backoff."""


class WebhookError(PgQueueError):
    """The webhook request failed in an unexpected way (UNKNOWN: retried, then
    dead-lettered)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would turn the POST into a GET and
    would send the secret headers on to whatever host the redirect names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


@handler(conf.ALERT_TOPIC, atomic=False, timeout=DELIVERY_TIMEOUT)
def deliver_alert(message):
    deliver(message.payload)


def deliver(payload):
    """POST ``payload`` as JSON to ALERT_WEBHOOK_URL; returns the HTTP status.

    Raises ``WebhookUnavailable`` (retried), ``Permanent`` (not retried) or
    ``WebhookError`` (anything unexpected, UNKNOWN: retried); see the module
    docstring. When ALERT_WEBHOOK_URL has been unset since the alert was
    queued, the alert is dropped (logged) and None returned. The HTTP timeout
    is ALERT_WEBHOOK_TIMEOUT, at most HTTP_TIMEOUT_MAX.
    """
    fields = payload if isinstance(payload, dict) else {}
    topic, category = fields.get("topic"), fields.get("category")
    url = conf.get("ALERT_WEBHOOK_URL")
    if url is None:
        logger.info(
            "Alert topic=%s category=%s dropped: ALERT_WEBHOOK_URL is no longer set",
            topic,
            category,
            extra={"topic": topic, "category": category, "state": "alert_dropped"},
        )
        return None
    secrets = _secrets(url)
    timeout = min(float(conf.get("ALERT_WEBHOOK_TIMEOUT")), HTTP_TIMEOUT_MAX)
    detail = None
    try:
        status, phrase = _post(url, payload, timeout), ""
    except urllib.error.HTTPError as exc:
        status, phrase = exc.code, str(exc.reason or "")
        exc.close()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        status, detail = None, _describe(exc, timeout)
    except Exception as exc:
        detail = _scrub(f"{type(exc).__name__}: {exc}", secrets)
        raise WebhookError(f"webhook request failed: {detail}") from None

    if status is None:
        raise WebhookUnavailable(_scrub(f"webhook unreachable: {detail}", secrets))
    if 200 <= status < 300:
        logger.info(
            "Alert topic=%s category=%s count=%s delivered to %s: HTTP %s",
            topic,
            category,
            fields.get("count"),
            _host(url),
            status,
            extra={"topic": topic, "category": category, "state": "alert_delivered"},
        )
        return status
    answer = _scrub(f"webhook answered HTTP {status} {phrase}".strip(), secrets)
    if status >= 500 or status in RETRYABLE_STATUSES:
        raise WebhookUnavailable(answer)
    if 300 <= status < 400:
        raise Permanent(
            f"{answer} (redirects are not followed: set ALERT_WEBHOOK_URL to the final URL)"
        )
    raise Permanent(f"{answer} (not retried: fix the webhook or its settings, then revive)")


def _post(url, payload, timeout):
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        **(conf.get("ALERT_WEBHOOK_HEADERS") or {}),
    }
    body = json.dumps(payload, ensure_ascii=False).encode()
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    # A new opener per call: it reads the proxy settings of the environment now.
    opener = urllib.request.build_opener(_NoRedirect)
    with opener.open(request, timeout=timeout) as response:
        return response.status


def _describe(exc, timeout):
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
        return f"timed out after {timeout:g}s"
    text = str(reason)
    return f"{type(reason).__name__}: {text}" if text else type(reason).__name__


def _secrets(url):
    """What must not appear in a log line or an exception message: the header
    values (and their words, e.g. the token of "Bearer <token>"), the URL, and
    the parts of the URL that may be credentials, as written and decoded: its
    password, its query values and its path segments (a Slack webhook's token
    is its last path segment); words under 8 characters only as a password."""
    secrets = {url}
    parts = urlsplit(url)
    words = [pair.partition("=")[2] for pair in parts.query.split("&")]
    words += parts.path.split("/")
    words = [*words, *map(unquote_plus, words)]
    secrets.update(word for word in words if len(word) >= 8)
    if parts.password:
        secrets.update({parts.password, unquote_plus(parts.password)})
    for value in (conf.get("ALERT_WEBHOOK_HEADERS") or {}).values():
        if isinstance(value, str) and value:
            secrets.add(value)
            secrets.update(word for word in value.split() if len(word) >= 8)
    return sorted(secrets, key=len, reverse=True)


def _scrub(text, secrets):
    for secret in secrets:
        text = text.replace(secret, "[hidden]")
    return text


def _host(url):
    """The scheme, host and port of ``url``: what a log line may show."""
    parts = urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{parts.hostname}{port}"
