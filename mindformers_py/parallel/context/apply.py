"""Context parallelism: every sequence split over ``context_parallel`` ranks, applied to a model from outside.

Model code does not change (a model declares, ``parallel/`` applies). :func:`apply_context_parallel`, called by
:func:`~mindformers_py.parallel.parallelize.parallelize` after tensor and expert parallelism and before recompute, changes only:

* **attention**: the ``core`` of every self-attention :class:`~mindformers_py.layers.Attention` and
  :class:`~mindformers_py.layers.latent_attention.LatentAttention` (the part selective recompute also swaps) becomes one that attends over the whole sequence (:mod:`.attention`: Ulysses,
  ring or hybrid); cross-attention gathers the encoder's keys and values. Projections, rotary positions and the
  output projection stay local. Multi-token prediction's blocks attend over the sequence of the stack they follow
  (its view, below).
* **masks**: a forward pre-hook on each stack of layers (``GPTModel``, ``BertModel``, each ``T5Stack``,
  ``ViTModel``) gathers the small per-token inputs of the forward pass (padding mask and positions, a few integers
  per token) from the group and records the whole sequence's :class:`~.attention.AttentionView`, which its
  attention cores read. The mask the model builds from its local inputs is not used.
* **the sequence cut**: text batches are cut on the data side (:mod:`.data`, through
  :meth:`ContextParallel.shard_batch`); a model whose input is not tokens (ViT) is cut at the embedding dropout
  ``<base>.drop``, the place sequence parallelism cuts too.
* **heads over the whole sequence** (pooled classifiers, question answering) get their input gathered (in sequence
  order) on every rank; per-token heads (language modelling, token classification) stay local.
* **MoE**: tokens are routed where they are; each MoE layer's router statistics (per-sequence sums) are summed over
  the group so the router losses are the whole sequence's.

Everything above is active only inside :meth:`ContextParallel.sharded` (the training step); evaluation and
generation run each sequence whole on every rank with the model's own attention.

Losses: every rank's loss is the sum over the items it scores divided by the items of the whole step summed over
data x context parallel ranks (a pooled head on every rank counts its items on every rank), and gradients are
averaged over those ranks (:attr:`~mindformers_py.parallel.mesh.ParallelMesh.batch_mesh`), so a step gives one batch's gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...layers import Attention, attention_core
from ...layers.block import TransformerBlock
from ...layers.latent_attention import LatentAttention
from ...layers.moe.layer import MoE
from ...layers.position_bias import RelativePositionBias
from ..layout import Layout
from .attention import (
    AttentionView,
    ContextGroups,
    context_attention,
    gather_sequence,
    gathered_cross_attention,
    sum_over_group,
)
from .data import BatchSharding, StreamSpec, shard_batch
from .layout import ContextLayout
from ..mesh import ParallelMesh

# The module before the layers where a model that embeds its own sequence (images) is cut: sequence parallelism's
# cut point too (mindformers_py.parallel.tensor.plans.SEQUENCE_SCATTER_MODULE).
EMBEDDING_CUT_MODULE = "drop"
# Inputs a stack's forward may take, from which the local token count is read (the first present).
_TOKEN_INPUTS = ("position_ids", "input_ids", "inputs_embeds", "hidden_states")


class _Stack:
    """One stack of layers and the view of the sequence its current forward pass attends over."""

    def __init__(self, module: nn.Module, causal: bool) -> None:
        self.module = module
        self.causal = causal
        self.sliding_window = getattr(getattr(module, "config", None), "sliding_window", None)
        bias = getattr(module, "position_bias", None)
        self.bias = bias if isinstance(bias, RelativePositionBias) else None
        self.view: AttentionView | None = None
        self.signature = inspect.signature(module.forward)
        self._windowed: dict[int | None, tuple[AttentionView, AttentionView]] = {}

    def view_with_window(self, window: int | None) -> AttentionView | None:
        """The current view for a layer whose own sliding window is ``window`` (layers may mix sliding and full
        attention: Qwen2's and Qwen3's ``layer_types``); one per window and forward pass, so its masks are derived
        once."""
        view = self.view
        if view is None or view.sliding_window == window:
            return view
        cached = self._windowed.get(window)
        if cached is None or cached[0] is not view:
            cached = self._windowed[window] = (view, dataclasses.replace(view, sliding_window=window))
        return cached[1]


class ContextParallel:
    """A run's context parallelism: its process groups, the stacks whose attention it serves, whether the current
    forward passes are split (:meth:`sharded`) and how batches are cut (:meth:`shard_batch`).

    Build one per run with the mesh, apply it to the model (or each pipeline stage) with
    :func:`apply_context_parallel`, and tell it the model with :meth:`prepare` so it can cut batches."""

    def __init__(self, mesh: ParallelMesh, config: Layout) -> None:
        if mesh.cp == 1 or mesh.cp_mesh is None:
            raise ConfigError("ContextParallel needs context_parallel > 1 and a process group")
        ring, ulysses = mesh.cp_ring_mesh, mesh.cp_ulysses_mesh
        self.groups = ContextGroups(
            cp_group=mesh.cp_mesh.get_group(), cp=mesh.cp, cp_rank=mesh.cp_rank,
            ring_group=ring.get_group() if ring is not None else None, ring=mesh.cp // mesh.cp_ulysses,
            ring_rank=ring.get_local_rank() if ring is not None else 0,
            ulysses_group=ulysses.get_group() if ulysses is not None else None, ulysses=mesh.cp_ulysses,
            ulysses_rank=ulysses.get_local_rank() if ulysses is not None else 0)
        self.algo = config.context_parallel_algo
        self.active = False
        self.stacks: list[_Stack] = []
        self.batch_sharding: BatchSharding | None = None
        self.task: Any = None
        """The task the model trains (the engine's task registry entry; None: the model's own ``task_spec``): its
        model input, labels and kind of items decide how batches are cut and which heads gather the sequence."""

    @property
    def size(self) -> int:
        """Context-parallel ranks."""
        return self.groups.cp

    # -- when forward passes are split ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def sharded(self) -> Iterator[None]:
        """Forward (and backward) passes inside run on this rank's chunks of sequences cut by :meth:`shard_batch`."""
        before, self.active = self.active, True
        try:
            yield
        finally:
            self.active = before
            if not before:
                for stack in self.stacks:
                    stack.view = None

    def recompute_context(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for torch's checkpointing: a recomputed forward (in backward, maybe after other
        micro-batches' forwards under a pipeline schedule) sees the views of the forward pass it repeats."""
        snapshot = [(stack, stack.view) for stack in self.stacks]

        @contextlib.contextmanager
        def restored() -> Iterator[None]:
            current = [(stack, stack.view) for stack in self.stacks]
            for stack, view in snapshot:
                stack.view = view
            try:
                yield
            finally:
                for stack, view in current:
                    stack.view = view

        return contextlib.nullcontext(), restored()

    # -- the data side -------------------------------------------------------------------------------------------

    def prepare(self, model: nn.Module) -> None:
        """Learn from ``model`` (the whole model, or a pipeline rank's cut of it) how its batches are cut: its task,
        which of its sequences are causal, its positions and padding id."""
        config = getattr(model, "config", None)
        task = self.task_of(model)
        stacks = _stacks(model) or self.stacks
        if not stacks:
            raise ConfigError(f"context_parallel={self.size} is not supported for {type(model).__name__}: it has no "
                              "stack of mindformers_py TransformerBlocks whose attention could be split")
        pad = getattr(config, "pad_token_id", None)
        pad = 0 if pad is None else pad
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        source = None
        if task is None or task.model_input == "input_ids":
            takes_positions = "position_ids" in inspect.signature(model.forward).parameters
            positions = None
            if takes_positions:
                positions = "padding_aware" if getattr(config, "padded_positions", False) else "arange"
            source = StreamSpec(causal=stacks[0].causal, pad_token_id=pad, positions=positions,
                                first_position=getattr(config, "first_position", 0) or 0)
        target = None
        if encoder_decoder:
            target = StreamSpec(causal=stacks[-1].causal, pad_token_id=pad, positions=None)
        tokens_task = task is not None and task.items == "tokens" and not encoder_decoder
        self.batch_sharding = BatchSharding(
            cp_rank=self.groups.cp_rank, ring=self.groups.ring, ulysses=self.groups.ulysses, source=source,
            target=target, shift_labels=bool(task is not None and task.shifted_labels),
            token_labels=tokens_task and not (task is not None and task.shifted_labels),
            decoder_inputs=getattr(model, "prepare_decoder_input_ids_from_labels", None) if encoder_decoder else None,
            tokens_ahead=int(getattr(model, "tokens_ahead", 0) or 0))

    def task_of(self, model: nn.Module) -> Any:
        """The task ``model`` trains: :attr:`task`, else the model's own ``task_spec`` (None for a base model)."""
        return self.task if self.task is not None else getattr(model, "task_spec", None)

    def shard_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's part of a batch (see :mod:`.data`)."""
        if self.batch_sharding is None:
            raise ConfigError("ContextParallel.shard_batch needs the model first: call prepare(model)")
        return shard_batch(batch, self.batch_sharding)

    # -- building a view -----------------------------------------------------------------------------------------

    def view_of(self, stack: _Stack, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                batch: int, local_length: int, device: torch.device) -> AttentionView:
        """The whole sequence behind this rank's ``local_length`` tokens: the padding masks and positions of every
        rank, gathered (a few integers per token) and put in sequence order."""
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ConfigError("context parallelism needs a 2-D attention_mask (batch, tokens); a ready 4-D mask cannot "
                              "be split over the ranks")
        n = local_length
        mask = attention_mask.long() if attention_mask is not None else torch.ones(batch, n, dtype=torch.long,
                                                                                   device=device)
        positions = position_ids.long().expand(batch, n) if position_ids is not None \
            else torch.zeros(batch, n, dtype=torch.long, device=device)
        flag = torch.full((batch, 1), int(attention_mask is not None), dtype=torch.long, device=device)
        local = torch.cat([mask, positions, flag], dim=1)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.groups.cp_group)
        layout = ContextLayout(n * self.size, self.groups.ring, self.groups.ulysses,
                               balanced=stack.causal and self.groups.ring > 1)
        restore = layout.restore().to(device)
        whole_mask = torch.cat([p[:, :n] for p in parts], dim=1)[:, restore]
        whole_positions = torch.cat([p[:, n:2 * n] for p in parts], dim=1)[:, restore]
        had_mask = any(bool(p[:, -1].any()) for p in parts)
        return AttentionView(layout, whole_mask if had_mask else None,
                             whole_positions if position_ids is not None else None, stack.causal,
                             stack.sliding_window, stack.bias)


