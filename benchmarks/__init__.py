"""django-pgqueue's benchmarks, one tool: ``python -m benchmarks SCENARIO
[options]`` from the checkout's root (``--help`` lists the scenarios;
benchmarks/README.md says what each measures, RESULTS.md what they found).

- ``harness/``: what every scenario needs and none owns (databases, child
  processes, the worker, numbers, output);
- ``scenarios/``: one module (or package) per scenario;
- ``peers/``: the client and worker programs of the systems ``compare``
  measures, run in their own virtualenvs.
"""
