"""The faults the soak injects: kill -9, SIGTERM, pg_terminate_backend of
a worker's connections, and a crash restart of PostgreSQL (only of the
cluster it was given)."""

import os
import random
import signal
import subprocess
import time

from benchmarks.harness import throwaway_pg
from benchmarks.scenarios.chaos import log, with_retry


class Restarter:
    """Restarts the one cluster it was given, ``pg_ctl -D <datadir> restart -m
    immediate`` (as the data directory's owner when we are root)."""

    def __init__(self, datadir, pg_ctl, log_path):
        self.datadir = datadir
        self.pg_ctl = pg_ctl
        self.log_path = log_path

    def check_serves(self, connection):
        """Refuse to go on unless ``connection``'s server runs on our data directory."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('data_directory')")
            served = cursor.fetchone()[0]
        if os.path.realpath(served) != os.path.realpath(self.datadir):
            raise SystemExit(
                f"--restart-datadir {self.datadir} is not the data directory of the server"
                f" behind DATABASE_URL ({served}): refusing to restart it"
            )

    def restart(self):
        command = [
            self.pg_ctl,
            "-D",
            self.datadir,
            "restart",
            "-m",
            "immediate",
            "-w",
            "-t",
            "120",
            # The new postmaster writes there, not into our pipes.
            "-l",
            self.log_path,
        ]
        done = subprocess.run(
            throwaway_pg.as_owner(command, self.datadir),
            cwd=self.datadir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=180,
        )
        if done.returncode:
            raise RuntimeError(
                f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            )


class Faults:
    """One fault per call, in shuffled rounds of the chosen kinds."""

    def __init__(self, kinds, workers, restarter=None):
        self.kinds = list(kinds)
        self.workers = workers
        self.round = []
        self.counts = dict.fromkeys(kinds, 0)
        # Messages leased to a worker when a fault hit it: the most that a
        # non-atomic handler may have handled again afterwards.
        self.exposed = 0
        self.restarter = restarter
        assert restarter is not None or "restart" not in kinds

    def inject(self):
        if not self.kinds:
            return
        if not self.round:
            self.round = random.sample(self.kinds, len(self.kinds))
        kind = self.round.pop()
        getattr(self, kind)()
        self.counts[kind] += 1

    def leased(self, pid=None):
        from django.db import connection

        def count():
            with connection.cursor() as cursor:
                if pid is None:
                    cursor.execute(
                        "SELECT count(*) FROM django_pgqueue_message WHERE status = 'processing'"
                    )
                else:
                    cursor.execute(
                        "SELECT count(*) FROM django_pgqueue_message"
                        " WHERE status = 'processing' AND locked_by LIKE %s",
                        [f"%:{pid}:%"],
                    )
                return cursor.fetchone()[0]

        return with_retry(count, "counting leased messages")

    def kill9(self):
        self._signal_and_replace(signal.SIGKILL, "kill -9")

    def sigterm(self):
        # A graceful stop finishes or hands back what it holds; counted as
        # exposed all the same, so the bound never relies on that.
        self._signal_and_replace(signal.SIGTERM, "SIGTERM")

    def _signal_and_replace(self, signum, label):
        victim = self.workers.victim()
        if victim is None:
            return
        exposed = self.leased(victim.pid)
        self.workers.signal(victim, signum)
        self.exposed += exposed
        self.workers.start()
        log(f"fault: {label} worker {victim.pid} ({exposed} leased); replaced")

    def terminate(self):
        from django.db import connection

        victim = self.workers.victim()
        if victim is None:
            return
        exposed = self.leased(victim.pid)

        def cut():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE application_name LIKE %s",
                    [f"pgqueue_%#{victim.pid}"],
                )
                return cursor.fetchone()[0]

        cut_count = with_retry(cut, "terminating backends")
        self.exposed += exposed
        log(f"fault: pg_terminate_backend x{cut_count} of worker {victim.pid} ({exposed} leased)")

    def restart(self):
        from django.db import connection

        exposed = self.leased()
        started = time.monotonic()
        self.restarter.restart()
        connection.close()
        self.exposed += exposed
        log(
            f"fault: PostgreSQL of {self.restarter.datadir} restarted (immediate) in"
            f" {time.monotonic() - started:.1f}s ({exposed} leased)"
        )
