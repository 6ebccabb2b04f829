"""The fair claim and the limits of partitions (issue 38) with real
``manage.py pgqueue_worker`` processes: four workers never run more than
two messages of one partition at once, a partition's rate of 20/s holds
across workers for ten seconds, and the partitions that came after A's
400 messages all finish before A's 200th starts.

The handler ``test.started`` (testproject/demo/handlers.py) commits its
ledger row (demo.Handled) as it starts, then sleeps ``payload["seconds"]``.
Running messages are sampled from a connection of this process; claim
times are the history's (``FinishedMessage.started_at``: the claim's own
clock, which the rate counts by). Weights between queues:
test_queue_weights.py; the claim alone: test_fair_claim.py.
"""

import datetime
import threading
from collections import Counter, defaultdict

import pytest
from demo.models import Handled

from django_pgqueue import enqueue_many
from django_pgqueue.models import FinishedMessage, Message

from .conftest import raw_connection, wait_until

pytestmark = pytest.mark.slow

TOPIC = "test.started"
SAMPLE_EVERY = 0.02  # seconds


def start_workers(start_worker, count, queue, threads, pgqueue, *options):
    """``count`` workers of ``queue`` with ``threads`` handler threads each."""
    args = ["--queues", queue, "--concurrency", str(threads), "--log-level", "WARNING", *options]
    return [start_worker(*args, pgqueue=pgqueue) for _ in range(count)]


def enqueue_partitions(queue, sizes, seconds):
    """For each partition key of ``sizes``, its messages (one enqueue_many()
    each, in order): {message id: partition key}."""
    keys = {}
    for key, size in sizes.items():
        rows = [{"payload": {"seconds": seconds, "n": n}} for n in range(size)]
        for message in enqueue_many(rows, topic=TOPIC, queue=queue, partition_key=key):
            keys[message.pk] = key
    return keys


def drained(queue, ids):
    """Whether every message of ``ids`` started and ``queue`` is empty."""
    return (
        Handled.objects.filter(message_id__in=list(ids)).count() >= len(ids)
        and not Message.objects.filter(queue=queue).exists()
    )


class PartitionSampler:
    """Counts a queue's processing rows per partition every 20 ms from its
    own connection, one snapshot per sample."""

    def __init__(self, queue):
        self.queue = queue
        self.samples = []  # {partition key: processing}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with raw_connection(autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT partition_key, count(*) FROM django_pgqueue_message"
                    " WHERE queue = %s AND status = 'processing' GROUP BY 1",
                    [self.queue],
                )
                self.samples.append(dict(rows.fetchall()))
                self._stop.wait(SAMPLE_EVERY)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)
        return self


def test_four_workers_never_run_more_than_two_of_one_partition_at_once(start_worker):
    queue, seconds = "tenants", 0.08
    keys = enqueue_partitions(queue, {f"tenant:{n}": 30 for n in range(5)}, seconds)
    sampler = PartitionSampler(queue)
    try:
        # 16 threads for 5 partitions of 2 slots each: the partitions' limit
        # is what bounds them.
        start_workers(
            start_worker, 4, queue, 4,
            {"QUEUES": {queue: {"partition": {"concurrency": 2}}}},
            "--prefetch", "0", "--poll-interval", "1",
        )  # fmt: skip
        wait_until(lambda: drained(queue, keys), timeout=180, message="all 150 to finish")
    finally:
        sampler.stop()
    most = Counter()  # partition -> most processing at once in a sample
    at_two = 0  # samples in which some partition had 2 processing
    for sample in sampler.samples:
        for key, count in sample.items():
            most[key] = max(most[key], count)
        at_two += any(count == 2 for count in sample.values())
    busiest = max(sum(sample.values()) for sample in sampler.samples)
    print(
        f"partition concurrency 2: {len(sampler.samples)} samples, most per partition "
        f"{dict(most)}, a partition at 2 in {at_two}, most processing in all {busiest}"
    )
    assert set(most) <= set(keys.values())
    assert max(most.values()) <= 2, f"more than 2 of a partition processing at once: {most}"
    assert at_two >= 10, f"the limit of 2 was hardly reached ({at_two} samples)"
    assert busiest > 2, "the workers never ran several partitions at once"
    # The handlers' side: each runs at least `seconds` after its start, so
    # three starts of one partition closer than that ran at once.
    starts = defaultdict(list)
    for pk, at in Handled.objects.filter(message_id__in=list(keys)).values_list(
        "message_id", "handled_at"
    ):
        starts[keys[pk]].append(at)
    assert sum(map(len, starts.values())) >= 150
    close = {
        key: [t.isoformat() for t in times[i : i + 3]]
        for key, times in ((key, sorted(times)) for key, times in starts.items())
        for i in range(len(times) - 2)
        if (times[i + 2] - times[i]).total_seconds() < seconds
    }
    assert not close, f"three handlers of one partition ran at once: {close}"


