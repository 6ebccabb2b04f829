"""The benchmarks' shared harness: what every scenario needs and none owns.

- ``tree``: the source tree under test (its testproject, its Python);
- ``db``: bench database URLs, creating and migrating them, this process's
  Django, small SQL helpers;
- ``pgstats``: the server's statistics views, read from a connection of
  their own;
- ``processes``: child processes in sessions of their own, reaped and
  killed on any exit, their peak RSS sampled;
- ``worker``: ``manage.py pgqueue_worker`` as such a process, its log
  checked, and the ``Bench`` a scenario runs in;
- ``monitor``: a queue watched from a connection of its own while it drains;
- ``machine``: the machine's and a process's CPU, memory, load, git commit;
- ``numbers``: percentiles, medians, ratios of rounds run in turn;
- ``output``: tables and number formats, JSON files;
- ``cli``: argument types, the bench-database guard, signals, log folders;
- ``internals``: the one place that reaches into django_pgqueue beyond its
  public API (the claim, the acknowledgement, captured statements);
- ``throwaway_pg``: a PostgreSQL cluster of a run's own, for the scenarios
  (and tests) that crash or restart the server.

``python -m benchmarks`` (benchmarks/__main__.py) is the one entry point;
benchmarks/scenarios/ holds the scenarios it runs.
"""
