"""Dead-letter alerts: a JSON POST to ``PGQUEUE["ALERT_WEBHOOK_URL"]``.

How an alert travels:

1. ``on_dead_lettered`` receives the ``dead_lettered`` signal (sent after the
   dead letter committed). With no ``ALERT_WEBHOOK_URL`` it does nothing.
   Dead letters of ``conf.ALERT_TOPIC`` (an alert that could not be
   delivered) never raise an alert of their own: no alert loops.
2. ``raise_alert`` asks the suppression row of the dead letter's topic and
   category (``AlertState``, shared by every process) whether an alert may go
   out now, and if so enqueues a message of topic ``"pgqueue.alert"`` on the
   dead letter's queue, with ``max_attempts = 1 + ALERT_WEBHOOK_RETRIES``,
   in the same transaction. A message, not a request made right here: it
   survives a crash after the dead letter committed, it is delivered with
   the queue's retry and backoff policy, a slow webhook holds one handler
   slot and nothing else, and an alert that cannot be delivered becomes a
   dead letter itself (visible in the admin, revivable).
3. A worker runs the handler of ``"pgqueue.alert"`` (``handlers.py``): one
   POST, success on any 2xx answer.

The receiver never raises: an error on the way to the alert is logged and
swallowed, so the dead-lettering (and the message processing around it)
never fails because of alerts.

Suppression: at most one alert per topic and category per ``ALERT_WINDOW``
seconds. The first dead letter of a topic and category sends one and opens a
window; the dead letters that follow inside the window are counted, not
sent. The first dead letter after the window has passed sends the next
alert, which reports how many were held back (``suppressed``) and how many
dead letters it stands for (``count = 1 + suppressed``), and opens a new
window. Known limit: the held-back dead letters are reported by the *next*
alert of their topic and category only; if no dead letter of that topic and
category follows, they are never reported (the admin and the dead-letter
metrics still show them).

The payload (JSON object)::

    event             "dead_lettered"
    topic, category   of the dead letter (and of the suppression window)
    queue             the dead letter's queue (the alert is sent from it too)
    reason            the first line of the dead letter's reason, at most
                      1000 characters
    dead_letter_id    the DeadLetter's id
    message_id        the id the message had in the queue
    attempts          attempts the message made
    worker            the worker that dead-lettered it ("" from the admin)
    dead_lettered_at  ISO 8601
    count             dead letters of this topic and category the alert
                      stands for: this one and the ones held back before it
    suppressed        dead letters held back since the previous alert
    window_seconds    ALERT_WINDOW
    admin_url         ALERT_SITE_URL + the admin page of this dead letter
                      (count 1) or the dead-letter list filtered by topic
                      and category (count > 1); "" when the admin's URLs
                      cannot be reversed
    text              the same in one line, for chat webhooks (Slack,
                      Mattermost, Teams) that show a "text" field; what
                      came from the dead letter is inert there (see
                      ``chat_text``), the other fields are as they are

Delivery, its failures and the secrecy of the webhook's headers: see
``handlers.py``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.db import connections, transaction
from django.urls import reverse

from django_pgqueue import conf
from django_pgqueue.enqueuing import enqueue
from django_pgqueue.models import AlertState, DeadLetter, Message
from django_pgqueue.text import first_line

logger = logging.getLogger(__name__)

REASON_MAX_LENGTH = 1000

# One statement decides, for all processes at once, whether this dead letter
# sends an alert; the ORM cannot say "insert or update, and return the old
# value" in one statement.
#
# Concurrency: ``old`` locks the topic's row (FOR UPDATE) before anything
# else. A concurrent statement waits for that lock and then reads the row as
# the first one committed it (READ COMMITTED re-reads a locked row's newest
# version), so two workers never both see an expired window: the second sees
# the first one's new window and is suppressed. The ON CONFLICT update then
# changes that same, already locked, version, so ``old`` holds exactly the
# values it replaces (what RETURNING cannot show). When the row does not
# exist yet, both insert: one wins, the other finds the conflict with an empty
# ``old`` and counts itself as suppressed (an alert has just gone out).
# ``old`` is MATERIALIZED and read by the INSERT's own source, so it runs
# once, before the insert.
SUPPRESS_SQL = """
WITH clock AS (SELECT COALESCE(%(now)s::timestamptz, now()) AS now),
old AS MATERIALIZED (
    SELECT a.suppressed,
        a.last_sent_at <= clock.now - make_interval(secs => %(window)s) AS window_over
    FROM {table} AS a, clock
    WHERE a.topic = %(topic)s AND a.category = %(category)s
    FOR UPDATE OF a
)
INSERT INTO {table} AS s (topic, category, last_sent_at, suppressed)
SELECT %(topic)s, %(category)s, clock.now, 0 FROM clock LEFT JOIN old ON true
ON CONFLICT (topic, category) DO UPDATE SET
    last_sent_at = CASE WHEN (SELECT window_over FROM old)
        THEN EXCLUDED.last_sent_at ELSE s.last_sent_at END,
    suppressed = CASE WHEN (SELECT window_over FROM old)
        THEN 0 ELSE LEAST(s.suppressed, 2147483646) + 1 END
