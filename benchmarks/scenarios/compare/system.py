"""A system under test: its virtualenv, its database, its client script
(one subprocess per operation, answering in JSON) and its workers."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import db
from benchmarks.harness.processes import Process, die_with_parent
from benchmarks.harness.tree import HERE
from benchmarks.scenarios.compare import PEERS, VENVS, StepFailed


@dataclass
class Variant:
    key: str  # e.g. "atomic", "batch100"
    label: str  # the table's row label
    client: str = ""  # --variant for the client script (topic / handler)
    worker_args: list = field(default_factory=list)  # added to the system's worker args
    # The worker as a user starts it first: its own default options instead
    # of the system's (--pgqueue-worker-args); only ``worker_args`` added.
    worker_defaults: bool = False
    env: dict = field(default_factory=dict)  # added to the worker's environment


class System:
    name = ""
    label = ""
    pins: list[str] = []  # pip requirements of benchmarks/.venvs/<name>; none: the repo's .venv
    python_min = (3, 11)
    script = ""
    tables: list[str] = []  # emptied before every measurement, VACUUM ANALYZEd before a drain
    poll_note = ""  # what the idle worker waits on
    bulk_note = ""
    single_note = ""
    # The worker command for the report; {args}: the worker's options.
    worker_note_format = ""
    default_args = ""  # the worker's options unless --worker-args SYSTEM=... says otherwise
    latency_from = "file"  # "file": the handler appends to BENCH_LATENCY_FILE; "sql"

    # SQL the monitor runs on the system's database
    first_key_sql = ""  # the job claimed first (min id)
    claimed_sql = ""  # %s = that key: true once it left the waiting state
    empty_sql = ""  # true when no job is waiting or running
    remaining_sql = ""  # jobs not finished (read on timeout only)
    verify_sql = ""  # (finished ok, failed) after a drain; None when not kept

    def __init__(self, opts: Any, name: str | None = None) -> None:
        """``opts``: the options of the run (the compare scenario's); ``name``: of this
        instance, when it is not the system's own (the ab scenario's "before", "after")."""
        self.opts = opts
        self.name = name or self.name
        self.dbname = f"{opts.database_prefix}_{self.name.replace('-', '_')}"
        self.url = db.with_database(opts.server, self.dbname)
        self.worker_args = shlex.split(opts.worker_args.get(self.name, self.default_args))
        self.skip_reason = None
        self.info: dict[str, Any] = {}
        self.freeze = None
        # CPU seconds of burst workers on an empty queue, per worker command
        # (measure.startup_cpu): their median is taken off the drains' CPU.
        self.startup_cpu_runs: dict[str, list[float]] = {}

    # -- environment --

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def python(self) -> Path:
        return Path(sys.executable) if not self.pins else self.venv / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.venv / "bin" / name

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for key in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(key, None)
        env.update(BENCH_DSN=self.url, PYTHONPATH=str(PEERS), PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    @property
    def worker_note(self) -> str:
        return self.worker_note_format.format(args=" ".join(self.worker_args))

    def variants(self) -> list[Variant]:
        return [Variant("default", self.label)]

    def base_interpreter(self) -> str:
        return sys.executable

    def install(self, log_dir: Path) -> None:
        """Create benchmarks/.venvs/<name> with the pins (kept when they already match)."""
        if not self.pins:
            return
        marker = self.venv / ".bench-pins"
        wanted = "\n".join(self.pins) + "\n"
        if self.python.exists() and marker.exists() and marker.read_text() == wanted:
            return
        if self.opts.skip_install:
            raise StepFailed(f"{self.venv} is missing or not at the pins, and --skip-install")
        interpreter = self.base_interpreter()
        print(f"  installing {', '.join(self.pins)} into {self.venv}", file=sys.stderr)
        shutil.rmtree(self.venv, ignore_errors=True)
        log = Path(log_dir) / f"install-{self.name}.log"
        with open(log, "wb") as out:
            steps = [
                [interpreter, "-m", "venv", str(self.venv)],
                [str(self.python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                 *self.pins],
            ]  # fmt: skip
            for step in steps:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    text = log.read_text(errors="replace").splitlines()
                    errors = [ln for ln in text if "ERROR" in ln] or text[-5:]
                    errors = [e if len(e) < 160 else e[:100] + " ... " + e[-50:] for e in errors]
                    raise StepFailed(f"install failed ({log}): " + " | ".join(errors[-3:]))
        marker.write_text(wanted)

    def pip_freeze(self) -> list[str] | None:
        done = subprocess.run(
            [self.python, "-m", "pip", "freeze", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout.split() if done.returncode == 0 else None

    # -- database --

    def setup_database(self) -> None:
        db.recreate_database(self.url)
        self.create_schema()

    def create_schema(self) -> None:
        self.client("setup")

    def reset(self) -> None:
        with db.connect(self.url) as conn:
            conn.execute(f"TRUNCATE {', '.join(self.tables)} RESTART IDENTITY CASCADE")

    def vacuum(self) -> None:
        with db.connect(self.url) as conn:
            for table in self.tables:
                conn.execute(f"VACUUM ANALYZE {table}")

    def run_checked(
        self,
        argv: list[Any],
        what: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 600,
    ) -> str:
        try:
            done = subprocess.run(
                [str(a) for a in argv],
                cwd=cwd or HERE,
                env=env or self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                preexec_fn=die_with_parent(),
            )
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(f"{what}: timed out after {timeout}s") from exc
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise StepFailed(f"{what} exited {done.returncode}:\n{tail}")
        return done.stdout

    def client(self, op: str, *args: Any, timeout: float = 900) -> dict[str, Any]:
        """Run one operation of the system's client script; returns its JSON answer."""
        out = self.run_checked(
            [self.python, PEERS / self.script, op, *args],
            f"{self.name} {op}",
            env=self.client_env(),
            timeout=timeout,
        )
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        if not lines:
            raise StepFailed(f"{self.name} {op}: no JSON answer in {out[-500:]!r}")
        return json.loads(lines[-1])

    def client_env(self) -> dict[str, str]:
        return self.env()

    def start_client(self, op: str, *args: Any, log_name: str) -> Process:
        """One operation of the client script, in the background (several run
        at once: the senders of an offered load); ``client_answer`` reads it."""
        return Process(
            [self.python, PEERS / self.script, op, *args],
            env=self.client_env(),
            cwd=HERE,
            log_path=self.opts.log_dir / f"{self.name}-{log_name}.log",
        )

    def client_answer(self, process: Process, timeout: float) -> dict[str, Any]:
        """The JSON answer of a ``start_client`` operation, once it exited."""
        code = process.wait(timeout)
        if code != 0:
            raise StepFailed(f"{self.name} {process.argv[2]} exited {code}:\n{process.log_tail(8)}")
        lines = [ln for ln in process.log_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise StepFailed(f"{self.name} {process.argv[2]}: no JSON answer")
        return json.loads(lines[-1])

    # -- workers --

    def worker_argv(self, variant: Variant | None, burst: bool) -> list[Any]:
        raise NotImplementedError

    def worker_env(
        self, variant: Variant | None, latency_file: Path | None = None
    ) -> dict[str, str]:
        env = self.env()
        if variant:
            env.update(variant.env)
        if latency_file:
            env["BENCH_LATENCY_FILE"] = str(latency_file)
        return env

    def worker_cwd(self) -> Path:
        return PEERS

    def start_worker(
        self, variant: Variant | None, burst: bool, log_name: str, latency_file: Path | None = None
    ) -> Process:
        return Process(
            self.worker_argv(variant, burst),
            env=self.worker_env(variant, latency_file),
            cwd=self.worker_cwd(),
            log_path=self.opts.log_dir / f"{self.name}-{log_name}.log",
        )

    def command_text(self, variant: Variant | None, burst: bool) -> str:
        argv = [str(a) for a in self.worker_argv(variant, burst)]
        for prefix in (str(self.venv / "bin") + "/", str(Path(sys.executable).parent) + "/"):
            argv = [a.replace(prefix, "") for a in argv]
        return " ".join(shlex.quote(str(a).replace(str(HERE) + "/", "")) for a in argv)

    # -- latency --

    def latency_results(self, latency_file: Path) -> dict[str, list[float]]:
        """{key: [handler start (epoch seconds), ...]}: a key may repeat."""
        found: dict[str, list[float]] = {}
        try:
            text = Path(latency_file).read_text()
        except FileNotFoundError:
            return found
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2:
                found.setdefault(parts[0], []).append(float(parts[1]))
        return found


def find_python312() -> str:
    """An interpreter >= 3.12 for Django 6: BENCH_PYTHON312, pyenv, or PATH."""
    candidates: list[str | None] = []
    if os.environ.get("BENCH_PYTHON312"):
        candidates.append(os.environ["BENCH_PYTHON312"])
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True)
        versions = []
        for line in done.stdout.split():
            parts = line.strip().split(".")
            if len(parts) >= 2 and parts[0] == "3" and parts[1].isdigit() and int(parts[1]) >= 12:
                if all(p.isdigit() for p in parts):
                    versions.append(tuple(int(p) for p in parts))
        for version in sorted(versions):  # the oldest >= 3.12 first: the best-tested
            text = ".".join(map(str, version))
            prefix = subprocess.run(["pyenv", "prefix", text], capture_output=True, text=True)
            if prefix.returncode == 0:
                candidates.append(str(Path(prefix.stdout.strip()) / "bin" / "python"))
    candidates += [shutil.which(n) for n in ("python3.12", "python3.13", "python3.14", "python3")]
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        done = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info >= (3, 12))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.stdout.strip() == "True":
            return candidate
    raise StepFailed("no Python >= 3.12 found for Django 6 (set BENCH_PYTHON312)")
