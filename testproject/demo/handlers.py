"""Handlers of the demo project. The demo.* topics show the failure policy;
the test.* topics are driven by the test suite's worker processes."""

import asyncio
import os
import time

from django.core.exceptions import ValidationError

from django_pgqueue import Permanent, Retry, cancel_requested, handler

from .models import Handled


def record(message):
    Handled.objects.create(
        message_id=message.pk, topic=message.topic, attempt=message.attempts, pid=os.getpid()
    )


# --- the demo ---------------------------------------------------------------


@handler("demo.welcome_email")
def welcome_email(message):
    record(message)


@handler("demo.charge_card", backoff_base=0.2, backoff_cap=1.0)
def charge_card(message):
    # The payment service is "down" for the first attempts.
    if message.attempts < message.payload.get("succeed_on_attempt", 2):
        raise ConnectionError("payment service unreachable")
    record(message)


@handler("demo.import_row")
def import_row(message):
    if "sku" not in message.payload:
        raise Permanent(f"row without a sku: {message.payload!r}")
    record(message)


@handler("demo.reserve_stock")
def reserve_stock(message):
    if message.payload.get("quantity", 0) > 100:
        raise ValidationError("cannot reserve more than 100 items")
    record(message)


@handler("demo.clock")
def clock(message):
    """The demo's periodic schedule (pgqueue_demo's "demo.clock", every
    second): each tick's message names its schedule and tick in its headers."""
    record(message)


# --- for the tests ------------------------------------------------------------


@handler("test.record")
def test_record(message):
    record(message)


@handler("test.record_nonatomic", atomic=False)
def test_record_nonatomic(message):
    record(message)


@handler("test.sleep")
def test_sleep(message):
    """Writes its ledger row first, then sleeps payload["seconds"] (on a later
    attempt payload["then"]): a kill in the sleep leaves an uncommitted write."""
    record(message)
    key = "seconds" if message.attempts == 1 else "then"
    time.sleep(message.payload.get(key, message.payload.get("seconds", 1)))


@handler("test.timeout", timeout=1, max_attempts=2, backoff_base=0.1, backoff_cap=0.1)
def test_timeout(message):
    time.sleep(message.payload.get("seconds", 5))
    record(message)


FAILURES = {
    "ValueError": lambda: ValueError("malformed value"),
    "ConnectionError": lambda: ConnectionError("downstream is down"),
    "TimeoutError": lambda: TimeoutError("took too long"),
    "RuntimeError": lambda: RuntimeError("something odd"),
    "ValidationError": lambda: ValidationError("rule says no"),
    "Permanent": lambda: Permanent("cannot ever work"),
}


@handler("test.fail", backoff_base=0.05, backoff_cap=0.2)
def test_fail(message):
    """Fails with payload["raise"] for the first payload["times"] attempts
    (all of them if "times" is absent); payload["after"] asks Retry(after=)."""
    times = message.payload.get("times")
    if times is None or message.attempts <= times:
        if "after" in message.payload:
            raise Retry("asked to retry", after=message.payload["after"])
        raise FAILURES[message.payload.get("raise", "RuntimeError")]()
    record(message)


@handler("test.async")
async def test_async(message):
    from asgiref.sync import sync_to_async

    await sync_to_async(record)(message)


@handler("test.async_batch", backoff_base=0.05, backoff_cap=0.1)
async def test_async_batch(message):
    """Records through sync_to_async; payload "fail" then raises (first attempt)."""
    from asgiref.sync import sync_to_async

    await sync_to_async(record)(message)
    if message.payload.get("fail") and message.attempts == 1:
        raise RuntimeError("async handler failed after writing")


# Async handlers on the worker's event loop (atomic=False): how many are in
# their handler now, and the most at once (in-process tests read it; all of
# them run in the loop's one thread).
ASYNC_RUNNING = {"now": 0, "most": 0}


