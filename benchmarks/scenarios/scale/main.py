#!/usr/bin/env python
"""Scale benchmark: one worker with a million delayed messages and a million
dead letters in the tables, and one worker's memory over a million messages.

Runs against a database of its own (default ``pgqueue_bench_scale``, created
and migrated if missing, emptied by every run), never the developer's. See
benchmarks/README.md ("scale") for what is measured and how to read it.

    .venv/bin/python -m benchmarks scale [--json out.json] [--skip memory]

The measurements are in benchmarks/scenarios/scale/.
"""

import argparse
import os
import shlex
import sys
from dataclasses import asdict, dataclass

from benchmarks.harness import cli, db
from benchmarks.harness.cli import run_with_logs
from benchmarks.harness.machine import description, git_commit, load_average
from benchmarks.harness.numbers import in_turn, median
from benchmarks.harness.output import command_line, fmt, now_iso, write_checked
from benchmarks.harness.worker import Bench
from benchmarks.scenarios.scale import BASELINES, STATES, TOPICS
from benchmarks.scenarios.scale.checks import checks, noise_floor
from benchmarks.scenarios.scale.claims import ClaimSizes, claim_scenarios
from benchmarks.scenarios.scale.drain import drain_run
from benchmarks.scenarios.scale.fill import fill_loaded
from benchmarks.scenarios.scale.memory import memory_run
from benchmarks.scenarios.scale.report import print_report

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_scale"
# --subscriptions none: the testproject's stream subscribers are the test
# suite's; a project without any runs no stream thread.
DEFAULT_WORKER_ARGS = "--concurrency 4 --batch-size 100 --subscriptions none"
NUMBERS = (  # the sizes and thresholds: (option, type, default, help)
    ("--messages", int, 20000, "messages per worker drain"),
    ("--repeat", int, 3, "worker drains per state and topic (--in-turn 0)"),
    ("--delayed", int, 1_000_000, "delayed messages"),
    ("--dead-letters", int, 1_000_000, "dead letters in the loaded state"),
    ("--claim-calls", int, 200, "claims of the full scenario (of a backlog)"),
    ("--sparse-claim-calls", int, 1000, "claims of each scenario with few or no messages ready"),
    ("--claim-batch", int, 100, "what a claim asks for with a backlog"),
    ("--memory-messages", int, 1_000_000, "messages of the memory run"),
    ("--sample-interval", float, 0.25, "memory sampling, s"),
    ("--tolerance", float, 0.10, "allowed loaded/baseline difference"),
    ("--latency-slack-ms", float, 0.0, "absolute allowance on top of --tolerance for latencies"),
)
SKIPPABLE = ["baseline", "loaded", "baseline2", "memory", "drain", "claims", "atomic", "nonatomic"]


@dataclass
class Context:
    bench: Bench
    metrics: bool  # the workers serve Prometheus metrics (prometheus_client is installed)
    claims: ClaimSizes


