"""Running a task recipe: resolve it into a :class:`~.run_spec.RunSpec` (every check, nothing slow:
:func:`~.run_spec.resolve_recipe`), then build the tokenizer, data and model from it and train / finetune /
evaluate / predict. The same recipe runs on one process or many: only ``parallel`` changes, and when it needs more
processes than this one the run re-launches itself under torchrun's machinery.

The recipe's ``task`` (a task registry name or alias; ``causal_lm`` by default) decides which Auto class loads the
model, how the data is prepared (:mod:`mindformers_py.data.recipe_data`), the collator, the evaluation metrics
and which pipeline runs on ``generate.prompts`` after training (:mod:`mindformers_py.pipelines.samples`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..launcher.launch import launched_by_torchrun as under_torchrun
from ..models.hub import TOKENIZER_FILES, resolve_source
from ..parallel.layout import Layout
from ..parallel.layout_checks import check_run
from ..task_registry import TaskSpec
from ..utils.damaged_files import loading_from
from .layout_handover import sending_layout
from .loader import dump_recipe
from .run_spec import RunSpec, recipe_task, resolve_recipe
from .sections import DataSection, TokenizerSection

logger = logging.getLogger(__name__)

RESOLVED_NAME = "run_config.yaml"
__all__ = ["RESOLVED_NAME", "RunSpec", "recipe_task", "resolve_recipe", "run", "run_recipe"]


def run_recipe(recipe: dict[str, Any], overrides: list[str] | None = None) -> dict[str, Any]:
    """Run a recipe dict (with CLI-style ``overrides``); returns the final metrics (and the pipeline's outputs on
    ``generate.prompts``). A recipe that fails a check is refused before anything slow starts
    (:func:`~.run_spec.resolve_recipe`)."""
    return run(resolve_recipe(recipe, overrides))


def run(spec: RunSpec) -> dict[str, Any]:
    """Run a resolved recipe: the task's processing class and data (prepared here, once, before any worker starts),
    then the ranks launched (a multi-process run started outside torchrun), or the model built and trained /
    evaluated, then the samples generated."""
    task, run_mode, layout, world = spec.task, spec.run_mode, spec.layout, spec.world
    args, name_or_path, adapter_dir, data_s = spec.args, spec.name_or_path, spec.adapter_dir, spec.data
    recipe, model_s = dict(spec.recipe), dict(spec.model_options)
    if world > 1 and not under_torchrun():  # ranks (or a pool) fork from it: it imports while the data is prepared
        from ..launcher.launch import start_fork_server

        start_fork_server()
    from ..auto import auto_class_for, resolve_config

    tokenizer = _load_processing_class(task, spec.tokenizer, data_s, name_or_path, spec.model_config)
    if task.name == "causal_lm" and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # GPT-2's and Llama's tokenizers have no pad token: pad with eos, as trl's SFTTrainer does (the labels of
        # padding are -100 whatever its id)
        tokenizer.pad_token = tokenizer.eos_token
    if not Path(name_or_path).is_dir() and task.processor == "tokenizer":  # a preset: size the vocabulary and
        # special tokens to the tokenizer
        model_s.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            model_s.setdefault(name, getattr(tokenizer, name))
    if task.processor == "tokenizer":  # the checks that waited for the tokenizer, before the data and the model
        sized, _, _ = resolve_config(name_or_path, **model_s)
        if sized.vocab_size < len(tokenizer):
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but model vocab_size={sized.vocab_size}; set "
                              "model.vocab_size")
        if spec.vocab_from_tokenizer and spec.layout_checked and layout.vocab_parallel:
            check_run(layout, sized, task=task.name, sequence_length=spec.seq_length)
    datasets = None
    if run_mode != "predict":
        from ..data.progress import data_progress
        from ..data.recipe_data import RECIPE_DATA

        if data_s.source == "megatron" and data_s.train_samples is None and args.max_steps > 0:
            # Megatron builds the samples a run reads (--train-iters x the global batch), epochs reshuffled
            data_s.train_samples = (args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
                                    * layout.dp)
        with data_progress():  # datasets' bars from one process: this one, or rank 0 of a job started elsewhere
            datasets = RECIPE_DATA[task.recipe_data](data_s, tokenizer, spec.model_config)
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
    if run_mode == "predict" and world > 1:  # generation in a pool of workers holding the sharded model
        from ..pipelines.samples import predict_in_pool

        return {"samples": predict_in_pool(task, adapter_dir or name_or_path, model_s, tokenizer, spec.generate,
                                           args.output_dir, spec.parallel, args.seed)}
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

    results: dict[str, Any] = {}
    if run_mode != "predict":
        results.update(_train_or_eval(run_mode, recipe, args, model, tokenizer, datasets, task, spec.peft_config))
    gen_s = spec.generate
    if not gen_s.prompts:
        return results
    from ..pipelines.samples import run_samples, samples_on_every_rank  # transformers' pipelines: a run that generates

    if world == 1:
        results["samples"] = run_samples(task, model, tokenizer, gen_s, args.output_dir, args.seed, run_mode)
    elif under_torchrun() and run_mode != "predict":
        del model  # the training shards go before the saved model is loaded again, sharded for generation
        _return_freed_memory()
        # what was trained was saved in output_dir; an evaluated model is where it came from
        source = args.output_dir if run_mode != "eval" else (adapter_dir or name_or_path)
        results["samples"] = samples_on_every_rank(task, source, model_s, tokenizer, gen_s, args.output_dir, args.seed,
                                                   run_mode, world, use_cpu=args.use_cpu)
    return results


def _return_freed_memory() -> None:
    """Give the Trainer's engine and the training model's shards back to the OS rather than keep them in the heap
    beside the model loaded next for generation."""
    import gc

    from ..engine.cpu_memory import return_freed_cpu_memory

    gc.collect()
    return_freed_cpu_memory()


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
    if run_mode == "eval":
        # Nothing is trained, so the model is frozen for good (the Trainer, given no train_dataset, freezes it only
        # while the layout wraps it: wrapped trainable under ep2, a Qwen3-MoE slice's evaluation held 10.5 GiB a rank).
        model.requires_grad_(False)
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


def _relaunch(recipe: dict[str, Any], output_dir: str, world: int, max_restarts: int = 0,
              layout: Layout | None = None) -> dict[str, Any]:
    """Start ``world`` local ranks running this recipe (torchrun's machinery) and wait for them; after a failure the
    ranks are restarted up to ``max_restarts`` times (each resumes from the latest checkpoint in ``output_dir``).
    ``layout``, resolved here, is sent to them (:func:`sending_layout`): they run it without checking it again.
    The ranks fork from multiprocessing's fork server (:func:`_rank`), which imports the package once for all of
    them: a 2-rank run of a tiny recipe started in 14 s instead of 42 s on the loaded 2-core machine (29 s when the
    server starts with it)."""
    import os
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ..data.progress import progress_shown_to_workers
    from ..launcher.launch import LaunchError, launch, main_module_not_rerun, prepare_fork_server, quiet_agent
    from ..launcher.restarts import RESTART_LOG_ENV

    # The workers run the resolved recipe, overrides included, from a file of their own: the output folder is
    # written by the run itself, once its checks have passed on every rank (its rank 0 records the recipe there).
    with tempfile.TemporaryDirectory(prefix="mindformers_py-recipe-") as folder:
        resolved = Path(folder) / RESOLVED_NAME
        dump_recipe(recipe, resolved)
        prepare_fork_server()
        try:
            # this process showed the data's progress: the ranks prepare it quietly; the agent's own log lines (a
            # signal received, each rank it stops) give way to the one line the CLI prints
            with progress_shown_to_workers(), quiet_agent(), sending_layout(layout), main_module_not_rerun():
                # one OpenMP thread per rank unless the user chose (torchrun's rule, as launch() applies it)
                environ = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                environ.pop(RESTART_LOG_ENV, None)  # launch() hands the ranks this launch's own
                launch(_rank, world, str(resolved), environ, os.getcwd(), _ParentStdio(), max_restarts=max_restarts,
                       start_method="forkserver")
        except SignalException as err:  # the agent stopped every rank; one line says so (the CLI's)
            if err.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise LaunchError(f"the run was stopped by {err.sigval.name}; every rank was stopped") from None
    return {}


class _ParentStdio:
    """The launching process's stdout and stderr as they are at the launch, for a rank forked from the fork server
    (which holds those of the moment it started: in a program that runs several launches, possibly others). Pickled
    into the rank as duplicates of the two descriptors (multiprocessing passes them to the forked process)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        return _attach_stdio, (DupFd(1), DupFd(2))


def _attach_stdio(stdout: Any, stderr: Any) -> None:
    """In a rank: make the launcher's stdout and stderr (``DupFd`` handles, see :class:`_ParentStdio`) this
    process's descriptors 1 and 2."""
    import os

    for handle, fd in ((stdout, 1), (stderr, 2)):
        os.dup2(handle.detach(), fd)


def _rank(resolved: str, environ: dict[str, str], cwd: str, _stdio: None) -> None:
    """One rank of a relaunched run: what ``python -u -m mindformers_py run <resolved>`` runs, in a process forked
    from the fork server, which imported torch, transformers and the Trainer once for every rank (each rank started
    as a new interpreter used to import them itself: some 10 s of a core per rank). The launching process's
    environment and working folder as they are now (the server holds those of the moment it started: relative
    paths in the recipe are the launcher's), its stdout and stderr (attached when ``_stdio`` was unpickled), and
    unbuffered lines as ``-u`` gave them."""
    import os
    import runpy
    import sys

    import torch

    from ..launcher.launch import adopt_environment

    adopt_environment(environ)
    os.chdir(cwd)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    sys.argv = ["mindformers_py", "run", resolved]
    runpy.run_module("mindformers_py", run_name="__main__", alter_sys=True)  # exits with the CLI's status


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
