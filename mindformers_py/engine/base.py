"""The seam between the Trainer and the layout: everything that depends on how training is spread over devices.

The Trainer owns the loop (steps, epochs, callbacks, logging, evaluation schedule, checkpoint naming); an
:class:`Engine` owns what a layout changes: where the model lives and how it is wrapped, the optimizer, mixed
precision, one optimizer step's forward and backward over its micro-batches (a pipeline schedule needs to own
that), gradient clipping, which samples this rank reads, metric reduction, and how weights, optimizer state and
RNG state are written and read. The Trainer never branches on the layout: it calls the engine.

:class:`Engine` itself is the stand-alone implementation (one process, one device), kept lean because it is what
most runs use. Distributed engines subclass it and override what their layout changes; the table of which engine
serves which ``parallel_mode`` is in :mod:`.registry`.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..adapters.apply import adapter_state, check_adapter_source, is_peft_model, load_adapter_weights, write_adapter
from ..checkpoint.background_writer import CheckpointWriter, snapshot
from ..checkpoint.disk_space import check_free_space
from ..checkpoint.manifest import manifest_problem
from ..checkpoint.rng_state import capture_rng_state, restore_rng_state
from ..checkpoint.safetensors_io import atomic_folder, load_state_dict, save_state_dict
from ..checkpoint.state_files import DCP_DIR, OPTIMIZER_NAME, RNG_NAME, SCALER_NAME, SCHEDULER_NAME, copy_weights, \
    load_state_into, torch_load
from ..errors import ConfigError
from ..loading.deferred import materialize
from ..parallel.compile import compile_layers
from ..parallel.layout import FSDP, Layout
from ..parallel.recompute import apply_recompute
from ..utils.batch_rows import batch_rows, first_rows
from .args import EngineArguments
from .cpu_memory import keep_freed_cpu_memory
from .step_loss import LossFn, StepLoss, TrainingLoss, count_step_items
from .optim import create_optimizer, parameter_groups

class Engine:
    """Stand-alone engine: one process on one device (CUDA when visible and not ``use_cpu``, else CPU).

    Attributes:
        rank, world_size: this process and the number of processes (0 and 1 here).
        dp_rank, dp_size: this process's data-parallel rank and the data-parallel size (0 and 1 here).
        cp_size: context-parallel ranks that split each sequence of this rank's batches (1 here).
        device: where the model, batches and losses live.
        scaler: the fp16 ``GradScaler`` (None unless ``fp16``).
        layout: the run's resolved :class:`~mindformers_py.parallel.layout.Layout` (checked once, when it was
            resolved; the engine reads it and checks nothing again).
        plan_summary: why the ``auto_parallel`` planner chose this engine's layout (None for a given layout).
    """

    supports_fused_loss: bool = True
    """Whether the Trainer may compute a causal-LM loss from the model's body and head directly (the model is not
    wrapped, so calling its submodules is the same as calling it)."""

    supports_model_fused_loss: bool = True
    """Whether a model may compute its causal-LM loss with its head fused in its own forward (no logits returned):
    not where a pipeline schedule takes the loss from the last stage's logits."""

    def __init__(self, layout: Layout, args: EngineArguments) -> None:
        self.layout = layout
        self.args = args
        self.rank = 0
        self.world_size = 1
        self.dp_rank = 0
        self.dp_size = 1
        self.cp_size = 1
        self.device = torch.device("cpu")
        self.scaler: torch.amp.GradScaler | None = None
        self._checkpoint_writer = CheckpointWriter()
        self.plan_summary: str | None = None

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes shared files and logs (global rank 0)."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this process is the first on its machine."""
        return self.rank == 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Pick the device and precision tools."""
        self._pick_device()
        if self.args.fp16:
            if self.device.type != "cuda":
                raise ConfigError(
                    "fp16=True needs a CUDA device (float16 training uses torch.amp.GradScaler); "
                    "on CPU use bf16=True"
                )
            self.scaler = torch.amp.GradScaler("cuda")

    @property
    def keeps_freed_cpu_memory(self) -> bool:
        """Whether this engine's layout gains from ``cpu_keep_freed_memory`` (not where FSDP2 shards the model:
        see :attr:`~mindformers_py.trainer.arguments.TrainingArguments.cpu_keep_freed_memory`)."""
        return self.layout.data_parallel_engine != FSDP

    def _pick_device(self) -> None:
        """This process's device: the current CUDA device when visible and not ``use_cpu``, else the CPU (whose
        allocator then keeps freed memory, per ``cpu_keep_freed_memory``). Every engine's setup calls it."""
        use_cuda = torch.cuda.is_available() and not self.args.use_cpu
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if self.device.type == "cpu" and self.args.cpu_keep_freed_memory and self.keeps_freed_cpu_memory:
            keep_freed_cpu_memory()

    def teardown(self) -> None:
        """Wait for a checkpoint still being written, then release what :meth:`setup` acquired."""
        self._checkpoint_writer.close()

    def barrier(self) -> None:
        """Wait for every process (a no-op for one process)."""

    def watch_progress(self) -> ContextManager[Any]:
        """A context in which a job whose processes stop making progress ends, naming the one it waits for (see
        :meth:`beat`); nothing to watch for one process."""
        return contextlib.nullcontext()

    def beat(self, step: int) -> None:
        """Tell the progress watch that training reached another point (``step``); every process beats at the same
        points."""

    # -- model and optimizer --------------------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module, task: Any = None) -> nn.Module:
        """Place ``model`` for training (device, recompute, ``torch.compile`` of each transformer layer, or of the
        whole model when it declares no layers); returns the module to call.

        The returned module may be a wrapper; ``model`` itself stays the plain model whose ``save_pretrained``
        and parameters the Trainer uses. ``task`` is the task the Trainer trains (its task registry entry), for
        engines whose model parts must know it (pipeline stages); None lets the model say.
        """
        materialize(model, self.device)  # a model built on meta for a layout: one process holds it all
        model.to(self.device)
        apply_recompute(model, self.layout.recompute)
        if not self.args.torch_compile:
            return model
        backend = self.args.torch_compile_backend or "inductor"
        if not compile_layers(model, self.args.torch_compile_mode, backend):
            return torch.compile(model, mode=self.args.torch_compile_mode, backend=backend)  # no declared layers
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW over ``model``'s decay / no-decay parameter groups, with the arguments' hyper-parameters."""
        return create_optimizer(parameter_groups(model, self.args.weight_decay), self.args)

    # -- one optimizer step ---------------------------------------------------------------------------------------

    def autocast(self) -> ContextManager[Any]:
        """The mixed-precision context for forward passes (bf16 on CPU/CUDA, fp16 on CUDA, else nothing)."""
        if self.args.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.args.fp16:
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``batch`` with its tensors on :attr:`device` (asynchronous copies from pinned memory)."""
        if self.device.type == "cpu":
            return dict(batch)
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def shard_batch(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """This rank's part of a training batch the data-parallel split gave it: the batch itself here; its chunks of
        every sequence under context parallelism. Items, tokens and the loss are counted on what it returns."""
        return batch

    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold other samples of a step: the loss items are counted over them, and their number is
        what data parallelism averages gradients over (None: this process alone). The one place a layout widens
        the loss normalisation (:mod:`.step_loss`)."""
        return None

    def count_items(self, micro_batches: Sequence[Mapping[str, Any]], loss: TrainingLoss) -> torch.Tensor | None:
        """The items of the whole step's loss (``num_items_in_batch``): ``loss``'s count of this rank's
        micro-batches summed over :meth:`loss_group` (see :func:`~.loss.count_step_items`)."""
        return count_step_items(loss, micro_batches, self.loss_group(), self.device)

    def step_loss(self, loss_fn: LossFn | TrainingLoss, num_items_in_batch: torch.Tensor | None,
                  pieces: int) -> StepLoss:
        """The loss of one step over ``pieces`` micro-batches on this rank (:class:`~.loss.StepLoss`): each
        micro-batch's share, rescaled by the size of :meth:`loss_group`."""
        group = self.loss_group()
        return StepLoss(loss_fn, num_items_in_batch, pieces, dist.get_world_size(group) if group is not None else 1)

    def check_loss(self, loss: TrainingLoss) -> None:
        """Refuse, in one line and before training starts, a loss this layout cannot compute (nothing here)."""

    def forward_backward(self, model: nn.Module, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: torch.Tensor | None, loss_fn: LossFn | TrainingLoss,
                         real_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch of one optimizer step; gradients accumulate in the
        parameters. Each micro-batch back-propagates its share of the step's loss (:meth:`step_loss`: the
        ``loss_fn`` value normalised by ``num_items_in_batch``, the items of the whole step on every rank of
        :meth:`loss_group`, and rescaled for data parallelism), so the returned sum is the step's loss. No sync.
        ``real_rows``: how many of each micro-batch's first rows are samples (the rest is padding, which adds
        nothing: see :func:`padded_share`); None: all."""
        step = self.step_loss(loss_fn, num_items_in_batch, len(micro_batches))
        total = None
        for i, batch in enumerate(micro_batches):
            with self.autocast():
                loss = padded_share(step, model, self.to_device(batch), None if real_rows is None else real_rows[i])
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def forward(self, model: nn.Module, inputs: Mapping[str, Any], **kwargs: Any) -> Any:
        """One forward pass without backward (evaluation, prediction): ``model(**inputs, **kwargs)`` here; a
        pipeline engine runs its schedule and returns the last stage's outputs."""
        return model(**inputs, **kwargs)

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping (a tensor, no sync)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the accumulated gradients (through the fp16 scaler when there is one)."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def balance_experts(self, model: nn.Module) -> None:
        """Auxiliary-loss-free load balancing after an optimizer step (DeepSeek-V3; ``MoEConfig.bias_update_rate``):
        the expert loads each balancing router on this rank counted in the step's forwards (``expert_load``), all
        layers stacked and summed over the ranks that saw other tokens of the step (:meth:`all_reduce_sum`: data x
        context parallel, which expert parallelism borrows its ranks from; tensor-parallel ranks see the same tokens
        and each pipeline stage holds its own layers), then each router's ``update_bias(load)``: the same update on
        every rank. One collective per step, none without such routers."""
        routers = [m for m in model.modules() if getattr(m, "bias_update_rate", 0) > 0 and hasattr(m, "update_bias")]
        if not routers:
            return
        loads = self.all_reduce_sum(torch.stack([router.expert_load for router in routers]))
        for router, load in zip(routers, loads):
            router.update_bias(load)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients (set to None: no memset, and the next backward writes instead of adding)."""
        optimizer.zero_grad(set_to_none=True)

    # -- data and metrics -----------------------------------------------------------------------------------------

    def batch_share(self, rows: int) -> tuple[int, int]:
        """``(first, count)``: this data-parallel rank's rows of a global batch of ``rows`` samples (all of them
        here). See :meth:`shard_indices`."""
        return 0, rows

    def shard_indices(self, indices: Sequence[int]) -> list[int]:
        """This data-parallel rank's share of a global batch's sample indices (:meth:`batch_share`): contiguous,
        the ranks' shares differing by one at most, so the ranks together read the batch once, as one process
        does. A rank whose share is empty (a batch smaller than the data-parallel size) reads the batch's first
        index, as padding that counts for nothing (the batch's ``real_rows`` are 0)."""
        indices = list(indices)
        first, count = self.batch_share(len(indices))
        return indices[first:first + count] or indices[:1]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over the data-parallel ranks (itself here)."""
        return tensor

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of ``tensor`` over the data-parallel ranks (itself here)."""
        return tensor

    def reduce_metrics(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Totals of a model's running sums (its ``training_metrics`` hook: router loads, ...) over the ranks that
        saw different data (the sums themselves here)."""
        return dict(sums)

    def gather_for_metrics(self, value: Any) -> list[Any]:
        """Every data-parallel rank's ``value`` (CPU tensors or nests of them) for one global batch, in rank
        order, so that concatenating them gives the batch in dataset order (``[value]`` here)."""
        return [value]

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save_pretrained(self, model: nn.Module, folder: str | Path, processing_class: Any = None) -> None:
        """Write whole (consolidated) weights and config into ``folder`` with ``save_pretrained`` (safetensors),
        and the tokenizer/processor beside them."""
        if not self.is_main_process:
            return
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if is_peft_model(model):  # the adapter alone, in peft's format
            write_adapter(model, folder)
        elif hasattr(model, "save_pretrained"):
            with _quiet_progress_bars():
                model.save_pretrained(folder)
        else:
            save_state_dict(model.state_dict(), folder)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(folder)

    def load_weights(self, model: nn.Module, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """Copy the safetensors weights of ``folder`` (or an already converted ``state``) into ``model`` in place;
        tied parameters may be absent from the file. Mismatches raise a CheckpointError naming ``folder``."""
        if is_peft_model(model):  # only the adapter is trained and saved; the base model is loaded already
            check_adapter_source(folder, state)
            load_adapter_weights(model, folder)
            return
        state = load_state_dict(folder) if state is None else state
        copy_weights(model, state, folder)

    def save_checkpoint(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        lr_scheduler: Any, files: Mapping[str, str], processing_class: Any = None, *,
                        asynchronous: bool = False, on_saved: Callable[[], None] | None = None) -> None:
        """Write a complete training checkpoint into ``folder`` atomically: weights (``save_pretrained``),
        optimizer, scheduler, fp16 scaler, RNG states, the Trainer's text ``files`` (name -> content) and a manifest
        of them all (sizes, checksums). The folder appears only when everything is written; a filesystem without
        room for it is refused before anything is written, in one line naming the folder and the space it needs.

        ``asynchronous``: the state is copied to host memory (all the step waits for) and written by a background
        thread (:mod:`~mindformers_py.checkpoint.background_writer`); a save still in flight is waited for first,
        and :meth:`wait_for_checkpoint` waits for this one. ``on_saved`` runs once the folder is in place (in the
        thread that wrote it)."""
        self.wait_for_checkpoint()
        folder = Path(folder)
        needed = self.checkpoint_bytes(model, optimizer)
        self.check_free_space(folder, needed)
        state = self._checkpoint_state(model, optimizer, lr_scheduler)
        if asynchronous:
            state = snapshot(state)
        job = functools.partial(self._write_checkpoint, folder, model, state, dict(files), processing_class, needed,
                                on_saved)
        if asynchronous:
            self._checkpoint_writer.submit(str(folder), job)
        else:
            job()

    def _checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> dict[str, Any]:
        """What a checkpoint holds, as state dicts (live tensors: :func:`snapshot` copies them for a background
        write)."""
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": lr_scheduler.state_dict(),
                 "rng": capture_rng_state()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _write_checkpoint(self, folder: Path, model: nn.Module, state: dict[str, Any], files: Mapping[str, str],
                          processing_class: Any, needed: int, on_saved: Callable[[], None] | None) -> None:
        with atomic_folder(folder, manifest=True, needed_bytes=needed) as tmp:
            if is_peft_model(model):  # the adapter alone, in peft's format, from the state taken at the step
                write_adapter(model, tmp, adapter_state(model, state["model"]))
            elif hasattr(model, "save_pretrained"):
                with _quiet_progress_bars():
                    model.save_pretrained(tmp, state_dict=state["model"])
            else:
                save_state_dict(state["model"], tmp)
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(tmp)
            torch.save(state["optimizer"], tmp / OPTIMIZER_NAME)
            torch.save(state["scheduler"], tmp / SCHEDULER_NAME)
            if "scaler" in state:
                torch.save(state["scaler"], tmp / SCALER_NAME)
            torch.save(state["rng"], tmp / RNG_NAME)
            for name, text in files.items():
                (tmp / name).write_text(text, encoding="utf-8")
        if on_saved is not None:
            on_saved()

    def wait_for_checkpoint(self) -> None:
        """Wait for the background checkpoint write in flight, if any, and raise what it failed with."""
        self._checkpoint_writer.wait()

    def raise_checkpoint_error(self) -> None:
        """Raise the error of a background checkpoint write that has finished (never waits)."""
        self._checkpoint_writer.raise_if_failed()

    def checkpoint_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """About how many bytes a checkpoint of ``model`` and ``optimizer`` takes on disk (their tensors; shared
        tensors counted once)."""
        return _tensor_bytes([model.state_dict(), optimizer.state_dict()["state"]])

    def check_free_space(self, folder: Path, needed: int) -> None:
        """Refuse a checkpoint of ``needed`` bytes that the filesystem of ``folder`` cannot hold."""
        check_free_space(folder, needed)

    def load_checkpoint(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        lr_scheduler: Any) -> None:
        """Restore weights, optimizer, scheduler and fp16 scaler from a folder written by :meth:`save_checkpoint`
        (RNG states separately, with :meth:`load_rng_state`, right before training). A distributed run's checkpoint
        is read from its sharded part (``dcp/``, any layout, pipeline stages included)."""
        folder = Path(folder)
        if (folder / DCP_DIR).is_dir():
            from ..checkpoint import sharded as dcp_checkpoint  # torch.distributed.checkpoint, only when needed

            dcp_checkpoint.load_checkpoint(folder / DCP_DIR, model, optimizer, no_dist=True)
        else:
            self.load_weights(model, folder)
            load_state_into("optimizer", optimizer, folder / OPTIMIZER_NAME)
        load_state_into("scheduler", lr_scheduler, folder / SCHEDULER_NAME)
        if self.scaler is not None and (folder / SCALER_NAME).is_file():
            load_state_into("fp16 scaler", self.scaler, folder / SCALER_NAME)

    def checkpoint_files(self) -> list[str]:
        """Files (besides weights and the optimizer state, ``optimizer.pt`` or ``dcp/``, checked when loading) a
        complete checkpoint holds, for checking checkpoints written before manifests existed."""
        return [SCHEDULER_NAME, RNG_NAME]

    def checkpoint_problem(self, folder: str | Path) -> str | None:
        """What is wrong with checkpoint ``folder`` against its manifest (a file missing, cut short or changed), in
        one line, or None. Distributed engines split the checksum reading over the ranks and agree on the answer."""
        return manifest_problem(folder)

    def load_rng_state(self, folder: str | Path) -> None:
        """Restore Python, NumPy, torch and CUDA random states saved in ``folder``."""
        restore_rng_state(torch_load(Path(folder) / RNG_NAME, "RNG state"))


# -- helpers -----------------------------------------------------------------------------------------------------


def padded_share(step: StepLoss, model: nn.Module, batch: dict[str, Any], real_rows: int | None) -> torch.Tensor:
    """``step(model, batch)`` on the batch's first ``real_rows`` rows (None: all); a batch with no real row (a
    rank without a share of a global batch, which must still run its forward and backward for the collectives of
    the layout) back-propagates its loss times zero."""
    if real_rows is None or real_rows >= batch_rows(batch):
        return step(model, batch)
    if real_rows == 0:
        return step(model, batch) * 0.0
    return step(model, first_rows(batch, real_rows))


def _tensor_bytes(states: Sequence[Any]) -> int:
    """Bytes of the tensors in nested state dicts, each storage counted once (tied weights share one)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            key = (local.untyped_storage().data_ptr(), local.storage_offset())
            if key not in seen or local.numel() == 0:
                seen.add(key)
                total += local.numel() * local.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    for state in states:
        walk(state)
    return total


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' per-save "Writing model shards" bar, which would break the training progress bar."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


__all__ = ["Engine"]
