"""The fair claim beside the plain claim (issue 38): one queue of ready
messages without a key and one of as many ready messages in many
partitions, with the rounds enqueue() gives them, claimed in turn through
the real claim statement.

- ``fill``: both queues written by INSERT ... SELECT FROM generate_series,
  the rounds computed as enqueue() computes them (checked against
  ``enqueue_many()`` on a sample first), and the delayed keyed messages of
  the variant;
- ``claims``: the timed claims of one queue on a connection of its own, and
  the plan of one claim;
- ``main``: the options, the rounds in turn, the report.
"""

PLAIN = "plain"  # the queue without partitions
FAIR = "fair"  # the queue in partitions
SIDES = (PLAIN, FAIR)
WORKER_ID = "bench-fair"
LEASE_SECONDS = 60
# The big partition holds every BIG_EVERY-th message (a tenth of the queue).
BIG_EVERY = 10
