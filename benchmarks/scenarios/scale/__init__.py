"""The scale scenario's measurements: one worker with a million delayed messages and
a million dead letters in the tables, against empty tables, in turn.

- ``fill``: the loaded state (delayed messages, dead letters, their sizes);
- ``drain``: a worker draining bench messages, its claim histogram (``metrics``);
- ``claims``: the worker's claim timed in this process, and its plan (``plans``);
- ``memory``: one worker's RSS over a million messages;
- ``checks``: loaded against baseline, rounds in turn; ``report`` prints it all.
"""

from benchmarks.harness.db import MESSAGE_TABLE
from benchmarks.harness.worker import TOPIC_ATOMIC, TOPIC_NONATOMIC

QUEUE = "default"  # the queue the bench messages go to and the worker drains
CLAIM_WORKER_ID = "bench-scale"
CLAIM_LEASE_SECONDS = 60
TOPICS = (("nonatomic", TOPIC_NONATOMIC, False), ("atomic", TOPIC_ATOMIC, True))
# The baseline is measured again after the loaded state (the load removed):
# on a shared machine, the difference between the two is the noise floor.
STATES = ("baseline", "loaded", "baseline2")
BASELINES = ("baseline", "baseline2")
PARTIAL_INDEXES = ("pgqueue_msg_claim_idx", "pgqueue_msg_due_idx")
PKEY_INDEX = f"{MESSAGE_TABLE}_pkey"
