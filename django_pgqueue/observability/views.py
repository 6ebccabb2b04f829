"""The metrics and health URLs (see ``urls.py``).

Who may read each is a setting (``METRICS_ACCESS``, ``HEALTH_ACCESS``):
"open", "staff" (a logged-in, active staff user; needs Django's
authentication middleware) or "token" (``Authorization: Bearer
<ENDPOINT_TOKEN>``, compared in constant time).
"""

from django.http import HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from django_pgqueue import conf
from django_pgqueue.observability import endpoints, scrape
from django_pgqueue.observability import health as health_checks


def _refusal(request, setting):
    """None when the request may read the endpoint, else the response."""
    access = conf.get(setting)
    if access == "open":
        return None
    if access == "token":
        # The same check as a worker's own ports (endpoints.worker_refusal).
        if endpoints.token_matches(request.headers.get("Authorization")):
            return None
        response = HttpResponse(endpoints.TOKEN_REQUIRED, status=401)
        response["WWW-Authenticate"] = endpoints.AUTHENTICATE
        response["Content-Type"] = "text/plain; charset=utf-8"
        return response
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return None
    return HttpResponse("Staff only.\n", status=403, content_type="text/plain; charset=utf-8")


@require_safe
@never_cache
def metrics(request):
    """The database metrics (queue depth, oldest ready age, dead letters,
    live workers) in the Prometheus text format, of every database that
    holds the queues (a ``database`` label on each series)."""
    refusal = _refusal(request, "METRICS_ACCESS")
    if refusal is not None:
        return refusal
    body, content_type = scrape.render_database_metrics()
    return HttpResponse(body, content_type=content_type)


@require_safe
@never_cache
def health(request):
    """200 when the queue database answers and every configured queue has a
    live worker, else 503; the JSON body says why. With queues on several
    databases, one part per database (``"databases"``), the failing ones
    named (``"failing"``)."""
    refusal = _refusal(request, "HEALTH_ACCESS")
    if refusal is not None:
        return refusal
    healthy, body = health_checks.system_health()
    return JsonResponse(body, status=200 if healthy else 503)