def _stack_attentions(module: nn.Module) -> list[Attention | LatentAttention]:
    return [m for layer in module.layers if layer is not None for m in layer.modules()
            if isinstance(m, (Attention, LatentAttention))]


def _holds_blocks(module: nn.Module, directly: bool) -> bool:
    """Whether ``module``'s ``layers`` are transformer blocks (``directly``; recompute's checkpoint wrappers seen
    through), or only wrap some (multi-token prediction's modules, each around a block)."""
    layers = getattr(module, "layers", None)
    if not isinstance(layers, nn.Module):
        return False
    direct = any(isinstance(getattr(m, "_checkpoint_wrapped_module", m), TransformerBlock) for m in layers.children())
    return direct if directly else not direct and any(isinstance(m, TransformerBlock) for m in layers.modules())


def _stacks(model: nn.Module) -> list[_Stack]:
    """The stacks of layers in ``model`` (modules whose ``layers`` are transformer blocks), in forward order."""
    found = []
    for module in model.modules():
        if _holds_blocks(module, directly=True):
            attentions = [a for a in _stack_attentions(module) if not a.cross_attention]
            if attentions:
                found.append(_Stack(module, attentions[0].is_causal))
    return found


def _followers(model: nn.Module) -> list[nn.Module]:
    """Modules whose ``layers`` wrap transformer blocks (multi-token prediction's modules): they run after the
    model's stack, on its sequence, so their attention reads that stack's view."""
    return [module for module in model.modules() if _holds_blocks(module, directly=False)]


