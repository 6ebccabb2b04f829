"""Child processes of a benchmark: each in a session of its own (ctrl-c
reaches only the benchmark, which then kills them), its output in a log
file, its peak RSS sampled while it runs; every one not yet reaped is
killed when the benchmark ends (``kill_all``), and by the kernel should
the benchmark itself be killed outright (``die_with_parent``)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.tree import Tree

LIVE: set[Process] = set()  # started, not yet reaped

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive the process starting
    it (a worker, a client): the kernel sends the child SIGKILL when its
    parent dies, even of a SIGKILL, which no ``finally`` or ``kill_all``
    survives to clean up after. Linux only (elsewhere it does nothing). The
    signal comes when the *thread* that started the child ends: start them
    from the main thread (every scenario does)."""
    parent = os.getpid()

    def preexec() -> None:  # in the child, between fork and exec
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # it died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def start_scenario(scenario: str, args: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """``python -m benchmarks SCENARIO ARGS`` of this checkout as a child that
    ends with this process, even one killed outright (a test run killed by
    its timeout): ``die_with_parent``, and in a session of its own, so that
    killing that group ends the scenario and the workers it started."""
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks", scenario, *args],
        cwd=Tree.here().root,
        start_new_session=True,
        preexec_fn=die_with_parent(),
        text=True,
        **popen,
    )


class Process:
    """One child process, reaped with ``os.wait4`` (for its CPU time)."""

    def __init__(
        self, argv: Sequence[Any], *, env: dict[str, str], cwd: Path | str, log_path: Path | str
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed when reaped)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        LIVE.add(self)
        self.pid = self.proc.pid
        self.ended: float | None = None
        self.returncode: int | None = None
        self.rusage: Any = None
        self.timed_out = False  # wait() had to kill it
        # Peak RSS: VmHWM of the process's own address space, sampled while it
        # runs. (getrusage's ru_maxrss is no good here: Linux carries the
        # forking parent's RSS over the exec, so it reports the benchmark's size.)
        self.hwm_kib = 0
        threading.Thread(target=self._sample_hwm, daemon=True).start()

    def _sample_hwm(self) -> None:
        path = f"/proc/{self.pid}/status"
        while self.returncode is None:
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.hwm_kib = max(self.hwm_kib, int(line.split()[1]))
                            break
            except (OSError, ValueError):
                return
            time.sleep(0.02)

    def _reaped(self, status: int, rusage: Any) -> None:
        self.ended = time.perf_counter()
        self.rusage = rusage
        self.returncode = self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._log.close()
        LIVE.discard(self)

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        if self.returncode is None:
            pid, status, rusage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self._reaped(status, rusage)
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """Reap the process, killing its session after ``timeout`` seconds;
        returns its exit code, None when it had to be killed (``timed_out``)."""
        if self.returncode is None:

            def expire() -> None:
                self.timed_out = True
                self.kill_session()

            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
            try:
                _, status, rusage = os.wait4(self.pid, 0)
            finally:
                timer.cancel()
            self._reaped(status, rusage)
        return None if self.timed_out else self.returncode

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then (as ``wait``) SIGKILL after ``timeout``."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return self.wait(timeout)

    def kill_session(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """Last resort on the way out: kill and reap."""
        if self.returncode is None:
            self.kill_session()
            try:
                self.wait(10)
            except ChildProcessError:
                pass

    @property
    def elapsed(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def peak_rss_mib(self) -> float:
        return self.hwm_kib / 1024.0

    @property
    def cpu_seconds(self) -> float:
        return float(self.rusage.ru_utime + self.rusage.ru_stime)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_text(), lines)


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def kill_all() -> None:
    """Kill and reap every process not reaped yet."""
    for process in list(LIVE):
        process.kill()
