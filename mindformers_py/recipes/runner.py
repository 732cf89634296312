"""Running a task recipe: build tokenizer, data, model, TrainingArguments and ParallelConfig from the sections,
then train / finetune / evaluate / predict. The same recipe runs on one process or many: only ``parallel``
changes, and when it needs more processes than this one the run re-launches itself under torchrun's machinery.

The recipe's ``task`` (a task registry name or alias; ``causal_lm`` by default) decides which Auto class loads the
model, how the data is prepared (:mod:`mindformers_py.data.recipe_data`), the collator, the evaluation metrics
and which pipeline runs on ``generate.prompts`` after training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..adapters.config import recipe_peft_config
from ..adapters.files import adapter_base, is_adapter_folder
from ..errors import ConfigError, check_choice
from ..models.hub import TOKENIZER_FILES, hub_options, resolve_source
from ..parallel.config import ParallelConfig
from ..parallel.layout import Layout
from ..parallel.layout_checks import check_run
from ..parallel.context.checks import check_compile
from ..launcher.launch import launched_by_torchrun as under_torchrun
from ..task_registry import TASKS, TaskSpec, get_task
from ..utils.damaged_files import loading_from
from .layout_handover import layout_was_sent, received_layout, sending_layout
from .loader import apply_overrides, check_recipe, dump_recipe, from_mindformers_r2, parse_overrides
from .sections import RUN_MODES, DataSection, GenerateSection, TokenizerSection, section_from_dict

logger = logging.getLogger(__name__)

RESOLVED_NAME = "run_config.yaml"
DEFAULT_TASK = "causal_lm"


def recipe_task(recipe: dict[str, Any]) -> TaskSpec:
    """The recipe's task; one without a data preparation is refused naming those that have one."""
    task = get_task(recipe.get("task") or DEFAULT_TASK)
    if task.recipe_data is None:
        ready = [t.name for t in TASKS.values() if t.recipe_data]
        raise ConfigError(f"task={task.name!r} has no recipe data preparation; recipes run the tasks: {', '.join(ready)} "
                          "(train other tasks from Python with Trainer)")
    return task


def run_recipe(recipe: dict[str, Any], overrides: list[str] | None = None) -> dict[str, Any]:
    """Run a recipe dict (with CLI-style ``overrides``); returns the final metrics (and the pipeline's outputs on
    ``generate.prompts``)."""
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

    # Validate everything that needs no weights and no process group first (config, layout, batch).
    from ..auto import auto_class_for, resolve_config
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
    # field names and values, before anything slow; the layout the arguments hold is the recipe's (whose recompute
    # activation_checkpointing may turn on)
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
    per_device_batch = args.per_device_train_batch_size
    # Image models see a fixed number of tokens per sample (class token + patches), text models data.block_size.
    seq_length = getattr(config, "fixed_sequence_length", None) or data_s.block_size
    # The layout, resolved once in this process: sent by the process that launched this one, else checked here
    # against the world before any data is prepared (against the final model and the batch once the data has
    # said what the model is, below).
    layout = received_layout(world)
    if layout is None:
        # auto_parallel: the planner turns the hints into a fixed layout, which the launched workers then run.
        from ..adapters.counting import adapter_parameter_count
        from ..engine.registry import plan_layout  # the engines' modules: after the checks above, which need none

        trainable = adapter_parameter_count(peft_config, config, task.name) if peft_config is not None else None
        planned = plan_layout(parallel, config, world, per_device_batch, seq_length, trainable_params=trainable)
        if planned is not parallel:
            parallel, args = planned, args.with_layout(planned)
        layout = args.parallel_config.resolve(world)  # a world it cannot hold fails here
    if run_mode in ("train", "finetune", "eval"):  # refused now, not at the first evaluation after training
        from ..trainer.seq2seq import check_generation_layout

        check_generation_layout(args, layout)
    if parallel.ignored_sizes_warning(layout):  # e.g. stand_alone with data_parallel=2: say so, record what runs
        logger.warning("%s", parallel.ignored_sizes_warning(layout))
        parallel = parallel.without_ignored_sizes()
        args = args.with_layout(parallel)  # recorded with the sizes that run (the layout is the same)
    recipe["parallel"] = parallel.to_dict()

    # The task's processing class (tokenizer or image processor) and data are prepared (and cached) here, once,
    # before any worker starts.
    tokenizer = _load_processing_class(task, tok_s, data_s, name_or_path, config)
    if task.name == "causal_lm" and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # GPT-2's and Llama's tokenizers have no pad token: pad with eos, as trl's SFTTrainer does (the labels of
        # padding are -100 whatever its id)
        tokenizer.pad_token = tokenizer.eos_token
    if not Path(name_or_path).is_dir() and task.processor == "tokenizer":  # a preset: size the vocabulary and
        # special tokens to the tokenizer
        model_s.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            model_s.setdefault(name, getattr(tokenizer, name))
    datasets = None
    if run_mode != "predict":
        from ..data.progress import data_progress
        from ..data.recipe_data import RECIPE_DATA

        if data_s.source == "megatron" and data_s.train_samples is None and args.max_steps > 0:
            # Megatron builds the samples a run reads (--train-iters x the global batch), epochs reshuffled
            data_s.train_samples = args.max_steps * per_device_batch * args.gradient_accumulation_steps * layout.dp
        with data_progress():  # datasets' bars from one process: this one, or rank 0 of a job started elsewhere
            datasets = RECIPE_DATA[task.recipe_data](data_s, tokenizer, config)
        if data_s.max_train_samples is not None and datasets.train is not None:
            datasets.train = _first_samples(datasets.train, data_s.max_train_samples)
        for key, value in datasets.config_updates.items():
            if key in model_s and model_s[key] != value:
                raise ConfigError(f"model.{key}={model_s[key]!r} contradicts the data, which gives {key}={value!r}; "
                                  f"remove model.{key}")
            model_s[key] = value
        # Recorded in run_config.yaml too: a saved adapter holds no config.json, so its base model gets the
        # classifier's labels from there when the run is evaluated or predicted again.
        recipe["model"] = {**(recipe.get("model") or {}), **datasets.config_updates}
    config, _, _ = resolve_config(name_or_path, **model_s)
    if not layout_was_sent():  # the rest of the resolution: the final model and the batch
        check_run(layout, config, per_device_batch, task=task.name, sequence_length=seq_length)
    check_compile(layout.cp, bool(args.torch_compile))
    if run_mode == "predict" and world > 1:  # generation in a pool of workers holding the sharded model
        return _predict_in_pool(task, adapter_dir or name_or_path, model_s, tokenizer, gen_s, args.output_dir, parallel,
                                args.seed)
    if world > 1 and not under_torchrun():
        return _relaunch(recipe, args.output_dir, world, args.max_restarts, layout)

    from transformers import set_seed

    from ..adapters.apply import with_saved_adapter
    from ..loading import deferred_loading

    args = args.with_resolved_layout(layout)  # the Trainer's engine takes the layout as it is
    set_seed(args.seed)  # the same initial weights on every rank and in every layout
    auto = auto_class_for(task.name)
    # A worker of a multi-process layout builds the model on meta: its engine fills only this rank's shards.
    with deferred_loading() if world > 1 else contextlib.nullcontext():
        model = auto.from_pretrained(name_or_path, **model_s)
    if adapter_dir is not None:
        model = with_saved_adapter(model, adapter_dir, trainable=run_mode in ("train", "finetune"))
    if task.processor == "tokenizer" and model.config.vocab_size < len(tokenizer):
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model vocab_size={model.config.vocab_size}; set model.vocab_size")

    results: dict[str, Any] = {}
    if run_mode != "predict":
        results.update(_train_or_eval(run_mode, recipe, args, model, tokenizer, datasets, task, peft_config))
    if gen_s.prompts and world == 1:
        results["samples"] = run_pipeline(task, model, tokenizer, gen_s, args.output_dir, args.seed, run_mode)
    elif gen_s.prompts and under_torchrun() and run_mode != "predict":
        del model  # the training shards go before the saved model is loaded again, sharded for generation
        # what was trained was saved in output_dir; an evaluated model is where it came from
        source = args.output_dir if run_mode != "eval" else (adapter_dir or name_or_path)
        results["samples"] = _samples_on_every_rank(task, auto, args, tokenizer, gen_s, model_s, world, run_mode,
                                                    source)
    return results


def _first_samples(dataset: Any, count: int) -> Any:
    """The first ``count`` samples of a recipe's dataset: a ``datasets.Dataset``, or a dataset wrapping one in its
    ``dataset`` attribute (the image datasets, which process each image when read)."""
    import copy

    if hasattr(dataset, "select"):
        return dataset.select(range(min(count, len(dataset))))
    inner = getattr(dataset, "dataset", None)
    if not hasattr(inner, "select"):
        raise ConfigError(f"data.max_train_samples is not supported for a {type(dataset).__name__}")
    capped = copy.copy(dataset)
    capped.dataset = inner.select(range(min(count, len(inner))))
    return capped


def _samples_on_every_rank(task: TaskSpec, auto: Any, args: Any, tokenizer: Any, gen_s: GenerateSection,
                           model_s: dict[str, Any], world: int, run_mode: str, source: str) -> list[Any]:
    """The samples of a multi-process run: every rank loads the model (``source``: the one just saved, or the one
    evaluated), sharded over all ranks for
    generation (tensor parallel, else pipeline stages: :func:`~mindformers_py.parallel.inference.generation_layout`),
    reading only its own shards, and runs the pipeline in step with the others; rank 0 prints and writes them. No
    rank holds the whole model. A model no layout splits is generated by rank 0 alone."""
    import gc

    import torch
    import torch.distributed as dist

    from ..adapters.apply import adapted_model, from_pretrained_with_adapter, is_peft_model
    from ..engine.cpu_memory import return_freed_cpu_memory
    from ..loading import deferred_loading, materialize
    from ..parallel.inference import generation_layout, shard_for_inference
    from ..parallel.mesh import build_mesh, init_distributed

    gc.collect()  # the Trainer's engine and the training model's shards,
    return_freed_cpu_memory()  # given back rather than kept in the heap beside the model loaded next
    use_cuda = torch.cuda.is_available() and not args.use_cpu
    owns_group = not dist.is_initialized()  # (the engine left the group it joined; one given to us stays)
    init_distributed(backend=None if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    # model_s: an adapter's base model gets the classifier's labels, which its folder does not hold
    with deferred_loading():
        model = from_pretrained_with_adapter(auto, source, **model_s).eval()
    layout = generation_layout(model.config, world)
    if layout is not None and layout.pp > 1 and is_peft_model(model):  # stages replace the model's forward, not peft's
        layout = None
    samples: list[Any] = []
    if layout is None:
        logger.warning("no layout shards %s over %d ranks for generation; rank 0 generates the samples alone",
                       type(model).__name__, world)
        if rank == 0:
            samples = run_pipeline(task, materialize(model, device), tokenizer, gen_s, args.output_dir, args.seed, run_mode)
    else:
        if rank == 0:
            logger.info("samples: generating with %s over %d ranks (each holds its shards)", layout.describe(), world)
        shard_for_inference(adapted_model(model), layout, build_mesh(layout, device_type=device.type))
        materialize(model, device).to(device)
        samples = run_pipeline(task, model, tokenizer, gen_s, args.output_dir, args.seed, run_mode, report=rank == 0)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    return samples


def _load_processing_class(task: TaskSpec, tok_s: TokenizerSection, data_s: DataSection, name_or_path: str, config):
    """The task's processing class: the tokenizer (:func:`_load_tokenizer`), or the image processor saved with the
    checkpoint, else one made for the model's image size and channels."""
    if task.processor == "tokenizer":
        return _load_tokenizer(tok_s, data_s, name_or_path)
    from transformers import AutoImageProcessor

    from ..data.images import default_image_processor

    if Path(name_or_path, "preprocessor_config.json").is_file():
        with loading_from(name_or_path, "image processor"):
            return AutoImageProcessor.from_pretrained(name_or_path)
    return default_image_processor(config)


def _load_tokenizer(tok_s: TokenizerSection, data_s: DataSection, name_or_path: str):
    """The recipe's tokenizer, the checkpoint's own, or a byte-level BPE trained on the recipe's training text."""
    from transformers import AutoTokenizer

    from ..data import default_tokenizer, load_text_files, train_bpe_tokenizer
    from ..data.tokenizers.t5 import default_t5_tokenizer, train_t5_tokenizer
    from ..data.tokenizers.bpe_wordpiece import default_wordpiece_tokenizer, train_wordpiece_tokenizer

    if tok_s.name_or_path:
        folder = str(resolve_source(tok_s.name_or_path, files=TOKENIZER_FILES))
        with loading_from(folder, "tokenizer"):
            return AutoTokenizer.from_pretrained(folder)
    if Path(name_or_path, "tokenizer_config.json").is_file():
        with loading_from(name_or_path, "tokenizer"):
            return AutoTokenizer.from_pretrained(name_or_path)
    cached, trained = {"bpe": (default_tokenizer, train_bpe_tokenizer),
                       "wordpiece": (default_wordpiece_tokenizer, train_wordpiece_tokenizer),
                       "t5": (default_t5_tokenizer, train_t5_tokenizer)}[tok_s.type]
    extra = {"extra_ids": tok_s.extra_ids} if tok_s.type == "t5" else {}
    if data_s.source == "stdlib":  # trained once per (vocab, file list), then cached
        return cached(vocab_size=tok_s.vocab_size, max_files=data_s.max_files, **extra)
    if data_s.source != "files":
        raise ConfigError(f"tokenizer.name_or_path is required with data.source={data_s.source!r} (or a model folder "
                          "that holds a tokenizer)")
    texts = load_text_files(data_s.train_files, format=data_s.format)[data_s.text_column]
    return trained(texts, tok_s.vocab_size, **extra)


def _train_or_eval(run_mode, recipe, args, model, tokenizer, datasets, task: TaskSpec,
                   peft_config: Any = None) -> dict[str, Any]:
    from ..metrics import AVAILABLE, classification_metrics, score_texts, text_generation_metrics
    from ..trainer import Seq2SeqTrainer, Trainer

    train, val = datasets.train, datasets.validation
    # The task's default metrics, for tasks scored by comparing each prediction's argmax with its label; generated
    # texts (seq2seq with predict_with_generate) by ROUGE / BLEU.
    metrics = [m for m in task.metrics if m in AVAILABLE] if task.items in ("sequences", "images") else []
    compute = classification_metrics(metrics) if metrics else None
    generating = getattr(args, "predict_with_generate", False)
    if generating:
        compute = text_generation_metrics(tokenizer, [m for m in task.metrics if m in AVAILABLE])
    trainer_class = Seq2SeqTrainer if task.name == "seq2seq_lm" else Trainer
    trainer = trainer_class(model=model, args=args, train_dataset=train if run_mode != "eval" else None, eval_dataset=val,
                            processing_class=tokenizer, compute_metrics=compute, data_collator=datasets.collator,
                            peft_config=peft_config if run_mode in ("train", "finetune") else None)
    if args.process_index == 0:  # the resolved recipe, once every check of the run has passed
        if run_mode in ("train", "finetune"):
            trainer.add_callback(_recipe_recorder(recipe))
        else:
            _record_recipe(recipe, args.output_dir)
    results: dict[str, Any] = {}
    if generating and val is not None:
        # The data's own baselines the trained model is measured against (seq2seq: the function's name as its
        # summary); the model before this run is one with training.eval_on_start.
        names = [m for m in task.metrics if m in AVAILABLE]
        for name, predictions in datasets.baselines.items():
            scores = score_texts(predictions, datasets.references, names)
            logged = {f"baseline_{name}_{k}": v for k, v in scores.items()}
            results.update(logged)
            trainer.log(logged)  # printed, and kept in log.jsonl beside the model's scores
    return {**results, **_train_and_evaluate(run_mode, trainer, args, val)}


def _train_and_evaluate(run_mode, trainer, args, val) -> dict[str, Any]:
    from ..trainer.callbacks import SaveBeforeFinalEvaluationCallback

    saver = SaveBeforeFinalEvaluationCallback(trainer)
    trainer.add_callback(saver)
    if run_mode == "train":
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    elif run_mode == "finetune":  # the model was loaded from name_or_path already
        trainer.finetune(resume_from_checkpoint=args.resume_from_checkpoint)
    if run_mode in ("train", "finetune") and not saver.saved:
        trainer.save_model()
    if val is None:
        return {}
    # Reuse the evaluation the training loop ran at its last step rather than evaluating twice.
    last = [h for h in trainer.state.log_history if "eval_loss" in h]
    if run_mode != "eval" and last and last[-1].get("step") == trainer.state.global_step:
        return {k: v for k, v in last[-1].items() if k.startswith("eval_")}
    return trainer.evaluate()


def _predict_in_pool(task: TaskSpec, name_or_path: str, model_s: dict[str, Any], tokenizer, gen_s: GenerateSection,
                     output_dir: str, parallel: ParallelConfig, seed: int) -> dict[str, Any]:
    """``run_mode: predict`` with a layout: the pipeline's workers load the checkpoint (a saved adapter: its base
    model, then the adapter) and shard it (the model is loaded here first only when the recipe overrides its
    config)."""
    if under_torchrun():
        raise ConfigError("run_mode='predict' with a parallel layout starts its own worker processes; run it without "
                          "torchrun (mindformers-py run ... --run_mode predict)")
    if not gen_s.prompts:
        raise ConfigError("run_mode='predict' needs generate.prompts (texts to complete)")
    model: Any = name_or_path
    if model_s:
        from ..adapters.apply import from_pretrained_with_adapter
        from ..auto import auto_class_for

        model = from_pretrained_with_adapter(auto_class_for(task.name), name_or_path, **model_s)
    return {"samples": run_pipeline(task, model, tokenizer, gen_s, output_dir, seed, "predict", parallel_config=parallel)}


def run_pipeline(task: TaskSpec, model, tokenizer, gen_s: GenerateSection, output_dir: str, seed: int = 42,
                 run_mode: str = "train", parallel_config: ParallelConfig | None = None, report: bool = True) -> list[Any]:
    """Run the task's pipeline on each of ``gen_s.prompts`` (texts, or image files for image tasks; generation
    settings apply to text generation) with the task's processing class ``tokenizer``; print the results and save
    them in ``output_dir``: ``samples.txt`` after training, ``predictions.txt`` for ``run_mode="predict"`` (beside,
    not over, the samples of the run that trained the model). Sampling starts from ``seed``, so the same model and
    recipe give the same samples whichever run mode generates them. ``model`` may be a checkpoint folder; with
    ``parallel_config`` the pipeline generates in a pool of worker processes, closed at the end. ``report=False``
    generates without printing or writing (the ranks beside rank 0 of a sharded model)."""
    from transformers import set_seed

    from ..pipelines import pipeline

    extra = {"parallel_config": parallel_config} if parallel_config is not None else {}
    pipe = pipeline(gen_s.pipeline or task.pipeline, model=model, **{task.processor: tokenizer}, **extra)
    kwargs: dict[str, Any] = {}
    if task.name in ("causal_lm", "seq2seq_lm"):
        kwargs = dict(max_new_tokens=gen_s.max_new_tokens, do_sample=gen_s.do_sample,
                      repetition_penalty=gen_s.repetition_penalty)
        if gen_s.do_sample:
            kwargs.update(temperature=gen_s.temperature, top_k=gen_s.top_k, top_p=gen_s.top_p)
        if task.name == "seq2seq_lm":
            kwargs["num_beams"] = gen_s.num_beams
    pipe.model.eval()  # as loaded by from_pretrained: a model fresh from training generates without dropout too
    set_seed(seed)  # what training drew from the random streams does not change the samples
    try:
        outputs = [pipe(p, **kwargs) for p in gen_s.prompts]
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


def _relaunch(recipe: dict[str, Any], output_dir: str, world: int, max_restarts: int = 0,
              layout: Layout | None = None) -> dict[str, Any]:
    """Start ``world`` local ranks running this recipe (torchrun's machinery) and wait for them; after a failure the
    ranks are restarted up to ``max_restarts`` times (each resumes from the latest checkpoint in ``output_dir``).
    ``layout``, resolved here, is sent to them (:func:`sending_layout`): they run it without checking it again."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ..data.progress import progress_shown_to_workers
    from ..launcher.launch import LaunchError, launch, quiet_agent

    # The workers run the resolved recipe, overrides included, from a file of their own: the output folder is
    # written by the run itself, once its checks have passed on every rank (its rank 0 records the recipe there).
    with tempfile.TemporaryDirectory(prefix="mindformers_py-recipe-") as folder:
        resolved = Path(folder) / RESOLVED_NAME
        dump_recipe(recipe, resolved)
        try:
            # this process showed the data's progress: the ranks prepare it quietly; the agent's own log lines (a
            # signal received, each rank it stops) give way to the one line the CLI prints
            with progress_shown_to_workers(), quiet_agent(), sending_layout(layout):
                launch(["-m", "mindformers_py", "run", str(resolved)], world, max_restarts=max_restarts)
        except SignalException as err:  # the agent stopped every rank; one line says so (the CLI's)
            if err.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise LaunchError(f"the run was stopped by {err.sigval.name}; every rank was stopped") from None
    return {}


def _check_output_dir(args: Any, run_mode: str) -> None:
    """Refuse, before anything is prepared or written (in the launching process and in every rank alike), a
    training run into a folder that holds another run, unless the recipe resumes it, overwrites it, or the
    launcher restarted this run (it then resumes from its own checkpoints)."""
    from ..launcher.restarts import restart_info
    from ..trainer.checkpoint import check_output_dir

    if run_mode in ("train", "finetune") and not args.resume_from_checkpoint and restart_info() is None:
        check_output_dir(args.output_dir, args.overwrite_output_dir)


def _record_recipe(recipe: dict[str, Any], output_dir: str) -> None:
    """Write the resolved recipe (``run_config.yaml``) into the run's folder, so the run can be repeated as is."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, Path(output_dir) / RESOLVED_NAME)


def _recipe_recorder(recipe: dict[str, Any]) -> Any:
    """A Trainer callback writing the resolved recipe when training begins: after every check of ``train()`` has
    passed, so a refused run leaves the recipe of the run that made the folder's model in place."""
    from transformers import TrainerCallback

    class RecordRecipe(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _record_recipe(recipe, args.output_dir)

    return RecordRecipe()
