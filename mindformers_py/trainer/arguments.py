"""``TrainingArguments``: HF's training fields with HF's names and meanings, plus ``parallel_config`` and ``task``.

Fields keep the meaning a transformers user knows; the few defaults that differ are documented on the field
(``logging_steps=10`` and ``report_to="tensorboard"``, because our runs are small and we always want a curve).
Values may be given as Python values or as strings (YAML / CLI); strings are converted to the field's type at
construction and every field is checked there, so an instance that exists is valid.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..engine.compile_policy import auto_decision
from ..engine.precision import AUTO, resolve_bf16
from ..errors import ConfigError, check_choice
from ..parallel.config import ParallelConfig
from ..parallel.layout import Layout
from ..utils.typed_values import coerce_value



@functools.cache
def schedulers() -> tuple[str, ...]:
    """transformers' ``lr_scheduler_type`` names. Its ``trainer_utils`` imports peft when installed (seconds), so
    it is read when an argument is checked, not when this module is imported."""
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


# Schedulers that step on an evaluation metric instead of every optimizer step.
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
INTERVAL_STRATEGIES = ("no", "steps", "epoch")
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
REPORT_TARGETS = ("tensorboard", "mlflow", "wandb")
"""What ``report_to`` names: TensorBoard (a dependency), and the trackers transformers' integrations drive where their
package is installed (:data:`TRACKER_PACKAGES`)."""
TRACKER_PACKAGES = {"mlflow": "mlflow (or mlflow-skinny)", "wandb": "wandb"}
"""Tracker -> the package it needs (``pip install`` name)."""


def tracker_installed(name: str) -> bool:
    """Whether the package of tracker ``name`` is importable (TensorBoard always is)."""
    import importlib.util

    return name not in TRACKER_PACKAGES or importlib.util.find_spec(name) is not None



@dataclass
class TrainingArguments:
    """Everything that controls a training run, with HuggingFace's field names and meanings.

    ``parallel_config`` adds MindFormers' layout (a :class:`ParallelConfig` or a mapping of its fields; the
    default runs stand-alone) and ``task`` names what is trained (it picks the default collator, how label
    tokens are counted and whether evaluation reports perplexity). Artifacts written to ``output_dir``:
    ``checkpoint-<step>/``, ``trainer_state.json`` (HF's format), ``log.jsonl`` (always), TensorBoard events
    (``report_to``) and ``loss_curve.png``.
    """

    output_dir: str = "trainer_output"
    """Folder for checkpoints, ``trainer_state.json``, logs and the loss curve."""
    overwrite_output_dir: bool | None = None
    """What a fresh run does with an ``output_dir`` that holds another run. None (the default): train over it, as
    transformers 5 does (a re-run notebook cell): checkpoint folders of the same step are replaced, the state, log
    and curve are rewritten. True: remove the other run's checkpoints, state, logs, curve and TensorBoard events
    first. False: refuse (the CLI's default, so a recipe never trains over another run by accident)."""
    task: str | None = None
    """What is trained: a task registry name or alias (``causal_lm``/``text_generation``, ``sequence_classification``/
    ``text_classification``, ...); None infers it from the model's class (``...ForCausalLM`` -> ``causal_lm``)."""

    per_device_train_batch_size: int = 8
    """Training samples per data-parallel rank per micro-batch (HF's meaning)."""
    per_device_eval_batch_size: int = 8
    """Evaluation samples per data-parallel rank per batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step; the loss is normalised by the label tokens of all of
    them together, so batch 4 x 1 and batch 2 x 2 give the same update."""

    learning_rate: float = 5e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; biases and normalisation weights (1-D parameters) never decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (logged as ``grad_norm``); 0 disables clipping."""
    optim: str = "adamw_torch_fused"
    """``"adamw_torch_fused"`` (fused kernel where the device supports it, else foreach) or ``"adamw_torch"``
    (foreach, multi-tensor)."""

    num_train_epochs: float = 3.0
    """Passes over the training data (fractions allowed); ignored when ``max_steps`` > 0."""
    max_steps: int = -1
    """Total optimizer steps; -1 derives it from ``num_train_epochs``."""
    lr_scheduler_type: str = "linear"
    """A schedule of ``transformers.get_scheduler`` (``SchedulerType``): linear, cosine, constant, ..."""
    lr_scheduler_kwargs: dict[str, Any] | None = None
    """Extra arguments of the schedule (e.g. ``{"min_lr_rate": 0.1}`` for ``cosine_with_min_lr``)."""
    warmup_steps: int | float = 0
    """Linear warmup steps; a float in (0, 1) is a fraction of the total steps (HF v5's meaning)."""
    warmup_ratio: float = 0.0
    """Fraction of the total steps used for warmup when ``warmup_steps`` is 0."""

    logging_strategy: str = "steps"
    """When to log: ``"no"``, ``"steps"`` (every ``logging_steps``) or ``"epoch"``."""
    logging_steps: int = 10
    """Log every this many optimizer steps (HF's default is 500; ours suits small runs). Logging is the only
    point where the training loop waits for the device."""
    logging_first_step: bool = True
    """Also log after the first step, so the starting loss shows at once (HF's default is False)."""
    logging_dir: str | None = None
    """TensorBoard folder; None = ``<output_dir>/runs``."""
    report_to: str | list[str] = "tensorboard"
    """Integrations that receive the logs: ``"tensorboard"``, ``"mlflow"`` and ``"wandb"`` (transformers'
    integrations, configured by their own environment variables: ``MLFLOW_TRACKING_URI``, ``WANDB_MODE=offline``,
    ...; their package must be installed), ``"all"`` (every one installed) or ``"none"``. HF v5 defaults to none; we
    default to TensorBoard. ``log.jsonl`` is written whatever this says."""
    run_name: str | None = None
    """A name for the run, shown in TensorBoard's text tab; None = the ``output_dir`` name."""
    disable_tqdm: bool = False
    """Hide the progress bar."""
    plot_loss_curve: bool = True
    """Write ``<output_dir>/loss_curve.png`` (train and eval loss) when training ends."""

    eval_strategy: str = "no"
    """When to evaluate during training: ``"no"``, ``"steps"`` (every ``eval_steps``) or ``"epoch"``."""
    eval_steps: int | None = None
    """Evaluate every this many steps; None = ``logging_steps``."""
    eval_delay: float = 0
    """Steps (or epochs, with ``eval_strategy="epoch"``) to wait before the first evaluation."""
    eval_on_start: bool = False
    """Evaluate once before the first training step (logged at step 0, as in transformers): the untrained model's
    scores, for comparison."""
    prediction_loss_only: bool = False
    """In ``evaluate``/``predict``, compute only the loss (no logits gathered for ``compute_metrics``)."""

    save_strategy: str = "steps"
    """When to write ``checkpoint-<step>``: ``"no"``, ``"steps"`` (every ``save_steps`` and at the end) or
    ``"epoch"``."""
    save_steps: int = 500
    """Checkpoint every this many optimizer steps."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints, deleting the oldest; None keeps all."""
    load_best_model_at_end: bool = False
    """Keep the checkpoint with the best ``metric_for_best_model`` (rotation never deletes it) and load its
    weights when training ends. Needs ``save_strategy`` equal to ``eval_strategy`` (and ``save_steps`` a
    multiple of ``eval_steps``), so every evaluated step has a checkpoint."""
    metric_for_best_model: str | None = None
    """Evaluation metric that ranks checkpoints (``"loss"`` means ``eval_loss``; the default when
    ``load_best_model_at_end``); transformers' ``EarlyStoppingCallback`` reads it too."""
    greater_is_better: bool | None = None
    """Whether a larger ``metric_for_best_model`` is better; None = False for names ending in "loss", else True."""
    resume_from_checkpoint: str | bool | None = None
    """Checkpoint folder to resume from, or True for the latest ``checkpoint-*`` in ``output_dir`` that passes its
    manifest check; used when ``Trainer.train`` is called without one. A run restarted by the launcher
    (``max_restarts``) resumes from the latest complete checkpoint in ``output_dir`` whatever this says."""
    save_async: bool = False
    """Write checkpoints in a background thread: the step waits only while the state is copied to host memory, not
    while it is written (torchtitan's ``async_mode``, Megatron's ``--async-save``). At most one save is in flight (the
    next waits for it); the run waits for it before it ends; the folder appears under its final name only when
    complete, as with a synchronous save."""
    max_restarts: int = 0
    """Times the launcher restarts all processes of a distributed run after one fails (torchrun's
    ``--max-restarts``); each restart resumes from the latest complete checkpoint in ``output_dir`` and is logged
    (``restart`` entries in ``log.jsonl`` and ``trainer_state.json``, with the cause). Applies where this package
    starts the processes (the CLI, a Trainer that launches its own workers); under your own torchrun pass
    ``--max-restarts`` to it."""
    ddp_timeout: int = 1800
    """Seconds a distributed run may go without progress (transformers' name and default): a rank that stops (a
    SIGSTOP, a deadlocked collective, a host that hangs) ends the job after this long with one line naming the rank
    the others wait for, instead of hanging; the process group's collective timeout is slightly longer."""

    seed: int = 42
    """Seed of Python, NumPy and torch at the start of a fresh run (dropout, initialisation)."""
    data_seed: int | None = None
    """Seed of the training-data shuffle; None = ``seed``."""
    bf16: bool | str = "auto"
    """bfloat16 autocast (CPU and CUDA); weights, gradients and optimizer state stay fp32. ``"auto"`` (the default;
    transformers' is False) means True where the training device computes bf16 natively (CUDA compute capability
    8.0 or newer; a CPU with AVX-512 BF16 or AMX) and ``fp16`` is off, else False
    (:mod:`mindformers_py.engine.precision`); the field holds the resolved bool after construction, and
    :meth:`to_dict` writes ``"auto"`` back so a saved run re-decides on other hardware."""
    fp16: bool = False
    """float16 autocast with a gradient scaler; CUDA only."""
    torch_compile: bool | str = "auto"
    """Compile each transformer layer with ``torch.compile`` (the whole model when it declares no layers): inductor
    fuses the memory-bound work between matrix products. The compilation is paid in the first step (reported as
    ``train_first_step_runtime``) and kept in inductor's on-disk cache for later runs of the same shapes.
    ``"auto"`` (the default; transformers' is False) means True when training on a CUDA GPU, where it was measured
    faster and leaner than the eager step, and False on the CPU, where it is slower, and under context parallelism
    or ``auto_parallel`` (:mod:`mindformers_py.engine.compile_policy`); the field holds the resolved bool after
    construction, and :meth:`to_dict` writes ``"auto"`` back so a saved run re-decides on other hardware."""
    torch_compile_backend: str | None = None
    """``torch.compile`` backend (``"inductor"`` when None); setting it turns ``torch_compile`` on, as in
    transformers."""
    torch_compile_mode: str | None = None
    """``torch.compile`` mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``); None = default. Setting it
    turns ``torch_compile`` on, as in transformers."""
    fused_loss: bool = False
    """Compute the causal-LM loss with a chunked linear + cross-entropy that never holds the full (tokens x
    vocabulary) logits or their gradient: a memory saver for large vocabularies, in training and in loss-only
    evaluation. Our models do it in their own forward, under every layout but pipeline stages, wherever their output
    head is an ``nn.Linear``: whole, sharded over the vocabulary by tensor parallelism (a vocabulary-parallel loss)
    or, frozen, sharded by ZeRO-2/3 (gathered for the loss alone) or split over the data-parallel ranks
    (``ParallelConfig.shard_frozen_head``: every rank's tokens against each rank's rows); not one trained under
    ZeRO-2/3, one sharded over the vocabulary under ZeRO-2/3, nor an adapted one (the log says which it was); another
    model gets it from outside, stand-alone only, after a check on the first batch that the two losses agree. Also
    faster on a CPU at a large vocabulary (0.61x the step of the model's own loss on a 2-layer model at a 152k
    vocabulary, ``benchmarks/bench_fused_loss.py``). Off by default (transformers' Trainer has no such option): the
    model then returns no logits."""
    use_cpu: bool = False
    """Train on the CPU even when a GPU is present."""
    cpu_keep_freed_memory: bool = True
    """On CPU, keep memory freed by one step in the process heap for the next (glibc ``mallopt``) instead of
    returning it to the OS: large activations and gradients are reused rather than page-faulted in again every
    step (about 25% of a small GPT's CPU step). Resident memory stays at its peak. Applies to the whole process
    once a CPU Trainer is created, except under ZeRO-2/3 (FSDP2), whose gather buffers of changing sizes would
    fragment a heap that is never trimmed, against the point of sharding (a 1.5 B LoRA step on two ranks: 5.9 GiB
    peak per rank with it, 3.2 GiB without)."""

    dataloader_num_workers: int = 0
    """Worker processes that load and collate batches; 0 loads in the main process."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete training batch of each epoch."""
    dataloader_pin_memory: bool = True
    """Pin host batches for faster copies to a GPU (no effect on CPU)."""
    dataloader_prefetch_factor: int | None = None
    """Batches prefetched per worker (with ``dataloader_num_workers`` > 0); None = torch's default."""
    remove_unused_columns: bool = True
    """Drop dataset columns that the model's ``forward`` does not take (e.g. raw ``text``)."""
    label_names: list[str] | None = None
    """Keys of the batch holding labels; None = the model's (``["labels"]`` for most)."""

    parallel_config: ParallelConfig | Mapping[str, Any] | None = field(default_factory=ParallelConfig)
    """How training is spread over processes (MindFormers' parallel_config); a mapping of its fields is accepted.
    The default runs in one process."""

    activation_checkpointing: bool | None = None
    """transformers' switch for activation recomputation: True turns on ``parallel_config.recompute="full"`` (whole
    transformer layers re-run in backward) when the layout asks for no recompute (a layout's own ``recompute``
    setting is kept); None: as ``gradient_checkpointing`` says, else False."""
    gradient_checkpointing: bool | None = None
    """The older name of ``activation_checkpointing`` (transformers 5 keeps it as an alias); after construction both
    hold the same value."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingArguments:
        # A keyword that is no field is refused here in one line, before the dataclass's __init__ raises a TypeError.
        for name in kwargs:
            if name not in cls.field_names():
                raise unknown_field(cls, name)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self._convert()
        self.validate()

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        """Every field name, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> TrainingArguments:
        """Build from a YAML section or CLI strings; unknown keys are refused with the valid names."""
        return cls(**dict(data or {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-serialisable dict of every field, accepted back by :meth:`from_dict` (``bf16`` and
        ``torch_compile`` as ``"auto"`` when that is what was asked and they still hold the value it resolved to)."""
        out = {}
        for name in self.field_names():
            value = getattr(self, name)
            out[name] = value.to_dict() if isinstance(value, ParallelConfig) else value
        if self.bf16 is getattr(self, "_bf16_auto", None):
            out["bf16"] = AUTO
        if self.torch_compile is getattr(self, "_torch_compile_auto", None):
            out["torch_compile"] = AUTO
        return out

    def with_layout(self, parallel_config: ParallelConfig) -> TrainingArguments:
        """These arguments under another layout, rebuilt from :meth:`to_dict` rather than ``dataclasses.replace``:
        ``bf16="auto"`` and ``torch_compile="auto"`` stay ``"auto"`` and are decided again for that layout."""
        return type(self).from_dict({**self.to_dict(), "parallel_config": parallel_config})

    def with_resolved_layout(self, layout: Layout) -> TrainingArguments:
        """A copy of these arguments carrying ``layout``, their ``parallel_config`` already resolved for the run (by
        the process that started this one: :meth:`ParallelConfig.resolve`): the Trainer's engine takes it as it is
        and checks nothing again. The layout is not saved with the arguments (:meth:`to_dict`)."""
        out = copy.copy(self)
        out._resolved_layout = layout
        return out

    @property
    def resolved_layout(self) -> Layout | None:
        """The layout :meth:`with_resolved_layout` gave these arguments (None: the Trainer resolves
        ``parallel_config`` itself)."""
        return getattr(self, "_resolved_layout", None)

    def to_json_string(self) -> str:
        """The fields as indented JSON (saved beside checkpoints as ``training_args.json``)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def _convert(self) -> None:
        hints = typing.get_type_hints(type(self))
        for name in self.field_names():
            if name == "parallel_config":
                continue
            setattr(self, name, coerce_value(name, getattr(self, name), hints[name]))
        self.parallel_config = ParallelConfig.coerce(self.parallel_config, "parallel_config")
        if self.activation_checkpointing is None:  # transformers' rule: the older name counts when the new is unset
            self.activation_checkpointing = bool(self.gradient_checkpointing)
        self.gradient_checkpointing = self.activation_checkpointing
        if self.activation_checkpointing and self.parallel_config.recompute.recompute is False:
            self.parallel_config = dataclasses.replace(self.parallel_config, recompute="full")
        self._resolve_bf16()
        self._resolve_torch_compile()
        if isinstance(self.report_to, str):
            self.report_to = [part.strip() for part in self.report_to.split(",") if part.strip()]
        report = [r.lower() for r in self.report_to]
        for target in report:
            check_choice("report_to", target, REPORT_TARGETS + ("all", "none"))
            if not tracker_installed(target):
                raise ConfigError(f"report_to={target!r} needs the {target} package, which is not installed: pip "
                                  f"install {TRACKER_PACKAGES[target].split(' ')[0]}")
        installed = [t for t in REPORT_TARGETS if tracker_installed(t)]  # transformers' "all": every one installed
        self.report_to = [] if "none" in report else installed if "all" in report else report
        for name in ("lr_scheduler_type", "eval_strategy", "save_strategy", "logging_strategy", "optim"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, value.strip().lower())
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # transformers' rule
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _resolve_bf16(self) -> None:
        """``bf16="auto"`` becomes the bool the hardware decides (remembered, for :meth:`to_dict`)."""
        if not isinstance(self.bf16, str):
            return
        if self.bf16.strip().lower() != AUTO:
            raise ConfigError(f"bf16={self.bf16!r} is not valid; expected true, false or 'auto'")
        self.bf16 = self._bf16_auto = resolve_bf16(AUTO, self.fp16, self.use_cpu)

    def _resolve_torch_compile(self) -> None:
        """``torch_compile="auto"`` becomes the bool the device and layout decide (remembered, for :meth:`to_dict`);
        a backend or mode given with it still turns compilation on (transformers' rule, applied after)."""
        if not isinstance(self.torch_compile, str):
            return
        if self.torch_compile.strip().lower() != AUTO:
            raise ConfigError(f"torch_compile={self.torch_compile!r} is not valid; expected true, false or 'auto'")
        # the reason is kept with the decision: the run's compile line says it without reading the layout again
        decision, self._torch_compile_reason = auto_decision(self.use_cpu, self.parallel_config)
        self.torch_compile = self._torch_compile_auto = decision

    # -- checks -------------------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every field and the relations between fields; raise a one-line ConfigError on the first fault."""
        check_choice("eval_strategy", self.eval_strategy, INTERVAL_STRATEGIES)
        check_choice("save_strategy", self.save_strategy, INTERVAL_STRATEGIES)
        check_choice("logging_strategy", self.logging_strategy, INTERVAL_STRATEGIES)
        check_choice("optim", self.optim, OPTIMIZERS)
        _check_folder_path("output_dir", self.output_dir)
        if self.logging_dir is not None:
            _check_folder_path("logging_dir", self.logging_dir)
        if self.task is not None:
            from ..task_registry import get_task  # imports torch: not needed to read the fields

            get_task(self.task)
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "eval_steps", "save_steps"):
            _at_least(name, getattr(self, name), 1)
        for name in ("dataloader_num_workers", "seed", "max_restarts"):
            _at_least(name, getattr(self, name), 0)
        _at_least("ddp_timeout", self.ddp_timeout, 1)
        if self.data_seed is not None:
            _at_least("data_seed", self.data_seed, 0)
        if self.save_total_limit is not None:
            _at_least("save_total_limit", self.save_total_limit, 1)
        if self.dataloader_prefetch_factor is not None:
            _at_least("dataloader_prefetch_factor", self.dataloader_prefetch_factor, 1)
        if self.max_steps != -1:
            _at_least("max_steps", self.max_steps, 1, hint="or -1 to use num_train_epochs")
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "eval_delay", "warmup_steps"):
            _at_least(name, getattr(self, name), 0)
        if not self.num_train_epochs > 0:
            raise ConfigError(f"num_train_epochs={self.num_train_epochs!r} is not valid; expected a number > 0")
        if not self.adam_epsilon > 0:
            raise ConfigError(f"adam_epsilon={self.adam_epsilon!r} is not valid; expected a number > 0")
        for name in ("adam_beta1", "adam_beta2", "warmup_ratio"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"{name}={value!r} is not valid; expected a number in [0, 1)")
        if isinstance(self.warmup_steps, float) and not self.warmup_steps.is_integer() and self.warmup_steps > 1:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps!r} is not valid; expected a whole number of steps or a fraction < 1"
            )
        if self.bf16 and self.fp16:
            raise ConfigError("bf16=True and fp16=True are both set; choose one mixed-precision mode")
        if self.lr_scheduler_type in METRIC_SCHEDULERS and self.eval_strategy == "no":
            raise ConfigError(
                f"lr_scheduler_type={self.lr_scheduler_type!r} steps on the evaluation loss, but eval_strategy='no'; "
                "choose one of: 'steps', 'epoch' for eval_strategy"
            )
        if self.load_best_model_at_end:
            if self.eval_strategy == "no" or self.save_strategy != self.eval_strategy:
                raise ConfigError(
                    f"load_best_model_at_end=True needs save_strategy equal to eval_strategy (not 'no'); got "
                    f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}"
                )
            if self.save_strategy == "steps" and self.save_steps % self.eval_steps:
                raise ConfigError(
                    f"load_best_model_at_end=True needs save_steps={self.save_steps} to be a multiple of "
                    f"eval_steps={self.eval_steps}"
                )
        if self.torch_compile_mode is not None:
            check_choice("torch_compile_mode", self.torch_compile_mode,
                         ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
        if not str(self.output_dir).strip():
            raise ConfigError("output_dir='' is not valid; expected a folder path")
        check_choice("lr_scheduler_type", self.lr_scheduler_type, schedulers())  # last: may import peft (seconds)
        if not isinstance(self.parallel_config, ParallelConfig):
            raise ConfigError(f"parallel_config={self.parallel_config!r} is not valid; expected a ParallelConfig")
        self.parallel_config.validate()

    # -- derived values (HF's names, read by callbacks written for transformers) -----------------------------------

    @property
    def tensorboard_dir(self) -> str:
        """Where TensorBoard events go: ``logging_dir`` or ``<output_dir>/runs``."""
        return self.logging_dir or os.path.join(self.output_dir, "runs")

    @property
    def world_size(self) -> int:
        """Number of processes of the run (``WORLD_SIZE`` set by torchrun; 1 otherwise)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """Global rank of this process."""
        return int(os.environ.get("RANK", "0"))

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its machine."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def should_log(self) -> bool:
        """Whether this process writes logs (the main process only)."""
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes shared files (the main process only)."""
        return self.process_index == 0

    @property
    def train_batch_size(self) -> int:
        """Samples per micro-batch on one rank (HF's name)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch on one rank (HF's name)."""
        return self.per_device_eval_batch_size

    def warmup_steps_for(self, max_steps: int) -> int:
        """Warmup steps for a run of ``max_steps``: ``warmup_steps`` (a fraction of ``max_steps`` when < 1) or
        ``warmup_ratio`` of ``max_steps``."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(self.warmup_steps * max_steps)
        return math.ceil(self.warmup_ratio * max_steps)


def unknown_field(cls: type, name: str) -> ConfigError:
    """The one-line refusal of ``name``, which is no field of ``cls``: a transformers ``TrainingArguments`` field
    this package does not have is named as such; otherwise the closest field names are suggested."""
    import difflib

    fields = cls.field_names()
    close = difflib.get_close_matches(name, fields, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    try:
        import transformers

        counterpart = getattr(transformers, cls.__name__, transformers.TrainingArguments)
        theirs = {f.name for f in dataclasses.fields(counterpart)}
    except ImportError:  # pragma: no cover - transformers is a dependency
        counterpart, theirs = None, set()
    if name in theirs:
        return ConfigError(f"{name} is a transformers {counterpart.__name__} field that {cls.__name__} does not have; "
                           f"{hint}remove it (valid fields: {', '.join(fields)})")
    return ConfigError(f"{name} is not a {cls.__name__} field; {hint}valid fields: {', '.join(fields)}")


def _at_least(name: str, value: Any, minimum: float, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        kind = "an integer" if isinstance(minimum, int) and not isinstance(value, float) else "a number"
        extra = f" {hint}" if hint else ""
        raise ConfigError(f"{name}={value!r} is not valid; expected {kind} >= {minimum}{extra}")


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    """:class:`TrainingArguments` plus transformers' generation-during-evaluation fields."""

    predict_with_generate: bool = False
    """Predictions of ``evaluate``/``predict`` are generated token ids (for ROUGE, BLEU, ...) instead of logits."""
    generation_max_length: int | None = None
    """``max_length`` of that generation; None: the model's generation config."""
    generation_num_beams: int | None = None
    """``num_beams`` of that generation; None: the model's generation config."""

    def validate(self) -> None:
        super().validate()
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value!r} is not valid; expected an integer >= 1 or None")


def _check_folder_path(name: str, path: Any) -> None:
    """Refuse a folder argument naming a file, or inside one (the run could not create it)."""
    here = os.path.abspath(os.fspath(path))
    while True:
        if os.path.exists(here) and not os.path.isdir(here):
            what = "is a file" if here == os.path.abspath(os.fspath(path)) else f"lies inside {here!r}, which is a file"
            raise ConfigError(f"{name}={os.fspath(path)!r} {what}, not a folder; give a folder path (it is created if "
                              "missing)")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent
