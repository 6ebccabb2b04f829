"""manage.py pgqueue_worker: option validation and a burst run."""

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command

from django_pgqueue import enqueue
from django_pgqueue.models import Message


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--concurrency", "0"], "--concurrency: must be at least 1, not 0"),
        (["--concurrency", "many"], "--concurrency: 'many' is not a whole number"),
        (["--batch-size", "-3"], "--batch-size: must be at least 1"),
        (["--prefetch", "-1"], "--prefetch: must be zero or more, not -1"),
        (["--prefetch", "many"], "--prefetch: 'many' is not a whole number"),
        (["--max-messages", "1.5"], "--max-messages: '1.5' is not a whole number"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout: must be zero or more seconds"),
        (["--poll-interval", "0"], "--poll-interval: must be more than zero seconds"),
        (["--poll-interval", "nan"], "--poll-interval: must be more than zero seconds"),
        (["--lease", "soon"], "--lease: 'soon' is not a number of seconds"),
        (["--queues", ","], "--queues: give at least one queue name"),
        (["--queues", "ok,not ok"], "--queues: queue name 'not ok' may contain only"),
        (["--log-level", "LOUD"], "--log-level: must be one of DEBUG, INFO"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_bad_options_get_a_clear_error(args, words):
    with pytest.raises(CommandError, match=words):
        call_command("pgqueue_worker", *args)


@pytest.mark.django_db(transaction=True)
def test_burst_run_handles_the_ready_messages_of_its_queues_and_exits():
    mine = enqueue("test.record", {}, queue="mail")
    other = enqueue("test.record", {}, queue="sms")
    call_command("pgqueue_worker", "--burst", "--queues", "mail,reports", "--log-level", "ERROR")
    assert list(Handled.objects.values_list("message_id", flat=True)) == [mine.pk]
    assert list(Message.objects.values_list("pk", flat=True)) == [other.pk]


@pytest.mark.django_db(transaction=True)
def test_max_messages_stops_after_that_many():
    for _ in range(5):
        enqueue("test.record", {})
    call_command(
        "pgqueue_worker", "--max-messages", "2", "--concurrency", "1", "--log-level", "ERROR"
    )
    assert Handled.objects.count() == 2
    assert Message.objects.count() == 3
