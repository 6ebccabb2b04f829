"""The worker: claim ready messages, run their handlers, acknowledge them.

``Worker`` (``core``) is the coordinator; each part owns one concern:

- ``config``: the options, resolved once;
- ``ledger``: the jobs it holds, from claim to acknowledgement;
- ``claiming``: whether and how much to claim, and the claim;
- ``pool``, ``executor``, ``atomic``: the handler threads, running a job
  alone or atomic ones in a shared transaction, and timeouts;
- ``outcomes``: what follows a success or a failure;
- ``acks``: the acknowledgements of atomic=False handlers, in batches;
- ``heartbeat``: liveness, lease extension, maintenance;
- ``wakeup``, ``listener``: what wakes the main loop;
- ``shutdown``: signals and the steps of a shutdown;
- ``streams``: the stream delivery thread, for the subscriptions it serves;
- ``threads``: how its threads start, each working on its database.

A ``Worker`` is an engine for one database. ``engines`` runs one per
database in one process, for a worker whose queues are on several.
"""

from django_pgqueue.worker.core import Worker

__all__ = ["Worker"]