def worker_claim_limit(worker_args):
    """What an idle worker with these options asks one claim for:
    min(--concurrency, --batch-size), the command's defaults being 4 and = concurrency."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None)
    known, _ = parser.parse_known_args(worker_args)
    return min(known.concurrency, known.batch_size or known.concurrency)


def use_database(ctx, url):
    """Point the workers and this process's Django at the database of ``url``
    and its "_other" companion (--in-turn switches between the baseline's
    database and the loaded one)."""
    from django.db import connections

    ctx.bench.use_database(url)
    for alias, target in (("default", url), ("other", db.other_url(url))):
        connections[alias].close()
        connections[alias].settings_dict["NAME"] = db.database_name(target)


def measure_state(ctx, args, result, topics, state, repeat, index=0, paired_round=None):
    """The drains and the in-process claims of one state, on ctx's database
    (``paired_round``: --in-turn's round, recorded with each figure)."""
    # The fill (or the previous state) leaves dirty pages and WAL behind:
    # flush them now rather than in a checkpoint during the measurements.
    db.execute("CHECKPOINT")
    if "drain" not in args.skip:
        for topic, atomic in topics:
            for i in range(repeat):
                run = drain_run(
                    ctx.bench, ctx.metrics, state, topic, atomic, args.messages, index + i
                )
                run.round = paired_round
                result["drain_runs"].append(asdict(run))
                print(
                    f"  {state:8} {topic:22} {run.jobs_per_s:8,.0f} jobs/s  claim mean "
                    f"{fmt(run.claim_mean_ms, '.3f')} ms  box "
                    f"{fmt(run.machine_busy_percent, '.0f')}%",
                    file=sys.stderr,
                )
    if "claims" not in args.skip:
        for claims in claim_scenarios(ctx.claims, state):
            claims.round = paired_round
            result["claims"].append(asdict(claims))


def fill_loaded_state(args, result):
    print(
        f"filling: {args.delayed:,} delayed messages, {args.dead_letters:,} dead letters",
        file=sys.stderr,
    )
    result["fill"] = fill_loaded(args.delayed, args.dead_letters, args.priorities)


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--delayed-priorities",
        default="0",
        help="comma-separated priorities the delayed messages take in turn",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=SKIPPABLE,
        help="leave out a part (repeatable)",
    )
    cli.add_database_url(parser, "BENCH_SCALE_DATABASE_URL", DEFAULT_URL)
    parser.add_argument(
        "--worker-args",
        default=DEFAULT_WORKER_ARGS,
        help="pgqueue_worker options of every worker (the script adds --log-level WARNING"
        " and, for the drains, --metrics-port/--http-host)",
    )
    parser.add_argument(
        "--in-turn",
        type=int,
        default=8,
        metavar="ROUNDS",
        help="keep the loaded state in a database of its own (the bench database's name +"
        " '_loaded') and measure baseline and loaded in turn, ROUNDS rounds of one drain per"
        " topic and the claims each (the baseline passes alternate as baseline and"
        " baseline2); each check takes the median of the rounds' loaded/baseline ratios."
        " 0: baseline, loaded, baseline2 one after the other, --repeat drains each, and the"
        " ratios of the medians",
    )
    parser.add_argument("--keep-data", action="store_true", help="leave the last state in place")
    cli.add_results(parser, "also write the results here as JSON")
    args = parser.parse_args(argv)
    cli.require_bench_database(parser, args.database_url)
    if (
        min(args.messages, args.repeat, args.claim_calls, args.sparse_claim_calls, args.claim_batch)
        < 1
    ):
        parser.error(
            "--messages, --repeat, --claim-calls, --sparse-claim-calls and --claim-batch"
            " must be at least 1"
        )
    if args.in_turn < 0:
        parser.error("--in-turn must be 0 or more")
    if args.in_turn and {"baseline", "loaded", "baseline2"} & set(args.skip):
        parser.error("--in-turn measures every state: no --skip of baseline, loaded, baseline2")
    if "memory" not in args.skip and args.memory_messages < 20_000:
        parser.error("--memory-messages must be at least 20,000 (RSS is compared at 10,000)")
    worker_args = shlex.split(args.worker_args)
    if "--burst" in worker_args:
        parser.error("--worker-args: no --burst (the script stops the workers itself)")
    try:
        args.priorities = [int(p) for p in args.delayed_priorities.split(",")]
    except ValueError:
        parser.error("--delayed-priorities: integers separated by commas")
    return args, worker_args


def environment(worker_args):
    settings = {
        name: db.scalar(f"SHOW {name}")
        for name in ("shared_buffers", "autovacuum", "synchronous_commit", "work_mem", "jit")
    }
    return {
        "started_at": now_iso(),
        "command": command_line(),
        "commit": git_commit(),
        "worker_args": " ".join(worker_args),
        "postgres": db.scalar("SHOW server_version"),
        "settings": settings,
        **description(),
        "load_average_start": load_average(),
    }


