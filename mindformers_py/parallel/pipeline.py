"""Pipeline parallelism: a causal LM cut into stages by layers, run by ``torch.distributed.pipelining``.

The cut follows the plans the model declares (``config.base_model_pp_plan`` and the head's ``_pp_plan``): modules
listed before ``layers`` (token and position embeddings) live on the first stage, ``layers`` is split into
contiguous ranges, and modules listed after it (final norm, LM head) live on the last stage, where the loss is
computed. Modules outside the plans hold no trained weights (rotary tables, dropout) and every stage keeps them.

A stage module shares the original model's submodules (no copy) and keeps their names, so its state-dict keys
are those of the full model (``model.layers.5.mlp.up_proj.weight`` stays that on whichever rank owns layer 5):
sharded checkpoints written under one layout load under another. Each stage is wrapped in torch's
``PipelineStage`` and driven by one of its schedules: ``gpipe`` (``ScheduleGPipe``), ``1f1b``
(``Schedule1F1B``) or ``interleaved_1f1b`` (``ScheduleInterleaved1F1B``, several stage modules per rank,
assigned round-robin: rank r holds stages r, r + pp, r + 2·pp, ...).

The loss of a micro-batch is its token-summed cross-entropy divided by the token count of the whole batch
(``num_items_in_batch``), and gradients are not rescaled by the schedule, so a pipelined step computes the
same loss and gradients as one stand-alone forward/backward of the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor.parallel import loss_parallel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import ConfigError
from ..layers import IGNORE_INDEX, build_attention_mask, causal_lm_loss
from .config import ParallelConfig

LAYERS_KEY = "layers"


def layer_ranges(num_layers: int, num_chunks: int) -> list[range]:
    """Split ``num_layers`` transformer layers into ``num_chunks`` contiguous ranges, as even as possible.

    Left-over layers go to the earliest chunks: the last chunk also runs the LM head and the loss, whose cost
    grows with the vocabulary, so it is the one that gets the smaller share.
    """
    if num_chunks < 1 or num_layers < num_chunks:
        raise ConfigError(
            f"pipeline chunks={num_chunks} is not valid for num_hidden_layers={num_layers}; "
            f"expected between 1 and {num_layers} chunks (each needs a layer)"
        )
    base, extra = divmod(num_layers, num_chunks)
    ranges, start = [], 0
    for chunk in range(num_chunks):
        size = base + (1 if chunk < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_for_rank(pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank``: round-robin ("looped"), as interleaved 1F1B expects."""
    return [pp_rank + chunk * pp_size for chunk in range(virtual_stages)]


class LayerSlice(nn.ModuleDict):
    """Some consecutive layers of a ``ModuleList``, keyed by their index in the full model.

    Iterating yields the layers (not the keys, unlike ``ModuleDict``), so code written for the full
    ``ModuleList`` runs unchanged, while parameter names keep the full model's numbering.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def _plan_names(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """From the model's pipeline plan (transformers merges ``config.base_model_pp_plan`` under the base-model
    prefix with the head's ``_pp_plan``): the base model's modules before ``layers`` (first stage), those after
    it (last stage), and the head's modules (last stage)."""
    prefix = model.base_model_prefix + "."
    plan = list(getattr(model, "_pp_plan", None) or {})
    base = [name[len(prefix):] for name in plan if name.startswith(prefix)]
    if LAYERS_KEY not in base:
        raise ConfigError(
            f"pipeline_stage > 1 is not supported for {type(model).__name__}: it declares no pipeline plan "
            f"(base_model_pp_plan) with a '{LAYERS_KEY}' entry; use pipeline_stage=1"
        )
    cut = base.index(LAYERS_KEY)
    head = [name for name in plan if not name.startswith(prefix)]
    return base[:cut], base[cut + 1 :], head


class CausalLMStage(nn.Module):
    """One pipeline chunk of a decoder-only causal LM (``GPTForCausalLM`` and models built like it).

    It holds the chunk's layers and, on the first chunk, the embeddings, on the last the final norm and the
    head, under the full model's attribute names (``model.embed_tokens``, ``model.layers.<i>``, ``lm_head``).
    ``forward`` maps token ids (first chunk) or hidden states (others) to hidden states (others than the last)
    or logits (last); positions run 0..T-1, as in training without a cache.

    Args:
        model: the full causal LM; its submodules are shared, not copied.
        layers: indices of the transformer layers this chunk runs.
        is_first: whether the chunk embeds the tokens.
        is_last: whether the chunk applies the final norm and the LM head.

    Attributes:
        stage_index: index of this chunk in the whole pipeline (set by :func:`split_model`).
        pp_rank: pipeline rank holding this chunk (per-stage settings such as recompute layer counts read it).
        sequence_shards: sequence-parallel shards of the hidden states this chunk receives (the tensor-parallel
            size with ``use_seq_parallel``), so positions and masks are built for the whole sequence.
        config, base_model_prefix, tp_plan: the full model's, for the tensor-parallel and recompute engines.
    """

    def __init__(self, model: nn.Module, layers: range, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = model.config
        # What the other parallel engines read from an HF model: the plans, the layer class, the tied weights.
        self.base_model_prefix = model.base_model_prefix
        self.tp_plan = dict(getattr(model, "tp_plan", None) or {})
        self._no_split_modules = list(getattr(model, "_no_split_modules", None) or ())
        self.is_first, self.is_last = is_first, is_last
        self.layer_ids = layers
        self.stage_index = 0
        self.pp_rank = 0
        self.sequence_shards = 1
        before, after, head = _plan_names(model)
        prefix = model.base_model_prefix
        source_base = getattr(model, prefix)
        base = nn.Module()
        # Weight-free helpers (rotary tables, dropout) are needed by every chunk.
        planned = {*before, *after, LAYERS_KEY}
        for name, child in source_base.named_children():
            if name not in planned:
                base.add_module(name, child)
        for names, owned in ((before, is_first), (after, is_last)):
            for name in names:
                base.add_module(name, getattr(source_base, name, None) if owned else None)
        all_layers = getattr(source_base, LAYERS_KEY)
        base.add_module(LAYERS_KEY, LayerSlice({str(i): all_layers[i] for i in layers}))
        self.add_module(prefix, base)
        self._base_name = prefix
        self._head_names = head
        for name in head:
            self.add_module(name, getattr(model, name) if is_last else None)

    @property
    def base(self) -> nn.Module:
        """The container of embeddings, layers and norm (``self.model`` for GPT)."""
        return getattr(self, self._base_name)

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs`` (B, T) token ids on the first chunk, (B, T, C) hidden states elsewhere; returns (B, T, C)
        hidden states, or (B, T, V) logits on the last chunk. ``attention_mask`` is the HF padding mask (B, T)."""
        base, cfg = self.base, self.config
        length = inputs.shape[1] if self.is_first else inputs.shape[1] * self.sequence_shards
        position_ids = torch.arange(length, device=inputs.device)[None]
        if self.is_first:
            hidden = base.embed_tokens(inputs)  # (B, T, C)
            if getattr(base, "embed_positions", None) is not None:
                hidden = hidden + base.embed_positions(position_ids)
            hidden = base.drop(hidden) if hasattr(base, "drop") else hidden
        else:
            hidden = inputs
        mask = build_attention_mask(
            attention_mask, query_length=length, kv_length=length,
            sliding_window=getattr(cfg, "sliding_window", None), device=hidden.device,
        )
        rotary = base.rotary_emb(position_ids, hidden.dtype) if getattr(base, "rotary_emb", None) is not None else None
        for layer in base.layers:
            hidden = layer(hidden, mask, rotary)
        if self.is_last:
            if getattr(base, "norm", None) is not None:
                hidden = base.norm(hidden)
            for name in self._head_names:
                hidden = getattr(self, name)(hidden)
        return hidden


def split_model(model: nn.Module, num_chunks: int, chunk_ids: list[int], pp_size: int = 1) -> list[CausalLMStage]:
    """The stage modules ``chunk_ids`` of ``model`` cut into ``num_chunks`` chunks by :func:`layer_ranges`
    (chunk ``i`` runs on pipeline rank ``i % pp_size``)."""
    ranges = layer_ranges(model.config.num_hidden_layers, num_chunks)
    parts = []
    for i in chunk_ids:
        part = CausalLMStage(model, ranges[i], is_first=i == 0, is_last=i == num_chunks - 1)
        part.stage_index, part.pp_rank = i, i % pp_size
        parts.append(part)
    return parts


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a next-token loss in ``labels`` (shifted by one, ``-100`` ignored)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _pipeline_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None,
                   loss_scale: float = 1.0) -> torch.Tensor:
    """Loss of one micro-batch: token-summed cross-entropy over the whole batch's token count, times
    ``loss_scale`` (a data-parallel engine that averages gradients over N ranks passes N)."""
    loss = causal_lm_loss(logits, labels, num_items_in_batch)
    return loss * loss_scale if loss_scale != 1.0 else loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a DTensor (tensor parallel, FSDP), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# Schedules kept per input shape (torch fixes a stage's activation shapes when it first runs): training and
# evaluation batches, and a few sequence lengths of dynamically padded data, each keep theirs.
MAX_CACHED_SCHEDULES = 8


class PipelineParallel:
    """This rank's share of a pipelined causal LM and the schedules that run it.

    Build it with :func:`build_pipeline`. ``model_parts`` are the stage modules this rank holds (one, or
    ``virtual_pipeline_stages`` for interleaved 1F1B); give their parameters to the optimizer. :meth:`step`
    runs forward and backward of a whole per-rank batch and returns the batch loss on every pipeline rank;
    calling the object runs forward only (evaluation) and returns loss and logits on every pipeline rank.

    torch's ``PipelineStage`` infers the shapes of the activations it sends on its first run and keeps them, so
    a schedule is built per batch shape (a different sequence length or batch size gets its own).

    Attributes:
        model_parts: this rank's stage modules, in stage order.
        stage_ids: the pipeline stage index of each model part.
        pp_group: the process group of this rank's pipeline.
        pp_rank: this rank's position in the pipeline.
        pp_size: number of pipeline ranks.
        micro_batches: micro-batches each batch is split into.
        has_first_stage, has_last_stage: whether this rank embeds the tokens / computes the loss.
    """

    def __init__(self, model_parts: list[nn.Module], stage_ids: list[int], num_stages: int,
                 parallel_config: ParallelConfig, pp_group: dist.ProcessGroup, device: torch.device,
                 tied_group: dist.ProcessGroup | None = None, tied_names: Sequence[str] = ()) -> None:
        self.model_parts = model_parts
        self.stage_ids = stage_ids
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.device = device
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.micro_batches = parallel_config.micro_batches
        self.has_first_stage = 0 in stage_ids
        self.has_last_stage = num_stages - 1 in stage_ids
        self.training = True
        self._schedule_cls = get_schedule_class(parallel_config.torch_schedule_name)
        self._vocab_parallel_loss = parallel_config.vocab_parallel
        self._tied_group = tied_group
        self._tied_names = list(tied_names)
        self._schedules: dict[tuple[int, ...], Any] = {}

    # -- parameters and modes ---------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Trainable parameters of every model part on this rank."""
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters with the full model's names (each name lives on exactly one pipeline rank, except tied
        embeddings, which the first and last stage both hold)."""
        for part in self.model_parts:
            yield from part.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the full model's state dict (full-model key names)."""
        out: dict[str, Any] = {}
        for part in self.model_parts:
            out.update(part.state_dict())
        return out

    def train(self, mode: bool = True) -> PipelineParallel:
        """Set training mode on every model part."""
        self.training = mode
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> PipelineParallel:
        """Set evaluation mode on every model part."""
        return self.train(False)

    @property
    def tied_copy_names(self) -> list[str]:
        """Names of this rank's parameters that duplicate another rank's (the last stage's copy of a tied
        embedding); a global gradient norm must count them once."""
        if self._tied_group is None or self.has_first_stage:
            return []
        return [name for name, _ in self.named_parameters() if name in self._tied_names]

    # -- running --------------------------------------------------------------------------------------------------

    def _schedule_for(self, shape: tuple[int, ...]) -> Any:
        schedule = self._schedules.pop(shape, None)
        if schedule is None:
            if len(self._schedules) >= MAX_CACHED_SCHEDULES:
                self._schedules.pop(next(iter(self._schedules)))
            stages = [PipelineStage(part, i, self.num_stages, self.device, group=self.pp_group)
                      for part, i in zip(self.model_parts, self.stage_ids)]
            # Each micro-batch loss is already divided by the whole batch's tokens: no scaling by the schedule.
            common = dict(n_microbatches=self.micro_batches, loss_fn=_pipeline_loss, scale_grads=False)
            if issubclass(self._schedule_cls, PipelineScheduleSingle):
                schedule = self._schedule_cls(stages[0], **common)
            else:
                schedule = self._schedule_cls(stages, **common)
        self._schedules[shape] = schedule  # most recently used last
        return schedule

    def _run(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
             num_items_in_batch: Any, loss_scale: float, backward: bool) -> tuple[torch.Tensor, Any]:
        """One schedule run; returns the summed micro-batch losses (on every rank) and the last stage's output."""
        kwargs = {}
        if attention_mask is not None and not bool(attention_mask.all()):
            kwargs["attention_mask"] = attention_mask
        args = (input_ids,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        schedule = self._schedule_for(tuple(input_ids.shape))
        loss_kwargs = {"num_items_in_batch": num_items_in_batch, "loss_scale": loss_scale}
        # Vocabulary-sharded logits (a DTensor) need torch's parallel cross-entropy.
        context = loss_parallel() if self._vocab_parallel_loss else contextlib.nullcontext()
        with context:
            run = schedule.step if backward else schedule.eval
            output = run(*args, target=target, losses=losses, return_outputs=not backward, loss_kwargs=loss_kwargs,
                         **kwargs)
        total = torch.stack([_local(loss.detach()).float() for loss in losses]).sum() if losses \
            else torch.zeros((), device=self.device)
        # The loss is known on the last rank only; the caller logs it on every rank.
        dist.broadcast(total, group_src=self.pp_size - 1, group=self.pp_group)
        return total, output

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             num_items_in_batch: int | torch.Tensor | None = None, loss_scale: float = 1.0,
             sync_tied: bool = True) -> torch.Tensor:
        """Forward and backward of one per-rank batch, split into the configured micro-batches.

        Every rank of the pipeline passes the same batch (the first stage reads ``input_ids``, the last
        ``labels``). ``num_items_in_batch`` normalises the summed token loss (HF's meaning); by default it is
        this batch's loss-token count, which makes the loss the token mean. ``loss_scale`` multiplies the loss
        before backward. Gradients accumulate into the parameters. ``sync_tied`` then sums the gradients of a tied
        embedding between the first and last stage: pass False for all but the last batch of an accumulation
        (a sum of already-summed gradients would count the earlier batches twice). Returns the backpropagated
        batch loss (detached) on every rank of the pipeline.
        """
        if num_items_in_batch is None:
            num_items_in_batch = max(count_loss_tokens(labels), 1)
        total, _ = self._run(input_ids, labels, attention_mask, num_items_in_batch, loss_scale, backward=True)
        if sync_tied:
            self._sync_tied_grads()
        return total

    def forward_backward(self, micro_batches: Sequence[Mapping[str, Any]],
                         num_items_in_batch: int | torch.Tensor | None = None, loss_scale: float = 1.0) -> torch.Tensor:
        """:meth:`step` over each gradient-accumulation batch (``input_ids``, ``labels``, optional
        ``attention_mask``) of one optimizer step; returns the summed loss. ``num_items_in_batch`` is the loss-token
        count of the whole step, so the sum is the step's loss; by default it is counted from ``micro_batches``."""
        if num_items_in_batch is None:
            num_items_in_batch = max(sum(count_loss_tokens(b["labels"]) for b in micro_batches), 1)
        total = None
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            loss = self.step(batch["input_ids"], batch["labels"], batch.get("attention_mask"), num_items_in_batch,
                             loss_scale, sync_tied=i == last)
            total = loss if total is None else total + loss
        return total

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                 **unused: Any) -> CausalLMOutputWithPast:
        """Forward only (evaluation), like calling the whole model: returns the loss (with ``labels``) and the
        logits on every pipeline rank. A batch whose size the micro-batches do not divide is padded with
        ignored rows. Other model arguments (``use_cache``, ...) are accepted and ignored."""
        rows = input_ids.shape[0]
        extra = -rows % self.micro_batches
        if extra:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(extra, -1)])
            if labels is not None:
                labels = torch.cat([labels, torch.full_like(labels[:1], IGNORE_INDEX).expand(extra, -1)])
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask[:1].expand(extra, -1)])
        # The schedules always compute a loss; without labels it is over no token and not reported.
        targets = labels if labels is not None else torch.full_like(input_ids, IGNORE_INDEX)
        if num_items_in_batch is None:
            num_items_in_batch = max(count_loss_tokens(targets), 1)
        loss, output = self._run(input_ids, targets, attention_mask, num_items_in_batch, 1.0, backward=False)
        logits = self._broadcast_logits(output, tuple(input_ids.shape))
        return CausalLMOutputWithPast(loss=loss if labels is not None else None, logits=logits[:rows])

    def _broadcast_logits(self, output: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """The last stage's logits on every pipeline rank."""
        if self.has_last_stage:
            logits = output.full_tensor() if hasattr(output, "full_tensor") else output
            meta = [tuple(logits.shape), logits.dtype]
        else:
            meta = [None, None]
        dist.broadcast_object_list(meta, group_src=self.pp_size - 1, group=self.pp_group)
        if not self.has_last_stage:
            logits = torch.empty(meta[0], dtype=meta[1], device=self.device)
        dist.broadcast(logits.contiguous(), group_src=self.pp_size - 1, group=self.pp_group)
        return logits

    def _sync_tied_grads(self) -> None:
        """Sum the gradients of weights shared by the first and last stage (tied input/output embeddings):
        each stage holds its own copy, and both copies must take the same update."""
        if self._tied_group is None:
            return
        for part in self.model_parts:
            params = dict(part.named_parameters(remove_duplicate=False))
            for name in self._tied_names:
                param = params.get(name)
                if param is not None and param.grad is not None:
                    dist.all_reduce(_local(param.grad), group=self._tied_group)

    # -- the original model ---------------------------------------------------------------------------------------

    def keep_local_stages(self, model: nn.Module) -> nn.Module:
        """Cut ``model`` (the model the stages were made from) down to what this rank holds, in place: the
        layers of its stages (under their original indices), and the embeddings / final norm and head only on
        the first / last stage. Its parameters are then exactly this rank's, under the full model's names, so
        optimizers, gradient norms and sharded checkpoints can use it as "the model". Returns ``model``."""
        parts = [part for part in self.model_parts if isinstance(part, CausalLMStage)]
        if len(parts) != len(self.model_parts):
            raise TypeError("keep_local_stages needs the CausalLMStage parts built by build_pipeline")
        before, after, head = _plan_names(model)
        base = getattr(model, model.base_model_prefix)
        layers = {str(i): base.layers[i] for part in parts for i in part.layer_ids}
        base.layers = LayerSlice(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))
        for name in before:
            if not self.has_first_stage and getattr(base, name, None) is not None:
                setattr(base, name, None)
        for name in after:
            if not self.has_last_stage and getattr(base, name, None) is not None:
                setattr(base, name, None)
        for name in head:
            if not self.has_last_stage and getattr(model, name, None) is not None:
                setattr(model, name, None)
        return model


def _tied_weight_names(model: nn.Module) -> list[str]:
    """Names of the weights the first and last stage would both hold (tied input/output embeddings)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return [*tied, *tied.values()] if isinstance(tied, Mapping) else list(tied)


def _pp_group(mesh: Any) -> dist.ProcessGroup:
    """The pipeline process group of ``mesh``: a :class:`~.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"``
    dimension, a 1-D pipeline ``DeviceMesh``, or None (the whole world)."""
    if mesh is None:
        return dist.group.WORLD
    if hasattr(mesh, "pp_mesh"):
        return mesh.pp_mesh.get_group()
    if isinstance(mesh, DeviceMesh) and mesh.ndim > 1:
        return mesh["pp"].get_group()
    return mesh.get_group()


def _tied_group(group: dist.ProcessGroup, pp_rank: int, pp_size: int) -> dist.ProcessGroup | None:
    """The group of this pipeline's first and last rank, which both hold the tied embedding (None elsewhere)."""
    if pp_size == 2:
        return group
    if pp_rank not in (0, pp_size - 1):
        return None
    ranks = dist.get_process_group_ranks(group)
    # Only the two members take part in creating the group; the middle ranks hold no tied weight.
    return dist.new_group([ranks[0], ranks[-1]], use_local_synchronization=True)


def build_pipeline(
    model: nn.Module,
    parallel_config: ParallelConfig,
    mesh: Any = None,
    device: torch.device | str | None = None,
    parallelize: Callable[[CausalLMStage], nn.Module | None] | None = None,
) -> PipelineParallel:
    """Cut ``model`` into pipeline stages and keep this rank's, ready to run with torch's schedules.

    Args:
        model: a causal LM declaring a pipeline plan (e.g. ``GPTForCausalLM``), with the same weights on every
            rank (same seed or same checkpoint). Its submodules are shared by the stage modules; either drop the
            other references to it, or cut it down with :meth:`PipelineParallel.keep_local_stages`, so the layers
            of other stages are freed.
        parallel_config: gives ``pipeline_stage``, ``virtual_pipeline_stages``, ``micro_batch_num``,
            ``pipeline_schedule`` (and, for the stages' inputs and the loss, sequence and vocabulary parallelism).
        mesh: the run's :class:`~.mesh.ParallelMesh`, a ``DeviceMesh`` with a ``"pp"`` dimension or a 1-D
            pipeline mesh; None uses the whole world as the pipeline.
        device: where the stage modules run (default: the current CUDA device with NCCL, else CPU).
        parallelize: applied to each stage module after the cut (tensor parallel, recompute, data parallel /
            ZeRO, in torchtitan's order; ``part.pp_rank`` gives the stage for per-stage settings); it may return
            a wrapping module or modify the part in place and return None.
    """
    pp, vpp = parallel_config.pp, parallel_config.vpp
    group = _pp_group(mesh)
    if dist.get_world_size(group) != pp:
        raise ConfigError(
            f"pipeline_stage={pp} does not match the pipeline process group of {dist.get_world_size(group)} ranks"
        )
    pp_rank = dist.get_rank(group)
    if device is None:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    device = torch.device(device)
    num_chunks = pp * vpp
    chunk_ids = stage_ids_for_rank(pp_rank, pp, vpp)
    parts: list[nn.Module] = []
    for part in split_model(model, num_chunks, chunk_ids, pp):
        part.sequence_shards = parallel_config.tp if parallel_config.sequence_parallel else 1
        part.to(device)
        if parallelize is not None:
            part = parallelize(part) or part
        parts.append(part)
    tied_names = _tied_weight_names(model) if pp > 1 else []
    tied_group = _tied_group(group, pp_rank, pp) if tied_names else None
    return PipelineParallel(parts, chunk_ids, num_chunks, parallel_config, group, device, tied_group, tied_names)
