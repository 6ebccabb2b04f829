#!/usr/bin/env python
"""The fair claim beside the plain claim: a million ready messages in
10,000 partitions against a million without a key, claimed in turn.

Issue 38's target: the fair claim of a queue of ``--messages`` ready
messages in ``--partitions`` partitions costs at most ``--target`` (2x)
the claim of a queue of as many ready messages without a key, measured
in the same run. One database, two queues (benchmarks/scenarios/fair/fill.py:
the layout, one partition with a tenth of the messages and the others
spread evenly, and the rounds enqueue() gives them, checked against
``enqueue_many()`` on a sample first), ``VACUUM ANALYZE``d; then each
queue's claim (the worker's statement, on a connection of the queue's
own: fair/claims.py) runs ``--warmup`` untimed claims of each size, and
``--rounds`` rounds: in each, for each of ``--sizes``, ``--claims``
claims of that size on one queue then on the other, the order
alternating from round to round. Claims commit and consume the messages
they take. Reported per round and size: each queue's median claim time
(and the server backend's CPU), their ratio fair/plain; over the rounds
the median ratio and its range. The target is met when the median ratio
of every size is at most ``--target``: the exit status is 0, else 3 (1
when a check failed: a claim took the wrong messages or count).

The variant (``--delayed`` > 0): as many keyed messages without a round,
due in 1 minute to 1 hour (delayed or retried), added to the queue in
partitions, vacuumed and analysed again, and ``--rounds`` more rounds;
with ``--default-rows`` > 0, another: those removed, as many ready
messages without a key added to the queue in partitions (its default
partition). Both reported, not held to the target.

    .venv/bin/python -m benchmarks fair --rounds 6          # about a minute
    .venv/bin/python -m benchmarks fair --messages 100000 --partitions 1000 --rounds 2
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from benchmarks.harness import cli, db
from benchmarks.harness.machine import git_commit, load_average
from benchmarks.harness.numbers import in_turn, median, round_ratios, spread
from benchmarks.harness.output import command_line, fmt, now_iso, table, write_json
from benchmarks.scenarios.fair import FAIR, PLAIN, SIDES
from benchmarks.scenarios.fair.claims import (
    Side,
    claims,
    explain,
    open_side,
    plan_counts,
    scan_summary,
)
from benchmarks.scenarios.fair.fill import (
    big_partition_size,
    check_rounds,
    delete_delayed,
    fill,
    insert_delayed,
    insert_plain,
    vacuum_analyze,
)

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/pgqueue_fairbench"
# The sample of check_rounds: small enough to enqueue in a second, in few
# enough partitions that they have many rounds each.
CHECK_MESSAGES, CHECK_PARTITIONS = 2000, 20
# The claims may take this share of a queue at most: the queue in
# partitions then still has every partition in each round it reaches.
MAX_CLAIMED_SHARE = 0.8

NUMBERS = (  # (option, type, default, help)
    ("--messages", int, 1_000_000, "ready messages in each queue"),
    ("--partitions", int, 10_000, "partitions of the queue in partitions (at least 2)"),
    ("--delayed", int, 10_000, "keyed messages without a round, not yet due, of the variant"
     " (0: no variant)"),
    ("--default-rows", int, 0, "ready messages without a key added to the queue in partitions,"
     " in a variant of their own (0: no such variant)"),
    ("--rounds", int, 5, "rounds of each phase (the main one, each variant)"),
    ("--claims", int, 50, "timed claims per round, queue and size"),
    ("--warmup", int, 10, "untimed claims of each size and queue before each phase"),
    ("--target", float, 2.0, "the most the fair claim may cost, in plain claims"),
)  # fmt: skip


def parse_args(argv: list[str] | None) -> Any:
    parser = cli.parser(__doc__, NUMBERS)
    parser.add_argument(
        "--sizes", type=cli.positive_ints, default=[100, 500], help="claim sizes, comma-separated"
    )
    cli.add_database_url(parser, "BENCH_FAIR_DATABASE_URL", DEFAULT_URL)
    parser.add_argument("--json", metavar="PATH", help="also write every claim's figures as JSON")
    args = parser.parse_args(argv)
    if min(args.messages, args.rounds, args.claims) < 1 or args.partitions < 2:
        parser.error("--messages, --rounds and --claims must be at least 1, --partitions 2")
    if min(args.warmup, args.delayed, args.default_rows) < 0:
        parser.error("--warmup, --delayed and --default-rows cannot be negative")
    phases = 1 + bool(args.delayed) + bool(args.default_rows)
    claimed = phases * (args.warmup + args.rounds * args.claims) * sum(args.sizes)
    if claimed > MAX_CLAIMED_SHARE * args.messages:
        parser.error(
            f"the claims would take {claimed:,} messages of each queue, more than"
            f" {MAX_CLAIMED_SHARE:.0%} of --messages: fewer --rounds, --claims or --sizes"
        )
    cli.require_bench_database(parser, args.database_url)
    return args


def warm_up(sides: dict[str, Side], sizes: list[int], calls: int) -> None:
    """Untimed claims: each side's statement prepared, its plan chosen, the
    index heads in the cache."""
    for size in sizes:
        for side in sides.values():
            claims(side, size, calls)


def plans(
    conn: Any, sides: dict[str, Side], size: int, phase: str, when: str
) -> list[dict[str, Any]]:
    """The plan of one claim of ``size`` per side, generic or custom as the
    side's prepared claim has run so far; printed (the text before a
    phase, a line after it)."""
    out = []
    for side in sides.values():
        generic, custom = plan_counts(side)
        plan = explain(conn, side.queue, size, generic=generic > custom)
        plan.update(phase=phase, when=when, generic_plans=generic, custom_plans=custom)
        out.append(plan)
        lead = "" if when == "after" else "\n"
        print(
            f"{lead}--- {phase}, {when}: EXPLAIN (ANALYZE, BUFFERS)"
            f" of one claim of {size} of {side.queue!r}, {plan['plan']} plan (the prepared"
            f" claim so far: {generic} generic, {custom} custom): planning"
            f" {plan['planning_ms']:.3f} ms, execution {plan['execution_ms']:.3f} ms,"
            f" {plan['buffers']} buffers; index scans (rows/buffers): {scan_summary(plan)}"
        )
        if when != "after":
            print(plan["text"])
    return out


def run_phase(
    sides: dict[str, Side], args: Any, phase: str, first_round: int
) -> list[dict[str, Any]]:
    """``--rounds`` rounds; per round and size each side's claims in turn."""
    rounds = []
    for index in range(args.rounds):
        figures: dict[str, Any] = {"phase": phase, "round": first_round + index, "sizes": {}}
        for size in args.sizes:
            by_side: dict[str, Any] = {}
            for name in in_turn(index, SIDES):
                timed = claims(sides[name], size, args.claims)
                by_side[name] = {
                    "median_ms": median(timed.wall_ms),
                    "median_server_cpu_ms": median(timed.server_cpu_ms),
                    "wall_ms": [round(t, 4) for t in timed.wall_ms],
                    "server_cpu_ms": [round(t, 4) for t in timed.server_cpu_ms],
                }
            plain, fair = by_side[PLAIN], by_side[FAIR]
            by_side["ratio"] = fair["median_ms"] / plain["median_ms"]
            by_side["cpu_ratio"] = fair["median_server_cpu_ms"] / plain["median_server_cpu_ms"]
            figures["sizes"][size] = by_side
            print(
                f"  {phase} round {figures['round']} ({'/'.join(in_turn(index, SIDES))}),"
                f" claims of {size}: {PLAIN} {plain['median_ms']:.3f} ms,"
                f" {FAIR} {fair['median_ms']:.3f} ms, ratio {by_side['ratio']:.2f}"
                f" (server CPU {plain['median_server_cpu_ms']:.3f} /"
                f" {fair['median_server_cpu_ms']:.3f} ms, ratio {by_side['cpu_ratio']:.2f})",
                file=sys.stderr,
            )
        rounds.append(figures)
    return rounds