def test_a_partition_rate_of_20_per_second_holds_across_workers_for_10_seconds(start_worker):
    queue, rate, period = "metered", 20, datetime.timedelta(seconds=1)
    keys = enqueue_partitions(queue, {"tenant:1": 320}, 0)  # 16 s of work at 20/s
    start_workers(
        start_worker, 4, queue, 2,
        {"QUEUES": {queue: {"partition": {"rate": f"{rate}/s"}}}},
        "--prefetch", "0", "--poll-interval", "1",
    )  # fmt: skip
    claimed = FinishedMessage.objects.filter(message_id__in=list(keys))

    def span():
        times = list(claimed.values_list("started_at", flat=True))
        return times and (max(times) - min(times)).total_seconds() >= 10

    wait_until(span, timeout=180, interval=0.2, message="10 s of claims")
    times = sorted(claimed.values_list("started_at", flat=True))
    # A claim counts the starts after its time less the period: each
    # window (t - 1 s, t] holds at most 20.
    lo, busiest = 0, 0
    for hi, at in enumerate(times):
        while times[lo] <= at - period:
            lo += 1
        busiest = max(busiest, hi - lo + 1)
    first_ten = [t for t in times if t - times[0] < 10 * period]
    per_second = Counter(int((t - times[0]) / period) for t in first_ten)
    print(
        f"partition rate 20/s: {len(first_ten)} claimed in the first 10 s, most in a 1 s "
        f"window {busiest}; per second {[per_second[s] for s in range(10)]}"
    )
    assert busiest <= rate, f"{busiest} claims of the partition within one second"
    assert len(first_ten) >= 150, (
        f"only {len(first_ten)} claimed in 10 s: the rate of 20/s was not what bound them"
    )


def test_partitions_after_as_400_all_finish_before_as_200th_starts(start_worker):
    queue = "fairq"
    sizes = {"A": 400, **{key: 20 for key in "BCDE"}}
    keys = enqueue_partitions(queue, sizes, 0.005)
    start_workers(start_worker, 2, queue, 2, {"QUEUES": {queue: {}}})
    wait_until(lambda: drained(queue, keys), timeout=180, message="all 480 to finish")
    started = Handled.objects.filter(message_id__in=list(keys)).order_by("handled_at", "pk")
    a_starts = [at for pk, at in started.values_list("message_id", "handled_at") if keys[pk] == "A"]
    others = [pk for pk, key in keys.items() if key != "A"]
    finished = FinishedMessage.objects.filter(message_id__in=others)
    last_finish = max(finished.values_list("finished_at", flat=True))
    a_200th = a_starts[199]
    before = sum(at < last_finish for at in a_starts)
    print(f"fairness: A had started {before} of its 400 when the last of B..E finished")
    assert finished.count() == 80
    assert last_finish < a_200th, (
        f"B..E's last finished at {last_finish}, after A's 200th started ({a_200th}); "
        f"A had started {before} by then"
    )
