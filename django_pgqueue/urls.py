"""URLs for the web process: include them wherever suits, e.g.

    path("pgqueue/", include("django_pgqueue.urls")),

gives ``/pgqueue/metrics`` (Prometheus) and ``/pgqueue/health`` (JSON).
"""

from django.urls import path

from django_pgqueue.observability import views

app_name = "pgqueue"

urlpatterns = [
    path("metrics", views.metrics, name="metrics"),
    path("health", views.health, name="health"),
]
