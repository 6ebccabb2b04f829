"""Pages of the demo shop: placing an order enqueues its welcome e-mail
(tests/test_tracing.py follows one trace from this request to the handler
in a worker process), from sync and from async views
(tests/test_async_enqueue.py)."""

from asgiref.sync import sync_to_async
from django.db import transaction
from django.http import JsonResponse
from django.views.decorators.http import require_POST

from django_pgqueue import aenqueue, enqueue

from .models import Order


@require_POST
def place_order(request):
    message = enqueue("demo.welcome_email", {"customer": request.POST.get("customer", "")})
    return JsonResponse({"message_id": message.pk}, status=201)


@require_POST
async def place_order_async(request):
    """The same from an async view. It opened no transaction: the message
    is committed when aenqueue() returns."""
    message = await aenqueue("demo.welcome_email", {"customer": request.POST.get("customer", "")})
    return JsonResponse({"message_id": message.pk}, status=201)


@transaction.atomic
def record_order(customer):
    """The order and its message in one transaction: both or neither."""
    order = Order.objects.create(customer=customer)
    message = enqueue("demo.welcome_email", {"customer": customer, "order_id": order.pk})
    return order, message


@require_POST
async def place_order_with_writes(request):
    """An async view that writes an order with its message: the sync
    function under transaction.atomic, awaited through sync_to_async."""
    order, message = await sync_to_async(record_order)(request.POST.get("customer", ""))
    return JsonResponse({"order_id": order.pk, "message_id": message.pk}, status=201)
