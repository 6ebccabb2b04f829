"""The chaos soak (``python -m benchmarks chaos``), short: real worker processes killed,
stopped and cut off from the database, PostgreSQL itself crashed and
restarted, with the invariant checked during the run and nothing lost or
handled twice by an atomic handler.

The soak runs against a throwaway cluster of this module's own (initdb in a
temporary directory, a free port: benchmarks/harness/throwaway_pg.py), the only
server it restarts. The server that the rest of the suite uses is never
stopped, restarted or reconfigured (conftest.py checks at the end of the run
that its postmaster is the one it found at the start)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import throwaway_pg

from .conftest import (
    MANAGE,
    SharedServer,
    run_benchmark,
    shared_server_changes,
    shared_servers,
    wait_until,
)

pytestmark = [pytest.mark.slow]

DATABASES = {"default": "pgqueue_chaos", "other": "pgqueue_chaos_other"}
ROOT = Path(__file__).resolve().parent.parent


def cluster_env(cluster):
    return {
        **os.environ,
        "DATABASE_URL": cluster.url(DATABASES["default"]),
        "OTHER_DATABASE_URL": cluster.url(DATABASES["other"]),
    }


@pytest.fixture(scope="module")
def throwaway_cluster():
    """A PostgreSQL cluster of this module's own (the binaries of the major
    version the suite's server runs, when installed), with both aliases'
    databases created and migrated; removed at the end."""
    try:
        cluster = throwaway_pg.ThrowawayCluster.create(major=shared_servers()[0].major())
    except throwaway_pg.ClusterError as exc:
        pytest.fail(f"the chaos test cannot run its own PostgreSQL: {exc}")
    try:
        for name in DATABASES.values():
            cluster.create_database(name)
        for alias in DATABASES:
            migrate = subprocess.run(
                [sys.executable, str(MANAGE), "migrate", "--database", alias, "--verbosity", "0"],
                env=cluster_env(cluster),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        yield cluster
    finally:
        cluster.close()


def postmaster_start_time(cluster):
    with cluster.connect(DATABASES["default"], autocommit=True) as conn:
        return conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]


def test_the_shared_server_check_notices_a_reload_and_a_restart(throwaway_cluster):
    """conftest.py's end-of-run check (that the suite's servers were neither
    restarted nor reconfigured), on a server that we may do both to."""
    server = SharedServer("127.0.0.1", throwaway_cluster.port, throwaway_cluster.user, "")
    before = {server: server.state()}
    assert shared_server_changes(before) == []
    throwaway_cluster.pg_ctl("reload")  # the postmaster handles the SIGHUP when it gets to it
    problems = wait_until(lambda: shared_server_changes(before), message="the reload noticed")
    assert problems == [
        f"{server!r} reloaded its configuration: at {before[server][1]}, now at {server.state()[1]}"
    ]
    before = {server: server.state()}
    throwaway_cluster.restart("immediate")
    [problem] = shared_server_changes(before)
    assert problem.startswith(f"{server!r} was restarted: up since {before[server][0]}, now since")


def test_short_chaos_soak_loses_nothing(throwaway_cluster, tmp_path):
    faults = ["kill9", "sigterm", "terminate", "restart"]
    result_file = tmp_path / "chaos.json"
    booted = postmaster_start_time(throwaway_cluster)
    soak = run_benchmark(
        "chaos",
        *[
            "--messages",
            "2000",
            "--workers",
            "3",
            "--waves",
            "4",
            "--wave-interval",
            "1",
            "--fault-interval",
            "1.2",
            "--faults",
            ",".join(faults),
            "--restart-datadir",
            str(throwaway_cluster.datadir),
            "--pg-ctl",
            throwaway_cluster.pg_ctl_path,
            "--restart-log",
            str(throwaway_cluster.log_path),
            "--seed",
            "7",
            "--timeout",
            "600",
            "--reset",
            "--json",
            str(result_file),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        env=cluster_env(throwaway_cluster),
        timeout=700,
    )
    stdout, stderr = soak.stdout, soak.stderr
    print(stdout)
    report = stdout + stderr[-3000:] + "\nPostgreSQL:\n" + throwaway_cluster.log()[-3000:]
    assert result_file.exists(), report
    result = json.loads(result_file.read_text())
    assert result["enqueued"] == 2000, report
    assert result["lost"] == 0, report
    assert result["still_queued"] == 0, report
    assert result["handled_twice_atomic"] == 0, report
    assert result["extra_handlings_nonatomic"] <= result["exposed_in_flight"], report
    assert result["invariant_checks"] >= 5 and not result["invariant_violations"], report
    assert not result["unexpected_worker_exits"], report
    assert all(result["faults"][kind] >= 1 for kind in faults), report
    # The crash restarts happened, on the throwaway cluster.
    assert result["faults"]["restart"] >= 1, report
    assert postmaster_start_time(throwaway_cluster) > booted, report
    # Every message ended somewhere, and the failure plans reached the dead letters.
    assert result["done"] + result["dead_lettered"] == 2000, report
    assert {"permanent", "business"} <= set(result["dead_letter_categories"]), report
    assert result["ok"] and soak.returncode == 0, report


# A test runner in miniature: it starts the chaos soak as run_benchmark does
# (start_scenario), then waits on it.
RUNNER = """
import sys
from benchmarks.harness.processes import start_scenario

soak = start_scenario("chaos", sys.argv[1:])
print(soak.pid, flush=True)
soak.wait()
"""


def parent_pids():
    """{pid: parent pid} of every live process (zombies are dead)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if state != "Z":
                parents[int(entry)] = int(ppid)
    return parents


def test_a_runner_killed_outright_leaves_neither_soak_nor_workers(throwaway_cluster, tmp_path):
    """The runner (pytest, in real life) is SIGKILLed mid-soak: no finally of
    its runs, yet the soak and its worker processes end with it."""
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, "--messages", "1000", "--waves", "1000"]
        + ["--wave-interval", "1", "--workers", "2", "--faults", "kill9"]
        + ["--fault-interval", "600", "--timeout", "120", "--reset", "--log-dir", str(tmp_path)],
        cwd=ROOT,
        env=cluster_env(throwaway_cluster),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started = []
    try:
        soak = int(runner.stdout.readline())
        started.append(soak)

        def workers():
            found = [pid for pid, parent in parent_pids().items() if parent == soak]
            return found if len(found) == 2 else None

        started += wait_until(workers, timeout=60, message="the soak's two workers")
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        wait_until(
            lambda: not set(started) & parent_pids().keys(),
            timeout=60,
            message=f"the soak and its workers ({started}) to end with their runner",
        )
    finally:
        for pid in [runner.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        runner.wait()
        runner.stdout.close()