def summary_rows(rounds: list[dict[str, Any]], size: int) -> tuple[list[list[str]], float | None]:
    """The table rows of one phase and size, and its median ratio."""
    figures = [r["sizes"][size] for r in rounds]

    def cells(values: list[float], spec: str) -> list[str]:
        low, high = spread(values) or (None, None)
        return [fmt(median(values), spec), f"{fmt(low, spec)}..{fmt(high, spec)}"]

    ratios = round_ratios((f[FAIR]["median_ms"], f[PLAIN]["median_ms"]) for f in figures)
    cpu = round_ratios((f[FAIR]["median_server_cpu_ms"], f[PLAIN]["median_server_cpu_ms"])
                       for f in figures)  # fmt: skip
    rows = [
        [f"claim of {size}: {PLAIN}, ms", *cells([f[PLAIN]["median_ms"] for f in figures], ".3f")],
        [f"claim of {size}: {FAIR}, ms", *cells([f[FAIR]["median_ms"] for f in figures], ".3f")],
        [f"claim of {size}: ratio {FAIR}/{PLAIN}", *cells(ratios, ".2f")],
        [f"claim of {size}: server CPU ratio", *cells(cpu, ".2f")],
    ]
    return rows, median(ratios)


def report(args: Any, phases: dict[str, list[dict[str, Any]]], layout: dict[str, Any]) -> bool:
    parts = layout["partitions"]
    print(
        f"\n{PLAIN!r}: {args.messages:,} ready messages without a key; {FAIR!r}:"
        f" {args.messages:,} ready messages in {parts['partitions']:,} partitions (tenant-0:"
        f" {parts['tenant-0']:,}, the others {parts['others_min']:,} to {parts['others_max']:,}"
        f" each; rounds 0 to {parts['last_round']:,} as enqueue() gives them)."
        f" {args.claims} claims per round, queue and size; rounds in turn; claims committed."
    )
    met = True
    for phase, rounds in phases.items():
        print(f"\n{phase} ({len(rounds)} rounds): the rounds' medians, their median and range")
        rows = []
        for size in args.sizes:
            size_rows, ratio = summary_rows(rounds, size)
            rows += size_rows
            if phase == "main":
                met = met and ratio is not None and ratio <= args.target
        print(table(["", "median", "range"], rows))
        for r in rounds:
            ratios = ", ".join(f"{s}: {r['sizes'][s]['ratio']:.2f}" for s in args.sizes)
            print(f"  round {r['round']}: ratio {FAIR}/{PLAIN} {ratios}")
    print(
        f"\ntarget: the fair claim costs at most {args.target:g}x the plain claim (the median"
        f" of the rounds' ratios, every size, the main phase): {'met' if met else 'NOT MET'}"
    )
    return met


