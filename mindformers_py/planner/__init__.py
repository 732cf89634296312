"""The offline planner: model shapes, the accelerator catalog, memory and step-time models, the layout search and
the ``mindformers-py plan`` command.

It reads :class:`~mindformers_py.parallel.config.ParallelConfig` (the layouts it proposes are parallel configs) and
runs nothing: no mechanism in :mod:`mindformers_py.parallel` imports it. Its callers are the CLI (``plan``), the
recipe runner and the engine registry (``auto_parallel``).
"""
