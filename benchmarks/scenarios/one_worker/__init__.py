"""The throughput scenario's measurements of one worker process: a ``--burst`` drain
(``burst``), enqueue-to-start latency (``latency``) and what an idle worker
asks the database (``idle``); ``report`` prints them and checks the goals."""
