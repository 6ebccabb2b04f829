"""A throwaway PostgreSQL cluster, for the tests and benchmarks that crash or
restart the server: ``initdb`` in a new temporary directory, a free port on
127.0.0.1, the Unix socket in that directory, trust authentication, superuser
``postgres``. It never touches any other cluster; the machine's PostgreSQL
is only its source of binaries.

    with ThrowawayCluster.create() as cluster:
        cluster.create_database("pgqueue_chaos")
        url = cluster.url("pgqueue_chaos")
        cluster.pg_ctl("restart", "-m", "immediate")

Torn down (``pg_ctl stop -m immediate``, then SIGKILL to the postmaster and
its children if they are still there, then the directory removed) when the
block ends, at interpreter exit (atexit), and, should this process be killed
outright, by a guardian process that waits for this one to go away.

As root it runs ``initdb``, ``pg_ctl`` and the server as the ``postgres`` OS
user (``runuser``): PostgreSQL refuses to run as root.

The binaries: ``$PGQUEUE_PG_BINDIR`` if set, else Debian's
``/usr/lib/postgresql/<major>/bin`` (the major version asked for, else the
newest), else ``pg_config --bindir``, else ``PATH``.
"""

import atexit
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BINARIES = ("initdb", "pg_ctl", "postgres")
INSTALL_HINT = (
    "the throwaway PostgreSQL cluster needs the server binaries (initdb, pg_ctl, postgres):"
    " on Debian/Ubuntu `apt-get install postgresql`; or point PGQUEUE_PG_BINDIR at the"
    " directory that holds them"
)


class ClusterError(RuntimeError):
    pass


def _has_binaries(directory):
    return all(os.access(os.path.join(directory, name), os.X_OK) for name in BINARIES)


def find_bindir(major=None):
    """The directory of initdb, pg_ctl and postgres; ``major`` (e.g. 15) is
    preferred among Debian's versioned directories. Raises ClusterError
    with an install hint when there are none."""
    override = os.environ.get("PGQUEUE_PG_BINDIR")
    if override:
        if not _has_binaries(override):
            raise ClusterError(f"PGQUEUE_PG_BINDIR={override} lacks one of {BINARIES}")
        return override
    versioned = {}
    for directory in glob.glob("/usr/lib/postgresql/*/bin"):
        version = Path(directory).parent.name
        if re.fullmatch(r"\d+(\.\d+)?", version) and _has_binaries(directory):
            versioned[tuple(int(part) for part in version.split("."))] = directory
    if major is not None and (int(major),) in versioned:
        return versioned[(int(major),)]
    if versioned:
        return versioned[max(versioned)]
    if shutil.which("pg_config"):
        bindir = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=False
        ).stdout.strip()
        if bindir and _has_binaries(bindir):
            return bindir
    initdb = shutil.which("initdb")
    if initdb and _has_binaries(os.path.dirname(initdb)):
        return os.path.dirname(initdb)
    raise ClusterError(INSTALL_HINT)


def bindir_for_datadir(datadir):
    """The binaries of the major version that ``datadir`` was made by
    (its PG_VERSION file): pg_ctl must match the cluster."""
    try:
        major = Path(datadir, "PG_VERSION").read_text().strip()
    except OSError as exc:
        raise ClusterError(f"{datadir} is not a PostgreSQL data directory: {exc}") from None
    return find_bindir(major.split(".")[0])