class _SelfAttentionCore:
    """The ``core`` of a self-attention layer under context parallelism (the layer's own when nothing is split),
    with the layer's own sliding window (``window``: None for full attention)."""

    def __init__(self, stack: _Stack, context: ContextParallel, window: int | None = None) -> None:
        self.stack = stack
        self.context = context
        self.window = window

    def __call__(self, q, k, v, mask, is_causal: bool, dropout: float = 0.0, scale: float | None = None,
                 return_weights: bool = False):
        view = self.stack.view_with_window(self.window)
        if view is None:
            return attention_core(q, k, v, mask, is_causal, dropout, scale, return_weights)
        return context_attention(q, k, v, view, self.context.groups, dropout, scale), None


class _CrossAttentionCore:
    """The ``core`` of a cross-attention layer under context parallelism: keys and values of the whole encoder
    output, gathered."""

    def __init__(self, stack: _Stack, context: ContextParallel) -> None:
        self.stack = stack
        self.context = context

    def __call__(self, q, k, v, mask, is_causal: bool, dropout: float = 0.0, scale: float | None = None,
                 return_weights: bool = False):
        if self.stack.view is None:
            return attention_core(q, k, v, mask, is_causal, dropout, scale, return_weights)
        return gathered_cross_attention(q, k, v, mask, self.context.groups, dropout, scale), None


