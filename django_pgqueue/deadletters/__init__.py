"""Dead-letter triage: revive(), resolve() and categorize(), the only code
that changes ``DeadLetter.state``::

    new --revive--> revived        (a new Message in the queue, attempts 0)
     '--resolve--> resolved        (kept for audit, with who and a note)
    revived/resolved --revive(force=True)--> revived (again)

Each function takes a ``DeadLetter`` queryset, or an iterable of ids (or of
``DeadLetter`` instances), and works through it in chunks of ``chunk_size``
rows in id order, one transaction per chunk. A chunk's rows are locked with
``SELECT ... FOR UPDATE`` (waiting, not skipping) and their state re-read
under the lock: two operators reviving the same rows at once revive each
row once; the second one finds it revived and skips it. A failure rolls back
its own chunk only; earlier chunks stay done. Only the ids of one chunk, and
that chunk's rows, are in memory at a time.

Rows that are left alone are counted by reason in the returned
``TriageResult``. Bad arguments raise ``DeadLetterError`` before anything is
written. Who did it and the note go into ``notes``, one line per change.

The modules: ``redrive`` (revive), ``resolution`` (resolve),
``categorization`` (categorize), ``selection`` (select() and the chunks a
call works through), ``arguments`` (checks of what a caller passes),
``audit`` (the notes lines and the log), ``result`` (TriageResult).
"""

from django_pgqueue.deadletters.categorization import categorize
from django_pgqueue.deadletters.redrive import revive
from django_pgqueue.deadletters.resolution import resolve
from django_pgqueue.deadletters.result import (
    ALREADY_RESOLVED,
    ALREADY_REVIVED,
    DUPLICATE,
    GONE,
    INVALID,
    IS_RESOLVED,
    IS_REVIVED,
    UNCHANGED,
    TriageResult,
)
from django_pgqueue.deadletters.selection import CHUNK_SIZE, select
from django_pgqueue.exceptions import DeadLetterError

__all__ = [
    "ALREADY_RESOLVED",
    "ALREADY_REVIVED",
    "CHUNK_SIZE",
    "DUPLICATE",
    "GONE",
    "INVALID",
    "IS_RESOLVED",
    "IS_REVIVED",
    "UNCHANGED",
    "DeadLetterError",
    "TriageResult",
    "categorize",
    "resolve",
    "revive",
    "select",
]
