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
        ({"ASYNC_CONCURRENCY": 0}, "PGQUEUE['ASYNC_CONCURRENCY'] must be a whole number from 1"),
        ({"ASYNC_CONCURRENCY": 10**6}, "must be a whole number from 1 to 100,000"),
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
        ({"QUEUES": {"a": {"weight": 0}}}, "queue 'a': weight must be a whole number from 1 to"),
        ({"QUEUES": {"a": {"weight": 2.5}}}, "weight must be a whole number from 1 to 1000"),
        ({"QUEUES": {"a": {"share": 2}}}, "unknown limit 'share' (known: concurrency, rate, p"),
        ({"QUEUES": {"a": {"fair": "no"}}}, "queue 'a': fair must be True (the default"),
        ({"QUEUES": {"a": {"partition": 2}}}, "partition must be a dict of the limits of each"),
        (
            {"QUEUES": {"a": {"partition": {"rate": "2/d"}}}},
            "queue 'a': partition rate must be a rate like '20/s'",
        ),
        (
            {"QUEUES": {"a": {"partition": {"weight": 2}}}},
            "partition has an unknown limit 'weight' (known: concurrency, rate)",
        ),
        ({"QUEUES": {"a": {"partition": {"concurrency": 0}}}}, "partition concurrency must be"),
        ({"HEARTBEAT_INTERVAL": 0}, "must be a number of seconds greater than 0"),
        ({"LOG_SUMMARY_INTERVAL": -1}, "must be a number of seconds (0 turns it off)"),
        ({"VACUUM_DEAD_ROWS": 0}, "must be a whole number of at least 1, or None (never vac"),
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
        ({"WORKER_HTTP_HOST": ""}, "PGQUEUE['WORKER_HTTP_HOST'] must be an IP address or a"),
        ({"WORKER_HTTP_HOST": None}, "must be an IP address or a host name"),
        ({"WORKER_HTTP_HOST": "127.0.0.1:9100"}, "without brackets or a port (got '127.0"),
        ({"WORKER_HTTP_HOST": "[::1]"}, "must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)"),
        ({"WORKER_HTTP_HOST": "10.0.0.256"}, "must be an IP address"),
        ({"WORKER_HTTP_HOST": "my host"}, "must be an IP address"),
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


# --- autovacuum (a database check) ------------------------------------------------


def server_setting(name):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting(%s)", [name])
        return cursor.fetchone()[0]


@pytest.mark.django_db
def test_autovacuum_off_on_the_server_is_a_warning_with_what_to_do():
    from django.db import connection

    # The real server: the one the tests run on has autovacuum = off.
    server_off = server_setting("autovacuum") == "off"
    warnings = pgqueue_checks.check_vacuum(databases=["default"])
    assert [w.id for w in warnings] == (["pgqueue.W107"] if server_off else [])
    if server_off:
        [warning] = warnings
        assert isinstance(warning, checks.Warning)
        assert "'default' runs on a server with autovacuum = off" in warning.msg
        assert "slow down without bound" in warning.msg
        assert "Set autovacuum = on" in warning.hint
        name = connection.settings_dict["NAME"]
        assert f"vacuumdb --dbname {name} -t django_pgqueue_message" in warning.hint
        assert "-t django_pgqueue_streamevent" in warning.hint
        assert "-t django_pgqueue_subscription" in warning.hint


@pytest.mark.django_db
def test_autovacuum_switched_off_on_our_tables_is_a_warning_whose_hint_fixes_it():
    from django.db import connection

    def per_table():
        return [
            w
            for w in pgqueue_checks.check_vacuum(databases=["default"])
            if "switched off on" in w.msg
        ]

    assert per_table() == []
    # In the test's transaction: rolled back (restored) at its end.
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_pgqueue_message SET (autovacuum_enabled = false)")
        cursor.execute(
            "ALTER TABLE django_pgqueue_streamevent SET (toast.autovacuum_enabled = off)"
        )
        cursor.execute("ALTER TABLE django_pgqueue_taskrecord SET (autovacuum_enabled = no)")
    [warning] = per_table()
    assert warning.id == "pgqueue.W107"
    assert (
        "Autovacuum is switched off on queue table(s) of database 'default': "
        "django_pgqueue_message, django_pgqueue_streamevent (its TOAST table), "
        "django_pgqueue_taskrecord."
    ) in warning.msg
    statements = [part.strip() for part in warning.hint.split(";")[:-1]]
    assert statements[0] == (
        "Switch it back on: ALTER TABLE django_pgqueue_message "
        "RESET (autovacuum_enabled, toast.autovacuum_enabled)"
    )
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement.removeprefix("Switch it back on: "))
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'django_pgqueue_message'")
        [options] = cursor.fetchone()
    assert per_table() == [], "the hint's statements switch it back on"
    assert "fillfactor=50" in options, "and leave the migrations' other settings alone"


def test_the_autovacuum_check_runs_only_for_the_queue_database_when_asked():
    assert pgqueue_checks.check_vacuum() == [], "manage.py check without --database"
    assert pgqueue_checks.check_vacuum(databases=["other"]) == [], "the queue is on 'default'"
    with override_settings(PGQUEUE={"DATABASE": "missing"}):
        assert pgqueue_checks.check_vacuum(databases=["missing"]) == []
    assert "pgqueue.W107" not in ids(checks.run_checks())


@pytest.mark.django_db(databases=["default", "other"])
def test_the_autovacuum_check_passes_over_an_unreachable_database():
    from .conftest import unreachable

    with unreachable("other"), override_settings(PGQUEUE={"DATABASE": "other"}):
        assert pgqueue_checks.check_vacuum(databases=["other"]) == []


@pytest.mark.django_db
def test_manage_py_check_database_fails_on_w107_unless_silenced(settings):
    # tox runs "check --fail-level WARNING --database default" on a server
    # with autovacuum off: the test project silences W107, and only W107.
    assert settings.SILENCED_SYSTEM_CHECKS == ["pgqueue.W107"]
    call_command("check", "--fail-level", "WARNING", "--database", "default")
    if server_setting("autovacuum") == "off":
        settings.SILENCED_SYSTEM_CHECKS = []
        with pytest.raises(SystemCheckError, match="pgqueue.W107"):
            call_command("check", "--fail-level", "WARNING", "--database", "default")
