"""What every benchmark script does around its measurements: its argument
parser and the options several share, the bench-database guard, signals,
the worker log folder, and the exit status when something fails."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from benchmarks.harness.db import DEFAULT_SERVER, CheckFailed, bench_name_problem
from benchmarks.harness.processes import kill_all

# A numeric option: (flag, type, default, help).
Number = tuple[str, type, float | None, str | None]


def parser(doc: str, numbers: Sequence[Number] = ()) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring, defaults
    shown; ``numbers``: its numeric options, declared as a table."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for flag, kind, default, text in numbers:
        parser.add_argument(flag, type=kind, default=default, help=text)
    return parser


def add_database_url(parser: argparse.ArgumentParser, env_var: str, default: str) -> None:
    """--database-url, the bench database (its name checked by ``require_bench_database``)."""
    parser.add_argument(
        "--database-url",
        default=os.environ.get(env_var, default),
        help="the bench database (its name must contain 'bench'; created and migrated if"
        f" missing, emptied by every run); env {env_var}",
    )


def add_server(parser: argparse.ArgumentParser, prefix: str, databases: str) -> None:
    """--server and --database-prefix (``databases``: which databases it names)."""
    parser.add_argument(
        "--server",
        default=os.environ.get("BENCH_SERVER_URL", DEFAULT_SERVER),
        help="PostgreSQL server URL without a database; env BENCH_SERVER_URL",
    )
    parser.add_argument(
        "--database-prefix",
        default=prefix,
        help=f"{databases} (dropped and created again; the prefix must contain 'bench')",
    )


def check_server(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "bench" not in args.database_prefix:
        parser.error("--database-prefix must contain 'bench': every run drops those databases")


def add_latency(parser: argparse.ArgumentParser, samples_help: str | None = None) -> None:
    """--latency-samples and --latency-spacing-ms."""
    parser.add_argument("--latency-samples", type=int, default=200, help=samples_help)
    parser.add_argument("--latency-spacing-ms", type=float, default=20.0)


def add_results(parser: argparse.ArgumentParser, json_help: str) -> None:
    """--json and --keep-logs."""
    parser.add_argument("--json", metavar="PATH", help=json_help)
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker logs")


def require_bench_database(parser: argparse.ArgumentParser, url: str) -> None:
    problem = bench_name_problem(url)
    if problem:
        parser.error(problem)


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of integers, each at least 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("every value must be at least 1")
    return values


class LogDir:
    """A temporary folder for the workers' logs: removed at the end unless
    ``keep`` (set it when a check failed: the logs say why)."""

    def __init__(self, prefix: str, keep: bool = False) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self.keep = keep

    def __enter__(self) -> LogDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.keep:
            print(f"worker logs kept in {self.path}", file=sys.stderr)
            return
        for path in self.path.glob("*.log"):
            path.unlink()
        os.rmdir(self.path)


def run_guarded(
    body: Callable[[], int],
    logs: LogDir | None = None,
    failures: tuple[type[Exception], ...] = (CheckFailed,),
    label: str = "CHECK FAILED",
) -> int:
    """Run a benchmark's ``body``, returning its exit status: SIGTERM and
    ctrl-c (even when started in the background) end it with 130, one of
    ``failures`` with 1 (the worker logs kept: they say why); every worker
    it started is killed on the way out, whatever happened."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return body()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except failures as exc:
        print(f"\n{label}: {exc}", file=sys.stderr)
        if logs is not None:
            logs.keep = True
        return 1
    finally:
        kill_all()


def run_with_logs(
    prefix: str,
    keep: bool,
    body: Callable[[LogDir], int],
    failures: tuple[type[Exception], ...] = (CheckFailed,),
    label: str = "CHECK FAILED",
) -> int:
    """``run_guarded(body)`` with a worker log folder (``LogDir(prefix)``,
    kept with ``keep`` or when one of ``failures`` ends the run)."""
    with LogDir(prefix, keep=keep) as logs:
        return run_guarded(lambda: body(logs), logs, failures, label)
