"""The paper's benchmark tables as one paired evaluation (``launch/benchmark.py``).

``suites`` (the tasks and every setting with its source), ``cache`` (model identity and the
per-(model, task, settings) result cache), ``runner`` (settings, matching checks, one lm-eval task),
``session`` (one invocation), ``stats`` (paired bootstrap, exact McNemar), ``report`` (tables, JSON).
"""