def apply_context_parallel(model: nn.Module, context: ContextParallel) -> nn.Module:
    """Make ``model`` (a model or one pipeline stage of it) split its sequences over ``context``'s ranks; in place,
    returns ``model``. See the module docstring for what changes."""
    stacks = _stacks(model)
    if not stacks:
        raise ConfigError(f"context_parallel={context.size} is not supported for {type(model).__name__}: it has no "
                          "stack of mindformers_py TransformerBlocks whose attention could be split")
    task = context.task_of(model)
    for stack in stacks:
        context.stacks.append(stack)
        stack.module.register_forward_pre_hook(_view_hook(stack, context), with_kwargs=True)
        for attention in _stack_attentions(stack.module):
            if attention.cross_attention:
                attention.core = _CrossAttentionCore(stack, context)
            else:
                attention.core = _SelfAttentionCore(stack, context, attention.sliding_window)
    for follower in _followers(model):
        for attention in _stack_attentions(follower):
            attention.core = _SelfAttentionCore(stacks[-1], context, attention.sliding_window)
    if task is not None and task.model_input != "input_ids":
        _cut_embeddings(model, stacks[0], context)
    if task is not None and task.items != "tokens":
        _gather_before_heads(model, stacks[-1], context)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.register_forward_hook(_sum_router_statistics(context))
    return model


def _view_hook(stack: _Stack, context: ContextParallel):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not context.active:
            stack.view = None
            return
        inputs = stack.signature.bind_partial(*args, **kwargs).arguments
        reference = next((inputs[k] for k in _TOKEN_INPUTS if isinstance(inputs.get(k), torch.Tensor)), None)
        if reference is None:  # the model embeds its own sequence: the cut at its embeddings records the view
            return
        batch = reference.shape[0] if reference.dim() > 1 else 1
        mask = inputs.get("attention_mask")
        positions = inputs.get("position_ids")
        if isinstance(positions, torch.Tensor):
            batch = max(batch, positions.shape[0])
        stack.view = context.view_of(stack, mask if isinstance(mask, torch.Tensor) else None,
                                     positions if isinstance(positions, torch.Tensor) else None,
                                     batch, reference.shape[-1] if reference.dim() == 2 else reference.shape[1],
                                     reference.device)

    return hook


def _cut_embeddings(model: nn.Module, stack: _Stack, context: ContextParallel) -> None:
    """Cut a model that embeds its own sequence (ViT) at the input of ``<base>.drop`` (before sequence
    parallelism's cut there: this hook runs first) and record the view of the whole sequence."""
    drop = getattr(stack.module, EMBEDDING_CUT_MODULE, None)
    if not isinstance(drop, nn.Module):  # a later pipeline stage: its input arrives already cut
        return

    def cut(module: nn.Module, args: tuple):
        if not context.active:
            return None
        hidden = args[0]  # (B, T, C), the whole sequence
        layout = ContextLayout(hidden.shape[1], context.groups.ring, context.groups.ulysses,
                               balanced=stack.causal and context.groups.ring > 1)
        stack.view = AttentionView(layout, None, None, stack.causal, stack.sliding_window, stack.bias)
        index = layout.indices(context.groups.cp_rank).to(hidden.device)
        return (hidden.index_select(1, index), *args[1:])

    drop.register_forward_pre_hook(cut, prepend=True)


def _gather_before_heads(model: nn.Module, stack: _Stack, context: ContextParallel) -> None:
    """Heads over the whole sequence (pooled classifiers, question answering) get the whole hidden states, in
    sequence order, on every rank."""
    from ..tensor import _whole_sequence_modules as whole_sequence_modules

    def gather(module: nn.Module, args: tuple):
        view = stack.view
        if not context.active or view is None:
            return None
        return (gather_sequence(args[0], view.layout, context.groups.cp_group), *args[1:])

    for name in whole_sequence_modules(model):
        model.get_submodule(name).register_forward_pre_hook(gather)


def _sum_router_statistics(context: ContextParallel):
    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        if not context.active:
            return None
        out, stats = output
        return out, sum_over_group(stats, context.groups.cp_group)

    return hook
