"""The failover fault (``--failover sync|async``): the soak runs against a
throwaway primary and its streaming standby (benchmarks/harness/replication.py),
every process on a multi-host DATABASE_URL; mid-run the primary is killed
(SIGKILL to the postmaster and every child) and the standby promoted. Then
it measures, on the new primary: when every live worker has connected
again, when the first handling commits, when every message that was leased
at the kill is out of its dead lease (handed back, claimed again or done),
and how many enqueues that the old primary acknowledged are missing (the
asynchronous window; 0 with a synchronous standby)."""

import time

from benchmarks.harness import replication
from benchmarks.scenarios.chaos import log, with_retry
from benchmarks.scenarios.chaos.ledger import EXPECTED_TABLE

DATABASE = "pgqueue_chaos"


class Failover:
    def __init__(self, primary, standby, synchronous):
        self.primary = primary
        self.standby = standby
        self.synchronous = synchronous
        self.live_workers = lambda: 1  # () -> how many worker processes run (set by the soak)
        self.performed = False
        self.in_flight = {}  # message id -> lease token, at the kill
        self.killed = self.promoted = None
        self.last_handled = None  # the ledger's last id at the promotion
        self.figures = {}

    def busy(self):
        """Whether the workers hold messages (the failover waits for that:
        on a loaded machine they may still be starting)."""
        from django.db import connection

        def count():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM django_pgqueue_message WHERE status = 'processing'"
                )
                return cursor.fetchone()[0]

        return with_retry(count, "counting the leases") > 0

    def perform(self):
        """Kill the primary, promote the standby (once)."""
        from django.db import connection

        def leased():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT id, lease_token FROM django_pgqueue_message WHERE status = 'processing'"
                )
                return dict(cursor.fetchall())

        self.in_flight = with_retry(leased, "reading the leases")
        replication.kill9(self.primary)
        self.killed = time.monotonic()
        replication.promote(self.standby)
        self.promoted = time.monotonic()
        self.performed = True
        connection.close()  # ours reconnects to the new primary
        self.last_handled = self._read("SELECT coalesce(max(id), 0) FROM demo_handled")[0][0]
        self.figures = {
            "mode": "sync" if self.synchronous else "async",
            "in_flight_at_kill": len(self.in_flight),
            "kill_to_promoted_s": round(self.promoted - self.killed, 3),
        }
        log(
            f"fault: failover, primary killed (-9) with {len(self.in_flight)} leased, standby"
            f" promoted in {self.promoted - self.killed:.2f}s"
        )

    @property
    def measured(self):
        return not self.performed or all(
            key in self.figures
            for key in (
                "promoted_to_workers_reconnected_s",
                "promoted_to_first_handled_s",
                "promoted_to_in_flight_back_s",
            )
        )

    def measure(self):
        """One look at the new primary (the soak's loop calls it until ``measured``)."""
        if self.measured:
            return
        since = round(time.monotonic() - self.promoted, 3)
        figures = self.figures
        if "promoted_to_workers_reconnected_s" not in figures:
            connected = self._read(
                "SELECT count(DISTINCT application_name) FROM pg_stat_activity"
                " WHERE application_name LIKE 'pgqueue_worker#%'"
            )[0][0]
            if connected >= self.live_workers():
                figures["promoted_to_workers_reconnected_s"] = since
        if "promoted_to_first_handled_s" not in figures:
            last = self._read("SELECT coalesce(max(id), 0) FROM demo_handled")[0][0]
            if last > self.last_handled:
                figures["promoted_to_first_handled_s"] = since
        if "promoted_to_in_flight_back_s" not in figures:
            held = self._read(
                "SELECT count(*) FROM django_pgqueue_message WHERE status = 'processing' AND"
                " (id, lease_token) IN (SELECT * FROM unnest(%s::bigint[], %s::uuid[]))",
                [list(self.in_flight), list(self.in_flight.values())],
            )[0][0]
            if not held:
                figures["promoted_to_in_flight_back_s"] = since

    def result(self, enqueued):
        """The figures, with the enqueues that the new primary lacks."""
        if not self.performed:
            return {"mode": "sync" if self.synchronous else "async", "performed": False}
        recorded = self._read(f"SELECT count(*) FROM {EXPECTED_TABLE}")[0][0]
        return {**self.figures, "performed": True, "enqueues_lost": enqueued - recorded}

    def _read(self, sql, params=None):
        def read():
            with self.standby.connect(DATABASE, autocommit=True) as conn:
                return conn.execute(sql, params).fetchall()

        import psycopg

        for _ in range(60):
            try:
                return read()
            except psycopg.OperationalError:
                time.sleep(0.5)
        return read()
