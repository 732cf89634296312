"""Pipeline parallelism (not to be confused with :mod:`mindformers_py.pipelines`, transformers' inference
pipelines): :mod:`.stages` cuts a model into stages by the plans it declares, :mod:`.schedule` runs the stages with
``torch.distributed.pipelining``'s schedules (:class:`~.schedule.PipelineParallel`, built by
:func:`~.schedule.build_pipeline`)."""
