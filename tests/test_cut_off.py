"""Runs cut off by a lost connection (worker.cutoff): the hand-back that
returns their messages once the database answers, guarded by each lease
token (maintenance.rescue_cut_off), and what counts as a lost connection
(db.connection_lost). The end to end cases, with real worker processes and
a failover, are in tests/test_failover.py."""

import datetime
import uuid
from types import SimpleNamespace

import psycopg
import pytest
from django.db import DatabaseError, OperationalError

from django_pgqueue import lifecycle, maintenance
from django_pgqueue.db import connection_lost
from django_pgqueue.models import Category, DeadLetter, Message, Status
from django_pgqueue.worker.cutoff import REASON, CutOff
from django_pgqueue.worker.job import Job

from .conftest import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)


def config(worker_id):
    """What CutOff reads of the worker's configuration."""
    return SimpleNamespace(worker_id=worker_id, lease_seconds=60)


def reread(message):
    return Message.objects.filter(pk=message.pk).first()


def as_held(message):
    """The Message as the worker holds it: its id and lease token."""
    return Message(
        pk=message.pk, id=message.pk, lease_token=message.lease_token, topic=message.topic
    )


def test_the_cut_off_runs_go_back_at_once_and_only_under_their_lease(make_message):
    held = make_message(status=Status.PROCESSING, attempts=1, locked_by="w")
    last = make_message(status=Status.PROCESSING, attempts=3, max_attempts=3, locked_by="w")
    committed = make_message(status=Status.PROCESSING, locked_by="w")
    rescued_meanwhile = make_message(status=Status.PROCESSING, locked_by="w")
    other = make_message(status=Status.PROCESSING, locked_by="w2")
    messages = [as_held(m) for m in (held, last, committed, rescued_meanwhile)]
    # Its acknowledgement committed before the connection died: the row is gone.
    Message.objects.filter(pk=committed.pk).delete()
    # Another worker holds it now, under another token.
    Message.objects.filter(pk=rescued_meanwhile.pk).update(lease_token=uuid.uuid4())
    result, locked = maintenance.rescue_cut_off(messages, REASON, now=NOW)
    assert result == maintenance.RescueResult(requeued=1, dead_lettered=1)
    assert locked == set()
    row = reread(held)
    assert (row.status, row.attempts, row.lease_token, row.run_at) == (
        Status.WAITING,
        1,
        None,
        NOW,
    ), "due now, the attempt counted (the next claim makes it 2)"
    assert row.last_error.startswith(lifecycle.CONNECTION_LOST)
    assert row.last_error_category == Category.TRANSIENT
    dead = DeadLetter.objects.get(message_id=last.pk)
    assert dead.reason.startswith(lifecycle.CONNECTION_LOST) and "last of 3" in dead.reason
    assert reread(committed) is None, "a committed run is never handed back"
    assert reread(rescued_meanwhile).status == Status.PROCESSING
    assert reread(other).lease_token == other.lease_token, "another worker's lease is untouched"


def test_a_row_still_locked_by_the_cut_off_transaction_is_skipped_and_tried_again(make_message):
    message = make_message(status=Status.PROCESSING, locked_by="w")
    woken = []
    cut_off = CutOff(config("w"), wake=lambda: woken.append(1), held_ids=set)
    cut_off.add(job_of(message))
    assert woken and cut_off.due()
    with raw_connection() as zombie:  # the old backend's acknowledgement, not committed yet
        zombie.execute("DELETE FROM django_pgqueue_message WHERE id = %s", [message.pk])
        cut_off.hand_back()
        assert not cut_off.due(), "tried again a moment later, not at once"
        assert cut_off._held, "kept: its transaction may yet roll back"
        zombie.commit()
    cut_off._next_try = 0.0
    cut_off.hand_back()
    assert not cut_off._held and reread(message) is None, "the commit won: not handed back"


def test_a_cut_off_run_whose_transaction_rolled_back_is_handed_back(make_message):
    message = make_message(status=Status.PROCESSING, locked_by="w")
    cut_off = CutOff(config("w"), wake=lambda: None, held_ids=set)
    cut_off.add(job_of(message))
    with raw_connection() as zombie:
        zombie.execute("DELETE FROM django_pgqueue_message WHERE id = %s", [message.pk])
        cut_off.hand_back()
        zombie.rollback()
    cut_off._next_try = 0.0
    cut_off.hand_back()
    assert not cut_off._held and reread(message).status == Status.WAITING


