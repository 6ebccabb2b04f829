"""OpenTelemetry tracing (django_pgqueue/tracing.py), with the SDK's
in-memory exporter: PRODUCER spans around enqueue, enqueue_many and
publish, their context in the headers, and CONSUMER spans around handler
and subscriber runs that continue it; one trace from a request through a
real worker process (its spans exported to a file); and nothing at all when
tracing is off or the package is absent.

The SDK's tracer provider is global and can be set once per process: set
here it would trace every later test of this process (and put a
traceparent into headers that other tests compare). So the tests give the
tracing module a tracer of their own provider (``spans``) instead, and
take it back afterwards; the worker process sets its global provider as a
project would (testproject/settings.py, PGQUEUE_TRACE_FILE).
"""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from django_pgqueue import enqueue, enqueue_many, publish, testing, tracing
from django_pgqueue.models import Message

from . import test_testing  # noqa: F401  (its handlers: testing.flaky, testing.refuse)
from .test_streams import LEDGER, deliver

ROOT = Path(__file__).resolve().parent.parent


class Spans:
    def __init__(self):
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("tests")  # the "request" spans
        self.pgqueue_tracer = provider.get_tracer(tracing.INSTRUMENTATION)

    def finished(self, kind=None):
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if kind is None or s.kind == kind]

    def one(self, kind):
        found = self.finished(kind)
        assert len(found) == 1, found
        return found[0]


@pytest.fixture
def spans(monkeypatch):
    found = Spans()
    monkeypatch.setattr(tracing, "_tracer", found.pgqueue_tracer)
    return found


def traceparent(span):
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


# --- producing -------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_runs_in_a_producer_span_whose_context_travels_in_the_headers(spans):
    with spans.tracer.start_as_current_span("POST /orders/", kind=SpanKind.SERVER) as request:
        message = enqueue("testing.confirm", {"order": 1}, queue="mail", headers={"x": "y"})
    producer = spans.one(SpanKind.PRODUCER)
    assert producer.name == "send testing.confirm"
    assert producer.parent.span_id == request.get_span_context().span_id
    assert dict(producer.attributes) == {
        "messaging.system": "pgqueue",
        "messaging.destination.name": "mail",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.pgqueue.topic": "testing.confirm",
        "messaging.message.id": str(message.pk),
    }
    stored = Message.objects.get(pk=message.pk).headers
    assert stored == {"x": "y", "traceparent": traceparent(producer)}
    assert message.headers == stored


@pytest.mark.django_db
def test_enqueue_many_is_one_producer_span_for_all_its_messages(spans):
    messages = enqueue_many(
        [{"payload": {"n": 1}}, {"payload": {"n": 2}, "headers": {"own": True}}],
        topic="testing.confirm",
    )
    producer = spans.one(SpanKind.PRODUCER)
    assert producer.attributes["messaging.batch.message_count"] == 2
    assert producer.attributes["messaging.destination.name"] == "default"
    stored = {m.pk: m.headers for m in Message.objects.all()}
    assert stored == {
        messages[0].pk: {"traceparent": traceparent(producer)},
        messages[1].pk: {"own": True, "traceparent": traceparent(producer)},
    }


@pytest.mark.django_db
def test_a_refused_enqueue_records_its_error_on_the_span(spans):
    with pytest.raises(Exception, match="topic"):
        enqueue("", {})
    producer = spans.one(SpanKind.PRODUCER)
    assert producer.status.status_code == StatusCode.ERROR
    assert [e.name for e in producer.events] == ["exception"]


# --- consuming (in-process: the worker's own parts, through testing.drain) ----------------


@pytest.mark.django_db
def test_a_handler_runs_in_a_consumer_span_continuing_the_producers(spans):
    message = enqueue("testing.confirm", {"order": 2})
    testing.drain()
    producer, consumer = spans.one(SpanKind.PRODUCER), spans.one(SpanKind.CONSUMER)
    assert consumer.name == "process testing.confirm"
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent.span_id == producer.context.span_id
    assert dict(consumer.attributes) == {
        "messaging.system": "pgqueue",
        "messaging.destination.name": "default",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": str(message.pk),
        "messaging.pgqueue.topic": "testing.confirm",
        "messaging.pgqueue.message.attempt": 1,
        "pgqueue.outcome": "done",
    }
    assert consumer.status.status_code == StatusCode.UNSET


@pytest.mark.django_db
def test_a_failed_run_records_its_exception_and_its_retry_then_dead_letter(spans):
    enqueue("testing.flaky", {"succeed_on": 2})
    enqueue("testing.refuse", {"order": 3})
    testing.drain()
    retried, refused = sorted(
        spans.finished(SpanKind.CONSUMER), key=lambda s: s.attributes["messaging.pgqueue.topic"]
    )
    for span in (retried, refused):
        assert span.status.status_code == StatusCode.ERROR
        assert span.events[0].name == "exception"
    assert retried.events[0].attributes["exception.type"].endswith("Retry")
    assert [e.name for e in retried.events] == ["exception", tracing.RETRY_EVENT]
    assert retried.events[1].attributes["pgqueue.delay"] == 60
    assert [e.name for e in refused.events] == ["exception", tracing.DEAD_LETTER_EVENT]
    assert refused.events[1].attributes["pgqueue.category"] == "permanent"
    assert refused.attributes["pgqueue.outcome"] == "failed"


