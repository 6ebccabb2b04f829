"""The autovacuum soak (``python -m benchmarks soak``), short: it runs in a
PostgreSQL cluster of its own (benchmarks/harness/throwaway_pg.py), with autovacuum on, and
gets every message through a real worker process. Its figures are not
checked here (a few thousand messages say nothing about bloat); only that
the run completes, loses nothing and reports what the documentation quotes.
The shared server is never touched."""

import json

import pytest

from .conftest import run_benchmark

pytestmark = [pytest.mark.slow]


def test_short_soak_gets_every_message_through(tmp_path):
    result_file = tmp_path / "soak.json"
    done = run_benchmark(
        "soak",
        *[
            "--messages",
            "3000",
            "--rounds",
            "2",
            "--chunk",
            "500",
            "--claim-calls",
            "5",
            "--claim-batch",
            "20",
            "--settle",
            "1",
            "--naptime",
            "1",
            "--probe-pairs",
            "1",
            "--rate-pairs",
            "1",
            "--table-settings",
            "product",
            "--json",
            str(result_file),
        ],
        timeout=600,
    )
    # 0: the checks passed, 3: one failed (a run this short may well grow
    # its table); 1 would be a lost message or a worker's error.
    assert done.returncode in (0, 3), done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    assert result["environment"]["settings"]["autovacuum"] == "on"
    assert result["environment"]["settings"]["autovacuum_naptime"] == "1s"
    [run] = result["runs"]
    assert run["finished_rows"] == 3000
    assert run["dead_letters"] == 0
    assert "vacuum_index_cleanup=on" in run["storage_options"]
    for when in ("probe_start", "probe_end"):
        assert run[when]["calls"] == 5
        assert run[when]["server_cpu_mean_ms"] > 0
    for when in ("paired_start", "paired_end"):
        # The claim beside a never-used database's, in turn: the ratio the
        # check reads.
        pairs = run[when]["pairs"]
        assert len(pairs) == 1
        for pair in pairs:
            assert pair["soaked"]["calls"] == pair["reference"]["calls"] == 5
            assert pair["reference"]["quiesced_s"] is not None
        assert run[when]["server_cpu_ratio"] > 0 and run[when]["p50_ratio"] > 0
    rounds = run["rounds_end"]
    assert len(rounds["pairs"]) == 1 and rounds["messages"] == 1500
    assert all(p["soaked"] > 0 and p["reference"] > 0 for p in rounds["pairs"])
    names = [check["name"] for check in result["checks"]]
    assert "product: claim server CPU, soaked/reference at the end" in names
    assert "product: worker jobs/s, soaked/reference at the end" in names
    sizes = run["rounds"][-1]["sizes"]
    assert set(sizes) == {"django_pgqueue_message", "django_pgqueue_finishedmessage"}
    assert "pgqueue_msg_claim_idx" in sizes["django_pgqueue_message"]["index_bytes"]