RETURNING s.suppressed = 0, s.suppressed, COALESCE((SELECT suppressed FROM old), 0)
"""


@dataclass(frozen=True)
class Verdict:
    send: bool
    # send: how many were held back before this one (reported by its alert);
    # not send: how many are held back so far, this one included.
    suppressed: int


def suppression(
    topic: str, category: str, now: datetime | None = None, using: str | None = None
) -> Verdict:
    """Count a dead letter of ``topic`` and ``category`` against its alert
    window, in one statement (see SUPPRESS_SQL); returns the Verdict.

    ``now`` (an aware datetime) stands in for the database's clock.
    """
    using = using or conf.get("DATABASE")
    connection = connections[using]
    sql = SUPPRESS_SQL.format(table=connection.ops.quote_name(AlertState._meta.db_table))
    params = {
        "now": now,
        "window": float(conf.get("ALERT_WINDOW")),
        "topic": topic,
        "category": category,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        send, current, previous = cursor.fetchone()
    return Verdict(send=send, suppressed=previous if send else current)


def on_dead_lettered(sender: Any, dead_letter: Any = None, **kwargs: Any) -> None:
    """Receiver of ``dead_lettered``: raise an alert; never raises itself."""
    try:
        raise_alert(dead_letter)
    except Exception:
        logger.exception(
            "Dead letter id=%s topic=%s: the alert could not be raised",
            getattr(dead_letter, "pk", None),
            getattr(dead_letter, "topic", None),
            extra={"dead_letter_id": getattr(dead_letter, "pk", None), "state": "alert_failed"},
        )


def raise_alert(dead_letter: DeadLetter, now: datetime | None = None) -> Message | None:
    """Enqueue the alert for ``dead_letter`` unless alerts are off, it is an
    alert itself, or its window suppresses it. Returns the alert's Message,
    or None.
    """
    if conf.get("ALERT_WEBHOOK_URL") is None or dead_letter.topic == conf.ALERT_TOPIC:
        return None
    using = conf.get("DATABASE")
    # The window's update and the alert commit together: a window is never
    # spent on an alert that was not queued.
    with transaction.atomic(using=using):
        verdict = suppression(dead_letter.topic, dead_letter.category, now=now, using=using)
        if not verdict.send:
            held = verdict.suppressed
            what = f"alert suppressed ({held} in this window)"
            _log(dead_letter, "alert_suppressed", what, suppressed=held)
            return None
        message = enqueue(
            conf.ALERT_TOPIC,
            build_payload(dead_letter, verdict.suppressed),
            queue=dead_letter.queue,
            max_attempts=1 + conf.get("ALERT_WEBHOOK_RETRIES"),
            using=using,
        )
    _log(
        dead_letter,
        "alert_queued",
        f"alert queued as message id={message.pk} ({verdict.suppressed} held back before it)",
        message_id=message.pk,
    )
    return message


def _log(dead_letter: DeadLetter, state: str, what: str, **extra: Any) -> None:
    """One INFO line on ``dead_letter``'s alert: ``what`` became of it."""
    logger.info(
        "Dead letter id=%s topic=%s category=%s: %s",
        dead_letter.pk,
        dead_letter.topic,
        dead_letter.category,
        what,
        extra={
            "dead_letter_id": dead_letter.pk,
            "topic": dead_letter.topic,
            "category": dead_letter.category,
            "state": state,
            **extra,
        },
    )


