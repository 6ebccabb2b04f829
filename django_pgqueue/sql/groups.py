"""Message groups: the promotion of the next message of released groups,
and a group's advisory lock (as the promotion function takes it)."""

from __future__ import annotations

# Message groups: promote the next message of released groups (the function
# of migration 0009; see models.GroupRelease), which the ORM cannot lock and
# update group by group. Returns how many releases are left for another
# call. Parameters: the releases to take (PROMOTE_LIMIT) and whether to
# NOTIFY the queues of the promoted messages.
PROMOTE_GROUPS_SQL = "SELECT pgqueue_promote_groups(%s, %s)"
PROMOTE_LIMIT = 1000  # releases per call
# The transaction-scoped advisory lock of one group, as the promotion
# function takes it (two-key form: a space of its own, apart from the
# maintenance lock's single key).
GROUP_LOCK_SQL = "SELECT pg_advisory_xact_lock(1885827431, hashtext(%s))"
