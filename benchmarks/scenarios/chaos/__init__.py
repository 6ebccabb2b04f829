"""The chaos scenario's parts: messages enqueued in waves with a ledger of what was
enqueued (``ledger``), the worker processes (``workers``), the faults
injected into them and into PostgreSQL (``faults``), and the invariant
checked while it all runs (``invariant``)."""

import sys
import time

TOPICS = {  # topic: atomic?
    "chaos.orders": True,
    "chaos.invoices": True,
    "chaos.emails": False,
    "chaos.webhooks": False,
}
FAILURE_KINDS = ("transient", "dependency", "permanent", "business", "unknown", "retry")
FAULT_KINDS = ("kill9", "sigterm", "terminate", "restart")
MAX_ATTEMPTS = 4


def log(text):
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def with_retry(fn, what, attempts=60):
    """Run ``fn`` against the database, riding out a restart or a cut connection."""
    from django.db import InterfaceError, OperationalError, connection

    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if attempt == attempts - 1:
                raise
            log(f"{what}: {str(exc).splitlines()[0]}; retrying")
            connection.close()
            time.sleep(0.5)
    raise AssertionError("unreachable")
