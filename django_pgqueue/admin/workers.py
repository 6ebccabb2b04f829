"""The admin of the workers' heartbeats: which workers run, which queues
they serve, and whether each is alive."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest

from django_pgqueue.admin.common import ChoiceFilter, ReadOnlyModelAdmin
from django_pgqueue.models import WorkerHeartbeat


class AliveFilter(ChoiceFilter):
    title = "alive"
    parameter_name = "alive"
    options = {
        "yes": ("Alive", Q(expires_at__gt=Now())),
        "no": ("Dead (heartbeat stale)", Q(expires_at__lte=Now())),
    }


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyModelAdmin):
    """Read only: rows are written by the workers' heartbeats. A worker that
    stopped cleanly has no row; a dead one shows as not alive for a day."""

    list_display = [
        "worker_id",
        "alive",
        "queues_text",
        "concurrency",
        "inflight",
        "processed",
        "heartbeat_at",
        "started_at",
    ]
    list_filter = [AliveFilter]
    search_fields = ["worker_id", "hostname"]
    ordering = ["-heartbeat_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        alive = ExpressionWrapper(Q(expires_at__gt=Now()), BooleanField())
        return super().get_queryset(request).annotate(is_alive=alive)

    @admin.display(boolean=True, ordering="is_alive")
    def alive(self, obj: Any) -> bool:
        return obj.is_alive

    @admin.display(description="queues")
    def queues_text(self, obj: WorkerHeartbeat) -> str:
        return ", ".join(obj.queues)