def variants(args: Any) -> list[tuple[str, Callable[[], None] | None]]:
    """The phases, each with what changes the queue in partitions first:
    the main one; the keyed messages not yet due; those removed, the
    messages without a key (its default partition)."""
    phases: list[tuple[str, Callable[[], None] | None]] = [("main", None)]
    if args.delayed:
        phases.append((
            f"variant: {args.delayed:,} keyed not yet due",
            lambda: insert_delayed(FAIR, args.delayed, args.partitions),
        ))  # fmt: skip
    if args.default_rows:

        def default_partition() -> None:
            delete_delayed(FAIR)
            insert_plain(FAIR, 1, args.default_rows)

        phases.append((f"variant: {args.default_rows:,} without a key", default_partition))
    return phases


def run(args: Any) -> int:
    url = args.database_url
    env = db.pgqueue_env(url)
    db.recreate_database(url)
    db.recreate_database(db.other_url(url))
    db.migrate(env)
    db.setup_django(env)
    started_load = load_average()
    print(f"load average at the start: {started_load}", file=sys.stderr)
    check_rounds(CHECK_MESSAGES, CHECK_PARTITIONS)
    print(
        f"filling: {args.messages:,} messages in each queue; {FAIR!r} in {args.partitions:,}"
        f" partitions, tenant-0 with {big_partition_size(args.messages):,}",
        file=sys.stderr,
    )
    layout = fill(args.messages, args.partitions)
    print(f"  filled in {layout['plain_s'] + layout['fair_s']:.0f} s", file=sys.stderr)
    sides = {PLAIN: open_side(url, PLAIN, 0), FAIR: open_side(url, FAIR, args.partitions)}
    explaining = db.connect(url)
    result: dict[str, Any] = {"command": command_line(), "date": now_iso(),
                              "commit": git_commit(), "options": vars(args), "fill": layout,
                              "plans": [], "rounds": []}  # fmt: skip
    phases: dict[str, list[dict[str, Any]]] = {}
    for phase, setup in variants(args):
        if setup is not None:
            setup()
            vacuum_analyze()
        warm_up(sides, args.sizes, args.warmup)
        result["plans"] += plans(explaining, sides, args.sizes[0], phase, "before")
        phases[phase] = run_phase(sides, args, phase, len(result["rounds"]) + 1)
        result["rounds"] += phases[phase]
        result["plans"] += plans(explaining, sides, args.sizes[0], phase, "after")
    explaining.close()
    for side in sides.values():
        result.setdefault("prepared_claim_plans", {})[side.queue] = plan_counts(side)
        result.setdefault("claimed", {})[side.queue] = side.claimed
        side.conn.close()
    met = report(args, phases, layout)
    load = load_average()
    print(f"load average: {started_load} at the start, {load} at the end")
    print(f"prepared claims (generic, custom plans): {result['prepared_claim_plans']}")
    result.update(met=met, load_average={"start": started_load, "end": load})
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0 if met else 3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return cli.run_guarded(lambda: run(args))
