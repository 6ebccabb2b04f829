#!/usr/bin/env python
"""What keeping the history (PGQUEUE["KEEP_FINISHED"]) costs the tuned
no-op throughput: one worker drains the same backlog with the history on
(the default) and off (KEEP_FINISHED=0), alternating in one run, so that
the load of a shared machine weighs on both alike.

    .venv/bin/python benchmarks/history_cost.py [--rounds 5] [--messages 20000]
        [--concurrency 4] [--batch-size 100] [--database-url ...bench...]

Each round drains each topic (atomic and atomic=False no-op handlers) once
with each setting, the order of on and off swapped every round; the history
and counts tables are emptied before each drain (a drain with history on
starts as one with it off: both from an empty history). Prints each drain
and, per topic, the median jobs/s of each setting and their ratio.
"""

import json
import statistics
import sys

from harness import cli, db
from harness.cli import LogDir, run_guarded
from harness.pgstats import Stats
from harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC, Bench
from scenarios.one_worker.burst import Burst, measure_startup, throughput_run

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_bench_history"
SETTINGS = {"on": "{}", "off": '{"KEEP_FINISHED": 0}'}
NUMBERS = (
    ("--rounds", int, 5, "rounds (each: every topic, on and off)"),
    ("--messages", int, 20000, "messages per drain"),
    ("--concurrency", int, 4, "worker --concurrency"),
    ("--batch-size", int, 100, "worker --batch-size (the tuned configuration)"),
)


def parse_args(argv):
    parser = cli.parser(__doc__, NUMBERS)
    cli.add_database_url(parser, "BENCH_DATABASE_URL", DEFAULT_URL)
    cli.add_results(parser, "also write the drains and medians here as JSON")
    args = parser.parse_args(argv)
    if min(args.rounds, args.messages, args.concurrency, args.batch_size) < 1:
        parser.error("every number must be at least 1")
    cli.require_bench_database(parser, args.database_url)
    return args


def run(args, logs):
    url = args.database_url
    env = db.pgqueue_env(url)
    db.prepare([url, db.other_url(url)], env)
    db.setup_django(env)
    worker_args = ["--subscriptions", "none"]
    benches = {
        mode: Bench(url, dict(env, PGQUEUE_JSON=value), logs.path, worker_args=worker_args)
        for mode, value in SETTINGS.items()
    }
    drains = []
    with Stats(url) as stats:
        startup = {
            mode: measure_startup(bench, args.concurrency, args.batch_size, 3)
            for mode, bench in benches.items()
        }
        for round_ in range(args.rounds):
            order = ["on", "off"] if round_ % 2 == 0 else ["off", "on"]
            for topic, atomic in ((TOPIC_ATOMIC, True), (TOPIC_NONATOMIC, False)):
                for mode in order:
                    db.execute(
                        "TRUNCATE django_pgqueue_finishedmessage, django_pgqueue_outcomecount"
                    )
                    burst = Burst(topic, atomic, args.concurrency, args.batch_size, args.messages)
                    result = throughput_run(benches[mode], stats, burst, startup[mode])
                    kept = db.count("django_pgqueue_finishedmessage")
                    expected = args.messages if mode == "on" else 0
                    if kept != expected:
                        raise db.CheckFailed(f"history {mode}: {kept} rows, not {expected}")
                    drains.append({"round": round_, "mode": mode, **vars(result)})
                    print(
                        f"  round {round_ + 1} {topic:22} history {mode:3}: "
                        f"{result.jobs_per_s:8,.0f} jobs/s",
                        file=sys.stderr,
                    )
    db.truncate()
    summary = {}
    print(f"\n{'topic':22} {'on jobs/s':>10} {'off jobs/s':>10} {'on/off':>7}")
    for topic in (TOPIC_ATOMIC, TOPIC_NONATOMIC):
        medians = {
            mode: statistics.median(
                d["jobs_per_s"] for d in drains if d["topic"] == topic and d["mode"] == mode
            )
            for mode in SETTINGS
        }
        ratio = medians["on"] / medians["off"]
        summary[topic] = {**medians, "ratio": ratio}
        print(f"{topic:22} {medians['on']:10,.0f} {medians['off']:10,.0f} {ratio:7.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"drains": drains, "summary": summary, "options": vars(args)}, out, indent=2)
    return 0


def main(argv=None):
    args = parse_args(argv)
    with LogDir("pgqueue-history-", keep=False) as logs:
        return run_guarded(lambda: run(args, logs), logs)


if __name__ == "__main__":
    sys.exit(main())
