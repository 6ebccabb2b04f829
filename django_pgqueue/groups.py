"""FIFO message groups: the hand-off from one message of a group to the next.

Messages with the same ``group_key`` run one at a time, in enqueue order. A
grouped message arrives ``blocked``. Triggers (migration 0009) record a
release (models.GroupRelease) in the transaction of every change that may
leave a group without a head: a grouped message inserted or deleted
(acknowledged, dead-lettered, removed), a dead letter that held its group
revived, resolved or deleted. A promotion consumes the releases: for each
group, under the group's advisory lock, if no message of the group is
waiting or processing and no dead letter holds it, its oldest blocked
message becomes waiting (a unique index refuses a second head anyway).

The worker promotes in its claim's round trip (lifecycle.ack_and_claim_rows
with ``promote``); ``promote_groups`` is the same promotion on its own.
"""

from __future__ import annotations

from django.db import connections, transaction
from django.db.models import Exists
from django.db.models.functions import Now

from django_pgqueue import conf
from django_pgqueue.models import GROUP_HEAD, Message, Status
from django_pgqueue.sql import groups as groups_sql
from django_pgqueue.sql import wakeups as wakeups_sql


def promote_groups(limit: int = groups_sql.PROMOTE_LIMIT) -> int:
    """Promote the next message of each released group, in a transaction of
    its own unless the caller has one. Returns how many releases are left
    for another call (groups being promoted by another transaction right
    now, or past ``limit``)."""
    using = conf.database_alias()
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(groups_sql.PROMOTE_GROUPS_SQL, [limit, bool(conf.get("NOTIFY"))])
        left: int = cursor.fetchone()[0]
        return left


def lead_group(message: Message) -> bool:
    """Make ``message``, just inserted (so blocked) in the caller's
    transaction, the head of its group ahead of the group's older blocked
    messages, if the group has no head: a revived dead letter that held its
    group runs first. Returns whether it became the head."""
    using = conf.database_alias()
    connection = connections[using]
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            # After the lock, the statements below see what a promotion of
            # this group that held it committed (READ COMMITTED).
            cursor.execute(groups_sql.GROUP_LOCK_SQL, [message.group_key])
        has_head = Message.objects.using(using).filter(
            group_key=message.group_key, status__in=GROUP_HEAD
        )
        led = (
            Message.objects.using(using)
            .filter(pk=message.pk, status=Status.BLOCKED)
            .exclude(Exists(has_head))
            .update(status=Status.WAITING, updated_at=Now())
        )
        if led and conf.get("NOTIFY"):
            with connection.cursor() as cursor:
                cursor.execute(wakeups_sql.NOTIFY_SQL, [[message.queue]])
    if led:
        message.status = Status.WAITING
    return bool(led)
