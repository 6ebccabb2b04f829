"""``python -m benchmarks SCENARIO [options]``: runs one scenario of
benchmarks/scenarios/ (``python -m benchmarks SCENARIO --help``: its options)."""

from __future__ import annotations

import importlib
import sys

from benchmarks.scenarios import SCENARIOS

PROG = "python -m benchmarks"


def usage() -> str:
    width = max(map(len, SCENARIOS))
    lines = [f"usage: {PROG} SCENARIO [options]   ({PROG} SCENARIO --help: its options)", ""]
    lines += ["scenarios:"]
    lines += [f"  {name:<{width}}  {scenario.measures}" for name, scenario in SCENARIOS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SCENARIOS:
        print(f"{PROG}: unknown scenario {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # argparse names the program after argv[0]; the results files record the
    # command line from it too (harness.output.command_line).
    sys.argv = [f"{PROG} {name}", *rest]
    return importlib.import_module(SCENARIOS[name].module).main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