@handler("test.async_wait", atomic=False, backoff_base=0.05, backoff_cap=0.1)
async def test_async_wait(message):
    """Waits payload["seconds"] (default 1), counted in ASYNC_RUNNING, then
    records its run (payload "mark_start": a "started" row first).
    Cancelled (a timeout, a cancellation asked, shutdown): with payload
    "catch_cancel" it records a "cancel seen" row and returns, else the
    cancellation goes on. "fail_times" fails the first attempts."""
    from asgiref.sync import sync_to_async

    if message.payload.get("mark_start"):  # a "started" row: tests of worker processes
        await sync_to_async(Handled.objects.create)(
            message_id=message.pk, topic="started", attempt=message.attempts, pid=os.getpid()
        )
    ASYNC_RUNNING["now"] += 1
    ASYNC_RUNNING["most"] = max(ASYNC_RUNNING["most"], ASYNC_RUNNING["now"])
    try:
        await asyncio.sleep(message.payload.get("seconds", 1))
    except asyncio.CancelledError:
        if message.payload.get("catch_cancel"):
            await sync_to_async(Handled.objects.create)(
                message_id=message.pk,
                topic="cancel seen" if cancel_requested() else "cancelled, not asked",
                attempt=message.attempts,
                pid=os.getpid(),
            )
            return "caught"
        raise
    finally:
        ASYNC_RUNNING["now"] -= 1
    if message.attempts <= message.payload.get("fail_times", 0):
        raise RuntimeError("async handler failed")
    await sync_to_async(record)(message)
    return "waited"


# Atomic batches (several handlers share a transaction): what each one leaves.
COMMITTED = []  # message ids whose on_commit callback ran (in-process tests)
# Other clients' connections holding a message's row FOR UPDATE ("nodb_lock"
# below), by message id; the test that asked closes them.
ROW_LOCKS = {}


@handler("test.batch", backoff_base=0.05, backoff_cap=0.1)
def test_batch(message):
    """Records, registers an on_commit callback, then: payload "fail" raises
    after the write; "swallow" breaks the transaction with bad SQL and
    swallows the error; "steal" takes its own lease away (as a rescue and
    another worker's claim would) before returning; "sleep" sleeps.

    Before any query: "nodb" only registers the callback; "fail_early"
    registers it and raises; "nodb_steal" registers it and takes its own
    lease away without a query on the worker's connection; "nodb_lock"
    registers it and, on its first attempt, has another client lock its row
    (ROW_LOCKS) without a query on the worker's connection; "raw_swallow"
    breaks the transaction through
    the driver's connection (around Django) and swallows the error, and
    "raw_swallow_then_write" then also records (all on the first attempt)."""
    from django.db import connection, transaction

    action = message.payload.get("do")
    first = message.attempts == 1
    if action in ("nodb", "fail_early", "nodb_steal", "nodb_lock"):
        transaction.on_commit(lambda: COMMITTED.append(message.pk))
        if action == "fail_early" and first:
            raise RuntimeError("failed before any query")
        if action == "nodb_steal":
            steal_lease(message)
        if action == "nodb_lock" and first and message.pk not in ROW_LOCKS:
            other = other_client()
            other.execute(
                "SELECT 1 FROM django_pgqueue_message WHERE id = %s FOR UPDATE", [message.pk]
            )
            ROW_LOCKS[message.pk] = other
        return
    if action in ("raw_swallow", "raw_swallow_then_write") and first:
        try:
            connection.connection.execute("SELECT no_such_column FROM demo_handled")
        except Exception:
            pass
        if action == "raw_swallow":
            return
    record(message)
    transaction.on_commit(lambda: COMMITTED.append(message.pk))
    if action == "fail" and first:
        raise RuntimeError("failed after writing")
    if action == "swallow" and first:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT no_such_column FROM demo_handled")
        except Exception:
            pass
    if action == "steal":
        steal_lease(message)
    if action == "sleep":
        time.sleep(message.payload["seconds"])


def other_client(autocommit=False):
    """A psycopg connection of its own to the queue's database."""
    import psycopg
    from django.db import connection

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=autocommit)


def steal_lease(message):
    """Give ``message``'s row another lease token (as a rescue and another
    worker's claim would), from a connection of its own."""
    with other_client(autocommit=True) as other:
        other.execute(
            "UPDATE django_pgqueue_message SET lease_token = gen_random_uuid() WHERE id = %s",
            [message.pk],
        )


@handler("test.batch_timeout", timeout=0.5, backoff_base=0.05, backoff_cap=0.1)
def test_batch_timeout(message):
    """Records; on its first attempt, sleeps payload["sleep"] seconds (past
    its timeout when asked)."""
    record(message)
    if message.attempts == 1:
        time.sleep(message.payload.get("sleep", 0))


# --- for benchmarks/ ------------------------------------------------------------


@handler("bench.noop")
def bench_noop(message):
    pass


@handler("bench.noop_nonatomic", atomic=False)
def bench_noop_nonatomic(message):
    pass


