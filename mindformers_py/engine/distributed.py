"""The distributed training engine: the :class:`~.base.Engine` seam on torch.distributed.

Serves ``parallel_mode="data_parallel"`` and ``"semi_auto_parallel"`` (registered on import). It joins the process
group (torchrun's environment), builds the :class:`~mindformers_py.parallel.mesh.ParallelMesh`, applies the layout with
:func:`~mindformers_py.parallel.parallelize.parallelize` (tensor/sequence/vocabulary parallel, recompute, DDP/ZeRO/FSDP2/HSDP) and owns
what a layout changes in a step:

* **Loss normalisation** follows the one path of :mod:`.step_loss`: the loss group is the ranks holding
  different data of a step (data x context parallel), so every micro-batch loss is (its item-summed loss) /
  (items of the global batch), multiplied by the group's size before backward because DDP and FSDP average
  gradients over those ranks: the gradients are exactly those of one stand-alone step over the global batch.
  ``forward_backward`` returns that backpropagated value; :meth:`all_reduce_mean` of it over the ranks is the
  global step loss (the convention of HF's Trainer).
* **Context parallelism.** Each context-parallel rank trains on its chunks of every sequence (:meth:`shard_batch`,
  inside :meth:`ContextParallel.sharded <mindformers_py.parallel.context.apply.ContextParallel.sharded>`) and counts the
  items its own loss scores, so the counts, the loss scale and the gradient average all run over ``batch_mesh``.
* **Vocabulary-parallel loss.** With ``vocab_emb_dp=False`` the logits are sharded on the vocabulary and the
  cross-entropy runs under ``loss_parallel()`` (forward and backward).
* **Gradient clipping** over gradients that are DTensors on different meshes (tensor-parallel, FSDP, both) or
  plain tensors: one norm per (mesh, placements) group, combined exactly.
* **Checkpoints.** A checkpoint folder holds a sharded DCP checkpoint (``dcp/``: model and optimizer, resharded
  on load under any layout, the stand-alone engine's included) and, with :attr:`portable_checkpoints`, also the
  whole weights (``save_pretrained`` files, consolidated from the shards), so ``from_pretrained`` loads it.
  Resuming prefers ``dcp/`` and falls back to the whole files, so a stand-alone checkpoint resumes under a
  distributed layout too. With ``save_async`` the shards are written by a background thread on a gloo process
  group of its own (:mod:`~mindformers_py.checkpoint.background_writer`).

Pipeline parallelism (``pipeline_stage > 1``) is served by the pipeline engine, which builds on this one.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from ..adapters.apply import check_adapter_source, is_peft_model, refuse_prompt_learning, write_adapter
from ..adapters.distributed import gathered_adapter, load_adapter, save_adapter
from ..checkpoint import sharded as dcp_checkpoint
from ..checkpoint.disk_space import check_free_space
from ..checkpoint.manifest import first_problem, manifest_problem
from ..checkpoint.rng_state import capture_rng_state, restore_rng_state
from ..checkpoint.safetensors_io import load_state_dict
from ..checkpoint.state_files import DCP_DIR, OPTIMIZER_NAME, RNG_NAME, SCHEDULER_NAME, load_state_into, torch_load
from ..errors import CheckpointError, ConfigError
from ..layers.loss import IGNORE_INDEX
from ..loading.deferred import has_meta_parameters, materialize
from ..parallel.layout import FSDP, REPLICATE, Layout
from ..parallel.context.apply import ContextParallel
from ..parallel.data import set_gradient_sync, shard_optimizer
from ..parallel.mesh import ParallelMesh, build_mesh, init_distributed
from ..parallel.tensor.sequence_padding import SequenceGroup, cut_sequences, pad_sequences
from ..parallel.parallelize import parallelize
from ..launcher.watchdog import ProgressWatchdog, collective_timeout
from ..utils.state_names import state_name
from .args import EngineArguments
from .optim import parameter_group_names
from .base import Engine, _quiet_progress_bars, padded_share
from .step_loss import LossFn, TrainingLoss

RANK_RNG_NAME = "rng_state_{rank}.pth"


class DistributedEngine(Engine):
    """Data, tensor, sequence and vocabulary parallelism, ZeRO 1/2/3, HSDP and recompute on torch.distributed.

    Attributes (beyond :class:`Engine`'s):
        mesh: the run's :class:`ParallelMesh` (after :meth:`setup`).
        portable_checkpoints: also write the whole weights (``save_pretrained`` files, consolidated from the shards
            by rank 0) beside the sharded checkpoint, so ``from_pretrained`` loads it; turn off when the whole model
            does not fit one host.
    """

    supports_fused_loss = False  # FSDP/replicate hooks live on the root module: the model must be called whole
    portable_checkpoints: bool = True
    runs_pipeline_stages: bool = False
    """Whether this engine runs layouts with pipeline stages (:class:`~.pipelining_engine.PipeliningEngine` does)."""

    def __init__(self, layout: Layout, args: EngineArguments) -> None:
        super().__init__(layout, args)
        self.mesh: ParallelMesh | None = None
        self.context: ContextParallel | None = None
        self._owns_process_group = False
        self._fsdp_mixed_precision = False
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._watchdog: ProgressWatchdog | None = None
        # The whole model's trainable parameter names in the order a stand-alone optimizer numbers them (taken before
        # the layout cuts the model into stages), to resume a stand-alone checkpoint's optimizer state by name.
        self._optimizer_names: list[list[str]] | None = None
        self._sequence_groups: list[SequenceGroup] = []  # what sequence parallelism pads (see _note_sequences)

    @property
    def is_local_main_process(self) -> bool:
        """Whether this process is the first on its machine (``LOCAL_RANK`` 0)."""
        return int(os.environ.get("LOCAL_RANK", self.rank)) == 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Join the process group and build the layout's mesh (the layout was checked when it was resolved)."""
        if self.args.fp16:
            raise ConfigError(f"fp16=True is not supported with parallel_mode={self.layout.parallel_mode!r} "
                              "(FSDP2/DTensor have no float16 loss scaling here); use bf16=True")
        use_cuda = torch.cuda.is_available() and not self.args.use_cpu
        self._owns_process_group = not dist.is_initialized()
        init_distributed(backend=None if use_cuda else "gloo", timeout_s=collective_timeout(self.args.ddp_timeout))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.layout.pp > 1 and not self.runs_pipeline_stages:
            raise ConfigError(f"pipeline_stage={self.layout.pp} needs the pipeline engine; "
                              f"{type(self).__name__} runs layouts without pipeline stages")
        self._pick_device()
        self.mesh = build_mesh(self.layout, device_type=self.device.type)
        self.dp_rank, self.dp_size = self.mesh.dp_rank, self.mesh.dp
        self.cp_size = self.mesh.cp
        self.context = ContextParallel(self.mesh, self.layout) if self.mesh.cp > 1 else None
        # Background checkpoint writes run their collectives on a group of their own, never interleaved with the
        # step's on the default group (gloo: DCP stages to host memory).
        self._checkpoint_group = dist.new_group(backend="gloo") if self.args.save_async else None

    def teardown(self) -> None:
        """Wait for a checkpoint still being written, then leave the process group if :meth:`setup` joined it."""
        self._checkpoint_writer.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def barrier(self) -> None:
        """Wait for every process."""
        dist.barrier()

    def watch_progress(self) -> ContextManager[Any]:
        """A :class:`~mindformers_py.launcher.watchdog.ProgressWatchdog` over ``ddp_timeout``: when this process
        makes no progress (:meth:`beat`) for that long, the job ends naming the rank it waits for."""
        self._watchdog = ProgressWatchdog(self.args.ddp_timeout, self.rank, self.world_size)
        return self._watchdog

    def beat(self, step: int) -> None:
        """Progress for the watchdog (cheap: its thread publishes it)."""
        if self._watchdog is not None:
            self._watchdog.beat(step)

    # -- model and optimizer --------------------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module, task: Any = None) -> nn.Module:
        """Move the model to the device and parallelize it in place (its parameter names stay the same; its class
        gains FSDP/DDP mix-ins). Every rank must build the same model (the layout was checked against it when it was
        resolved)."""
        refuse_prompt_learning(model, f"parallel_mode={self.layout.parallel_mode!r}")
        self._optimizer_names = parameter_group_names(model)
        self._note_sequences(model, task)
        if self.context is not None:
            self.context.task = task
        if not has_meta_parameters(model):  # a model built on meta for its layout gets only its shards, below
            model.to(self.device)
        model = self.parallelize(model)
        if self.context is not None:
            self.context.prepare(model)
        return model

    def parallelize(self, module: nn.Module, stage: int = 0) -> nn.Module:
        """Apply the layout to ``module`` (the model, or pipeline stage ``stage`` of it) in place with
        :func:`~mindformers_py.parallel.parallelize.parallelize`: tensor parallel, recompute, ``torch.compile``
        of each layer (``torch_compile``, ``torch_compile_mode``), data parallel / ZeRO with bf16 mixed precision
        under FSDP2. The one place every distributed engine's modules are parallelized."""
        fsdp_family = self.layout.data_parallel_engine in (FSDP, REPLICATE)
        self._fsdp_mixed_precision = bool(self.args.bf16 and fsdp_family)
        return parallelize(module, self.layout, self.mesh,
                           param_dtype=torch.bfloat16 if self._fsdp_mixed_precision else None,
                           compile_layers=bool(self.args.torch_compile), compile_mode=self.args.torch_compile_mode,
                           compile_backend=self.args.torch_compile_backend,
                           stage=stage, context=self.context,
                           materialize=(lambda part: materialize(part, self.device)) if has_meta_parameters(module) else None)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The stand-alone optimizer over the parallelized parameters (whose state is then sharded like them),
        or its ZeRO-1 wrapper (:func:`~mindformers_py.parallel.data.shard_optimizer`)."""
        optimizer = super().build_optimizer(model)
        _fit_multi_tensor_kernels(optimizer)
        return shard_optimizer(optimizer, self.mesh, self.layout)

    # -- one optimizer step ---------------------------------------------------------------------------------------

    def autocast(self) -> ContextManager[Any]:
        """Nothing when FSDP2's mixed-precision policy already computes in bf16; else the stand-alone autocast."""
        return contextlib.nullcontext() if self._fsdp_mixed_precision else super().autocast()

    def loss_context(self) -> ContextManager[Any]:
        """``loss_parallel()`` when the vocabulary is sharded (the cross-entropy of sharded logits), else nothing."""
        return loss_parallel() if self.layout.vocab_parallel else contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: torch.Tensor | None, loss_fn: LossFn | TrainingLoss,
                         real_rows: Sequence[int] | None = None) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; gradients are reduced over the data-parallel ranks
        after the last one. ``num_items_in_batch`` is the item count of the whole global batch (all ranks, all
        micro-batches); returns the backpropagated loss, whose mean over the ranks is the global step loss.
        ``real_rows``: as for :meth:`Engine.forward_backward` (a rank without a share runs its padding row, times
        zero, so the gradient reduction still meets every rank)."""
        step = self.step_loss(loss_fn, num_items_in_batch, len(micro_batches))
        total = None
        last = len(micro_batches) - 1
        with self.context_sharded():
            for i, batch in enumerate(micro_batches):
                set_gradient_sync(model, i == last)
                with self.loss_context():
                    with self.autocast():
                        loss = padded_share(step, model, self.to_device(batch),
                                            None if real_rows is None else real_rows[i])
                    loss.backward()
                value = loss.detach()
                value = value.full_tensor() if isinstance(value, DTensor) else value
                total = value if total is None else total + value
        return total

    @property
    def batch_ranks(self) -> int:
        """Ranks holding different data (data x context parallel): gradients are averaged over them and losses,
        item counts and metric sums summed over them."""
        return self.dp_size * self.cp_size

    def shard_batch(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """This rank's chunks of every sequence of ``batch`` under context parallelism (the batch itself
        otherwise); see :mod:`mindformers_py.parallel.context.data`. Under sequence parallelism the sequences are
        first padded to a multiple of ``model_parallel`` (:mod:`mindformers_py.parallel.tensor.sequence_padding`)."""
        batch = self._pad_sequences(batch)[0]
        return self.context.shard_batch(batch) if self.context is not None else batch

    def forward(self, model: nn.Module, inputs: Mapping[str, Any], **kwargs: Any) -> Any:
        """One forward pass without backward; under sequence parallelism on sequences padded to a multiple of
        ``model_parallel``, whose outputs are cut back to the sequences given."""
        inputs, lengths = self._pad_sequences(inputs)
        return cut_sequences(model(**inputs, **kwargs), lengths)

    def _note_sequences(self, model: nn.Module, task: Any) -> None:
        """Which tensors of a batch share a sequence length and what pads them, for sequence parallelism: the
        model input's side (its labels too, unless the model is an encoder-decoder, whose labels are the target
        side's)."""
        if not self.layout.sequence_parallel:
            return
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        labels = tuple(getattr(task, "label_names", None) or ("labels",)) + ("shift_labels",)
        fill = {**dict.fromkeys(labels, IGNORE_INDEX), "input_ids": pad, "decoder_input_ids": pad}
        source = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
        if getattr(config, "is_encoder_decoder", False):
            self._sequence_groups = [SequenceGroup(source, fill, "attention_mask"),
                                     SequenceGroup(("decoder_input_ids", "decoder_attention_mask") + labels, fill)]
        else:
            self._sequence_groups = [SequenceGroup(source + labels, fill, "attention_mask")]

    def _pad_sequences(self, batch: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str | None, tuple[int, int]]]:
        """``batch`` padded for sequence parallelism and the lengths :func:`cut_sequences` cuts outputs back to."""
        if not self._sequence_groups:
            return batch, {}
        padded, lengths = pad_sequences(batch, self.layout.tp, self._sequence_groups)
        names = ["encoder", None] if len(lengths) == 2 else [None]
        return padded, {name: side for name, side in zip(names, lengths) if side is not None}

    def context_sharded(self) -> ContextManager[Any]:
        """The context in which forward and backward passes run on sequences cut by :meth:`shard_batch`."""
        return self.context.sharded() if self.context is not None else contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm over every rank's shards to ``max_norm``; returns the norm before
        clipping (identical on every rank)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = global_grad_norm(grads, self.mesh, self.device)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(coef)
        return total

    # -- data and metrics -----------------------------------------------------------------------------------------

    def batch_share(self, rows: int) -> tuple[int, int]:
        """This data-parallel rank's contiguous share of a global batch of ``rows`` samples: ``rows // dp`` each, the
        first ``rows % dp`` ranks one more (as ``torch.tensor_split``); tensor-parallel and pipeline ranks of one
        replica get the same share."""
        size, extra = divmod(rows, self.dp_size)
        return self.dp_rank * size + min(self.dp_rank, extra), size + (self.dp_rank < extra)

    def _dp_group(self) -> dist.ProcessGroup:
        return self.mesh.dp_mesh.get_group()

    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks holding different data: data x context parallel (tensor-parallel and pipeline ranks of one
        replica share its samples; context-parallel ranks hold different tokens of them and count the items of
        their own loss)."""
        return self.mesh.batch_mesh.get_group() if self.batch_ranks > 1 else None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over the ranks holding different data: the data-parallel ranks, times the
        context-parallel ones (a new tensor on the engine's device)."""
        out = tensor.detach().to(self.device).clone()
        group = self.loss_group()
        if group is not None:
            dist.all_reduce(out, group=group)
        return out

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of ``tensor`` over the ranks holding different data (see :meth:`all_reduce_sum`)."""
        out = self.all_reduce_sum(tensor)
        ranks = self.batch_ranks
        return out / ranks if out.is_floating_point() else out.float() / ranks

    def reduce_metrics(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Totals of a model's running sums over every rank, divided by the tensor-parallel size: tensor-parallel
        ranks count the same tokens, and pipeline stages without the loss hold zeros. One all-reduce."""
        names = list(sums)
        flat = torch.cat([sums[k].detach().to(self.device, torch.float64).reshape(-1) for k in names]) if names \
            else torch.zeros(0, dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        flat /= self.layout.tp
        out, start = {}, 0
        for name in names:
            size = sums[name].numel()
            out[name] = flat[start:start + size].view(sums[name].shape)
            start += size
        return out

    def gather_for_metrics(self, value: Any) -> list[Any]:
        """Every data-parallel rank's ``value`` (any picklable object), in rank order."""
        if self.dp_size == 1:
            return [value]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, value, group=self._dp_group())
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save_pretrained(self, model: nn.Module, folder: str | Path, processing_class: Any = None) -> None:
        """Whole weights and config in ``save_pretrained`` format (consolidated from every rank's shards by rank
        0), and the tokenizer/processor; collective. A peft model writes its adapter alone, in peft's format."""
        if is_peft_model(model):
            save_adapter(model, folder, processing_class)
            return
        dcp_checkpoint.save_consolidated(model, folder, processing_class)

    def load_weights(self, model: nn.Module, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """Load whole safetensors weights (every rank reads them; each keeps its shards). Tied parameters may be
        absent from the file. A peft model loads its adapter (saved under any layout)."""
        if is_peft_model(model):
            check_adapter_source(folder, state)
            load_adapter(model, folder)
            return
        state = load_state_dict(folder) if state is None else state
        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        tied = _tied_names(model)
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            first = (missing or result.unexpected_keys)[0]
            raise CheckpointError(f"weights in {folder} do not match the model: "
                                  f"{'missing' if missing else 'unexpected'} {first}")

    def _checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> dict[str, Any]:
        state = {"dcp": dcp_checkpoint.training_state(model, optimizer), "scheduler": lr_scheduler.state_dict(),
                 "rng": capture_rng_state()}
        if self.portable_checkpoints and is_peft_model(model):
            # The adapter, gathered here on the training thread (a collective; rank 0 holds it, None elsewhere): a
            # peft model's portable part is its adapter alone, in peft's format.
            state["adapter"] = gathered_adapter(model)
        return state

    def _write_checkpoint(self, folder: Path, model: nn.Module, state: dict[str, Any], files: Mapping[str, str],
                          processing_class: Any, needed: int, on_saved: Callable[[], None] | None) -> None:
        """Every rank writes its shards (``dcp/``) and RNG state; rank 0 the whole weights consolidated from the
        shards (``save_pretrained`` files), the tokenizer, scheduler and the Trainer's files; collective over the
        checkpoint group (its own group when the write runs in the background)."""
        group = self._checkpoint_group
        with dcp_checkpoint.shared_atomic_folder(folder, group=group, manifest=True, needed_bytes=needed) as tmp:
            (tmp / DCP_DIR).mkdir(exist_ok=True)
            dcp_checkpoint.write_training_state(tmp / DCP_DIR, state["dcp"], model, process_group=group)
            torch.save(state["rng"], tmp / RANK_RNG_NAME.format(rank=self.rank))
            if self.is_main_process:
                if "adapter" in state:
                    write_adapter(model, tmp, state["adapter"])
                elif self.portable_checkpoints:
                    with _quiet_progress_bars():
                        dcp_checkpoint.write_consolidated(tmp / DCP_DIR, tmp, dcp_checkpoint.same_class_factory(model))
                if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                    processing_class.save_pretrained(tmp)
                torch.save(state["scheduler"], tmp / SCHEDULER_NAME)
                torch.save(state["rng"], tmp / RNG_NAME)
                for name, text in files.items():
                    (tmp / name).write_text(text, encoding="utf-8")
        if on_saved is not None:
            on_saved()

    def checkpoint_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """About how many bytes a checkpoint takes: the whole model and optimizer state (the shards of every rank,
        from the global shapes; pipeline stages summed) and, with :attr:`portable_checkpoints`, the whole weights
        again."""
        model_bytes = _global_tensor_bytes(model.state_dict())
        optim_bytes = _global_tensor_bytes(dcp_checkpoint.training_state(model, optimizer).get("optimizer", {}))
        total = torch.tensor([model_bytes, optim_bytes], dtype=torch.float64)
        if self.mesh is not None and self.mesh.pp > 1:  # each pipeline rank holds its own stages
            dist.all_reduce(total, group=self.mesh.pp_mesh.get_group())
        model_bytes, optim_bytes = int(total[0]), int(total[1])
        return model_bytes + optim_bytes + (model_bytes if self.portable_checkpoints else 0)

    def check_free_space(self, folder: Path, needed: int) -> None:
        """Rank 0 checks the filesystem of ``folder``; every rank raises its answer (one collective)."""
        verdict = [None]
        if self.is_main_process:
            try:
                check_free_space(folder, needed)
            except CheckpointError as err:
                verdict = [str(err)]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise CheckpointError(verdict[0])

    def checkpoint_problem(self, folder: str | Path) -> str | None:
        """:func:`~mindformers_py.checkpoint.manifest.manifest_problem` with the checksums split over the ranks (each
        reads every world-size-th file); every rank gets the first problem any rank found."""
        mine = manifest_problem(folder, share=(self.rank, self.world_size))
        found: list[str | None] = [None] * self.world_size
        dist.all_gather_object(found, mine)
        return first_problem(found)

    def load_checkpoint(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        lr_scheduler: Any) -> None:
        """Restore weights, optimizer and scheduler from a checkpoint of any layout: the sharded ``dcp/`` part
        when present (resharded onto this layout), else the whole files of a stand-alone checkpoint."""
        folder = Path(folder)
        if (folder / DCP_DIR / dcp_checkpoint.METADATA_NAME).is_file():
            dcp_checkpoint.load_checkpoint(folder / DCP_DIR, model, optimizer)
        else:
            self.load_weights(model, folder)
            state = torch_load(folder / OPTIMIZER_NAME, "optimizer")
            dcp_checkpoint.load_full_optimizer_state(model, optimizer, state, self._optimizer_names)
        _fit_multi_tensor_kernels(optimizer)  # the loaded param groups carry the saving run's kernel choice
        load_state_into("scheduler", lr_scheduler, folder / SCHEDULER_NAME)

    def load_rng_state(self, folder: str | Path) -> None:
        """Restore this rank's random states (rank 0's, or a stand-alone run's, when the checkpoint has none for
        this rank)."""
        folder = Path(folder)
        own = folder / RANK_RNG_NAME.format(rank=self.rank)
        restore_rng_state(torch_load(own if own.is_file() else folder / RNG_NAME, "RNG state"))


def global_grad_norm(grads: Sequence[torch.Tensor], mesh: ParallelMesh | None, device: torch.device) -> torch.Tensor:
    """The 2-norm of all gradients of the model over every rank, identical on every rank.

    DTensor gradients (tensor-parallel, FSDP-sharded, or both) are grouped by mesh and placements; each group's
    norm is reduced over its mesh (``full_tensor`` of a scalar). Plain gradients are replicated (DDP) and counted
    locally. Pipeline stages hold disjoint parameters, so squares are summed over the pipeline ranks too.
    """
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq = total_sq + norm.float().to(device) ** 2
    if mesh is not None and mesh.pp > 1:
        dist.all_reduce(total_sq, group=mesh.pp_mesh.get_group())
    return total_sq.sqrt()


def _global_tensor_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the whole (unsharded) tensors of a flat state dict: DTensors by their global shape."""
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()  # a DTensor's numel is its global one
    return total


def _fit_multi_tensor_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Turn off the multi-tensor (foreach/fused) kernels in param groups that mix plain tensors and DTensors, or
    DTensors of different meshes, which those kernels refuse. Tensor parallelism without FSDP leaves replicated
    layers (norms, a whole embedding) as plain tensors beside the sharded DTensors."""
    for group in optimizer.param_groups:
        kinds = {p.device_mesh if isinstance(p, DTensor) else None for p in group["params"]}
        if len(kinds) > 1:
            group.update(foreach=False, fused=False)


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share their tensor with an earlier parameter (absent from saved weights)."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(state_name(name))
        seen.add(id(param))
    return tied

