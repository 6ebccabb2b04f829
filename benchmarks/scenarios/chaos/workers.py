"""The soak's worker processes: started, signalled, replaced, reaped. They
stay in the soak's session (whoever kills the soak's process group kills
them too), and die with the soak's process when it is killed outright
(``die_with_parent``)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

from benchmarks.harness.processes import die_with_parent
from benchmarks.harness.tree import Tree
from benchmarks.scenarios.chaos import log

MANAGE = Tree.here().testproject / "manage.py"


class Workers:
    """The worker processes: started, signalled, replaced, reaped."""

    def __init__(self, args, log_dir, pgqueue):
        self.args = args
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PGQUEUE_JSON": json.dumps(pgqueue),
            "PGQUEUE_LOG_LEVEL": "WARNING",
        }
        self.live = []  # Popen
        self.signalled = {}  # pid -> signal sent by us
        self.started = 0
        self.unexpected_exits = []  # (pid, returncode)

    def start(self):
        self.started += 1
        path = self.log_dir / f"worker-{self.started}.log"
        with open(path, "w") as out:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    str(MANAGE),
                    "pgqueue_worker",
                    "--concurrency",
                    str(self.args.concurrency),
                    "--lease",
                    str(self.args.lease),
                    "--poll-interval",
                    "1",
                    "--shutdown-timeout",
                    "10",
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(),
            )
        popen.log_path = path
        self.live.append(popen)
        return popen

    def reap(self):
        """Forget exited workers; note any exit that we did not cause."""
        for popen in list(self.live):
            code = popen.poll()
            if code is None:
                continue
            self.live.remove(popen)
            sent = self.signalled.get(popen.pid)
            # SIGTERM: exit 0 after a graceful stop, or -15 when it came before
            # the worker had installed its handler (it was still starting).
            if sent == signal.SIGKILL or (sent == signal.SIGTERM and code in (0, -signal.SIGTERM)):
                continue
            self.unexpected_exits.append((popen.pid, code, str(popen.log_path)))
            log(f"worker {popen.pid} exited with {code} unasked: see {popen.log_path}")

    def victim(self):
        running = [p for p in self.live if p.pid not in self.signalled]
        return random.choice(running) if running else None

    def signal(self, popen, signum):
        self.signalled[popen.pid] = signum
        popen.send_signal(signum)

    def stop_all(self, timeout=60):
        for popen in self.live:
            if popen.poll() is None and popen.pid not in self.signalled:
                self.signal(popen, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for popen in self.live:
            try:
                popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(popen, signal.SIGKILL)
                popen.wait()
        self.reap()
