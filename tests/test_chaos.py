"""The chaos soak (benchmarks/chaos.py), short: real worker processes killed,
stopped and cut off from the database, PostgreSQL itself restarted (when
this machine lets the tests do it), with the invariant checked during the
run and nothing lost or handled twice by an atomic handler."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connections

from .conftest import database_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHAOS = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"


def can_restart_postgres():
    sys.path.insert(0, str(CHAOS.parent))
    try:
        import chaos
    finally:
        sys.path.remove(str(CHAOS.parent))
    return chaos.postgres_cluster() is not None


def test_short_chaos_soak_loses_nothing(tmp_path):
    faults = ["kill9", "sigterm", "terminate"]
    if can_restart_postgres():
        faults.append("restart")
    result_file = tmp_path / "chaos.json"
    env = {
        **os.environ,
        "DATABASE_URL": database_url("default"),
        "OTHER_DATABASE_URL": database_url("other"),
    }
    # Our own connections would not survive a restart of the server.
    connections.close_all()
    try:
        run = subprocess.run(
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
                "--seed",
                "7",
                "--timeout",
                "240",
                "--json",
                str(result_file),
                "--log-dir",
                str(tmp_path / "logs"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        connections.close_all()
    assert result_file.exists(), run.stdout + run.stderr
    result = json.loads(result_file.read_text())
    report = run.stdout + run.stderr[-3000:]
    assert result["enqueued"] == 2000, report
    assert result["lost"] == 0, report
    assert result["still_queued"] == 0, report
    assert result["handled_twice_atomic"] == 0, report
    assert result["extra_handlings_nonatomic"] <= result["exposed_in_flight"], report
    assert result["invariant_checks"] >= 5 and not result["invariant_violations"], report
    assert not result["unexpected_worker_exits"], report
    assert all(result["faults"][kind] >= 1 for kind in faults), report
    # Every message ended somewhere, and the failure plans reached the dead letters.
    assert result["done"] + result["dead_lettered"] == 2000, report
    assert {"permanent", "business"} <= set(result["dead_letter_categories"]), report
    assert result["ok"] and run.returncode == 0, report
