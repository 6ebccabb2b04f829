"""One module per measurement, grouped by the script that runs them:

- ``one_worker``: throughput.py (one worker's burst drain, latency, idle cost);
- ``scale``: scale.py (a million delayed messages and dead letters, memory);
- ``compare``: compare.py (django-pgqueue beside its peers) and ab.py (two
  trees of django-pgqueue in turn);
- ``chaos``: chaos.py (faults while messages are handled; nothing lost).
"""
