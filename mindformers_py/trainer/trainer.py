"""``Trainer``: HF's Trainer API (train / evaluate / predict / save_model, callbacks, TrainerState) on a lean loop.

The loop waits for the device only at logging, evaluation and saving: losses, gradient norms and the non-finite
check stay on the device in between. Everything that depends on the parallel layout goes through the engine
(:mod:`mindformers_py.engine`), so distributed layouts plug in without changing this file.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import EvalPrediction, TrainOutput, set_seed, speed_metrics
from transformers.utils.generic import find_labels

from ..adapters.apply import apply_peft, is_peft_model
from ..engine import Engine, TrainingLoss, build_engine
from ..engine.cpu_memory import return_freed_cpu_memory
from ..engine.step_loss import accepts_loss_kwargs, initial_mode
from ..errors import ConfigError, MindFormersError
from ..launcher.restarts import RestartInfo, restart_info
from ..parallel.data import held_frozen
from ..task_registry import TaskSpec, get_task, task_of_model
from .arguments import TrainingArguments
from .batching import drop_unused_columns, forward_columns, is_stream, map_style_length, read_step
from .callbacks import default_callbacks
from .checkpoint import ARGS_NAME, DATA_STATE_NAME, TRAINER_STATE_NAME, DataPosition, check_checkpoint, \
    check_output_dir, prepare_output_dir, pretrained_state, read_trainer_state, remove_partial_checkpoints, resolve_resume, \
    rotate_checkpoints, save_trainer_state
from .evaluation import EvaluationMixin
from .fused_loss import FusedCausalLMLoss
from .loss_mixin import TrainingLossMixin
from .local_workers import LocalWorkers
from .run_description import compile_line, layout_line, precision_line, weights_dtype
from .scheduler import create_scheduler, steps_on_metric
from .training_data import default_collator, first_input_length, resumed_position, training_source

logger = logging.getLogger(__name__)


class Trainer(TrainingLossMixin, EvaluationMixin):
    """Train, evaluate and predict with a HuggingFace-style model (``model(**batch)`` returns ``.loss`` /
    ``.logits``), with transformers' callbacks, ``TrainerState`` and checkpoint layout.

    Args:
        model: the model to train (a ``PreTrainedModel`` or any module following its call convention).
        args: the :class:`TrainingArguments` (default: all defaults, ``output_dir="trainer_output"``).
        data_collator: turns a list of examples into a batch; default: the task's collator (task registry) with
            the tokenizer.
        train_dataset: a map-style dataset of dicts (lists or tensors), a ``datasets.Dataset``, or a stream (an
            ``IterableDataset``, with ``max_steps``).
        eval_dataset: as ``train_dataset`` (map-style), or a dict of named datasets.
        processing_class: the tokenizer (or processor), saved with the model; ``tokenizer`` is its old name.
        compute_metrics: ``EvalPrediction -> dict`` called by ``evaluate``/``predict``.
        callbacks: ``TrainerCallback`` instances or classes added after the defaults.
        optimizers: ``(optimizer, lr_scheduler)`` to use instead of AdamW and ``lr_scheduler_type``.
        preprocess_logits_for_metrics: ``(logits, labels) -> tensor`` applied to each batch's logits before they
            are gathered for ``compute_metrics`` (e.g. argmax, to avoid keeping whole vocabularies).
        task: overrides ``args.task`` (a task registry name or alias); None infers it from the model's class.
        peft_config: train a peft adapter instead of the whole model, as trl's ``SFTTrainer(peft_config=...)``: a
            peft config (``peft.LoraConfig(r=8)``, ...) or a recipe's ``peft:`` mapping (``{"type": "lora", "r": 8}``);
            peft wraps ``model`` (its ``task_type`` defaults to the task's), only the adapter is optimized, saved
            (peft's ``adapter_config.json`` + ``adapter_model.safetensors``) and checkpointed, under any layout. A
            model already wrapped by peft trains the same way without it.
        compute_loss_func: ``(outputs, labels, num_items_in_batch) -> loss``, the loss of a batch with ``labels``
            computed from the model's outputs (transformers' Trainer's argument, same meaning): it divides its
            item-summed loss by ``num_items_in_batch``. Under every layout it gives the gradients it gives
            stand-alone (under pipeline parallelism it runs on the last stage).

    The training loss is :meth:`compute_loss` (override it to change the objective, as in transformers); the engine
    normalises it over the step's items, micro-batches and data-parallel ranks in one place
    (:mod:`mindformers_py.engine.step_loss`). Set ``loss_is_scaled_for_ga`` (transformers' class attribute) on a
    subclass whose ``compute_loss`` divides by ``num_items_in_batch`` (True) or averages over its batch (False).

    Processes: under torchrun each process is one rank of the layout. In a program or notebook without torchrun, a
    layout needing more processes (``data_parallel=2``, ...) makes ``train``/``evaluate``/``predict`` start them
    on this machine and bring the results back (the state, metrics, and the trained weights into ``model``); see
    :mod:`mindformers_py.trainer.local_workers` for how the objects given here reach them and what cannot.
    """

    loss_is_scaled_for_ga: bool | None = None
    """Whether an overridden :meth:`compute_loss` already divides by ``num_items_in_batch`` (True) or returns a
    per-batch mean that the step then averages (False); None: transformers' rule (when the model accepts
    ``num_items_in_batch``, or with a ``compute_loss_func``)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        tokenizer: Any = None,
        compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
        callbacks: Iterable[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        task: str | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        peft_config: Any = None,
    ) -> None:
        if model is None:
            raise MindFormersError("Trainer needs a model")
        if peft_config is not None:
            named = task or (args.task if args is not None else None)
            spec = get_task(named) if named else task_of_model(model)
            model = apply_peft(model, peft_config, task=spec.name if spec else None, name="peft_config")
        if tokenizer is not None and processing_class is not None and tokenizer is not processing_class:
            raise MindFormersError("Trainer got both processing_class and tokenizer and they differ; pass one of them")
        self.args = args if args is not None else TrainingArguments()
        if self.args.eval_strategy != "no" and eval_dataset is None:  # transformers refuses it here too
            raise ConfigError(f"eval_strategy={self.args.eval_strategy!r} evaluates during training, but the Trainer "
                              "got no eval_dataset; pass an eval_dataset or set eval_strategy='no'")
        self.processing_class = processing_class if processing_class is not None else tokenizer
        name = task or self.args.task
        self.task_spec: TaskSpec | None = get_task(name) if name else task_of_model(model)
        self.task = self.task_spec.name if self.task_spec is not None else None
        self.label_names = list(self.args.label_names or find_labels(type(model))
                                or (self.task_spec.label_names if self.task_spec else ["labels"]))
        self.model = model
        self.train_dataset = train_dataset  # (read by _setup_engine: without one, the model is prepared for evaluation)
        self._evaluation_only = False  # (set by _setup_engine; the parent of local workers prepares no model)
        # A layout needing more processes than this program has: train/evaluate/predict start them (local_workers),
        # and this process builds no engine and joins no process group.
        seq_length = first_input_length(train_dataset, model)
        # HF's estimate of training FLOPs: 6 x non-embedding parameters per input token, of the whole model (before
        # a pipeline layout cuts it to this rank's stages).
        self._flops_per_token = 6 * model.num_parameters(exclude_embeddings=True) \
            if hasattr(model, "num_parameters") else 0
        self._workers = LocalWorkers.plan(self.args, model, seq_length, self.task)
        if self._workers is None:
            self._setup_engine(seq_length)
        else:
            self.engine: Engine = self._workers.host_engine(self.args)
            set_seed(self.args.seed)
            self.model_wrapped = model
        ignored = self.args.parallel_config.ignored_sizes_warning(
            self._workers.layout if self._workers is not None else self.engine.layout)
        if ignored and self.engine.is_main_process:
            logger.warning("%s", ignored)
        self.data_collator = data_collator or default_collator(self.task_spec, self.processing_class)
        self.eval_dataset = eval_dataset
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self._created_lr_scheduler = False  # a schedule train() made is made again by the next train() (transformers)
        self.compute_loss_func = compute_loss_func
        self.model_accepts_loss_kwargs = accepts_loss_kwargs(model)
        self._loss_mode = initial_mode(model)  # how the model's loss relates to num_items_in_batch (engine.loss)
        self._fused_loss: FusedCausalLMLoss | None = None
        self._fused_probed = False
        self._loss_mode_measured = False
        # What the engine's one loss path normalises: this Trainer's compute_loss and the task's item count.
        self.training_loss = TrainingLoss(self._compute_training_loss, self._count_items, self._share_mode,
                                          self._loss_override())
        self.engine.check_loss(self.training_loss)
        self.state = TrainerState(is_local_process_zero=self.engine.is_local_main_process,
                                  is_world_process_zero=self.engine.is_main_process)
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler(
            default_callbacks(self.args) + list(callbacks or []), self.model, self.processing_class,
            self.optimizer, self.lr_scheduler,
        )
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _setup_engine(self, seq_length: int | None = None) -> None:
        """Build the layout's engine (joining the process group of a distributed layout) and prepare the model on
        it; in this process, or in each worker the Trainer started (:mod:`.local_workers`). The layout is resolved
        here, once, against the model, the batch and the task, unless the process that started this one resolved it
        already and sent it with the arguments (:meth:`TrainingArguments.with_resolved_layout`)."""
        self.engine = build_engine(self.args.resolved_layout or self.args.parallel_config, self.args,
                                   model_config=getattr(self.model, "config", None), seq_length=seq_length,
                                   task=self.task)
        self.engine.setup()
        set_seed(self.args.seed)
        # Without a train_dataset nothing trains: as transformers wraps a model for training only, its weights stay
        # out of data parallelism's replicated copies (a Qwen3-MoE slice's evaluation under ep2 held 10.5 GiB a rank
        # with them, 3.5 without); train() refuses this Trainer afterwards
        self._evaluation_only = self.train_dataset is None and self.engine.world_size > 1
        with held_frozen(self.model) if self._evaluation_only else contextlib.nullcontext():
            self.model_wrapped = self.engine.prepare_model(self.model, task=self.task_spec)
        if self.engine.device.type == "cpu":
            # Loading and placing the weights freed temporaries (per-expert tensors stacked, shards sliced) that
            # training never allocates again in those sizes; kept in the heap (cpu_keep_freed_memory) they would
            # stay resident all run (about half again the weights of an expert-parallel rank).
            return_freed_cpu_memory()

    # -- callbacks (HF's API) ------------------------------------------------------------------------------------

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Add a callback (instance or class) after the current ones."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove a callback (instance or first of a class) and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Remove a callback (instance or first of a class)."""
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the run."""
        return self.engine.is_main_process

    # -- training -------------------------------------------------------------------------------------------------

    def finetune(self, finetune_checkpoint: str | Path | None = None,
                 resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train starting from pretrained weights (MindFormers' name): load ``finetune_checkpoint`` (a folder
        written by ``save_pretrained``; for our model families an HF checkpoint is converted) into the model,
        then :meth:`train` with a fresh optimizer. None trains the model as given. A resumed run takes its
        weights from the resumed checkpoint instead."""
        if finetune_checkpoint is not None:
            # A peft model loads an adapter (its base weights were loaded before peft wrapped it).
            state = None if is_peft_model(self.model) else pretrained_state(self.model, finetune_checkpoint)
            self.engine.load_weights(self.model, finetune_checkpoint, state)
        return self.train(resume_from_checkpoint=resume_from_checkpoint)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run the training loop; returns ``TrainOutput(global_step, training_loss, metrics)``.

        ``resume_from_checkpoint`` (default ``args.resume_from_checkpoint``) is a ``checkpoint-<step>`` folder
        or True for the latest in ``output_dir`` that passes its manifest check: weights, optimizer, scheduler, RNG
        and data position are restored, so the run continues exactly as if it had not stopped. A run the launcher
        restarted (``max_restarts``) resumes from the latest complete checkpoint in ``output_dir`` by itself and
        logs the restart and its cause.
        """
        if self.train_dataset is None:
            raise MindFormersError("Trainer.train needs a train_dataset")
        if self._evaluation_only:
            raise MindFormersError(
                f"this Trainer was made without a train_dataset, so its model was prepared under the layout's "
                f"{self.engine.world_size} processes for evaluation only (its gradients would not be reduced over "
                "the data-parallel ranks); make a Trainer with train_dataset= to train")
        args = self.args
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        restart = restart_info()
        if not resume and restart is None:  # refused here, before a worker starts or a file is touched
            check_output_dir(args.output_dir, args.overwrite_output_dir)
        if self._workers is not None:
            return self._workers.run(self, Trainer.train, resume_from_checkpoint=resume_from_checkpoint)
        engine = self.engine
        dataset, collate = self._prepared(self.train_dataset, "train")
        global_batch = args.per_device_train_batch_size * engine.dp_size
        num_samples = 0  # a stream's is unknown
        if not is_stream(dataset):  # checked before the folder is prepared: overwriting it deletes another run
            num_samples = map_style_length(dataset, "train_dataset")
            if num_samples < global_batch:
                raise MindFormersError(
                    f"train_dataset has {num_samples} samples, fewer than one batch of {global_batch} "
                    f"(per_device_train_batch_size={args.per_device_train_batch_size} x {engine.dp_size} data-parallel "
                    "ranks); use more data or a smaller per_device_train_batch_size"
                )
        elif args.max_steps <= 0:
            raise MindFormersError("an iterable train_dataset has no length, so the run needs max_steps > 0 "
                                   "(num_train_epochs cannot be turned into steps), as in transformers")
        engine.wait_for_checkpoint()
        if engine.is_main_process:
            remove_partial_checkpoints(args.output_dir)  # left by a run killed while it saved
        checkpoint, skipped = resolve_resume(resume, args.output_dir, engine.checkpoint_problem,
                                             restarted=restart is not None)
        for problem in skipped if engine.is_main_process else ():
            logger.warning("%s; resuming from an earlier checkpoint (the damaged one is left in place)", problem)
        if checkpoint is None:
            if engine.is_main_process:
                default_tb = None if args.logging_dir else args.tensorboard_dir
                # A restarted run with nothing to resume starts again: the failed attempt's logs go.
                prepare_output_dir(args.output_dir, True if restart else args.overwrite_output_dir, default_tb)
            engine.barrier()
            set_seed(args.seed)
        else:
            check_checkpoint(checkpoint, engine.checkpoint_files())

        data_seed = args.data_seed if args.data_seed is not None else args.seed
        source, max_steps, num_epochs = training_source(dataset, collate, args, engine, global_batch, num_samples,
                                                        data_seed)
        if self.optimizer is None:
            self.optimizer = engine.build_optimizer(self.model)
        if self._created_lr_scheduler:  # the last run's schedule has ended: this run gets its own (transformers)
            self.lr_scheduler = None
        if self.lr_scheduler is None:
            self.lr_scheduler = create_scheduler(self.optimizer, args, max_steps)
            self._created_lr_scheduler = True
        self.state = TrainerState(is_local_process_zero=engine.is_local_main_process,
                                  is_world_process_zero=engine.is_main_process)
        position = DataPosition(num_samples=num_samples, global_batch_size=global_batch, data_seed=data_seed)
        if checkpoint is not None:
            engine.load_checkpoint(checkpoint, self.model, self.optimizer, self.lr_scheduler)
            saved = read_trainer_state(checkpoint)
            self.state = dataclasses.replace(saved, is_local_process_zero=engine.is_local_main_process,
                                             is_world_process_zero=engine.is_main_process)
            position = resumed_position(DataPosition.read(checkpoint), num_samples, global_batch, data_seed)
        self.state.max_steps = max_steps
        self.state.num_train_epochs = num_epochs if num_epochs != math.inf else max_steps
        self.state.train_batch_size = args.per_device_train_batch_size
        self.state.compute_steps(args, max_steps)
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        self.callback_handler.train_dataloader = getattr(source, "loader", source)

        self.model_wrapped.train()
        # printed once (before the bar), kept in log.jsonl and trainer_state
        self.log({"layout": layout_line(engine),
                  "precision": precision_line(args, engine.device, weights_dtype(self.model)),
                  "compile": compile_line(args)})
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.eval_dataset is not None:
            self.evaluate()
        if checkpoint is not None:
            engine.load_rng_state(checkpoint)  # last, so nothing above shifts the random streams
        if restart is not None:
            self._log_restart(restart, checkpoint, skipped)
        with engine.watch_progress():
            return self._train_loop(source, position, num_epochs)

    def _log_restart(self, restart: RestartInfo, checkpoint: Path | None, skipped: list[str]) -> None:
        """Record a restart by the launcher (its count and cause, where training resumed, the seconds from the
        failure to resuming) in the logs and ``trainer_state.json``'s history."""
        entry: dict[str, Any] = {"restart": restart.count, "restart_cause": restart.cause,
                                 "resumed_from": checkpoint.name if checkpoint is not None else None}
        if restart.failed_at is not None:
            entry["restart_seconds"] = round(time.time() - restart.failed_at, 2)
        if skipped:
            entry["damaged_checkpoints"] = skipped
        if self.engine.is_main_process:
            logger.warning("restart %d after %s: resuming from %s", restart.count, restart.cause,
                           checkpoint or "the start (no complete checkpoint)")
        self.log(entry)

    def _train_loop(self, source: Any, position: DataPosition, num_epochs: float) -> TrainOutput:
        args, engine, state = self.args, self.engine, self.state
        accum = args.gradient_accumulation_steps
        self._tr_loss = torch.zeros((), device=engine.device)
        self._first_bad_step = torch.full((), -1, dtype=torch.long, device=engine.device)
        self._logged_step = state.global_step
        self._total_loss = 0.0
        self._grad_norm: torch.Tensor | None = None
        self._learning_rate = self.optimizer.param_groups[0]["lr"]
        self._tokens_since_log = 0  # every rank's, since the last log
        self._unsynced_tokens = 0  # this rank's, not yet summed into the state's counters
        self._tokens_run = 0  # every rank's, in this call
        self._log_clock = time.perf_counter()
        start_time, start_step = time.time(), state.global_step
        first_step_seconds: float | None = None
        self._position = position
        batches_per_epoch = source.batches_per_epoch or math.inf  # a stream's is unknown: read until it ends
        epoch = position.epoch
        skip = position.samples_consumed // position.global_batch_size
        if skip >= batches_per_epoch:
            epoch, skip = epoch + 1, 0

        while epoch < num_epochs and state.global_step < state.max_steps and not self.control.should_training_stop:
            source.set_epoch(epoch, skip)
            self._position = dataclasses.replace(position, epoch=epoch, samples_consumed=skip * source.global_batch_size)
            self.control = self.callback_handler.on_epoch_begin(args, state, self.control)
            batches = iter(source)
            consumed = skip
            while consumed < batches_per_epoch and state.global_step < state.max_steps:
                # Under context parallelism each rank keeps its chunks of every sequence; all counts are of those,
                # and of each batch's real rows (a rank without a share of a last batch reads a padding row).
                step = read_step(batches, accum, engine.shard_batch)
                if step is None:
                    break
                consumed += len(step.micro_batches)
                engine.beat(state.global_step + 1)
                self.control = self.callback_handler.on_step_begin(args, state, self.control)
                tokens = sum(self._count_throughput(b) for b in step.counted)
                self._measure_loss_mode([b for b, rows in zip(step.counted, step.real_rows) if rows])
                loss = engine.forward_backward(self.model_wrapped, step.micro_batches,
                                               engine.count_items(step.counted, self.training_loss),
                                               self.training_loss, **step.padding)
                # transformers' on_substep_end: once per micro-batch but the last (the engine runs a step's
                # micro-batches together, interleaved under pipeline parallelism, so they fire after them)
                for _ in step.micro_batches[1:]:
                    self.control = self.callback_handler.on_substep_end(args, state, self.control)
                if args.max_grad_norm > 0:
                    self._grad_norm = engine.clip_grad_norm(self.model, self.optimizer, args.max_grad_norm)
                self.control = self.callback_handler.on_pre_optimizer_step(args, state, self.control)
                engine.optimizer_step(self.optimizer)
                engine.balance_experts(self.model)  # MoE selection biases, from the step's expert loads
                self.control = self.callback_handler.on_optimizer_step(args, state, self.control)
                self._learning_rate = self.optimizer.param_groups[0]["lr"]
                if not steps_on_metric(self.lr_scheduler):
                    self.lr_scheduler.step()
                engine.zero_grad(self.optimizer)

                state.global_step += 1
                state.epoch = epoch + consumed / batches_per_epoch  # a stream counts whole passes
                self._unsynced_tokens += tokens  # summed over the ranks where the loop syncs anyway (_sync_counts)
                self._tr_loss += loss
                self._note_nonfinite(loss)
                self._position.samples_consumed = consumed * source.global_batch_size
                if first_step_seconds is None:  # includes torch.compile's compilation and the allocator's warm-up
                    first_step_seconds = time.time() - start_time
                engine.raise_checkpoint_error()  # a background save that failed stops the run here
                self.control = self.callback_handler.on_step_end(args, state, self.control)
                engine.beat(state.global_step)
                self._maybe_log_save_evaluate()
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(args, state, self.control)
            self._maybe_log_save_evaluate()
            epoch, skip = epoch + 1, 0

        self._check_finite()
        self._sync_counts()
        engine.wait_for_checkpoint()  # the run ends only once its last checkpoint is written
        if args.load_best_model_at_end and state.best_model_checkpoint and Path(state.best_model_checkpoint).is_dir():
            logger.info("loading the best model (%s=%s) from %s", args.metric_for_best_model, state.best_metric,
                        state.best_model_checkpoint)
            engine.load_weights(self.model, state.best_model_checkpoint)
        if args.save_total_limit == 1 and state.best_model_checkpoint and Path(state.best_model_checkpoint).is_dir() \
                and engine.is_main_process:
            # transformers' end of training: the best checkpoint alone remains (the last was kept for resuming)
            rotate_checkpoints(args.output_dir, 1, keep=[Path(state.best_model_checkpoint)])
        steps_run = state.global_step - start_step
        self._total_loss += self._tr_loss.item()
        train_loss = self._total_loss / max(steps_run, 1)
        # An image task's samples are its throughput items: train_samples_per_second says it, no tokens figure.
        tokens = self._tokens_run if self._throughput_unit() == "tokens" else None
        metrics = speed_metrics("train", start_time,
                                num_samples=steps_run * accum * self._position.global_batch_size,
                                num_steps=steps_run, num_tokens=tokens)
        if first_step_seconds is not None:
            metrics["train_first_step_runtime"] = round(first_step_seconds, 4)
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = train_loss
        self.log(metrics)
        if engine.is_main_process:
            save_trainer_state(state, args.output_dir)
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        engine.barrier()
        return TrainOutput(state.global_step, train_loss, metrics)

    def _count_throughput(self, batch: Mapping[str, Any]) -> int:
        """Tokens (images, for image tasks) of one batch, for throughput."""
        if self.task_spec is not None:
            return self.task_spec.count_throughput(batch)
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            return int(mask.sum())
        ids = batch.get("input_ids")
        return ids.numel() if isinstance(ids, torch.Tensor) else 0

    def _throughput_unit(self) -> str:
        """What throughput counts (:meth:`_count_throughput`): ``"images"`` for image tasks, else ``"tokens"``."""
        return "images" if self.task_spec is not None and self.task_spec.items == "images" else "tokens"

    def _sync_counts(self) -> None:
        """Add every rank's tokens (images) since the last call to ``state.num_input_tokens_seen``, ``total_flos``
        and the figures of the next log: one all-reduce over the ranks holding different data, where the loop
        syncs anyway (logging, saving, the end). Context-parallel ranks each hold their chunks of every sequence,
        so their token counts add up; each counts the whole images of its replica, counted once."""
        engine = self.engine
        total = int(engine.all_reduce_sum(torch.tensor(self._unsynced_tokens, device=engine.device)))
        if self._throughput_unit() != "tokens":
            total //= engine.cp_size
        self._unsynced_tokens = 0
        self.state.num_input_tokens_seen += total
        self.state.total_flos += float(self._flops_per_token * total)
        self._tokens_since_log += total
        self._tokens_run += total

    # -- log / evaluate / save -----------------------------------------------------------------------------------

    def _maybe_log_save_evaluate(self) -> None:
        state, control = self.state, self.control
        if control.should_log and state.global_step > self._logged_step:
            self._check_finite()
            steps = state.global_step - self._logged_step
            loss = self.engine.all_reduce_mean(self._tr_loss).item() / steps
            self._tr_loss.zero_()
            self._total_loss += loss * steps
            now = time.perf_counter()
            self._sync_counts()
            tokens = self._tokens_since_log
            logs: dict[str, float] = {"loss": loss, **self._model_metrics(steps)}
            if self._grad_norm is not None:
                logs["grad_norm"] = float(self._grad_norm)
            logs["learning_rate"] = self._learning_rate
            unit = self._throughput_unit()  # named by the task's item: tokens, or images for image tasks
            logs[f"num_input_{unit}_seen"] = state.num_input_tokens_seen
            logs[f"{unit}_per_second"] = round(tokens / max(now - self._log_clock, 1e-9), 1)
            self._tokens_since_log, self._log_clock, self._logged_step = 0, now, state.global_step
            self.log(logs)
        paused = time.perf_counter()
        if self.control.should_evaluate:
            self._check_finite()
            metrics = self.evaluate()
            self._update_best_metric(metrics)
            if steps_on_metric(self.lr_scheduler):
                self.lr_scheduler.step(metrics.get("eval_loss", next(iter(metrics.values()))))
        if self.control.should_save:
            self._save_checkpoint()
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        self._log_clock += time.perf_counter() - paused  # tokens/s counts training time only

    def _model_metrics(self, steps: int) -> dict[str, float]:
        """What the model counts itself over the training steps since the last log (its ``training_metrics``:
        ``pop(device)`` running sums, totalled over the ranks by the engine, then ``summarize(totals, steps)``; an
        MoE model's router loss and expert loads), logged beside the loss."""
        tracker = getattr(self.model, "training_metrics", None)
        if tracker is None:
            return {}
        return tracker.summarize(self.engine.reduce_metrics(tracker.pop(self.engine.device)), steps)

    def _update_best_metric(self, metrics: dict[str, float]) -> None:
        """Track ``metric_for_best_model`` in ``state.best_metric`` / ``best_global_step`` (HF's rule)."""
        name = self.args.metric_for_best_model
        if name is None:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise MindFormersError(f"metric_for_best_model={name!r} is not among the evaluation metrics; "
                                   f"choose one of: {', '.join(repr(k) for k in metrics)}")
        value, best = metrics[key], self.state.best_metric
        if best is None or (value > best if self.args.greater_is_better else value < best):
            self.state.best_metric = value
            if self.args.save_strategy != "no":
                self.state.best_global_step = self.state.global_step

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` (with ``epoch`` and ``step``) in ``state.log_history`` and send them to ``on_log``."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _save_checkpoint(self) -> Path:
        self._check_finite()
        self._sync_counts()  # the saved state's counters are every rank's
        args, engine = self.args, self.engine
        engine.wait_for_checkpoint()  # the previous (background) save is in place before it is named best or rotated
        folder = Path(args.output_dir) / f"checkpoint-{self.state.global_step}"
        best = Path(args.output_dir) / f"checkpoint-{self.state.best_global_step}" \
            if self.state.best_global_step else None
        if best is not None and (best == folder or best.is_dir()):
            self.state.best_model_checkpoint = str(best)
        files = {
            TRAINER_STATE_NAME: json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
            DATA_STATE_NAME: self._position.to_json(),
            ARGS_NAME: args.to_json_string(),
        }
        keep = [folder] + ([Path(self.state.best_model_checkpoint)] if self.state.best_model_checkpoint else [])
        state = copy.deepcopy(self.state) if args.save_async else self.state  # as of this step, written later

        def on_saved() -> None:  # once the folder is in place: older ones may go
            if engine.is_main_process:
                rotate_checkpoints(args.output_dir, args.save_total_limit, keep=keep)
                save_trainer_state(state, args.output_dir)

        engine.beat(self.state.global_step)
        engine.save_checkpoint(folder, self.model, self.optimizer, self.lr_scheduler, files, self.processing_class,
                               asynchronous=args.save_async, on_saved=on_saved)
        engine.barrier()
        engine.beat(self.state.global_step)
        return folder

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """Save the model (``save_pretrained``: config + safetensors), the tokenizer and ``training_args.json``
        into ``output_dir`` (default ``args.output_dir``)."""
        folder = Path(output_dir or self.args.output_dir)
        self.engine.wait_for_checkpoint()
        self.engine.save_pretrained(self.model, folder, self.processing_class)
        if self.engine.is_main_process:
            (folder / ARGS_NAME).write_text(self.args.to_json_string(), encoding="utf-8")

    # -- data -----------------------------------------------------------------------------------------------------

    def _prepared(self, dataset: Any, description: str) -> tuple[Any, Callable]:
        if not self.args.remove_unused_columns:
            return dataset, self.data_collator
        columns = forward_columns(self.model, self.label_names)
        return drop_unused_columns(dataset, self.data_collator, columns, description)
