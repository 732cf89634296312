"""A recipe's samples: the task's pipeline run on the ``generate`` section's prompts, after training or as the run
itself (``run_mode: predict``), in this process, in a pool of workers holding the model sharded
(:mod:`.parallel_pool`), or on every rank of a multi-process run, each holding its shards of the model.

``generate`` is the recipe's generate section: any object with its fields (``prompts``, ``pipeline``,
``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``num_beams``:
:class:`~mindformers_py.recipes.sections.GenerateSection`). ``task`` is the run's task registry entry (its
pipeline, processing class and Auto class).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..parallel.config import ParallelConfig
from ..task_registry import TaskSpec

logger = logging.getLogger(__name__)


def samples_pipeline(task: TaskSpec, generate: Any) -> str | None:
    """The pipeline the samples run: the generate section's, else the task's own (None when the task has none)."""
    return generate.pipeline or task.pipeline


def run_samples(task: TaskSpec, model: Any, processor: Any, generate: Any, output_dir: str, seed: int = 42,
                run_mode: str = "train", parallel_config: ParallelConfig | None = None,
                report: bool = True) -> list[Any]:
    """Run the task's pipeline on each of ``generate.prompts`` (texts, or image files for image tasks; generation
    settings apply to text generation) with the task's processing class ``processor``; print the results and save
    them in ``output_dir``: ``samples.txt`` after training, ``predictions.txt`` for ``run_mode="predict"`` (beside,
    not over, the samples of the run that trained the model). Sampling starts from ``seed``, so the same model and
    recipe give the same samples whichever run mode generates them. ``model`` may be a checkpoint folder; with
    ``parallel_config`` the pipeline generates in a pool of worker processes, closed at the end. ``report=False``
    generates without printing or writing (the ranks beside rank 0 of a sharded model)."""
    from transformers import set_seed

    from . import pipeline

    extra = {"parallel_config": parallel_config} if parallel_config is not None else {}
    pipe = pipeline(samples_pipeline(task, generate), model=model, **{task.processor: processor}, **extra)
    kwargs: dict[str, Any] = {}
    if task.name in ("causal_lm", "seq2seq_lm"):
        kwargs = dict(max_new_tokens=generate.max_new_tokens, do_sample=generate.do_sample,
                      repetition_penalty=generate.repetition_penalty)
        if generate.do_sample:
            kwargs.update(temperature=generate.temperature, top_k=generate.top_k, top_p=generate.top_p)
        if task.name == "seq2seq_lm":
            kwargs["num_beams"] = generate.num_beams
    pipe.model.eval()  # as loaded by from_pretrained: a model fresh from training generates without dropout too
    set_seed(seed)  # what training drew from the random streams does not change the samples
    try:
        outputs = [pipe(p, **kwargs) for p in generate.prompts]
    finally:
        pipe.close()
    # Generated texts come as records keyed generated_text / summary_text / translation_text.
    samples = [next(iter(out[0].values())) for out in outputs] if task.name in ("causal_lm", "seq2seq_lm") else outputs
    if not report:
        return samples
    text = "\n\n".join(f"----- sample {i + 1} -----\n{s}" for i, s in enumerate(samples))
    print(text)
    path = Path(output_dir, "predictions.txt" if run_mode == "predict" else "samples.txt")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {path}")
    return samples


def predict_in_pool(task: TaskSpec, source: str, load_kwargs: dict[str, Any], processor: Any, generate: Any,
                    output_dir: str, parallel_config: ParallelConfig, seed: int) -> list[Any]:
    """``run_mode: predict`` with a layout: the pipeline's workers load the checkpoint ``source`` (a saved adapter:
    its base model, then the adapter) and shard it (the model is loaded here first only when ``load_kwargs``, the
    recipe's model section, overrides its config)."""
    model: Any = source
    if load_kwargs:
        from ..adapters.apply import from_pretrained_with_adapter
        from ..auto import auto_class_for

        model = from_pretrained_with_adapter(auto_class_for(task.name), source, **load_kwargs)
    return run_samples(task, model, processor, generate, output_dir, seed, "predict", parallel_config=parallel_config)


def samples_on_every_rank(task: TaskSpec, source: str, load_kwargs: dict[str, Any], processor: Any, generate: Any,
                          output_dir: str, seed: int, run_mode: str, world: int, use_cpu: bool = False) -> list[Any]:
    """The samples of a multi-process run: every rank loads the model (``source``: the one just saved, or the one
    evaluated; ``load_kwargs``: the recipe's model section, which gives an adapter's base model the classifier's
    labels its folder does not hold), sharded over all ``world`` ranks for generation (tensor parallel, else
    pipeline stages: :func:`~mindformers_py.parallel.inference.generation_layout`), reading only its own shards, and
    runs the pipeline in step with the others; rank 0 prints and writes them. No rank holds the whole model. A model
    no layout splits is generated by rank 0 alone."""
    import torch
    import torch.distributed as dist

    from ..adapters.apply import adapted_model, from_pretrained_with_adapter, is_peft_model
    from ..auto import auto_class_for
    from ..loading import deferred_loading, materialize
    from ..parallel.inference import generation_layout, shard_for_inference
    from ..parallel.mesh import build_mesh, init_distributed

    use_cuda = torch.cuda.is_available() and not use_cpu
    owns_group = not dist.is_initialized()  # (the engine left the group it joined; one given to us stays)
    init_distributed(backend=None if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    with deferred_loading():
        model = from_pretrained_with_adapter(auto_class_for(task.name), source, **load_kwargs).eval()
    layout = generation_layout(model.config, world)
    if layout is not None and layout.pp > 1 and is_peft_model(model):  # stages replace the model's forward, not peft's
        layout = None
    samples: list[Any] = []
    if layout is None:
        logger.warning("no layout shards %s over %d ranks for generation; rank 0 generates the samples alone",
                       type(model).__name__, world)
        if rank == 0:
            samples = run_samples(task, materialize(model, device), processor, generate, output_dir, seed, run_mode)
    else:
        if rank == 0:
            logger.info("samples: generating with %s over %d ranks (each holds its shards)", layout.describe(), world)
        shard_for_inference(adapted_model(model), layout, build_mesh(layout, device_type=device.type))
        materialize(model, device).to(device)
        samples = run_samples(task, model, processor, generate, output_dir, seed, run_mode, report=rank == 0)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return samples
