"""Tables, number formats and result files."""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, right-aligned columns."""
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    return "\n".join(out)


def fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec`` (e.g. ``".3f"``, ``",.0f"``), or "-" for None."""
    return "-" if value is None else format(value, spec)


def fmt_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def mib(n_bytes: float) -> float:
    return n_bytes / 1024.0 / 1024.0


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def command_line(quote: bool = False) -> str:
    """How this benchmark was started."""
    # sys.argv[0] is "python -m benchmarks SCENARIO" (benchmarks/__main__.py)
    args = [Path(sys.executable).name, *sys.argv[0].split()[1:], *sys.argv[1:]]
    return " ".join(shlex.quote(a) for a in args) if quote else " ".join(args)


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_checked(result: dict[str, Any], path: str | Path | None) -> int:
    """Write ``result`` to ``path`` (if given); the exit status of a run
    whose ``checks`` are its verdict: 0 when every one passed, else 3."""
    if path:
        write_json(path, result)
        print(f"\nwrote {path}")
    return 0 if all(check["passed"] for check in result["checks"]) else 3


def print_warnings(warnings: dict[str, int], note: str = "") -> None:
    """The warnings the workers logged, by kind, most frequent first."""
    if warnings:
        print(f"\nWarnings the workers logged (by kind{note}):")
        for kind, n in sorted(warnings.items(), key=lambda item: -item[1]):
            print(f"  {n:5}  {kind}")
