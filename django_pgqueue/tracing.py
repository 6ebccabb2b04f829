"""OpenTelemetry tracing (the ``otel`` extra): one trace from the code that
enqueues a message to the handler that runs it, in whichever process.

``enqueue``, ``enqueue_many`` and ``publish`` run in a PRODUCER span and
write its W3C trace context (``traceparent``, ``tracestate``: whatever the
project's propagator writes) into the headers of the messages or the
event; the worker runs each handler, and each stream subscriber, in a
CONSUMER span whose parent is the context read back from those headers.
The attributes follow OpenTelemetry's semantic conventions for messaging
(``messaging.system``, ``messaging.destination.name`` = the queue or the
stream, ``messaging.operation.*``, ``messaging.message.id``), with the
topic and the attempt under ``messaging.pgqueue.*``. A failed run records
its exception and sets the span's status to ERROR; the retry or the dead
letter that follows is an event of the span.

Only the API is used: the spans go wherever the project's SDK sends them,
and nowhere when it configures none. ``PGQUEUE["TRACING"]``: None (the
default) traces when ``opentelemetry-api`` can be imported, False never,
True always (the system checks refuse it without the package).

The cost when tracing is off or the package is absent: ``tracer()``, one
function call that returns None; nothing of OpenTelemetry is imported.
With the API but no tracer provider configured, spans would record and
carry nothing: ``tracer()`` then returns None too, after a look at the
process's provider (benchmarks/instructions.py measures both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from django_pgqueue import conf

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# messaging.system: ours (the conventions' list names the brokers; a system
# outside it uses its own name).
SYSTEM = "pgqueue"
INSTRUMENTATION = "django_pgqueue"
# The attributes outside the conventions' common set, in our namespace.
TOPIC = "messaging.pgqueue.topic"
ATTEMPT = "messaging.pgqueue.message.attempt"
POSITION = "messaging.pgqueue.stream.position"
# The span events of a failed run's outcome.
RETRY_EVENT = "pgqueue.retry"
DEAD_LETTER_EVENT = "pgqueue.dead_letter"

_UNKNOWN: Any = object()
# On, but the process has no tracer provider yet (none configured: the API
# alone records nothing and propagates nothing, so there is nothing to do).
_UNCONFIGURED: Any = object()
_tracer: Any = _UNKNOWN  # the Tracer, None when off, or one of the two above
_api: Any = None  # the opentelemetry.trace module, once imported


def tracer() -> Tracer | None:
    """The tracer to use, or None when there is nothing to trace:
    ``PGQUEUE["TRACING"]`` is False, or None and ``opentelemetry-api`` is
    not installed, or the process has configured no tracer provider (yet:
    the SDK is usually set up at start-up, and is used from the moment it
    is). Decided once, and again after ``override_settings`` changes
    ``PGQUEUE``."""
    found = _tracer
    if found is _UNKNOWN:
        return _decide()
    if found is _UNCONFIGURED:
        return _configured()
    return found


def _decide() -> Tracer | None:
    global _tracer, _api
    setting = conf.get("TRACING")
    _tracer = None
    if setting is not False:
        try:
            from opentelemetry import trace
        except ImportError:
            if setting:
                raise ImproperlyConfigured(
                    "PGQUEUE['TRACING'] is True but opentelemetry-api is not installed "
                    "(pip install django-pgqueue[otel])"
                ) from None
        else:
            _api, _tracer = trace, _UNCONFIGURED
            trace.get_tracer_provider()  # loads one named by OTEL_PYTHON_TRACER_PROVIDER
            return _configured()
    return None


def _configured() -> Tracer | None:
    """The tracer of the process's tracer provider, kept once there is one
    (a provider is set once per process); None while there is none. A
    provider of the API's no-op kind (OTEL_SDK_DISABLED...) turns tracing off."""
    global _tracer
    # While none is set, get_tracer_provider() looks the environment up on
    # every call (microseconds, on every enqueue); the API's global says
    # the same at once. Should a later API lose it, the public call decides.
    if getattr(_api, "_TRACER_PROVIDER", _UNKNOWN) is None:
        return None
    provider = _api.get_tracer_provider()
    if isinstance(provider, _api.ProxyTracerProvider):
        return None
    if isinstance(provider, _api.NoOpTracerProvider):
        _tracer = None
        return None
    _tracer = provider.get_tracer(INSTRUMENTATION)
    return _tracer


