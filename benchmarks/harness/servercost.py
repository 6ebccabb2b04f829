"""What the database server spends: the CPU time of all its processes (from
``/proc/<pid>/stat``, when the server runs on this machine) and the WAL it
writes (``pg_current_wal_insert_lsn()``), read before and after a
measurement. The whole server counts: its background processes
(checkpointer, WAL writer, autovacuum) and the work of any other client
or database during the window too."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import CLK_TCK, proc_cpu_seconds


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)", or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def postmaster_of(backend_pid: int) -> int | None:
    """The postmaster of a server process seen on this machine: the parent of
    the backend ``backend_pid`` (a connection's ``pg_backend_pid()``). None
    when the server is elsewhere (no such process here, or not a postgres
    backend: another machine, or a container's other pid namespace)."""
    fields = _stat(backend_pid)
    if not fields or not _cmdline(backend_pid).startswith("postgres"):
        return None
    parent = int(fields[1])
    return parent if "postgres" in _cmdline(parent) else None


def tree_cpu_seconds(postmaster: int) -> float | None:
    """utime + stime + cutime + cstime of the postmaster and of every process
    it started (its backends and background processes). A backend that
    exited was reaped by the postmaster: its time is in the postmaster's
    cutime + cstime. None when the postmaster is gone."""
    fields = _stat(postmaster)
    if fields is None:
        return None
    ticks = sum(int(x) for x in fields[11:15])
    parent = str(postmaster)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == parent:
            continue
        child = _stat(entry.name)
        if child and child[1] == parent:
            ticks += sum(int(x) for x in child[11:15])
    return ticks / CLK_TCK


def lsn_bytes(lsn: str) -> int:
    """A WAL position "X/Y" as a byte count."""
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


@dataclass
class Reading:
    cpu_s: float | None  # the server's CPU seconds so far, this reader's own backend left out
    wal: int  # the WAL insert position, bytes


class ServerCost:
    """Reads the server's CPU and WAL position through ``conn`` (any
    connection to the server: a harness's own, e.g. ``Stats.conn``). The
    CPU of ``conn``'s own backend is left out."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.backend = int(conn.info.backend_pid)
        self.postmaster = postmaster_of(self.backend)

    @property
    def local(self) -> bool:
        return self.postmaster is not None

    def read(self) -> Reading:
        (lsn,) = self.conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        cpu = None
        if self.postmaster is not None:
            cpu = tree_cpu_seconds(self.postmaster)
            own = proc_cpu_seconds(self.backend)
            if cpu is not None and own is not None:
                cpu -= own
        return Reading(cpu, lsn_bytes(lsn))

    @staticmethod
    def per_message(
        before: Reading, after: Reading, messages: int, exclude_cpu_s: float = 0.0
    ) -> dict[str, Any]:
        """server_cpu_us_per_job and wal_bytes_per_job between two readings;
        ``exclude_cpu_s``: CPU of a harness backend (a monitor's) to leave out."""
        out: dict[str, Any] = {"wal_bytes": after.wal - before.wal}
        out["wal_bytes_per_job"] = out["wal_bytes"] / messages
        if before.cpu_s is not None and after.cpu_s is not None:
            out["server_cpu_s"] = round(after.cpu_s - before.cpu_s - exclude_cpu_s, 4)
            out["server_cpu_us_per_job"] = 1e6 * out["server_cpu_s"] / messages
        return out
