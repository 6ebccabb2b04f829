"""Queues shared by weight (``--queues a=3,b=1``): the option and the
setting checked, the turn of the slots, and a real worker that starts three
of ``a`` per one of ``b`` while both have work, then drains either alone."""

import argparse
from statistics import median

import pytest
from demo.models import Handled
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_pgqueue import enqueue_many
from django_pgqueue.management.options import queue_list
from django_pgqueue.worker import Worker
from django_pgqueue.worker.shares import QueueShares

from .conftest import running_worker, wait_until


def test_the_option_takes_names_in_order_or_names_with_weights():
    assert queue_list("a,b") == ["a", "b"]  # strict order, as always
    assert queue_list("a=3, b=1") == {"a": 3, "b": 1}
    assert queue_list("a=3,b") == {"a": 3, "b": 1}  # a name without a weight weighs 1


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("a=0", "queue 'a': weight must be at least 1, not 0"),
        ("a=x", "queue 'a': weight 'x' is not a whole number"),
        ("a=1001", "queue 'a': weight must be at most 1000, not 1001"),
        ("a,a", "names the queue 'a' twice"),
        ("a=2,b,a=1", "names the queue 'a' twice"),
        (",", "give at least one queue name"),
        ("=3", "queue name must not be empty"),
    ],
)
def test_a_bad_weight_is_refused_with_what_is_wrong(value, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        queue_list(value)


def test_the_command_refuses_a_bad_weight_before_it_starts():
    with pytest.raises(CommandError, match="queue 'bulk': weight must be at least 1, not 0"):
        call_command("pgqueue_worker", "--queues", "default=2,bulk=0", "--burst")


@pytest.mark.parametrize(
    ("queues", "words"),
    [
        ({"a": 0, "b": 1}, "queue 'a': its weight must be a whole number from 1 to 1000 (got 0)"),
        ({"a": "3", "b": 1}, "(got '3')"),
    ],
)
def test_the_worker_refuses_a_bad_weight(queues, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Worker(queues=queues)


def test_weights_come_from_the_setting_when_no_queues_are_given():
    with override_settings(PGQUEUE={"QUEUES": {"a": {"weight": 3}, "b": {"concurrency": 2}}}):
        assert Worker().config.weights == {"a": 3, "b": 1}
        assert Worker(queues=["a", "b"]).config.weights == {}  # named: in order
    with override_settings(PGQUEUE={"QUEUES": {"a": {}, "b": {"rate": "5/s"}}}):
        assert Worker().config.weights == {}


def test_slots_take_turns_by_weight_within_and_across_claims():
    shares = QueueShares({"a": 3, "b": 1})
    assert shares.slots(["a", "b"], 8) == ["a", "a", "b", "a", "a", "a", "b", "a"]
    one_at_a_time = [shares.slots(["a", "b"], 1)[0] for _ in range(400)]
    assert one_at_a_time.count("a") == 300 and one_at_a_time.count("b") == 100
    # A queue left out (paused, or waiting for a slot of its limits) takes none.
    assert shares.slots(["b"], 3) == ["b", "b", "b"]


@pytest.mark.django_db(transaction=True)
def test_a_worker_starts_three_of_a_per_one_of_b_then_drains_either_alone():
    topic = "test.record"
    a = {
        m.pk
        for m in enqueue_many(
            [{"payload": {"i": i}} for i in range(360)], topic=topic, queue="weights_a"
        )
    }
    b = {
        m.pk
        for m in enqueue_many(
            [{"payload": {"i": i}} for i in range(240)], topic=topic, queue="weights_b"
        )
    }
    with running_worker(
        queues={"weights_a": 3, "weights_b": 1}, concurrency=2, batch_size=8, poll_interval=0.2
    ):
        wait_until(lambda: Handled.objects.count() == 600, message="both queues drained")
    starts = list(Handled.objects.order_by("pk").values_list("message_id", flat=True))
    assert set(starts) == a | b  # each once
    # While both had work: up to the last start of a (360 of a, about 120 of b).
    last_a = max(i for i, pk in enumerate(starts) if pk in a)
    both = starts[: last_a + 1]
    of_a, of_b = sum(pk in a for pk in both), sum(pk in b for pk in both)
    assert of_b and 2 <= of_a / of_b <= 4, (of_a, of_b)
    # And start by start: the starts of a between two starts of b.
    b_at = [i for i, pk in enumerate(both) if pk in b]
    gaps = [later - earlier - 1 for earlier, later in zip(b_at, b_at[1:], strict=False)]
    assert 2 <= median(gaps) <= 4, gaps
    # Then b alone: everything left of it ran after a was empty.
    assert all(pk in b for pk in starts[last_a + 1 :])
    assert len(starts) - last_a - 1 > 100
