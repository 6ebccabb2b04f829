"""The maintenance round's leadership: one worker at a time does the round
(its key: ``maintenance.MAINTENANCE_LOCK_KEY``)."""

from __future__ import annotations

# Maintenance leadership: a transaction-scoped advisory lock, so it works
# behind a transaction-pooling PgBouncer too (no session state) and is
# released by the commit or by the connection's death, never leaked.
MAINTENANCE_LOCK_SQL = "SELECT pg_try_advisory_xact_lock(%s)"
