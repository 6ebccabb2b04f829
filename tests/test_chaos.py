"""The chaos soak (benchmarks/chaos.py), short: real worker processes killed,
stopped and cut off from the database, PostgreSQL itself crashed and
restarted, with the invariant checked during the run and nothing lost or
handled twice by an atomic handler.

The soak runs against a throwaway cluster of this module's own (initdb in a
temporary directory, a free port: benchmarks/throwaway_pg.py), the only
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

from .conftest import MANAGE, SharedServer, shared_server_changes, shared_servers, wait_until

pytestmark = [pytest.mark.slow]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CHAOS = BENCHMARKS / "chaos.py"
DATABASES = {"default": "pgqueue_chaos", "other": "pgqueue_chaos_other"}

sys.path.insert(0, str(BENCHMARKS))
try:
    import throwaway_pg
finally:
    sys.path.remove(str(BENCHMARKS))


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
    soak = subprocess.Popen(
        [
            sys.executable,
            str(CHAOS),
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
            "240",
            "--json",
            str(result_file),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        env=cluster_env(throwaway_cluster),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A process group of its own, with its worker processes: none of them
        # outlives the test, even when it times out or is interrupted.
        start_new_session=True,
    )
    try:
        stdout, stderr = soak.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(soak.pid, signal.SIGKILL)
        soak.wait()
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
