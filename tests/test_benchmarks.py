"""Every scenario of ``python -m benchmarks`` still runs: each with tiny
sizes, through the real entry point, on bench databases of this test
process's own (the chaos and soak scenarios run in tests/test_chaos.py and
tests/test_soak.py, on throwaway clusters). The figures of runs this small
mean nothing; what is asserted is that the run completes and reports what
it measures. Peers that install from the network (pgqueuer, procrastinate,
django-tasks-db, graphile-worker) are left out of the compare run."""

import json
import os
import re
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import pytest

from benchmarks.scenarios import SCENARIOS

from .conftest import run_benchmark

pytestmark = [pytest.mark.slow]

ELSEWHERE = {"chaos": "tests/test_chaos.py", "soak": "tests/test_soak.py"}


def bench_url(suffix=""):
    """A bench database of this test process's own: the developer's
    database name, the xdist worker, "bench" (the scenarios' guard)."""
    url = urlsplit(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/pgqueue"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    name = f"{url.path.lstrip('/')}_{worker}_bench{suffix}"
    return urlunsplit(url._replace(path=f"/{name}")), name


def run(scenario, *args, timeout=300):
    done = run_benchmark(scenario, *args, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_help_lists_every_scenario_with_what_it_measures():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, check=True
    )
    for name, scenario in SCENARIOS.items():
        line = rf"^  {re.escape(name)} +{re.escape(scenario.measures)}$"
        assert re.search(line, done.stdout, re.M), done.stdout
    unknown = run_benchmark("no-such-scenario")
    assert unknown.returncode == 2 and "unknown scenario 'no-such-scenario'" in unknown.stderr


def test_every_scenario_has_a_smoke_run():
    tested = {name.removeprefix("test_").replace("_", "-") for name in globals()}
    assert set(SCENARIOS) - tested == set(ELSEWHERE)


def test_throughput():
    url, _ = bench_url()
    out = run(
        "throughput",
        # Enough messages that the drain outlasts an empty-queue run (the
        # scenario's own check; atomic handlers, the slower), even when the
        # empty-queue runs were timed while the suite's other environments
        # loaded the machine and the drain then ran on a quiet one (20,000
        # were drained, start-up and all, in less than such a start-up).
        *["--messages", "60000", "--startup-runs", "3", "--sweep", "none", "--skip", "nonatomic"],
        *["--latency-samples", "3", "--latency-spacing-ms", "5"],
        *["--idle-seconds", "1", "--idle-poll-interval", "0.5", "--database-url", url],
    )
    assert re.search(r"atomic=True +default \(--concurrency 4\): [\d,]+ jobs/s", out), out
    assert re.search(r"p50 [\d.]+ ms", out), out


def test_compare(tmp_path):
    _, name = bench_url("_cmp")
    run(
        "compare",
        *["--systems", "raw,pgqueue", "--skip-install", "--pgqueue-variants", "nonatomic"],
        *["--messages", "300", "--enqueue-messages", "30", "--repeat", "1", "--processes", "1"],
        *["--latency-samples", "3", "--latency-spacing-ms", "5", "--idle-seconds", "0"],
        *["--load-rates", "40,1%", "--load-seconds", "0.25", "--load-senders", "2", "--load-batch"],
        *["--json", tmp_path / "compare.json", "--markdown", tmp_path / "compare.md"],
        *["--log-dir", tmp_path / "logs", "--database-prefix", name],
    )
    table = (tmp_path / "compare.md").read_text()
    assert "| raw loop, batch 100 |" in table and "| django-pgqueue, atomic=False, tuned |" in table
    assert "server CPU us/job (its backends), 1 / 2 procs | WAL B/job, 1 / 2 procs" in table
    assert re.search(r"\| django-pgqueue \| 40 \| 40 \|", table), table
    assert "| issue 41: enqueue_many(), chunks of 1,000 |" in table
    result = json.loads((tmp_path / "compare.json").read_text())
    statuses = {system["name"]: system["status"] for system in result["systems"]}
    assert statuses == {"raw": "ok", "pgqueue": "ok"}
    for system in result["systems"]:
        for variant in system["variants"].values():
            drain = variant["runs"]["1"]
            assert drain["wal_bytes_per_job"] > 0, drain
            assert drain["server_cpu_us_per_job"] is not None, drain  # the server is local
            assert drain["backends_cpu_us_per_job"] is not None, drain
        load = {r["rate"]: r for r in system["load"]}
        assert load.keys() == {"40", "1%"}, system["load"]
        assert load["40"]["handled"] == 10 and load["40"]["missing"] == 0, load
        # A sender reads its clock once its commit has returned: a handler
        # may start first when the sender is descheduled in between (a
        # loaded machine; benchmarks/README.md), so a latency may come out
        # a little below zero, never by seconds.
        assert load["40"]["p99_ms"] >= load["40"]["p50_ms"] > -100, load
    names = [t["target"] for t in result["issue41_targets"]]
    assert all(name.startswith("issue 41: ") for name in names), names


def test_ab():
    _, name = bench_url("_ab")
    out = run(
        "ab",
        *["--before", ".", "--after", ".", "--before-python", sys.executable],
        *["--after-python", sys.executable, "--rounds", "1", "--scenarios", "nonatomic,enqueue"],
        *["--messages", "300", "--enqueue-messages", "30", "--database-prefix", name],
    )
    assert re.search(r"throughput, atomic=False \(jobs/s\) +[\d,]+", out), out
    assert re.search(r"enqueue\(\), one per transaction \(msg/s\) +[\d,]+", out), out
    # The drains' cost to the database, beside their rates.
    assert re.search(r"throughput, atomic=False: server CPU \(us/msg\) +[\d.]+ +[\d.]+", out), out
    assert re.search(r"throughput, atomic=False: WAL \(B/msg\) +[\d.]+ +[\d.]+", out), out


def test_scale():
    url, _ = bench_url()
    out = run(
        "scale",
        *["--messages", "300", "--repeat", "1", "--in-turn", "0", "--delayed", "2000"],
        *["--dead-letters", "2000", "--claim-calls", "5", "--sparse-claim-calls", "5"],
        *["--skip", "memory", "--tolerance", "100", "--latency-slack-ms", "1000"],
        *["--database-url", url],
    )
    assert "loaded" in out and "baseline" in out, out


def test_streams():
    url, _ = bench_url()
    out = run(
        "streams",
        *["--events", "3000", "--per-transaction", "500", "--timeout", "120"],
        *["--database-url", url],
    )
    assert re.search(r"^ *\S+ +1 +[\d,]+ +[\d,]+-[\d,]+ +[\d.]+ ", out, re.M), out


def test_insert_cost():
    url, _ = bench_url()
    out = run("insert-cost", "--n", "5", "--rounds", "1", "--database", url)
    for variant in ("raw", "ours, no notify trigger", "ours, enqueue()'s INSERT", "enqueue()"):
        assert re.search(rf"^  {re.escape(variant)} +\d+ us", out, re.M), out


def test_worker_options():
    url, _ = bench_url()
    out = run(
        "worker-options",
        *["--messages", "500", "--rounds", "1", "--options", "", "--concurrency 8"],
        *["--database-url", url],
    )
    assert "--concurrency 8" in out, out


def test_instructions():
    url, _ = bench_url()
    out = run(
        "instructions",
        *["--messages", "2", "--scenarios", "enqueue-bulk", "--database-url", url],
        # Two Python start-ups under valgrind: minutes on a loaded machine.
        timeout=1500,
    )
    # (Two messages' difference is below the start-ups' own variation: the
    # figure may come out negative. A smoke run checks that there is one.)
    assert re.search(r"enqueue-bulk +-?[\d,]+$", out, re.M), out


def test_workflows():
    url, _ = bench_url("_wf")
    out = run("workflows", "--steps", "200", "--rounds", "1", "--database-url", url)
    assert re.search(r"workflow: steps/s +[\d,]+ ", out), out
    assert re.search(r"ratio workflow/plain +[\d.]+ ", out), out
    assert re.search(r"^target: .*: (met|MISSED)$", out, re.M), out


def test_routed():
    url, _ = bench_url("_routed")
    out = run("routed", "--messages", "200", "--rounds", "1", "--database-url", url)
    assert re.search(r"routed: messages/s +[\d,]+ ", out), out
    assert re.search(r"ratio routed/first +[\d.]+ ", out), out
    assert re.search(r"^target: .*: (met|MISSED)$", out, re.M), out


def test_partitioned():
    url, _ = bench_url("_partitioned")
    out = run(
        "partitioned",
        *["--messages", "200", "--partitions", "7", "--rounds", "1", "--database-url", url],
    )
    assert re.search(r"partitioned: messages/s +[\d,]+ ", out), out
    assert re.search(r"ratio partitioned/plain +[\d.]+ ", out), out
    assert re.search(r"^target: .*: (met|MISSED)$", out, re.M), out


def test_async():
    url, _ = bench_url("_async")
    out = run(
        "async",
        *["--messages", "20", "--seconds", "0.2", "--threads", "4", "--rounds", "1"],
        *["--database-url", url],
    )
    assert re.search(r"event loop \(--async-concurrency 1000\): drain, s +[\d.]+ ", out), out
    assert re.search(r"threads: worker's peak RSS, MiB +\d+ ", out), out
    assert re.search(r"^target: .*: (met|MISSED)$", out, re.M), out


def test_fair():
    url, _ = bench_url("_fair")
    out = run(
        "fair",
        *["--messages", "30000", "--partitions", "200", "--delayed", "500", "--rounds", "1"],
        *["--default-rows", "500", "--claims", "5", "--warmup", "6", "--target", "100"],
        *["--database-url", url],
    )
    assert re.search(r"^ *claim of 100: ratio fair/plain +[\d.]+ ", out, re.M), out
    for phase in ("main", "variant: 500 keyed not yet due", "variant: 500 without a key"):
        assert re.search(rf"^--- {phase}, before: EXPLAIN .* of 'fair', ", out, re.M), out
    assert re.search(r"^target: .*: met$", out, re.M), out


def test_wal(tmp_path):
    url, _ = bench_url("_wal")
    out = run(
        "wal",
        *["--messages", "300", "--rounds", "1", "--handlers", "nonatomic"],
        *["--keep-finished", "both", "--json", tmp_path / "wal.json", "--database-url", url],
    )
    assert re.search(r"^ *django_pgqueue_message +Heap/UPDATE +claim +[\d.]+ ", out, re.M), out
    assert re.search(r"^ *total, without full-page images( +[\d.]+ +[\d.]+-[\d.]+){2}$", out, re.M)
    result = json.loads((tmp_path / "wal.json").read_text())
    summary = result["summary"]
    assert set(summary) == {"atomic=False", "atomic=False, KEEP_FINISHED 0"}, summary
    (run_on,) = result["rounds"]["atomic=False"]
    message_bytes = sum(
        line["per_message"]
        for line in run_on["lines"]
        if line["relation"] == "django_pgqueue_message"
    )
    assert message_bytes > 0, run_on["lines"]
    for name, figures in summary.items():
        assert 200 < figures["total"] < 3000, (name, figures)
        assert figures["total_with_fpi"] >= figures["total"], (name, figures)
        assert figures["purposes"]["claim"] > 0 and figures["purposes"]["acknowledgement"] > 0
    # The history's bytes are what KEEP_FINISHED 0 saves.
    assert summary["atomic=False"]["purposes"]["history"] > 0, summary
    assert summary["atomic=False, KEEP_FINISHED 0"]["purposes"]["history"] == 0, summary
