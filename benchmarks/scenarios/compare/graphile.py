"""graphile-worker (Node.js) as a system of the compare scenario: its client and
worker are one script, peers/graphile/bench_graphile.js, run by node with
the pinned packages of peers/graphile/package-lock.json, which ``npm ci``
installs into peers/graphile/node_modules (ignored by git) when they are
missing or the lock file changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.scenarios.compare import PEERS, StepFailed
from benchmarks.scenarios.compare.system import System, Variant

HOME = PEERS / "graphile"
JOBS = "graphile_worker._private_jobs"

# The tuned configuration (graphile-worker's performance docs,
# "batching"): 24 concurrent jobs, a local queue of 500 jobs fetched (and
# locked) at once, and completions batched: completeJobBatchDelay 0 sends
# the completions that pile up within one turn of the event loop as one
# statement (the docs suggest starting at 250 ms in production; a longer
# delay only holds the jobs locked longer after they finished).
TUNED = ["--concurrency", "24", "--local-queue", "500", "--complete-batch-delay", "0"]


def node() -> str:
    """The node binary: BENCH_NODE, else ``node`` on PATH."""
    found = os.environ.get("BENCH_NODE") or shutil.which("node")
    if not found:
        raise StepFailed("node not found (set BENCH_NODE): graphile-worker runs on Node.js >= 20")
    return found


class Graphile(System):
    name = "graphile"
    label = "graphile-worker"
    script = "graphile/bench_graphile.js"
    tables = [JOBS, "graphile_worker._private_job_queues"]
    single_note = "`await workerUtils.addJob('noop', payload)` (one statement, autocommit)"
    bulk_note = "`await workerUtils.addJobs([...])`, one statement per chunk of 1,000"
    poll_note = "LISTEN, poll every 2 s"
    worker_note_format = (
        "`node bench_graphile.js worker{args}` + the variant's options: the library's"
        " `run()` (`runOnce()`, `--once`, for the drains), task list `{{noop}}`, warnings and"
        " errors logged"
    )
    first_key_sql = f"SELECT min(id) FROM {JOBS}"
    claimed_sql = f"SELECT coalesce((SELECT locked_at IS NOT NULL FROM {JOBS} WHERE id = %s), true)"
    # A finished job is deleted; a failed one stays, with last_error set,
    # scheduled for its retry: not waiting for a first attempt any more.
    empty_sql = f"SELECT NOT EXISTS (SELECT 1 FROM {JOBS} WHERE last_error IS NULL)"
    remaining_sql = f"SELECT count(*) FROM {JOBS} WHERE last_error IS NULL"
    verify_sql = (
        f"SELECT NOT EXISTS (SELECT 1 FROM {JOBS}),"
        f" (SELECT count(*) FROM {JOBS} WHERE last_error IS NOT NULL)"
    )

    def __init__(self, opts, name=None):
        super().__init__(opts, name)
        lock = json.loads((HOME / "package-lock.json").read_text())
        # For the report: the exact versions npm ci installs (the pins).
        self.pins = [
            f"{spec}@{lock['packages'][f'node_modules/{spec}']['version']}"
            for spec in lock["packages"][""]["dependencies"]
        ]

    @property
    def worker_note(self):
        return self.worker_note_format.format(args="".join(f" {a}" for a in self.worker_args))

    @property
    def python(self):
        return Path(node())

    def variants(self):
        return [
            Variant("defaults", "graphile-worker, defaults", worker_args=[]),
            Variant(
                "tuned",
                "graphile-worker, 24 jobs, local queue 500, batched completes",
                worker_args=TUNED,
            ),
        ]

    def install(self, log_dir):
        """``npm ci`` into peers/graphile/node_modules unless it matches the lock file."""
        lock = (HOME / "package-lock.json").read_bytes()
        wanted = hashlib.sha256(lock).hexdigest() + "\n"
        marker = HOME / "node_modules" / ".bench-lock"
        if marker.exists() and marker.read_text() == wanted:
            return
        if self.opts.skip_install:
            raise StepFailed(f"{HOME / 'node_modules'} is missing or stale, and --skip-install")
        npm = shutil.which("npm")
        if not npm:
            raise StepFailed("npm not found: it installs graphile-worker (npm ci)")
        print(f"  npm ci in {HOME} ({', '.join(self.pins)})", file=sys.stderr)
        log = Path(log_dir) / f"install-{self.name}.log"
        with open(log, "wb") as out:
            done = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"],
                cwd=HOME,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        if done.returncode != 0:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise StepFailed(f"npm ci failed ({log}): {tail}")
        marker.write_text(wanted)

    def pip_freeze(self):
        """The installed tree, as npm lists it (the report's counterpart of pip freeze)."""
        done = subprocess.run(
            ["npm", "ls", "--all", "--parseable", "--long"],
            cwd=HOME,
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [ln.split(":")[1] for ln in done.stdout.splitlines()[1:] if ":" in ln]
        return sorted(set(lines)) if done.returncode == 0 else None

    def worker_argv(self, variant, burst):
        variant = variant or self.variants()[-1]
        argv = [self.python, PEERS / self.script, "worker", *self.worker_args]
        return argv + variant.worker_args + (["--once"] if burst else [])