@handler("bench.latency", atomic=False)
def bench_latency(message):
    """The handler's start, recorded as the peers of python -m benchmarks
    compare record theirs: a line "<id> <epoch seconds>" appended to
    BENCH_LATENCY_FILE when the worker has one (no database work, as
    graphile-worker's handler does none); else a demo.Handled row, whose
    handled_at is taken when the handler starts its write (the throughput
    scenario reads those)."""
    path = os.environ.get("BENCH_LATENCY_FILE")
    if not path:
        record(message)
        return
    line = f"{message.pk} {time.time():.6f}\n".encode()
    # One write of one short line on an O_APPEND descriptor: the handler
    # threads' lines never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@handler("bench.async_wait", atomic=False)
async def bench_async_wait(message):
    """Waits payload["seconds"] on the worker's event loop, as a call to a
    slow HTTP API would (python -m benchmarks async)."""
    await asyncio.sleep(message.payload["seconds"])


@handler("bench.thread_wait", atomic=False)
def bench_thread_wait(message):
    """The same wait in a handler thread, for the thread-based run beside it."""
    time.sleep(message.payload["seconds"])


@handler("test.group")
def test_group(message):
    """Message groups: sleeps payload["delay"] seconds, then records."""
    time.sleep(message.payload.get("delay", 0))
    record(message)


@handler("test.group_nonatomic", atomic=False)
def test_group_nonatomic(message):
    time.sleep(message.payload.get("delay", 0))
    record(message)


@handler("test.group_fail", backoff_base=0.05, backoff_cap=0.05, max_attempts=2)
def test_group_fail(message):
    """Fails (UNKNOWN: retried, then dead-lettered) while payload["fail"]."""
    if message.payload.get("fail"):
        raise RuntimeError("test.group_fail: told to fail")
    record(message)


@handler("test.group_hold", max_attempts=1, dead_letter_blocks_group=True)
def test_group_hold(message):
    """Like test.group_fail, but its dead letters keep the group blocked."""
    if message.payload.get("fail"):
        raise RuntimeError("test.group_hold: told to fail")
    record(message)


# --- for python -m benchmarks chaos ---------------------------------------------------
# The payload says how each attempt goes: {"fail": {"<attempt>": "<kind>"}}
# raises the exception of that kind on that attempt (attempts count rescues
# too), {"sleep": seconds} holds the handler first, so that a fault finds
# messages in flight. An attempt that does not fail writes its ledger row
# (demo.Handled) last: for an atomic topic that row commits with the
# acknowledgement or not at all; for a non-atomic one it commits on its own,
# before the acknowledgement, as any non-atomic handler's effects do.

CHAOS_FAILURES = {
    "transient": lambda: TimeoutError("chaos: the downstream call timed out"),
    "dependency": lambda: ConnectionError("chaos: the downstream service refused"),
    "permanent": lambda: Permanent("chaos: malformed"),
    "business": lambda: ValidationError("chaos: the order was cancelled"),
    "unknown": lambda: RuntimeError("chaos: something unexpected"),
    "retry": lambda: Retry(after=0.05),
}


def chaos(message):
    time.sleep(message.payload.get("sleep", 0))
    kind = message.payload.get("fail", {}).get(str(message.attempts))
    if kind is not None:
        raise CHAOS_FAILURES[kind]()
    record(message)


# Two atomic and two non-atomic topics, so that several topics share the
# workers' claims and batches.
@handler("chaos.orders", backoff_base=0.05, backoff_cap=0.5)
def chaos_orders(message):
    chaos(message)


@handler("chaos.invoices", backoff_base=0.05, backoff_cap=0.5)
def chaos_invoices(message):
    chaos(message)


@handler("chaos.emails", atomic=False, backoff_base=0.05, backoff_cap=0.5)
def chaos_emails(message):
    chaos(message)


@handler("chaos.webhooks", atomic=False, backoff_base=0.05, backoff_cap=0.5)
def chaos_webhooks(message):
    chaos(message)


# --- run-time control (pause, cancel, limits) ------------------------------------


@handler("test.cancellable")
def test_cancellable(message):
    """Records (atomic: rolled back if it raises), then works for
    payload["seconds"] in 10 ms steps, asking cancel_requested() at each; when
    told, raises (payload "ignore": finishes anyway)."""
    from django_pgqueue import cancel_requested

    record(message)
    deadline = time.monotonic() + message.payload.get("seconds", 5)
    while time.monotonic() < deadline:
        if cancel_requested() and not message.payload.get("ignore"):
            raise RuntimeError("stopped early: cancellation was asked")
        time.sleep(0.01)


