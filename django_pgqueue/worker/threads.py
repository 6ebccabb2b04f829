"""The threads of a worker's engine: each runs in a copy of the context of
the code that starts it, so that ``conf.database_alias()`` there names the
engine's database (``Worker.run`` works inside ``conf.on_database``), and
the asyncio tasks of its event loop inherit it. One copy per thread: a
context can be entered by one thread at a time."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable


def thread(target: Callable[[], object], name: str) -> threading.Thread:
    """A daemon thread, not started, that runs ``target`` in a copy of the
    calling thread's context (taken now: make it where the engine's
    database is in force)."""
    context = contextvars.copy_context()
    return threading.Thread(target=context.run, args=(target,), name=name, daemon=True)


def start(target: Callable[[], object], name: str) -> threading.Thread:
    """``thread(target, name)``, started."""
    started = thread(target, name)
    started.start()
    return started