def build_payload(dead_letter: DeadLetter, suppressed: int) -> dict[str, Any]:
    """The alert's JSON object (see the module docstring)."""
    count = 1 + suppressed
    reason = first_line(dead_letter.reason)
    if len(reason) > REASON_MAX_LENGTH:
        reason = reason[: REASON_MAX_LENGTH - 1] + "…"
    at = dead_letter.dead_lettered_at
    url = admin_url(dead_letter, count)
    topic, category = chat_text(dead_letter.topic), chat_text(dead_letter.category)
    if count == 1:
        text = f"Dead letter in {topic} ({category})"
    else:
        text = f"{count} dead letters in {topic} ({category}) since the last alert"
    text += f" on queue {chat_text(dead_letter.queue)}: {chat_text(reason)}"
    if url:
        text += f" {slack_escape(url)}"
    return {
        "event": "dead_lettered",
        "topic": dead_letter.topic,
        "category": dead_letter.category,
        "queue": dead_letter.queue,
        "reason": reason,
        "dead_letter_id": dead_letter.pk,
        "message_id": dead_letter.message_id,
        "attempts": dead_letter.attempts,
        "worker": dead_letter.worker or "",
        "dead_lettered_at": at.isoformat() if hasattr(at, "isoformat") else None,
        "count": count,
        "suppressed": suppressed,
        "window_seconds": conf.get("ALERT_WINDOW"),
        "admin_url": url,
        "text": text,
    }


# Slack's control characters, escaped as its message formatting asks; Slack,
# and the markdown of Mattermost and Teams, show the entities as the
# characters.
_SLACK_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
# Line and paragraph breaks and other control characters: the text stays one
# line (a markdown link definition or a block needs a line of its own).
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
ZERO_WIDTH_SPACE = "\u200b"


def slack_escape(text: str) -> str:
    """``text`` with ``&``, ``<`` and ``>`` escaped (Slack's mrkdwn)."""
    return text.translate(_SLACK_ESCAPES)


def chat_text(value: object) -> str:
    """``value`` (a topic, queue, reason: anything a client or an exception
    wrote) made inert in a chat message's text, where it would otherwise
    ping or link: Slack's ``<!channel>``, ``<!here>``, ``<@U123>``,
    ``<#C123>`` and ``<http://x|label>`` (escaped), a mention of anyone or
    everyone (``@channel``, ``@here``, ``@everyone``, ``@all``, ``@name``:
    a zero-width space after every ``@``), and a markdown link or image
    ``[label](http://x)`` (a zero-width space between ``]`` and ``(``).
    Shown, it reads as written (a zero-width space is invisible)."""
    value = _CONTROL_RE.sub(" ", str(value))
    value = slack_escape(value).replace("@", "@" + ZERO_WIDTH_SPACE)
    return value.replace("](", "]" + ZERO_WIDTH_SPACE + "(")


def admin_url(dead_letter: DeadLetter, count: int) -> str:
    """The admin page an alert links to: the dead letter itself when the
    alert stands for it alone, else the dead letters of its topic and
    category. "" when the admin's URLs cannot be reversed."""
    try:
        if count == 1:
            path = reverse("admin:django_pgqueue_deadletter_change", args=[dead_letter.pk])
        else:
            # The parameters of the list filters on "topic" and "category",
            # so the admin shows them as selected.
            query = urlencode(
                {"topic__exact": dead_letter.topic, "category__exact": dead_letter.category}
            )
            path = reverse("admin:django_pgqueue_deadletter_changelist") + "?" + query
    except Exception:  # no admin, another admin site, a broken URLconf: no link
        logger.debug("No admin URL for dead letter id=%s", dead_letter.pk, exc_info=True)
        return ""
    return (conf.get("ALERT_SITE_URL") or "").rstrip("/") + path
