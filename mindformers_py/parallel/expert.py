"""Expert parallelism: the routed experts of every MoE layer split over ranks, tokens sent to them by all-to-all.

Model code stays single-device (:mod:`mindformers_py.layers.moe.layer`): an MoE layer sorts its (token, choice) rows by
expert and calls its :class:`~mindformers_py.layers.moe.layer.GroupedExperts` with those rows and the count of each
expert. This module, applied by :func:`~.parallelize.parallelize` right after tensor parallelism, changes only
what happens around that call:

* **sharding.** The stacked expert weights become DTensors on :attr:`~.mesh.ParallelMesh.expert_mesh`:
  ``Shard(0)`` over ``"ep"`` (each expert-parallel rank holds ``experts / ep`` whole experts) and, under tensor
  parallelism, ``Shard`` of the intermediate dimension over ``"tp"`` (expert tensor parallelism follows the dense
  layers', Megatron's default). The experts' forward runs on the local parts.
* **dispatch / combine.** A forward pre-hook exchanges the per-expert counts (a small all-to-all), then the rows
  themselves with ``all_to_all_single`` (autograd, uneven splits: exactly the routed rows travel, nothing is
  padded), and regroups what arrived by local expert; a forward hook puts the results back in arrival order and
  returns them to their ranks the same way. Under tensor parallelism the input is marked replicated (its gradient
  is summed over ``"tp"`` in backward) and the partial sums the intermediate-dimension shards return are
  all-reduced over ``"tp"``.
* **gradients.** Every rank's loss is its share of the global loss, scaled by the data-parallel size for the data
  parallel engines' averaging (see :mod:`mindformers_py.engine.distributed`). An expert's gradient already holds
  the contributions of all ``ep`` ranks it served, so it is reduced over the ``dp / ep`` ranks holding the same
  expert (``"dp_mod_ep"``) and divided by the whole data (x context) parallel size: each experts module becomes its own FSDP2
  unit on that mesh (replicated, or sharded under ZeRO 2/3) with ``set_gradient_divide_factor(dp)``, applied by
  :func:`apply_expert_data_parallel` before the layers' units, which then leave the experts' parameters alone.

With ``expert_parallel=1`` only the tensor-parallel split applies, and the experts' parameters join the data
parallelism of their layer like any other.

**Adapters on the experts.** peft's LoRA on the stacked expert weights (``target_parameters``, its ``ParamWrapper``)
adds ``scaling · B_e A_e`` to each expert's weight while the experts run; its factors hold every expert and are
replicated like the layer's other parameters. Around those wrappers the update is computed in DTensor's terms
(the factors are handed over as replicated DTensors on the experts' mesh, so each rank adds its own experts' slice of
the update), and in backward DTensor gathers each factor's gradient from the ranks that computed its
experts' parts. Every rank of an expert-parallel group then holds the group's gradient, which data parallelism would
add up ``ep`` times: a gradient hook divides it by ``ep``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..layers.moe.layer import GroupedExperts
from .layout import FSDP, NONE, Layout
from .data import frozen_params, mixed_precision_policy
from .gloo_collectives import use_in_place_collectives
from .mesh import ParallelMesh

# The dimension of each stacked expert weight that tensor parallelism splits: the intermediate one.
_TP_DIM = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}


def grouped_experts(model: nn.Module) -> list[GroupedExperts]:
    """Every MoE layer's experts module in ``model``."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Shard the experts of ``model`` (a model or pipeline stage) over the mesh's expert and tensor-parallel ranks
    and route tokens to them by all-to-all; in place, returns ``model``. A no-op without either split."""
    if mesh.expert_mesh is None:
        return model
    for experts in grouped_experts(model):
        _shard(experts, mesh)
        routing = _ExpertRouting(experts.num_experts, mesh)
        experts.register_forward_pre_hook(routing.dispatch)
        experts.register_forward_hook(routing.combine)
    for wrapper in _expert_adapters(model):
        _replicate_adapter_factors(wrapper, mesh)
    return model


def _expert_adapters(model: nn.Module) -> list[nn.Module]:
    """The outermost peft ``ParamWrapper`` around each experts module (peft nests one per adapted parameter)."""
    found = []
    for module in model.modules():
        if not hasattr(module, "parameter_name") or not hasattr(module, "get_base_layer"):
            continue
        if isinstance(module.get_base_layer(), GroupedExperts) and not any(
                child is module for parent in found for child in parent.modules()):
            found.append(module)
    return found


def _replicate_adapter_factors(wrapper: nn.Module, mesh: ParallelMesh) -> None:
    """Make each peft ``ParamWrapper`` in ``wrapper`` hand its LoRA update to the experts' weight as replicated
    DTensors on the experts' mesh, and divide its factors' gradients by ``ep`` (see the module docstring)."""
    for module in wrapper.modules():
        if not hasattr(module, "parameter_name"):
            continue
        for method in ("get_delta_factors", "get_delta_weight"):  # peft's one-adapter and general paths
            original = getattr(module, method, None)
            if original is not None:
                setattr(module, method, functools.partial(_replicated, original, module, mesh.ep))


def _replicated(method, wrapper: nn.Module, ep: int, *args, **kwargs):
    """``method``'s tensors as replicated DTensors on the mesh of the expert weight ``wrapper`` adapts (which
    expert data parallelism may have extended since), their gradients divided by ``ep``; other values as they
    are. (Scaled here, not by hooks on the factors: data parallelism replaces those parameters.)"""
    out = method(*args, **kwargs)
    weight = wrapper.get_param()
    if not isinstance(weight, DTensor):
        return out
    mesh = weight.device_mesh
    place = lambda t: DTensor.from_local(_ScaledGradient.apply(t, 1.0 / ep), mesh, [Replicate()] * mesh.ndim,  # noqa: E731
                                         run_check=False) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
    return tuple(place(t) for t in out) if isinstance(out, tuple) else place(out)


def apply_expert_data_parallel(model: nn.Module, mesh: ParallelMesh, config: Layout,
                               param_dtype: torch.dtype | None = None) -> nn.Module:
    """Make each experts module of ``model`` its own data-parallel unit over the ranks holding the same experts
    (FSDP2, sharded under ZeRO 2/3, replicated otherwise), dividing gradients by the whole data-parallel size.
    Apply after recompute and before :func:`~.data.apply_data_parallel`; a no-op without expert parallelism."""
    engine = config.data_parallel_engine
    if mesh.ep == 1 or engine == NONE:
        return model
    policy = mixed_precision_policy(param_dtype)
    for experts in grouped_experts(model):
        if engine == FSDP:
            fully_shard(experts, mesh=mesh.expert_dp_mesh, reshard_after_forward=config.zero_stage == 3, mp_policy=policy)
            if mesh.expert_dp_mesh.device_type == "cpu":
                use_in_place_collectives(experts)
        else:
            fsdp_replicate(experts, mesh=mesh.expert_dp_mesh, mp_policy=policy,
                           ignored_params=frozen_params(experts, param_dtype))
        experts.set_gradient_divide_factor(float(mesh.dp * mesh.cp))
        if engine == FSDP and mesh.dp * mesh.cp > mesh.ep:
            # Reduce-scatter a plain sum, then divide: the pre-scaled sum FSDP2 uses for a custom factor is not in
            # gloo. (Only here: on a single-rank shard group FSDP2 already divides while copying, and would twice.)
            experts.set_force_sum_reduction_for_comms(True)
    return model


def _shard(experts: GroupedExperts, mesh: ParallelMesh) -> None:
    """Replace the stacked weights by DTensors: experts split over ``"ep"``, the intermediate dimension over
    ``"tp"``. Every rank holds the same full weights (same seed or checkpoint), so each keeps its slice locally."""
    target = mesh.expert_mesh
    names = target.mesh_dim_names
    for name, param in list(experts.named_parameters(recurse=False)):
        placements = [Shard(0) if dim == "ep" else Shard(_TP_DIM[name]) for dim in names]
        sharded = distribute_tensor(param.detach(), target, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _ExpertRouting:
    """The all-to-all around one experts module (its forward pre-hook and hook), and the tensor-parallel marks.
    What the dispatch learns (split sizes, arrival order) is kept for the combine of the same call."""

    def __init__(self, num_experts: int, mesh: ParallelMesh) -> None:
        self.ep = mesh.ep
        self.local_experts = num_experts // mesh.ep
        self.ep_group = mesh.ep_mesh.get_group() if mesh.ep > 1 else None
        self.tp_group = mesh.tp_mesh.get_group() if mesh.tp > 1 else None
        self.sent: list[int] = []
        self.received: list[int] = []
        self.restore: torch.Tensor | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        tokens, counts = args  # (R, H) grouped by expert; (E,) rows per expert
        if self.ep_group is not None:
            arriving = torch.empty_like(counts)
            dist.all_to_all_single(arriving, counts, group=self.ep_group)
            arriving = arriving.view(self.ep, self.local_experts)  # rows from each rank for each local expert
            self.sent = counts.view(self.ep, self.local_experts).sum(1).tolist()
            self.received = arriving.sum(1).tolist()
            rows = funcol.all_to_all_single_autograd(tokens, self.received, self.sent, self.ep_group)
            # Rows arrive grouped by source rank, then by local expert; the experts want them by local expert.
            expert = torch.arange(self.local_experts, device=counts.device).repeat(self.ep)
            order = torch.argsort(expert.repeat_interleave(arriving.reshape(-1)), stable=True)
            self.restore = torch.argsort(order)
            tokens, counts = rows.index_select(0, order), arriving.sum(0)  # (index_select: see MoE._route)
        if self.tp_group is not None:
            tokens = _ReplicatedInput.apply(tokens, self.tp_group)
        return tokens, counts

    def combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.tp_group is not None:
            output = _SumPartials.apply(output, self.tp_group)
        if self.ep_group is None:
            return output
        return funcol.all_to_all_single_autograd(output.index_select(0, self.restore), self.sent, self.received,
                                                 self.ep_group)


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _ReplicatedInput(torch.autograd.Function):
    """Identity forward; in backward the gradient is summed over the tensor-parallel ranks, each of which used the
    (replicated) input with its own shard of the weights."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumPartials(torch.autograd.Function):
    """Sum of the tensor-parallel ranks' partial outputs; the gradient of a sum reaches every partial unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = tensor.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