def test_the_sweep_hands_back_the_leases_of_the_worker_that_it_does_not_hold(make_message):
    """After a lost connection: a claim whose reply never came, or (after a
    failover to an asynchronous standby) an outcome the new primary lacks,
    leaves rows leased to the worker that it does not hold."""
    held = make_message(status=Status.PROCESSING, locked_by="w")
    orphan = make_message(status=Status.PROCESSING, locked_by="w", attempts=2)
    locked = make_message(status=Status.PROCESSING, locked_by="w")
    others = make_message(status=Status.PROCESSING, locked_by="w2")
    cut_off = CutOff(config("w"), wake=lambda: None, held_ids=lambda: {held.pk})
    assert not cut_off.due()
    with raw_connection() as other:  # someone holds this row: skipped, not waited for
        other.execute("SELECT 1 FROM django_pgqueue_message WHERE id = %s FOR UPDATE", [locked.pk])
        cut_off.hand_back_if_due(after_error=True)  # the loop's last round failed
        other.rollback()
    assert not cut_off.due(), "one sweep per lost connection"
    row = reread(orphan)
    assert (row.status, row.attempts, row.lease_token) == (Status.WAITING, 2, None)
    assert row.last_error.startswith(lifecycle.CONNECTION_LOST)
    assert reread(held).lease_token == held.lease_token, "a message it holds is its own to finish"
    assert reread(locked).status == Status.PROCESSING
    assert reread(others).lease_token == others.lease_token, "another worker's are untouched"


def job_of(message):
    """A Job as the worker holds it after the claim (its Message built)."""
    job = Job(row=(), spec=None)
    job.__dict__["message"] = as_held(message)
    return job


def wrapped(error):
    """``error`` as Django raises it: a DatabaseError caused by psycopg's."""
    try:
        try:
            raise error
        except psycopg.Error as exc:
            raise OperationalError(str(exc)) from exc
    except DatabaseError as exc:
        return exc


def test_what_counts_as_a_lost_connection():
    assert connection_lost(wrapped(psycopg.OperationalError("server closed the connection")))
    assert connection_lost(wrapped(psycopg.errors.AdminShutdown("terminating connection")))
    assert connection_lost(wrapped(psycopg.errors.CannotConnectNow("the database is starting")))
    assert connection_lost(wrapped(psycopg.InterfaceError("the connection is closed")))
    assert not connection_lost(wrapped(psycopg.errors.LockNotAvailable("lock timeout")))
    assert not connection_lost(wrapped(psycopg.errors.QueryCanceled("statement timeout")))
    assert not connection_lost(wrapped(psycopg.errors.UniqueViolation("duplicate key")))
    assert not connection_lost(ValueError("not a database error"))


def test_a_multi_host_database_url_reaches_psycopg_as_libpq_takes_it():
    """docs/howto/failover.rst: django-environ reads a URL naming several
    servers into HOST and PORT lists and OPTIONS, which Django hands to
    psycopg as they are (the failover tests connect through one)."""
    import environ
    from django.db.backends.postgresql.base import DatabaseWrapper

    url = "postgres://shop@10.0.0.1:5432,10.0.0.2:5433/shop?target_session_attrs=read-write&connect_timeout=3"
    settings = environ.Env.db_url_config(url)
    assert (settings["HOST"], settings["PORT"]) == ("10.0.0.1,10.0.0.2", "5432,5433")
    assert settings["OPTIONS"] == {"target_session_attrs": "read-write", "connect_timeout": 3}
    settings.update(
        {"ATOMIC_REQUESTS": False, "AUTOCOMMIT": True, "CONN_MAX_AGE": 0, "TIME_ZONE": None}
    )
    settings.update({"CONN_HEALTH_CHECKS": False, "TEST": {}})
    params = DatabaseWrapper(settings).get_connection_params()
    assert (params["host"], params["port"]) == ("10.0.0.1,10.0.0.2", "5432,5433")
    assert params["target_session_attrs"] == "read-write"
    attempts = psycopg.conninfo.conninfo_attempts(
        {k: v for k, v in params.items() if isinstance(v, str | int)}
    )
    assert [(a["host"], a["port"]) for a in attempts] == [
        ("10.0.0.1", "5432"),
        ("10.0.0.2", "5433"),
    ]
