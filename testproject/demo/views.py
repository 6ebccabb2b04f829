"""A page of the demo shop: placing an order enqueues its welcome e-mail
(tests/test_tracing.py follows one trace from this request to the handler
in a worker process)."""

from django.http import JsonResponse
from django.views.decorators.http import require_POST

from django_pgqueue import enqueue


@require_POST
def place_order(request):
    message = enqueue("demo.welcome_email", {"customer": request.POST.get("customer", "")})
    return JsonResponse({"message_id": message.pk}, status=201)
