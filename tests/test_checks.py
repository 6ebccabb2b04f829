"""System checks on the PGQUEUE setting and the queue's database."""

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_pgqueue import checks as pgqueue_checks


def ids(errors):
    return [e.id for e in errors]


def run_checks():
    return pgqueue_checks.check_settings() + pgqueue_checks.check_database()


def test_no_setting_and_the_test_settings_are_fine():
    assert run_checks() == []
    with override_settings(PGQUEUE={"DATABASE": "other", "NOTIFY": False, "DEFAULT_QUEUE": "q"}):
        assert run_checks() == []


@override_settings(PGQUEUE=["NOTIFY"])
def test_setting_must_be_a_dict():
    [error] = run_checks()
    assert error.id == "pgqueue.E001"
    assert "PGQUEUE must be a dict, not list" in error.msg


@override_settings(PGQUEUE={"NOTIFIY": False})
def test_unknown_key_suggests_the_close_one():
    [error] = run_checks()
    assert error.id == "pgqueue.E002"
    assert "'NOTIFIY'" in error.msg
    assert "Did you mean 'NOTIFY'?" in error.hint


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"NOTIFY": "no"}, "PGQUEUE['NOTIFY'] must be True or False (got 'no')"),
        ({"DATABASE": 3}, "PGQUEUE['DATABASE'] must be a database alias"),
        ({"DATABASE": "missing"}, "names the alias 'missing', which is not in DATABASES"),
        ({"DEFAULT_QUEUE": ""}, "the queue name must not be empty"),
        ({"DEFAULT_QUEUE": "a b"}, "may contain only letters"),
        ({"MAX_ATTEMPTS": 0}, "PGQUEUE['MAX_ATTEMPTS'] must be a whole number of at least 1"),
        ({"MAX_ATTEMPTS": True}, "must be a whole number of at least 1"),
        ({"LEASE_SECONDS": -5}, "must be a number of seconds greater than 0"),
        ({"POLL_INTERVAL": "5"}, "must be a number of seconds greater than 0"),
        ({"BACKOFF_CAP": float("inf")}, "must be a number of seconds greater than 0"),
        ({"BACKOFF_JITTER": "full"}, "must be True or False"),
        ({"DEPENDENCY_BACKOFF_FACTOR": 0.5}, "must be a number of at least 1"),
        ({"CLASSIFIER": "no.such.func"}, "PGQUEUE['CLASSIFIER'] cannot be imported"),
        ({"CLASSIFIER": "os.sep"}, "does not name a callable"),
        ({"CLASSIFY_RULES": [{"category": "transient"}]}, "rule 0: a rule needs at least one"),
        ({"QUEUES": []}, "must be a non-empty list of queue names"),
        ({"QUEUES": "default"}, "must be a non-empty list of queue names"),
        ({"QUEUES": ["default", "a b"]}, "may contain only letters"),
        ({"QUEUES": ["a", "a"]}, "names a queue twice"),
        ({"HEARTBEAT_INTERVAL": 0}, "must be a number of seconds greater than 0"),
        ({"METRICS_ACCESS": "public"}, "must be one of 'open', 'staff', 'token'"),
        ({"HEALTH_ACCESS": None}, "must be one of 'open', 'staff', 'token'"),
        ({"ALERT_WEBHOOK_URL": "ftp://x"}, "must be an http:// or https:// URL, or None"),
        ({"ALERT_SITE_URL": "ops.example.com"}, "must be an http:// or https:// URL"),
        ({"ALERT_WEBHOOK_HEADERS": ["X-Token"]}, "must be a dict of header names to values"),
        ({"ALERT_WEBHOOK_HEADERS": {"X Token": "v"}}, "has an invalid header name 'X Token'"),
        ({"ALERT_WEBHOOK_HEADERS": {"X-Token": "a\r\nb"}}, "must have a one-line string value"),
        ({"ALERT_WEBHOOK_TIMEOUT": 0}, "must be a number of seconds greater than 0"),
        ({"ALERT_WEBHOOK_TIMEOUT": 60}, "greater than 0 and at most 50"),
        ({"ALERT_WEBHOOK_RETRIES": -1}, "must be a whole number of at least 0"),
        ({"ALERT_WINDOW": "5m"}, "must be a number of seconds greater than 0"),
    ],
)
def test_wrong_values_say_how_to_fix_them(setting, words):
    with override_settings(PGQUEUE=setting):
        [error] = run_checks()
    assert error.id == "pgqueue.E003"
    assert words in error.msg
    assert "its default is" in error.hint


@pytest.mark.parametrize(
    "setting",
    [
        {"ENDPOINT_TOKEN": "short-secret"},
        {"ALERT_WEBHOOK_HEADERS": {"Authorization": "Bearer very-secret\n"}},
    ],
)
def test_secret_settings_are_never_echoed(setting):
    with override_settings(PGQUEUE=setting):
        [error] = run_checks()
    assert error.id == "pgqueue.E003"
    assert "secret" not in error.msg + error.hint
    assert "(got a hidden value)" in error.msg


@pytest.mark.parametrize("key", ["METRICS_ACCESS", "HEALTH_ACCESS"])
def test_token_access_needs_a_token(key):
    with override_settings(PGQUEUE={key: "token"}):
        [error] = run_checks()
    assert error.id == "pgqueue.E003"
    assert f"PGQUEUE['{key}'] is 'token' but PGQUEUE['ENDPOINT_TOKEN'] is not set" in error.msg
    with override_settings(PGQUEUE={key: "token", "ENDPOINT_TOKEN": "x" * 32}):
        assert run_checks() == []


def test_queue_database_must_be_postgresql(settings, monkeypatch):
    # Added in place: replacing DATABASES at run time makes Django warn.
    lite = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    monkeypatch.setitem(settings.DATABASES, "lite", lite)
    settings.PGQUEUE = {"DATABASE": "lite"}
    [error] = run_checks()
    assert error.id == "pgqueue.E004"
    assert "'lite' uses django.db.backends.sqlite3" in error.msg
    assert "django.db.backends.postgresql" in error.hint


def test_checks_are_registered_with_django():
    with override_settings(PGQUEUE={"NOTIFIY": True}):
        assert "pgqueue.E002" in ids(checks.run_checks())
        with pytest.raises(SystemCheckError, match="pgqueue.E002"):
            call_command("check")
