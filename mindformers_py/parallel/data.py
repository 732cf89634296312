"""Data parallelism and ZeRO over the data-parallel ranks, with torch's engines.

``optimizer_shard`` (the ZeRO stage) maps onto torch as follows; the memory columns are per rank, N being the
number of ranks that shard (``dp_shard``):

=====  ==============================================  ==========  =========  ===============  ============
stage  engine                                          parameters  gradients  optimizer state  between steps
=====  ==============================================  ==========  =========  ===============  ============
0      ``replicate`` (DDP built on FSDP2's machinery)   full        full       full             full
1      DDP + ``ZeroRedundancyOptimizer``                full        full       1/N (per tensor) full
2      FSDP2 ``fully_shard(reshard_after_forward=      full in     1/N        1/N              params 1/N
       False)``                                        fwd/bwd
3      FSDP2 ``fully_shard(reshard_after_forward=      1/N, one    1/N        1/N              params 1/N
       True)``                                         layer full
=====  ==============================================  ==========  =========  ===============  ============

Honest notes on the mapping:

* Stage 1 is the faithful ZeRO-1: gradients are all-reduced as in plain DDP and every rank keeps whole
  parameters, but each rank holds AdamW state (and runs the update) only for the parameters it owns, then
  broadcasts them (``torch.distributed.optim.ZeroRedundancyOptimizer``, which partitions by whole tensors, so the
  split is only as even as the tensor sizes allow). That optimizer handles ordinary tensors only, so under tensor
  parallelism (DTensor parameters) stage 1 runs as stage 2 and says so in the log.
* FSDP2 has no "shard only gradients and optimizer state" mode: its stage 2 here is FSDP1's ``SHARD_GRAD_OP``.
  Parameters are all-gathered once per step for forward and kept until backward is done (no second all-gather),
  gradients are reduce-scattered, the optimizer updates the 1/N shard, and between steps the parameters rest
  sharded. So it holds *less* than textbook ZeRO-2 between steps and the same while computing.
* Stage 3 re-gathers each layer's parameters in backward (``reshard_after_forward=True``); only one layer is
  whole at a time.
* HSDP: when ``dp_shard`` < data-parallel size the mesh given to FSDP2 is 2-D ``(dp_replicate, dp_shard)``:
  state is sharded within groups of ``dp_shard`` ranks and replicated across groups (gradients reduce-scattered
  in a group, then all-reduced across groups).

Context-parallel ranks hold the same samples but different tokens: they join the data-parallel ranks in every
engine above (replicas, ZeRO-1's partition, FSDP2's shard dimension), as torchtitan folds ``cp`` into its FSDP mesh
(:attr:`~.mesh.ParallelMesh.batch_mesh`, :attr:`~.mesh.ParallelMesh.fsdp_mesh`).

Each transformer layer (the model's ``_no_split_modules`` classes) is its own FSDP unit, then the root takes the
rest (embeddings, final norm, head: tied weights stay in one unit), as torchtitan does. bf16 training uses
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 master weights and optimizer state,
bf16 compute, fp32 gradient reduction.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..layers.loss.fused_head import ROWS_OVER_BATCH
from ..utils.state_names import state_name
from .layout import DDP_ZERO1, NONE, REPLICATE, Layout
from .gloo_collectives import use_in_place_collectives
from .mesh import ParallelMesh

logger = logging.getLogger(__name__)



def mixed_precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2 policy computing in ``param_dtype`` (None: the parameters' own dtype) and reducing gradients in
    fp32, so bf16 runs keep fp32 master weights and optimizer state."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers (its ``_no_split_modules`` classes, HF's convention), in order; each becomes
    its own FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        config_owner = next((m for m in model.modules() if getattr(m, "_no_split_modules", None)), None)
        names = set(getattr(config_owner, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names or _wrapped_name(module) in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def vocabulary_units(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, output head) of ``model`` (or of the model a peft model adapts) when they are separate
    weights, each then an FSDP unit of its own, as torchtitan shards them: at a 128K vocabulary the two are a fifth to
    a third of a 1-8B model, and in the root's unit both would be gathered whole for the whole step. Tied, they stay
    in the root's unit (one tensor); a pipeline stage without one of them gets None for it."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    try:
        embedding = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    except (AttributeError, NotImplementedError):  # a stage whose embeddings were cut away
        return None, None
    embedding = embedding if isinstance(embedding, nn.Module) and any(True for _ in embedding.parameters()) else None
    head = head if isinstance(head, nn.Module) and any(True for _ in head.parameters()) else None
    if embedding is not None and head is not None and \
            {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}:
        return None, None
    return embedding, head


def _wrapped_name(module: nn.Module) -> str:
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    return type(inner).__name__ if inner is not None else ""


@contextmanager
def held_frozen(model: nn.Module) -> Iterator[None]:
    """Within, every parameter of ``model`` is frozen (an evaluation-only model: a layout wrapping it then leaves them
    out of data parallelism's replicated copies, :func:`frozen_params`); afterwards each takes back its
    ``requires_grad``, found by name (wrapping may replace a parameter: a ZeRO-3 shard, an expert-parallel slice)."""
    trained = {state_name(name) for name, p in model.named_parameters() if p.requires_grad}
    model.requires_grad_(False)
    try:
        yield
    finally:
        for name, param in model.named_parameters():
            if state_name(name) in trained:
                param.requires_grad_(True)


def frozen_params(module: nn.Module, param_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """``module``'s parameters that do not train (``requires_grad`` off: a LoRA run's base weights) and already
    compute in ``param_dtype``: a replicated data-parallel unit leaves them alone. They have no gradient to reduce
    and are the same on every rank, while FSDP2's replicate copies the parameters it manages into a second, whole
    buffer for every forward and backward, even over one rank: a frozen model would be held twice through each step.
    A frozen head split over the data-parallel ranks (:mod:`.frozen_head`) is left alone in any dtype: its rows differ
    from rank to rank, and it casts them to the compute dtype itself."""
    return {p for m in module.modules() for p in m.parameters(recurse=False) if not p.requires_grad
            and (param_dtype is None or p.dtype == param_dtype or getattr(m, ROWS_OVER_BATCH, False))}


def apply_data_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    config: Layout,
    param_dtype: torch.dtype | None = None,
    layers: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Apply ``config``'s data parallelism to ``model`` in place (after tensor parallelism and recompute);
    returns ``model``, whose parameter names are unchanged.

    Args:
        model: the (possibly tensor-parallel) model or pipeline stage.
        mesh: the run's :class:`ParallelMesh`.
        config: the layout; its ``zero_stage`` picks the engine (:attr:`Layout.data_parallel_engine <.layout.Layout.data_parallel_engine>`).
        param_dtype: compute dtype under FSDP2 (e.g. ``torch.bfloat16``); None computes in the parameters' dtype.
        layers: the modules made separate FSDP units; default :func:`layer_modules`.
    """
    engine = config.data_parallel_engine
    if engine == NONE:
        return model
    policy = mixed_precision_policy(param_dtype)
    units = list(layer_modules(model) if layers is None else layers)
    if engine == REPLICATE:
        for unit in units:
            fsdp_replicate(unit, mesh=mesh.batch_mesh, mp_policy=policy, ignored_params=frozen_params(unit, param_dtype))
        fsdp_replicate(model, mesh=mesh.batch_mesh, mp_policy=policy, ignored_params=frozen_params(model, param_dtype))
        return model
    if engine == DDP_ZERO1:
        if param_dtype not in (None, torch.float32):
            logger.info("ZeRO-1 runs on DDP, which keeps parameters in their dtype; use autocast for %s compute",
                        param_dtype)
        ddp_replicate(model, device_mesh=mesh.batch_mesh)
        return model
    if config.zero_stage == 1:
        logger.info("optimizer_shard=1 with model_parallel=%d runs as ZeRO-2 (FSDP2 reshard_after_forward=False): "
                    "ZeroRedundancyOptimizer cannot update tensor-parallel DTensor parameters", config.tp)
    reshard = config.zero_stage == 3

    def shard(module: nn.Module, reshard_after_forward: bool) -> None:
        fully_shard(module, mesh=mesh.fsdp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        if mesh.fsdp_mesh.device_type == "cpu":  # gloo: its tensor-form collectives stage through a whole copy
            use_in_place_collectives(module)

    for unit in units:
        shard(unit, reshard)
    embedding, head = vocabulary_units(model) if layers is None else (None, None)
    if embedding is not None:  # gathered at the start of forward only (its gradient needs no whole weight)
        shard(embedding, reshard)
    if head is not None:  # used last in forward and first in backward: kept whole between them, as the root
        shard(head, False)
    # The root's parameters (embeddings, head) are needed first in backward: never reshard them after forward.
    shard(model, False)
    return model


def shard_optimizer(optimizer: torch.optim.Optimizer, mesh: ParallelMesh,
                    config: Layout) -> torch.optim.Optimizer:
    """The optimizer to train a model prepared by :func:`apply_data_parallel` with.

    Under ZeRO-1 on DDP, ``optimizer`` (built as usual over the model's parameter groups, its state still empty)
    is replaced by a ``ZeroRedundancyOptimizer`` over the data-parallel group running the same optimizer class
    with the same groups and hyper-parameters on this rank's share of the parameters. Otherwise ``optimizer`` is
    returned as it is: FSDP2's sharded parameters already make its state 1/N.
    """
    if config.data_parallel_engine != DDP_ZERO1:
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params):
        raise ConfigError("optimizer_shard=1 on DDP needs ordinary tensors; DTensor parameters take the FSDP2 path")
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=mesh.batch_mesh.get_group(),
                                   **defaults)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward passes (off during gradient accumulation's
    inner micro-steps, on for the last one); a no-op without data parallelism."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)