@pytest.mark.django_db(transaction=True)
def test_a_stream_delivery_runs_in_a_consumer_span_continuing_the_publish(spans):
    event = publish("test.events", {"raise": "ConnectionError", "times": 1})
    producer = spans.one(SpanKind.PRODUCER)
    assert producer.attributes["messaging.destination.name"] == "test.events"
    assert event.headers == {"traceparent": traceparent(producer)}
    deliver(LEDGER)  # fails, retried later
    deliver(LEDGER, now=timezone.now() + datetime.timedelta(hours=1))
    first, second = spans.finished(SpanKind.CONSUMER)
    for span in (first, second):
        assert span.parent.span_id == producer.context.span_id
        assert span.attributes["messaging.consumer.group.name"] == LEDGER
        assert span.attributes["messaging.pgqueue.stream.position"] == event.position
    assert first.status.status_code == StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception", tracing.RETRY_EVENT]
    assert second.attributes["messaging.pgqueue.message.attempt"] == 2
    assert second.attributes["pgqueue.outcome"] == "delivered"


# --- across processes ----------------------------------------------------------------------


def test_one_trace_from_the_request_to_the_handler_in_a_worker_process(
    spans, client, start_worker, tmp_path
):
    with spans.tracer.start_as_current_span("POST /demo/orders/", kind=SpanKind.SERVER) as request:
        response = client.post(reverse("demo-place-order"), {"customer": "ada"})
    assert response.status_code == 201
    message_id = response.json()["message_id"]
    producer = spans.one(SpanKind.PRODUCER)

    exported = tmp_path / "worker-spans.jsonl"
    worker = start_worker("--burst", env={"PGQUEUE_TRACE_FILE": str(exported)})
    assert worker.wait(60) == 0, worker.log()
    consumers = [
        span
        for span in map(json.loads, exported.read_text().splitlines())
        if span["kind"] == "SpanKind.CONSUMER"
    ]
    assert len(consumers) == 1, consumers
    consumer = consumers[0]
    assert consumer["attributes"]["messaging.message.id"] == str(message_id)
    assert consumer["attributes"]["pgqueue.outcome"] == "done"
    assert consumer["context"]["trace_id"] == f"0x{request.get_span_context().trace_id:032x}"
    assert consumer["parent_id"] == f"0x{producer.context.span_id:016x}"
    assert producer.parent.span_id == request.get_span_context().span_id


# --- off, or absent ------------------------------------------------------------------------

# Run in a fresh interpreter: whether OpenTelemetry gets imported is the question.
OFF_SCRIPT = """
import sys
if sys.argv[1] == "absent":
    sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed
import django
django.setup()
from django.core.exceptions import ImproperlyConfigured
from django_pgqueue import enqueuing, tracing
from django_pgqueue.conf import validate
from django_pgqueue.streams import delivery
from django_pgqueue.worker import core
assert tracing.tracer() is None
if sys.argv[1] == "unconfigured":  # the API, but no tracer provider (yet)
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    assert tracing.tracer() is None
    trace.set_tracer_provider(TracerProvider())
    assert tracing.tracer() is not None, "the provider set later is used"
    print("ok")
    sys.exit()
loaded = [n for n, m in sys.modules.items() if n.startswith("opentelemetry") and m is not None]
assert not loaded, loaded
if sys.argv[1] == "absent":
    from django.test import override_settings
    with override_settings(PGQUEUE={"TRACING": True}):
        problems = validate()
        assert "opentelemetry-api is not installed" in problems[0][1], problems
        try:
            tracing.tracer()
        except ImproperlyConfigured as exc:
            assert "django-pgqueue[otel]" in str(exc)
        else:
            raise AssertionError("no error")
print("ok")
"""


@pytest.mark.parametrize(
    "case, pgqueue",
    [("off", '{"TRACING": false}'), ("absent", "{}"), ("unconfigured", "{}")],
    ids=["off", "absent", "unconfigured"],
)
def test_nothing_of_opentelemetry_is_imported_when_tracing_is_off_or_absent(case, pgqueue):
    """Off, or absent: nothing imported. The API without a tracer provider:
    nothing to trace until the process configures one."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PGQUEUE_JSON": pgqueue,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "testproject")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, case], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.django_db
def test_tracing_off_leaves_the_headers_alone(spans):
    with override_settings(PGQUEUE={"TRACING": False}):
        assert tracing.tracer() is None
        message = enqueue("testing.confirm", {"order": 4})
        testing.drain()
    assert message.headers == {} and spans.finished() == []


def test_the_setting_is_checked():
    from django_pgqueue.conf import validate

    with override_settings(PGQUEUE={"TRACING": "yes"}):
        assert [p[1] for p in validate()] == [
            "PGQUEUE['TRACING'] must be None (on when opentelemetry-api is installed), "
            "True or False (got 'yes')."
        ]
