"""A streaming standby of a throwaway cluster, and a failover: the primary
killed outright, the standby promoted. For the tests and benchmarks that
check what a failover costs (tests/test_failover.py, ``python -m benchmarks
chaos --failover``). Like throwaway_pg, it touches only the clusters it
made: the synchronous setting goes to the throwaway primary, never to the
machine's server.

    primary = ThrowawayCluster.create()
    standby = make_standby(primary, synchronous=True)
    url = multi_host_url([primary, standby], "pgqueue")
    kill9(primary)          # the postmaster and every child, SIGKILL
    promote(standby)
"""

import os
import signal
import tempfile
import time
from pathlib import Path

from benchmarks.harness.throwaway_pg import (
    ClusterError,
    ThrowawayCluster,
    _children,
    _is_our_postmaster,
    _postmaster_pid,
    _run,
    as_owner,
)

STANDBY_NAME = "standby1"


def make_standby(primary, name=STANDBY_NAME, synchronous=False, timeout=60.0):
    """A hot standby of ``primary`` (a ThrowawayCluster), on a free port:
    ``pg_basebackup -R`` through a replication slot, started, streaming.
    ``synchronous``: the primary's commits wait for it
    (``synchronous_standby_names``, set on the throwaway primary only).
    Torn down like any throwaway cluster."""
    base = Path(tempfile.mkdtemp(prefix="pgqueue-throwaway-standby-"))
    standby = ThrowawayCluster(base, primary.bindir, port=None, user=primary.user)
    import atexit

    atexit.register(standby.close)
    try:
        standby._prepare_base()
        _run(
            as_owner(
                [
                    os.path.join(primary.bindir, "pg_basebackup"),
                    "-D",
                    str(standby.datadir),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(primary.port),
                    "-U",
                    primary.user,
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                    "-C",
                    "-S",
                    name,
                    "-R",
                    "--no-sync",
                ],
                standby.base,
            ),
            "pg_basebackup",
            cwd=standby.base,
        )
        # The walreceiver names itself by cluster_name: the name that
        # synchronous_standby_names and pg_stat_replication know it by.
        standby.extra_settings = {
            "cluster_name": f"'{name}'",
            "hot_standby": "on",
            # Once the primary is gone the startup process retries the stream
            # this often; a promotion waits for its nap (5 s by default).
            "wal_retrieve_retry_interval": "'100ms'",
        }
        standby._start_guardian()
        standby._start()
    except BaseException:
        standby.close()
        raise
    if synchronous:
        with primary.connect(autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            conn.execute("SELECT pg_reload_conf()")
    wait_streaming(primary, name, synchronous, timeout)
    return standby


def replication_state(primary, name=STANDBY_NAME):
    """(state, sync_state) of the standby ``name`` as the primary sees it, or None."""
    with primary.connect(autocommit=True) as conn:
        return conn.execute(
            "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
            [name],
        ).fetchone()


def wait_streaming(primary, name=STANDBY_NAME, synchronous=False, timeout=60.0):
    """Until the standby streams (and, ``synchronous``, counts as sync)."""
    wanted = ("streaming", "sync" if synchronous else "async")
    deadline = time.monotonic() + timeout
    while True:
        state = replication_state(primary, name)
        if state is not None and tuple(state) == wanted:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"standby {name} is {state}, not {wanted}, after {timeout}s")
        time.sleep(0.05)


def kill9(cluster):
    """The server dies outright, as with its machine: SIGKILL to the
    postmaster and every child at once (nothing is flushed, no connection
    is closed politely). Returns the pids killed."""
    pid = _postmaster_pid(cluster.datadir)
    if pid is None or not _is_our_postmaster(pid, cluster.datadir):
        raise ClusterError(f"no postmaster runs on {cluster.datadir}")
    victims = [pid, *_children(pid)]
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 30
    while _is_our_postmaster(pid, cluster.datadir) and time.monotonic() < deadline:
        time.sleep(0.01)
    return victims


def promote(standby, timeout=60):
    """``pg_ctl promote -w``: the standby ends recovery and takes writes."""
    standby.pg_ctl("promote", "-w", "-t", str(timeout))


def in_recovery(cluster):
    with cluster.connect(autocommit=True) as conn:
        return conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]


def multi_host_url(clusters, dbname, user="postgres"):
    """A DATABASE_URL that names every cluster, for libpq to try in order,
    keeping the one that takes writes (``target_session_attrs=read-write``):
    django-environ reads it as HOST "h1,h2", PORT "p1,p2" and that OPTION."""
    hosts = ",".join(f"127.0.0.1:{cluster.port}" for cluster in clusters)
    return f"postgres://{user}@{hosts}/{dbname}?target_session_attrs=read-write"


def replayed_up_to(primary, standby, timeout=60.0):
    """Until ``standby`` has replayed everything ``primary`` has written so far."""
    with primary.connect(autocommit=True) as conn:
        lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    deadline = time.monotonic() + timeout
    with standby.connect(autocommit=True) as conn:
        while True:
            behind = conn.execute(
                "SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn()) > 0", [lsn]
            ).fetchone()[0]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the standby did not replay up to {lsn} in {timeout}s")
            time.sleep(0.02)
