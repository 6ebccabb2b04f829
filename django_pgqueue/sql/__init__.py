"""The SQL that the ORM cannot say, in one package: a module per concern.

Each statement is named and says why it is written by hand. Values are
always bound parameters (``%s``); identifiers that come from the models are
quoted through the connection (``table()``, here: every module uses it);
the rest of the text is fixed. The modules build statements and their
parameters (and decode what the claim returns); running them is the
business of the modules that own the state they change (``lifecycle``,
``groups``, ``maintenance``, ``liveness``, ``schedules.state``...).

- ``claim``: the claim of a queue's ready messages, and its rows decoded;
- ``limited``: the claim of a queue with limits (concurrency, rate);
- ``acks``: the acknowledgement, guarded by the lease;
- ``history``: the history of finished messages and the outcome counts;
- ``insert``: enqueue()'s and enqueue_many()'s INSERTs;
- ``timeouts``: the worker's lock and statement timeouts on a transaction;
- ``probe``: an idle worker's poll and the heartbeat sent with it;
- ``wakeups``: the NOTIFY of a queue's wake-up and of the control channel;
- ``groups``: the promotion of message groups and a group's lock;
- ``maintenance``: the maintenance round's leadership lock;
- ``schedules``: a scheduler round's clock, cursors and tick ledger.

Importers name the module they use (``from django_pgqueue.sql import claim
as claim_sql``); this package re-exports nothing.
"""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Model


def table(connection: BaseDatabaseWrapper, model: type[Model]) -> str:
    """The table of ``model``, quoted for ``connection``."""
    return connection.ops.quote_name(model._meta.db_table)