@handler("test.started", atomic=False)
def test_started(message):
    """Records its start at once (atomic=False: committed before it sleeps),
    then sleeps payload["seconds"]: the tests read the starts while it runs."""
    record(message)
    time.sleep(message.payload.get("seconds", 0))


# --- workflows (tests/test_workflows.py) ----------------------------------------


@handler("wf.value", backoff_base=0.05, backoff_cap=0.1)
def wf_value(message):
    """Records; returns payload["value"] (fails while payload["fail_times"]
    attempts are not over, raising payload["raise"])."""
    failures = message.payload.get("fail_times", 0)
    if failures and (failures < 0 or message.attempts <= failures):
        raise FAILURES[message.payload.get("raise", "Permanent")]()
    record(message)
    return message.payload.get("value")


@handler("wf.value_nonatomic", atomic=False)
def wf_value_nonatomic(message):
    record(message)
    return message.payload.get("value")


@handler("wf.sum")
def wf_sum(message):
    """Records; returns the sum of the results of the steps it follows (and
    payload["add"]), with what it saw."""
    record(message)
    results = message.workflow.results()
    return {
        "sum": sum(_number(v) for v in results.values()) + message.payload.get("add", 0),
        "saw": sorted(results),
    }


def _number(value):
    return value["sum"] if isinstance(value, dict) else (value or 0)


@handler("wf.split", backoff_base=0.05, backoff_cap=0.1)
def wf_split(message):
    """Adds payload["parts"] steps (wf.value, value i) and a wf.sum join after
    them to its own workflow; payload["fail"]: then raises (nothing added)."""
    record(message)
    wf = message.workflow
    parts = [
        wf.add("wf.value", {"value": i}, name=f"part-{i}")
        for i in range(message.payload.get("parts", 3))
    ]
    wf.add("wf.sum", {}, name="join", after=parts)
    if message.payload.get("fail") and message.attempts == 1:
        raise ConnectionError("split failed after adding")
    return len(parts)


@handler("wf.unserialisable")
def wf_unserialisable(message):
    return object()


@handler("wf.sleep")
def wf_sleep(message):
    """Records, then sleeps payload["seconds"] or until its cancellation is asked."""
    from django_pgqueue import cancel_requested

    record(message)
    end = time.monotonic() + message.payload.get("seconds", 1)
    while time.monotonic() < end and not cancel_requested():
        time.sleep(0.02)
    return message.payload.get("value")


# --- workflows under kill -9 (tests/test_workflow_chaos.py) -------------------------


@handler("wf.chaos_part")
def wf_chaos_part(message):
    """Records (with its acknowledgement: exactly once), after holding its
    thread payload["sleep"] seconds, so that a kill finds parts in flight;
    returns payload["value"]."""
    time.sleep(message.payload.get("sleep", 0))
    record(message)
    return message.payload.get("value")


@handler("wf.chaos_part_nonatomic", atomic=False)
def wf_chaos_part_nonatomic(message):
    """wf.chaos_part with atomic=False: its ledger row commits on its own, so
    a kill after it and before the acknowledgement runs it again."""
    time.sleep(message.payload.get("sleep", 0))
    record(message)
    return message.payload.get("value")


@handler("wf.chaos_join")
def wf_chaos_join(message):
    """Records; returns how many results of the steps it follows it saw (all
    of them: it is released only once every one is done)."""
    record(message)
    return len(message.workflow.results())


# --- demo workflow (pgqueue_demo's "demo.import": fetch -> 3 parts -> report) ----


@handler("demo.import_fetch")
def import_fetch(message):
    """The demo workflow's first step: "fetches" payload["file"]; its result
    (kept for the steps after it) says how many rows each part has."""
    record(message)
    return {"file": message.payload["file"], "rows_per_part": 10}


@handler("demo.import_part")
def import_part(message):
    """One part, after the fetch: reads the fetch's result, returns its rows."""
    record(message)
    return message.workflow.result("fetch")["rows_per_part"]


@handler("demo.import_report")
def import_report(message):
    """After every part: adds up their results."""
    record(message)
    parts = message.workflow.results()
    return {"parts": len(parts), "rows": sum(parts.values())}
