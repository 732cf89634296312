"""A recipe resolved into a :class:`RunSpec`: every check of the run done, nothing slow started.

:func:`resolve_recipe` reads the sections, checks the fields and values (the training arguments, the output folder,
the task against the model family, the context length, the generate section), plans an ``auto_parallel`` layout and
resolves the layout once against the world, the model config and the batch. It loads no tokenizer, prepares no data,
builds no model and starts no process: a recipe it refuses costs a second, not a training run. The one check left for
later is the vocabulary a preset takes from the tokenizer, which is known only once the tokenizer is loaded
(:attr:`RunSpec.vocab_from_tokenizer`). :mod:`.runner` runs the spec.

The ranks a recipe launches receive what the spec was resolved from and what it resolved: the resolved recipe (as
``run_config.yaml``) and the :class:`~mindformers_py.parallel.layout.Layout` (:mod:`.layout_handover`); each resolves
its own spec from them (its output folder checked on every rank), without planning or checking the layout again.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters.config import recipe_peft_config
from ..adapters.files import adapter_base, is_adapter_folder
from ..errors import ConfigError, check_choice
from ..launcher.launch import launched_by_torchrun as under_torchrun
from ..models.hub import hub_options, resolve_source
from ..parallel.config import ParallelConfig
from ..parallel.context.checks import check_compile
from ..parallel.layout import Layout
from ..task_registry import TASKS, TaskSpec, get_task
from .layout_handover import received_layout
from .loader import apply_overrides, check_recipe, from_mindformers_r2, parse_overrides
from .sections import RUN_MODES, DataSection, GenerateSection, TokenizerSection, section_from_dict

logger = logging.getLogger(__name__)

DEFAULT_TASK = "causal_lm"


@dataclass(frozen=True)
class RunSpec:
    """A recipe resolved and checked (:func:`resolve_recipe`): what :func:`~.runner.run` builds and runs."""

    recipe: dict[str, Any]
    """The resolved recipe (overrides applied, the layout that runs in ``parallel``): recorded as ``run_config.yaml``
    and run by the ranks a multi-process run launches. The runner adds what the data decides to its copy."""
    run_mode: str
    """``train``, ``finetune``, ``eval`` or ``predict``."""
    task: TaskSpec
    """The task registry entry: the Auto class, the data preparation, the collator, the metrics, the pipeline."""
    name_or_path: str
    """The model's folder (a Hub id or packaged checkpoint resolved to its files) or preset name; for a saved
    adapter, its base model."""
    adapter_dir: str | None
    """The saved adapter ``model.name_or_path`` named, loaded on the base model; None for a plain model."""
    model_options: dict[str, Any]
    """The model section less ``name_or_path``: config overrides and ``from_pretrained`` arguments."""
    model_config: Any
    """The model config as the recipe gives it (before the tokenizer sizes a preset's vocabulary and the data sets a
    classifier's labels)."""
    tokenizer: TokenizerSection
    """The recipe's tokenizer section."""
    data: DataSection
    """The recipe's data section."""
    generate: GenerateSection
    """The recipe's generate section (its pipeline name checked)."""
    args: Any
    """The ``TrainingArguments`` (``Seq2SeqTrainingArguments`` for ``seq2seq_lm``), holding the layout that runs."""
    peft_config: Any
    """The recipe's peft section as a peft config, or None."""
    parallel: ParallelConfig
    """The layout that runs as the user's fields (an ``auto_parallel`` recipe: the planner's choice)."""
    layout: Layout
    """``parallel`` resolved for ``world`` processes, the model and the batch."""
    world: int
    """The processes the run uses: torchrun's ``WORLD_SIZE`` in a launched rank, else what the layout needs."""
    layout_checked: bool
    """Whether this process checked the layout (False in a rank that received it from the process that launched it)."""
    vocab_from_tokenizer: bool
    """Whether the model's vocabulary is the tokenizer's (a preset without ``model.vocab_size``): checked against the
    layout once the tokenizer is loaded, the one check the spec cannot hold."""

    @property
    def seq_length(self) -> int:
        """Tokens per sample: an image model's fixed count (class token + patches), else ``data.block_size``."""
        return _seq_length(self.model_config, self.data)


def _seq_length(config: Any, data: DataSection) -> int:
    return getattr(config, "fixed_sequence_length", None) or data.block_size


def recipe_task(recipe: dict[str, Any]) -> TaskSpec:
    """The recipe's task; one without a data preparation is refused naming those that have one."""
    task = get_task(recipe.get("task") or DEFAULT_TASK)
    if task.recipe_data is None:
        ready = [t.name for t in TASKS.values() if t.recipe_data]
        raise ConfigError(f"task={task.name!r} has no recipe data preparation; recipes run the tasks: {', '.join(ready)} "
                          "(train other tasks from Python with Trainer)")
    return task


def resolve_recipe(recipe: dict[str, Any], overrides: list[str] | None = None) -> RunSpec:
    """Resolve a recipe dict (with CLI-style ``overrides``) into a :class:`RunSpec`, refusing it in one line when any
    check fails; nothing slow runs here (no tokenizer, data, model or process)."""
    recipe = apply_overrides(from_mindformers_r2(recipe, "recipe"), parse_overrides(overrides or []))
    check_recipe(recipe, "recipe")
    run_mode = recipe.get("run_mode", "train")
    check_choice("run_mode", run_mode, RUN_MODES)
    task = recipe_task(recipe)
    parallel = ParallelConfig.coerce(recipe.get("parallel"), "parallel")
    tok_s = section_from_dict(TokenizerSection, recipe.get("tokenizer"), "tokenizer")
    data_s = section_from_dict(DataSection, recipe.get("data"), "data")
    gen_s = section_from_dict(GenerateSection, recipe.get("generate"), "generate")
    model_s = dict(recipe.get("model") or {})
    name_or_path = model_s.pop("name_or_path", None)
    if name_or_path is None:
        raise ConfigError("model.name_or_path is required: a preset name, our checkpoint folder, an HF checkpoint folder "
                          "or a Hugging Face Hub id")
    # a packaged checkpoint's or a Hub repository's id -> its folder (the Hub's files through its cache)
    hub = hub_options(model_s)
    name_or_path = str(Path(resolve_source(name_or_path, **{k: v for k, v in hub.items() if k != "subfolder"}),
                            hub.get("subfolder", "")))
    # A saved adapter (a LoRA run's output) loads its base model, then the adapter on it.
    adapter_dir = name_or_path if is_adapter_folder(name_or_path) else None
    if adapter_dir is not None:
        name_or_path = adapter_base(adapter_dir)

    from ..auto import resolve_config
    from ..planner.search import default_world_size
    from ..trainer.arguments import Seq2SeqTrainingArguments, TrainingArguments

    training = dict(recipe.get("training") or {})
    if training.get("task") not in (None, task.name) and get_task(training["task"]) is not task:
        raise ConfigError(f"training.task={training['task']!r} contradicts the recipe's task={task.name!r}; keep one")
    training.setdefault("overwrite_output_dir", False)  # the CLI never trains over another run by accident
    arguments_class = Seq2SeqTrainingArguments if task.name == "seq2seq_lm" else TrainingArguments
    foreign = [k for k in training if k not in arguments_class.field_names()]
    if foreign:
        raise ConfigError(f"training.{foreign[0]} is a Seq2SeqTrainingArguments field, for task seq2seq_lm only; this "
                          f"recipe's task is {task.name!r}")
    # field names and values; the layout the arguments hold is the recipe's (whose recompute activation_checkpointing
    # may turn on)
    args = arguments_class(**{**training, "task": task.name, "parallel_config": parallel})
    _check_output_dir(args, run_mode)
    peft_config = recipe_peft_config(recipe, task.name)
    if peft_config is not None and adapter_dir is not None and run_mode in ("train", "finetune"):
        raise ConfigError(f"model.name_or_path={adapter_dir!r} is a saved adapter and the recipe has a peft section; "
                          "drop the peft section (--peft null) to continue training that adapter, or start from its "
                          "base model")
    config, family, _ = resolve_config(name_or_path, **model_s)
    if task.name not in family.model_classes:
        raise ConfigError(f"task={task.name!r} is not one the {family.name} family of model.name_or_path={name_or_path!r} "
                          f"serves; its tasks: {', '.join(t for t in family.model_classes if t != 'base')}")
    if data_s.block_size > getattr(config, "max_position_embeddings", data_s.block_size):
        raise ConfigError(f"data.block_size={data_s.block_size} exceeds the model's context length "
                          f"max_position_embeddings={config.max_position_embeddings}; lower data.block_size")
    if run_mode in ("finetune", "predict", "eval") and not Path(name_or_path).is_dir():
        raise ConfigError(f"run_mode={run_mode!r} needs model.name_or_path to be a checkpoint folder, got {name_or_path!r}")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else default_world_size(parallel)
    _check_generate(gen_s, task, run_mode, world)
    per_device_batch = args.per_device_train_batch_size
    # A preset's vocabulary is the tokenizer's unless the model section sets it: unknown until the tokenizer loads.
    vocab_from_tokenizer = (not Path(name_or_path).is_dir() and task.processor == "tokenizer"
                            and "vocab_size" not in model_s)
    seq_length = _seq_length(config, data_s)
    # The layout, resolved once in this process: sent by the process that launched this one, else checked here
    # against the world, the model and the batch.
    layout = received_layout(world)
    layout_checked = layout is None
    if layout is None:
        # auto_parallel: the planner turns the hints into a fixed layout, which the launched workers then run.
        from ..adapters.counting import adapter_parameter_count
        from ..engine.registry import plan_layout  # the engines' modules: after the checks above, which need none

        trainable = adapter_parameter_count(peft_config, config, task.name) if peft_config is not None else None
        planned = plan_layout(parallel, config, world, per_device_batch, seq_length, trainable_params=trainable,
                              fused_loss=bool(args.fused_loss))
        if planned is not parallel:
            parallel, args = planned, args.with_layout(planned)
        checked_config = config
        if vocab_from_tokenizer:  # the preset's default vocabulary is not the one that runs
            checked_config = copy.deepcopy(config)
            checked_config.vocab_size = None
        # a world, a model or a batch it cannot hold fails here
        layout = args.parallel_config.resolve(world, checked_config, per_device_batch, task=task.name,
                                              sequence_length=seq_length)
    if run_mode in ("train", "finetune", "eval"):  # refused now, not at the first evaluation after training
        from ..trainer.seq2seq import check_generation_layout

        check_generation_layout(args, layout)
    check_compile(layout.cp, bool(args.torch_compile))
    if parallel.ignored_sizes_warning(layout):  # e.g. stand_alone with data_parallel=2: say so, record what runs
        logger.warning("%s", parallel.ignored_sizes_warning(layout))
        parallel = parallel.without_ignored_sizes()
        args = args.with_layout(parallel)  # recorded with the sizes that run (the layout is the same)
    recipe["parallel"] = parallel.to_dict()
    return RunSpec(recipe=recipe, run_mode=run_mode, task=task, name_or_path=name_or_path, adapter_dir=adapter_dir,
                   model_options=model_s, model_config=config, tokenizer=tok_s, data=data_s, generate=gen_s, args=args,
                   peft_config=peft_config, parallel=parallel, layout=layout, world=world,
                   layout_checked=layout_checked, vocab_from_tokenizer=vocab_from_tokenizer)


def _check_generate(gen_s: GenerateSection, task: TaskSpec, run_mode: str, world: int) -> None:
    """Refuse a generate section the run could only fail on after training: a pipeline name that does not exist, and
    a multi-process ``predict`` without prompts or under the user's own torchrun."""
    if run_mode == "predict" and world > 1:
        if under_torchrun():
            raise ConfigError("run_mode='predict' with a parallel layout starts its own worker processes; run it "
                              "without torchrun (mindformers-py run ... --run_mode predict)")
        if not gen_s.prompts:
            raise ConfigError("run_mode='predict' needs generate.prompts (texts to complete)")
    if gen_s.prompts:
        from ..pipelines import get_pipeline
        from ..pipelines.samples import samples_pipeline

        name = samples_pipeline(task, gen_s)
        if name is None:
            raise ConfigError(f"generate.prompts needs generate.pipeline: task={task.name!r} has no pipeline of its own")
        get_pipeline(name, field="generate.pipeline")


def _check_output_dir(args: Any, run_mode: str) -> None:
    """Refuse, before anything is prepared or written (in the launching process and in every rank alike), a
    training run into a folder that holds another run, unless the recipe resumes it, overwrites it, or the
    launcher restarted this run (it then resumes from its own checkpoints)."""
    from ..launcher.restarts import restart_info
    from ..trainer.checkpoint import check_output_dir

    if run_mode in ("train", "finetune") and not args.resume_from_checkpoint and restart_info() is None:
        check_output_dir(args.output_dir, args.overwrite_output_dir)