def _forget(*, setting: str, **kwargs: object) -> None:
    """``PGQUEUE`` changed (override_settings): decide again when next asked."""
    global _tracer
    if setting == "PGQUEUE":
        _tracer = _UNKNOWN


setting_changed.connect(_forget, dispatch_uid="django_pgqueue.tracing")


# --- producing -------------------------------------------------------------------


@contextlib.contextmanager
def producing(
    tracer: Tracer,
    destination: str,
    topic: str | None,
    count: int | None = None,
) -> Iterator[tuple[Span, dict[str, str]]]:
    """A PRODUCER span around an enqueue (``destination``: the queue) or a
    publish (the stream; ``topic`` None); yields (the span, the headers that
    carry its context). ``count``: the messages of an enqueue_many. An
    exception is recorded on the span and raised on."""
    from opentelemetry import propagate, trace

    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": destination,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
    }
    if topic is not None:
        attributes[TOPIC] = topic
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    name = f"send {topic or destination}"
    with tracer.start_as_current_span(
        name, kind=trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield span, carrier


def with_context(headers: Mapping[str, Any] | None, carrier: Mapping[str, str]) -> dict[str, Any]:
    """``headers`` (not changed) with the trace context of ``carrier`` over them;
    anything that is not a dict is returned as it is, for the validation to
    refuse, and so are the headers when the carrier is empty (no SDK is
    configured: its spans carry no context)."""
    if not carrier:
        return headers  # type: ignore[return-value]
    if headers is None:
        return dict(carrier)
    if not isinstance(headers, dict):
        return headers  # type: ignore[return-value]
    return {**headers, **carrier}


def with_context_many(messages: Iterable[Any], carrier: Mapping[str, str]) -> Iterator[Any]:
    """enqueue_many's dicts, those with headers of their own given the trace
    context too (the others take it from the defaults' headers), one at a
    time as the insert consumes them."""
    for item in messages:
        if carrier and isinstance(item, dict) and "headers" in item:
            item = {**item, "headers": with_context(item["headers"], carrier)}
        yield item


def sent(span: Span, message_id: object) -> None:
    """The enqueue inserted its message: its id on the span."""
    if message_id is not None:
        span.set_attribute("messaging.message.id", str(message_id))


# --- consuming -------------------------------------------------------------------


def start_consumer(
    tracer: Tracer,
    headers: object,
    destination: str,
    topic: str,
    message_id: object,
    attempt: int,
    subscription: str | None = None,
) -> Span:
    """Start (not activate) the CONSUMER span of one run of a handler or a
    subscriber; its parent is the trace context in ``headers``, if any."""
    from opentelemetry import propagate, trace

    parent = propagate.extract(headers) if isinstance(headers, dict) else None
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": destination,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": str(message_id),
        TOPIC: topic,
        ATTEMPT: attempt,
    }
    if subscription is not None:
        attributes["messaging.consumer.group.name"] = subscription
        attributes[POSITION] = message_id
    return tracer.start_span(
        f"process {topic}", context=parent, kind=trace.SpanKind.CONSUMER, attributes=attributes
    )


@contextlib.contextmanager
def active(span: Span, record: bool = True) -> Iterator[None]:
    """``span`` is the current span inside the block (the handler's own spans
    are its children); an exception is recorded on it (unless ``record`` is
    False: the caller records it), its status set to ERROR, and raised on.
    The span is not ended: its outcome comes later."""
    from opentelemetry import trace

    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        try:
            yield
        except BaseException as exc:
            if record:
                failed(span, exc)
            raise


def failed(span: Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` and set its status to ERROR."""
    from opentelemetry.trace import Status, StatusCode

    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))


def retried(span: Span, category: str, reason: str, delay: float) -> None:
    """The failed run's message is retried ``delay`` seconds later."""
    span.add_event(
        RETRY_EVENT,
        {"pgqueue.category": str(category), "pgqueue.reason": reason, "pgqueue.delay": delay},
    )


def dead_lettered(span: Span, category: str, reason: str) -> None:
    """The failed run's message went to the dead letters."""
    span.add_event(DEAD_LETTER_EVENT, {"pgqueue.category": str(category), "pgqueue.reason": reason})


def end(span: Span, outcome: str) -> None:
    """End the run's span with its outcome (done, failed, lost...)."""
    span.set_attribute("pgqueue.outcome", outcome)
    span.end()
