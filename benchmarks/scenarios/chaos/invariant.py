"""The invariant, checked every interval during the soak from a connection
of its own, in one snapshot (one statement) per check."""

import threading
import time

from benchmarks.scenarios.chaos import log
from benchmarks.scenarios.chaos.ledger import CHECK_SQL


class InvariantChecker(threading.Thread):
    """CHECK_SQL every interval from a connection of its own (reconnecting
    after a restart); records every check that found a violation."""

    def __init__(self, dsn, interval):
        super().__init__(name="chaos-invariant", daemon=True)
        self.dsn = dsn
        self.interval = interval
        self.checks = 0
        self.violations = []
        self.pending = None  # messages still in the queue at the last check
        self.stop_event = threading.Event()

    def run(self):
        import psycopg

        conn = None
        while not self.stop_event.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                both, lost, atomic_twice, pending, total = conn.execute(CHECK_SQL).fetchone()
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                self.stop_event.wait(0.5)
                continue
            self.checks += 1
            self.pending = pending
            if both or lost or atomic_twice:
                found = {"in_queue_and_dead": both, "lost": lost, "atomic_done_twice": atomic_twice}
                self.violations.append({"at": time.time(), "of": total, **found})
                log(f"INVARIANT VIOLATED: {found}")
            self.stop_event.wait(self.interval)
        if conn is not None:
            conn.close()

    def stop(self):
        self.stop_event.set()
        self.join(timeout=30)