def as_owner(command, path):
    """``command`` run as the owner of ``path`` when we are root (PostgreSQL's
    programs refuse root), as it is otherwise."""
    if os.geteuid() != 0:
        return list(command)
    owner = pwd.getpwuid(os.stat(path).st_uid).pw_name
    if owner == "root":
        raise ClusterError(f"{path} belongs to root: PostgreSQL cannot run as root")
    return ["runuser", "-u", owner, "--", *command]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(command, what, cwd=None):
    done = subprocess.run(
        command,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if done.returncode != 0:
        raise ClusterError(
            f"{what} failed ({done.returncode}): {' '.join(command)}\n{done.stdout}{done.stderr}"
        )
    return done.stdout


def _postmaster_pid(datadir):
    try:
        first = Path(datadir, "postmaster.pid").read_text().split("\n", 1)[0]
        return int(first)
    except (OSError, ValueError):
        return None


def _is_our_postmaster(pid, datadir):
    """Whether ``pid`` is still a postmaster of ``datadir`` (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return os.fsencode(str(datadir)) in cmdline


def _children(pid):
    children = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            children.append(int(text.split(" ", 1)[0]))
    return children


def teardown(base, bindir):
    """Stop the cluster in ``base``/data however it can be, and remove ``base``.
    Safe to call twice, and from another process (the guardian)."""
    base = Path(base)
    datadir = base / "data"
    if datadir.is_dir():
        pid = _postmaster_pid(datadir)
        if pid is not None:
            pg_ctl = os.path.join(bindir, "pg_ctl")
            try:
                subprocess.run(
                    as_owner(
                        [pg_ctl, "-D", str(datadir), "stop", "-m", "immediate", "-w"], datadir
                    ),
                    cwd=base,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    check=False,
                    timeout=60,
                )
            except (OSError, subprocess.TimeoutExpired, ClusterError):
                pass
            # Whatever survived the stop goes: the postmaster and its children
            # (each of which is a process group of its own).
            if _is_our_postmaster(pid, datadir):
                children = _children(pid)
                for victim in (pid, *children):
                    try:
                        os.kill(victim, signal.SIGKILL)
                    except OSError:
                        pass
                for _ in range(100):
                    if not _is_our_postmaster(pid, datadir):
                        break
                    time.sleep(0.05)
    shutil.rmtree(base, ignore_errors=True)


class ThrowawayCluster:
    def __init__(self, base, bindir, port, user):
        self.base = Path(base)
        self.datadir = self.base / "data"
        self.socket_dir = self.base / "socket"
        self.log_path = self.base / "postgres.log"
        self.bindir = bindir
        self.port = port
        self.user = user
        self._guardian = None
        self._closed = False
        # More postgresql.conf settings (a standby's cluster_name: replication.py).
        self.extra_settings = {}

    @classmethod
    def create(cls, major=None, prefix="pgqueue-throwaway-pg-"):
        """initdb, configure and start a new cluster; ``major``: the PostgreSQL
        major version to prefer (e.g. the one the other tests run against)."""
        bindir = find_bindir(major)
        base = Path(tempfile.mkdtemp(prefix=prefix))
        cluster = cls(base, bindir, port=None, user="postgres")
        atexit.register(cluster.close)
        try:
            cluster._initdb()
            cluster._start_guardian()
            cluster._start()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _initdb(self):
        self._prepare_base()
        _run(
            as_owner(
                [
                    os.path.join(self.bindir, "initdb"),
                    "-D",
                    str(self.datadir),
                    "-U",
                    self.user,
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",  # a throwaway: nothing to keep after a power cut
                ],
                self.base,
            ),
            "initdb",
            cwd=self.base,
        )

    def _prepare_base(self):
        """The base directory, its socket directory and log, owned by the
        user the server runs as."""
        if os.geteuid() == 0:
            # initdb refuses root: the directory goes to the postgres user.
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise ClusterError(
                    "running as root, and there is no `postgres` OS user to run"
                    " PostgreSQL as (PostgreSQL refuses root)"
                ) from None
            os.chown(self.base, owner.pw_uid, owner.pw_gid)
        self.base.chmod(0o700)
        self.socket_dir.mkdir()
        self.log_path.touch()
        for path in (self.socket_dir, self.log_path):
            os.chown(path, self.base.stat().st_uid, self.base.stat().st_gid)

    def _configure(self, port):
        self.port = port
        conf = self.datadir / "postgresql.conf"
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(port),
            "unix_socket_directories": f"'{self.socket_dir}'",
            "max_connections": "100",
            "log_line_prefix": "'%m [%p] '",
            **self.extra_settings,
        }
        text = conf.read_text()
        text = re.sub(r"(?m)^# throwaway:.*\Z", "", text, flags=re.S)
        text += "# throwaway:\n" + "".join(f"{k} = {v}\n" for k, v in settings.items())
        conf.write_text(text)

    def _start(self):
        """Start the server on a free port; another port if that one was taken
        between choosing it and binding it."""
        for attempt in range(5):
            self._configure(free_port())
            try:
                self.pg_ctl("start", "-l", str(self.log_path), "-w", "-t", "60")
                return
            except ClusterError:
                log = self.log_path.read_text(errors="replace")
                if "could not bind" in log and attempt < 4:
                    continue
                raise ClusterError(f"the throwaway cluster did not start:\n{log[-4000:]}") from None

    def _start_guardian(self):
        """A process of its own session that waits for this one to end (its
        pipe closes however we die) and then tears the cluster down."""
        read_end, write_end = os.pipe()
        self._guardian = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--guard", str(self.base), self.bindir],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to our process group spares it
        )
        os.close(read_end)
        self._guardian_pipe = write_end  # not inheritable: only we hold it

    def pg_ctl(self, *args):
        """Run pg_ctl on this cluster (as its owner); its output, or ClusterError."""
        return _run(
            as_owner(
                [os.path.join(self.bindir, "pg_ctl"), "-D", str(self.datadir), *args], self.base
            ),
            f"pg_ctl {args[0]}",
            cwd=self.base,
        )

    def restart(self, mode="fast"):
        """``pg_ctl restart -m <mode>`` ("immediate": a crash and recovery)."""
        self.pg_ctl("restart", "-m", mode, "-w", "-t", "120", "-l", str(self.log_path))

    @property
    def pg_ctl_path(self):
        return os.path.join(self.bindir, "pg_ctl")

    def url(self, dbname="postgres"):
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname="postgres", **kwargs):
        import psycopg

        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname=dbname, **kwargs
        )

    def create_database(self, name):
        with self.connect(autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def log(self):
        return self.log_path.read_text(errors="replace")

    def close(self):
        if self._closed:
            return
        self._closed = True
        teardown(self.base, self.bindir)
        if self._guardian is not None:
            os.close(self._guardian_pipe)
            try:
                self._guardian.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._guardian.kill()
                self._guardian.wait()
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _guard(base, bindir):
    # Ignore the signals a terminal or a killed test run sends the group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    teardown(base, bindir)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--guard":
        _guard(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} --guard BASE BINDIR (started by ThrowawayCluster)")
