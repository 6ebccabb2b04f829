"""The threads of a worker's engine: each runs in a copy of the context of
the code that starts it, so that ``conf.database_alias()`` there names the
engine's database (``Worker.run`` works inside ``conf.on_database``), and
the asyncio tasks of its event loop inherit it. One copy per thread: a
context can be entered by one thread at a time."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable


def start(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread that runs ``target`` in a copy of the calling
    thread's context (call it where the engine's database is in force)."""
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name=name, daemon=True)
    thread.start()
    return thread
