"""``parallelize``: apply a resolved :class:`~.layout.Layout` to a model in torchtitan's fixed order.

1. tensor parallelism (and sequence / vocabulary parallelism) from the model's declared plans (:mod:`.tensor`);
2. expert parallelism: MoE experts sharded over the expert (and tensor) parallel ranks, tokens exchanged by
   all-to-all (:mod:`.expert`); a frozen output head split by rows over the data-parallel ranks when asked
   (:mod:`.frozen_head`);
3. context parallelism: attention over sequences split across ranks (:mod:`.context`);
4. activation recomputation around whole layers or parts of them (:mod:`.recompute`), which sees the attention
   context parallelism installed;
5. optionally ``torch.compile`` of each transformer layer;
6. data parallelism: first each experts module over the ranks holding the same experts, then DDP, ZeRO-1, FSDP2
   or HSDP over the data-parallel ranks (:mod:`.expert`, :mod:`.data`).

The order matters: FSDP2 must see the final (DTensor, checkpoint-wrapped) parameters so it shards what tensor and
expert parallelism left on each rank and gathers around the recomputed regions. Pipeline parallelism cuts the model
first and calls :func:`parallelize` on each stage module (``stage`` its index, for per-stage recompute counts).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .tensor.adapters import adapted_model
from .compile import compile_layers as compile_each_layer
from .layout import FSDP, Layout
from .context.apply import ContextParallel, apply_context_parallel
from .context.checks import check_compile
from .data import apply_data_parallel
from .expert import apply_expert_data_parallel, apply_expert_parallel
from .frozen_head import shard_frozen_head
from .mesh import ParallelMesh
from .recompute import apply_recompute
from .tensor import apply_tensor_parallel


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    compile_layers: bool = False,
    compile_mode: str | None = None,
    compile_backend: str | None = None,
    stage: int = 0,
    context: ContextParallel | None = None,
    materialize: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Apply ``layout`` to ``model`` (or one pipeline stage of it) in place; returns ``model``.

    Args:
        model: the model, already on this rank's device, built identically on every rank (same seed or same
            checkpoint), so replicated parts agree everywhere.
        layout: the resolved layout (:meth:`ParallelConfig.resolve <.config.ParallelConfig.resolve>`).
        mesh: the run's mesh (:func:`~.mesh.build_mesh`).
        param_dtype: compute dtype for FSDP2's mixed precision (``torch.bfloat16`` for bf16 training).
        compile_layers: ``torch.compile`` each transformer layer (before data parallelism, as torchtitan does).
        compile_mode: ``torch.compile`` mode for ``compile_layers`` (None: torch's default).
        compile_backend: ``torch.compile`` backend for ``compile_layers`` (None: inductor).
        stage: pipeline stage index of ``model`` (0 without pipeline parallelism).
        context: the run's :class:`~.context.apply.ContextParallel` when ``context_parallel > 1`` (one for all pipeline
            stages; the engine cuts batches and turns it on for training steps with it); None makes one, kept on
            the model as ``model.context_parallel``.
        materialize: for a model whose weights are still on ``meta`` (built for its layout to fill only its shards),
            what gives them values; called once the shards are laid out: after FSDP2 has sharded them (ZeRO 2/3),
            before the data-parallel engines that hold whole replicas (DDP, replicate), which need values to start.
    """
    # A peft model's adapters live inside its base model, under the base model's module names (which the plans
    # name); data parallelism wraps the peft model itself, so adapters outside the base (prompts) are reduced too.
    inner = adapted_model(model)
    if mesh.tp > 1:
        apply_tensor_parallel(inner, mesh.tp_mesh, sequence_parallel=layout.sequence_parallel,
                              vocab_parallel=layout.vocab_parallel)
    apply_expert_parallel(inner, mesh)
    if layout.frozen_head_sharded:
        shard_frozen_head(inner, mesh.batch_mesh)
    context_fn = None
    check_compile(mesh.cp, compile_layers)
    if mesh.cp > 1:
        context = context or ContextParallel(mesh, layout)
        apply_context_parallel(inner, context)
        model.context_parallel = context
        context_fn = context.recompute_context
    apply_recompute(inner, layout.recompute, stage, context_fn=context_fn)
    if compile_layers:
        compile_each_layer(inner, compile_mode, compile_backend or "inductor")
    sharded_by_fsdp = layout.data_parallel_engine == FSDP
    if materialize is not None and not sharded_by_fsdp:
        materialize(model)
    apply_expert_data_parallel(model, mesh, layout, param_dtype=param_dtype)
    apply_data_parallel(model, mesh, layout, param_dtype=param_dtype)
    if materialize is not None and sharded_by_fsdp:
        materialize(model)
    return model