def measure_in_turn(ctx, args, result, topics):
    """Two databases, the load in one of them: the states are measured a
    minute apart, in alternating order, instead of minutes apart."""
    url = ctx.bench.url
    loaded_url = db.with_database(url, db.database_name(url) + "_loaded")
    db.prepare([loaded_url, db.other_url(loaded_url)], db.pgqueue_env(loaded_url))
    use_database(ctx, loaded_url)
    db.truncate()
    fill_loaded_state(args, result)
    for n in range(args.in_turn):
        baseline = "baseline" if n % 2 == 0 else "baseline2"
        for state in in_turn(n, [baseline, "loaded"]):
            use_database(ctx, loaded_url if state == "loaded" else url)
            measure_state(ctx, args, result, topics, state, 1, index=n, paired_round=n)
    if not args.keep_data:
        use_database(ctx, loaded_url)
        db.truncate()
    use_database(ctx, url)


def measure_one_after_the_other(ctx, args, result, topics):
    for state in STATES:
        if state in args.skip:
            continue
        if state == "baseline2":
            db.truncate()  # the load goes: the baseline once more
        if state == "loaded":
            fill_loaded_state(args, result)
        measure_state(ctx, args, result, topics, state, args.repeat)


def drain_medians(result, topics):
    """The median of each figure per state and topic ("baselines": both baseline passes)."""
    out = {}
    for state in (*STATES, "baselines"):
        states = BASELINES if state == "baselines" else (state,)
        for topic, _ in topics:
            mine = [r for r in result["drain_runs"] if r["state"] in states and r["topic"] == topic]
            if mine:
                out[f"{state}/{topic}"] = {
                    key: median(r[key] for r in mine)
                    for key in ("jobs_per_s", "claim_mean_ms", "claim_p50_ms", "claim_p99_ms")
                } | {"runs_jobs_per_s": [r["jobs_per_s"] for r in mine]}
    return out


def measure(ctx, args, worker_args):
    result = {
        "environment": environment(worker_args),
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "delayed_priorities")},
        "drain_runs": [],
        "claims": [],
    }
    topics = [(topic, atomic) for part, topic, atomic in TOPICS if part not in args.skip]
    db.truncate()
    if args.in_turn:
        measure_in_turn(ctx, args, result, topics)
    else:
        measure_one_after_the_other(ctx, args, result, topics)
    result["drain"] = drain_medians(result, topics)
    if "memory" not in args.skip:
        print(f"memory run: {args.memory_messages:,} messages", file=sys.stderr)
        result["memory"] = memory_run(
            ctx.bench, args.memory_messages, args.sample_interval, ctx.claims.limit
        )
    result["worker_warnings"] = dict(ctx.bench.warnings)
    result["environment"]["load_average_end"] = load_average()
    result["checks"] = checks(result, args.tolerance, args.latency_slack_ms)
    result["noise_floor"] = noise_floor(result)
    return result


def run(args, worker_args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    os.environ["PGQUEUE_LOG_LEVEL"] = "WARNING"  # this process's claims log nothing either
    db.prepare([url, db.other_url(url)], env)
    db.setup_django(env)
    try:
        import prometheus_client  # noqa: F401

        metrics = True
    except ImportError:
        print("prometheus_client missing: no worker claim histogram", file=sys.stderr)
        metrics = False
    sizes = ClaimSizes(
        calls=args.claim_calls,
        sparse_calls=args.sparse_claim_calls,
        batch=args.claim_batch,
        limit=worker_claim_limit(worker_args),
    )
    ctx = Context(Bench(url, env, logs.path, worker_args=worker_args), metrics, sizes)
    result = measure(ctx, args, worker_args)
    if not args.keep_data:
        db.truncate()
    print_report(result)
    return write_checked(result, args.json)


def main(argv=None):
    args, worker_args = parse_args(argv)
    return run_with_logs(
        "pgqueue-scale-", args.keep_logs, lambda logs: run(args, worker_args, logs)
    )
