"""What the machine and a process are doing: CPU, memory, load; and which
commit is checked out."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness.tree import HERE

CLK_TCK = os.sysconf("SC_CLK_TCK")

CpuTimes = tuple[int, int]


def cpu_times() -> CpuTimes | None:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_percent(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """How busy all cores were between two ``cpu_times()``."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def proc_status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of ``pid`` in KiB, or None once it is gone."""
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except (OSError, ValueError):
        return None
    if rss is None or hwm is None:
        return None
    return rss, hwm


def proc_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of ``pid`` so far (all its threads), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)"; utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def git_commit(root: Path = HERE) -> str | None:
    """The commit checked out at ``root`` (with '+dirty' for local changes), or None."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def description() -> dict[str, Any]:
    """The machine, for a result file."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
