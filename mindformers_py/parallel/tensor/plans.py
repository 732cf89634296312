"""Tensor parallelism from the plans a model declares, applied with DTensor's ``parallelize_module``.

A model declares how its layers shard with HF's plan strings (``GPTConfig.base_model_tp_plan`` for the base
model, ``_tp_plan`` on the head); this module maps each string to one of torch's parallel styles:

=========================  =================================================================================
plan string                torch style
=========================  =================================================================================
``colwise``                ``ColwiseParallel()``: output features split, input replicated
``rowwise``                ``RowwiseParallel()``: input features split, output all-reduced (reduce-scattered
                           over the sequence with sequence parallelism)
``embedding_rowwise``      ``RowwiseParallel(input_layouts=Replicate())``: vocabulary rows split, looked-up
                           vectors all-reduced. Only with ``vocab_emb_dp=False``.
``colwise_rep``            ``ColwiseParallel(output_layouts=Replicate())``: output features split, the outputs
                           all-gathered (a projection whose output enters the residual stream whole on every
                           rank: multi-token prediction's ``eh_proj``, Megatron's column-parallel one; not with
                           ``use_seq_parallel``)
``colwise_gather_output``  ``ColwiseParallel(output_layouts=Replicate())``: vocabulary split, logits gathered.
                           Only with ``vocab_emb_dp=False``, where in training the logits are instead kept
                           sharded (``Shard(-1)`` DTensor) for ``loss_parallel``; in eval mode (evaluation,
                           generation) they are gathered into an ordinary full tensor.
``replicated_with_grad_``  ``SequenceParallel(sequence_dim=2)`` on a per-head norm (Qwen3's ``q_norm`` /
``allreduce``              ``k_norm``): its weight whole on every rank (a ``Replicate`` DTensor), its input the
                           rank's heads (B, T, heads, hs) marked sharded on the heads, so the weight's gradient,
                           a partial sum over this rank's heads, is summed over the ranks.
``replicated``             nothing: the module stays whole on every rank, which computes the same result
                           (multi-head latent attention's down-projections and their norms, whose inputs and
                           output gradients are whole on every rank); sequence parallelism leaves its norms
                           alone (their input is the whole sequence, gathered at the attention's input).
``shared_by_heads``        an identity on a tensor every rank's heads read (latent attention's rotary key):
                           its gradient, each rank's heads' part, is summed over the ranks.
=========================  =================================================================================

With ``vocab_emb_dp=True`` (MindFormers' default) the embedding and the LM head stay whole on every
tensor-parallel rank, as in MindFormers; the plan entries for them are then not applied.

Sequence parallelism (``use_seq_parallel``, torchtitan's recipe): between transformer sublayers the residual
stream is split along the sequence (``Shard(1)``) across the tensor-parallel ranks. Every norm gets
``SequenceParallel``; the attention and MLP blocks get ``PrepareModuleInput`` that all-gathers the sequence before
their column-parallel projections; their row-parallel projections reduce-scatter back to ``Shard(1)``. The
stream is cut into sequence shards at the embedding dropout (``<base>.drop``; BERT's is its embedding norm +
dropout), after the position embeddings were added, and the head (LM head, classifier, QA outputs, MLM head) and a
pooler all-gather it again; norms and vocabulary-parallel decoders inside such a head see the whole sequence.

Model code never changes: layers compute with local sizes (``view(b, t, -1, head_dim)``), so a rank holding
half the heads simply sees half the heads.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ...errors import ConfigError, invalid_choice
from ...layers import RMSNorm
from ...layers.loss.fused_head import SEQUENCE_SHARDED_INPUT
from .adapters import adapter_styles

PLAN_STYLES = ("colwise", "colwise_rep", "rowwise", "embedding_rowwise", "colwise_gather_output",
               "replicated_with_grad_allreduce", "replicated", "shared_by_heads")
# Where a per-head norm's input keeps its heads: (B, T, heads, head_dim), as layers.attention applies them.
_HEADS_DIM = 2
# Where the residual stream is cut into sequence shards: the base model's embedding dropout, which runs after
# token and position embeddings are summed (so positions see the whole sequence).
SEQUENCE_SCATTER_MODULE = "drop"
NORM_TYPES = (nn.LayerNorm, RMSNorm)


class _Replicated(ParallelStyle):
    """The plan's ``replicated``: the module whole on every rank, as it is."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module


class _GradientSummed(ParallelStyle):
    """The plan's ``shared_by_heads``: the module's first input passes unchanged; its gradient, the part this rank's
    heads gave it, is summed over the ranks (the input marked a ``Replicate`` DTensor whose local gradient is
    ``Partial``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_gradient(_module: nn.Module, args: tuple) -> tuple:
            shared = DTensor.from_local(args[0], device_mesh, [Replicate()], run_check=False)
            return (shared.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(sum_gradient)
        return module


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The full plan of ``model``: module-name pattern (``*`` for one name part) -> plan string.

    HF models merge the config's ``base_model_tp_plan`` (prefixed with ``base_model_prefix``) with the head's
    ``_tp_plan`` in ``model.tp_plan``; a bare module with a ``config`` gets the base plan under ``model.``.
    """
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "model")
    return {f"{prefix}.{k}": v for k, v in base.items()}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")) + r"\Z")


def _matching(model: nn.Module, key: str) -> list[str]:
    pattern = _pattern(key)
    return [name for name, _ in model.named_modules() if name and pattern.match(name)]


def _styles(
    model: nn.Module, plan: Mapping[str, str], *, sequence_parallel: bool, vocab_parallel: bool, gather_logits: bool
) -> dict[str, ParallelStyle]:
    """Module name -> torch parallel style for every module the plan (and sequence parallelism) touches."""
    seq = Shard(1)
    styles: dict[str, ParallelStyle] = {}
    block_inputs: set[str] = set()
    whole = _whole_sequence_modules(model) if sequence_parallel else []
    inside_whole = lambda name: any(name.startswith(f"{w}.") for w in whole)  # noqa: E731
    for key, kind in plan.items():
        if kind not in PLAN_STYLES:
            raise invalid_choice(f"tp_plan[{key!r}]", kind, PLAN_STYLES)
        for name in _matching(model, key):
            if inside_whole(name):  # inside a head that gathers the sequence at its own input (BERT's MLM decoder)
                if kind == "colwise_gather_output" and vocab_parallel:
                    styles[name] = ColwiseParallel(input_layouts=Replicate(),
                                                   output_layouts=Replicate() if gather_logits else Shard(-1),
                                                   use_local_output=gather_logits)
                continue
            if kind == "colwise":
                styles[name] = ColwiseParallel()
                block_inputs.add(name.rpartition(".")[0])
            elif kind == "colwise_rep":
                styles[name] = ColwiseParallel(output_layouts=Replicate())
            elif kind == "rowwise":
                styles[name] = RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
            elif kind == "replicated_with_grad_allreduce":
                styles[name] = SequenceParallel(sequence_dim=_HEADS_DIM, use_local_output=True)
            elif kind == "replicated":
                styles[name] = _Replicated()
            elif kind == "shared_by_heads":
                styles[name] = _GradientSummed()
            elif kind == "embedding_rowwise":
                if vocab_parallel:
                    styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            elif vocab_parallel:  # colwise_gather_output
                styles[name] = ColwiseParallel(
                    input_layouts=seq if sequence_parallel else Replicate(),
                    output_layouts=Replicate() if gather_logits else Shard(-1),
                    use_local_output=gather_logits,
                )
            elif sequence_parallel:  # a whole head still needs the whole sequence
                styles[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
    if not sequence_parallel:
        return styles
    for name, module in model.named_modules():
        if isinstance(module, NORM_TYPES) and not inside_whole(name) and name not in styles:  # (not per-head norms)
            # Local outputs, like every other style here: residual sums then never mix DTensors with tensors
            # (post-norm blocks add a norm's output to a sublayer's).
            styles[name] = SequenceParallel(use_local_output=True)
    for block in block_inputs:
        # Only the first input (the hidden states) changes layout; the others (mask, rotary, cache) pass through.
        arity = _positional_arity(model.get_submodule(block))
        styles[block] = PrepareModuleInput(
            input_layouts=(seq,) + (None,) * (arity - 1),
            desired_input_layouts=(Replicate(),) + (None,) * (arity - 1),
            use_local_output=True,
        )
    # A later pipeline stage holds no embeddings: its ``drop`` is None and its input arrives already split.
    bases = [(name, child) for name, child in model.named_children() if hasattr(child, "layers")]
    if not any(hasattr(child, SEQUENCE_SCATTER_MODULE) for _, child in bases):
        raise ConfigError(
            f"use_seq_parallel=True is not supported for {type(model).__name__}: its base model has no "
            f"'{SEQUENCE_SCATTER_MODULE}' module where the sequence could be split"
        )
    for name, child in bases:
        if isinstance(getattr(child, SEQUENCE_SCATTER_MODULE, None), nn.Module):
            styles[f"{name}.{SEQUENCE_SCATTER_MODULE}"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True)
    # Task heads beside the base model (a classifier's ``score``, ``qa_outputs``, an MLM head) and a pooler need the
    # whole sequence too.
    for name in whole:
        if name not in styles:
            styles[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
    return styles


def _whole_sequence_modules(model: nn.Module) -> list[str]:
    """Modules that take the whole sequence under sequence parallelism, as the model declares them in
    ``_whole_sequence_modules`` (its heads that pool or score positions) and its base model does (a pooler); those
    this model (or pipeline stage) holds."""
    names = list(getattr(model, "_whole_sequence_modules", ()))
    base = getattr(model, "base_model_prefix", None)
    base_module = getattr(model, base, None) if base else None
    if isinstance(base_module, nn.Module) and base_module is not model:
        names += [f"{base}.{name}" for name in getattr(base_module, "_whole_sequence_modules", ())]
    held = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = getattr(model.get_submodule(owner) if owner else model, leaf, None)
        if isinstance(module, nn.Module) and any(True for _ in module.parameters()):
            held.append(name)
    return held


def _positional_arity(module: nn.Module) -> int:
    """How many positional inputs ``module.forward`` takes (callers in our layers pass all of them)."""
    params = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    gather_logits: bool = False,
    plan: Mapping[str, str] | None = None,
) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following its declared plan; returns ``model``.

    Args:
        model: an HF-style model (or a pipeline stage of one) whose layers compute with local sizes.
        tp_mesh: the tensor-parallel mesh (``ParallelMesh.tp_mesh``).
        sequence_parallel: split the residual stream along the sequence between sublayers.
        vocab_parallel: shard the embedding and LM head by vocabulary (``vocab_emb_dp=False``); in training mode
            the logits come out as a ``DTensor`` sharded on the vocabulary, for ``loss_parallel``, in eval mode
            as an ordinary full tensor.
        gather_logits: with ``vocab_parallel``, always gather the logits into an ordinary full tensor (the plan's
            literal ``colwise_gather_output``, for a loss computed outside ``loss_parallel``).
        plan: module-name pattern -> plan string; default :func:`tp_plan_of` ``(model)``. Patterns that match no
            module are skipped, so one plan serves every pipeline stage.
    """
    if tp_mesh.ndim != 1:
        raise ConfigError(f"tensor-parallel mesh has {tp_mesh.ndim} dimensions; expected a 1-D mesh")
    plan = tp_plan_of(model) if plan is None else dict(plan)
    if not plan:
        raise ConfigError(f"model_parallel > 1 is not supported for {type(model).__name__}: it declares no tp_plan")
    styles = _styles(model, plan, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                     gather_logits=gather_logits)
    styles = adapter_styles(model, styles, tp=tp_mesh.size())  # peft layers: base layer and LoRA sharded alike
    if sequence_parallel and not any(isinstance(s, SequenceParallel) for s in styles.values()):
        raise ConfigError(f"use_seq_parallel=True is not supported for {type(model).__name__}: it has no norm layers")
    tied = _tied_pairs(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, styles)
    _retie(model, tied)
    for name, param in model.named_parameters():  # SequenceParallel re-creates parameters as trainable
        if name in frozen:
            param.requires_grad_(False)
    if vocab_parallel:
        for key, kind in plan.items():
            for name in _matching(model, key):
                module = model.get_submodule(name)
                if kind == "embedding_rowwise":
                    # DTensor's embedding backward yields a whole (Replicate) gradient for a vocabulary-sharded
                    # table; keep only this rank's rows at once instead of holding the full gradient.
                    for param in module.parameters(recurse=False):
                        if param.requires_grad:  # (a frozen table, under an adapter, has no gradient)
                            param.register_hook(functools.partial(_to_placements, placements=param.placements))
                elif kind == "colwise_gather_output" and not gather_logits:
                    module.register_forward_hook(_full_logits_outside_training)
                    # (what a fused loss reading the head's weight needs to know of its input: layers/loss/fused_head)
                    setattr(module, SEQUENCE_SHARDED_INPUT, sequence_parallel and not any(
                        name.startswith(f"{w}.") for w in _whole_sequence_modules(model)))
    return model


def _to_placements(grad: torch.Tensor, placements: tuple) -> torch.Tensor:
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def _full_logits_outside_training(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a vocabulary-parallel head: whole logits in eval mode, where no ``loss_parallel`` runs."""
    if not module.training and isinstance(output, DTensor):
        return output.full_tensor()
    return output


def _tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, owner) parameter names sharing one tensor, e.g. ``("lm_head.weight", "model.embed_tokens.weight")``.

    ``parallelize_module`` replaces each module's parameters separately, which would silently untie them."""
    seen: dict[int, str] = {}
    pairs = []
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if id(param) in seen:
                pairs.append((full, seen[id(param)]))
            else:
                seen[id(param)] = full
    return pairs


def _retie(model: nn.Module, pairs: list[tuple[str, str]]) -> None:
    for alias, owner in pairs:
        owner_param = model.get_parameter(owner)
        alias_param = model.get_parameter(alias)
        if owner_param is alias_param:
            continue
        if isinstance(owner_param, DTensor) != isinstance(alias_param, DTensor) or (
            isinstance(owner_param, DTensor) and owner_param.placements != alias_param.placements
        ):
            raise ConfigError(f"tied weights {owner} and {alias} are sharded differently by the tp_plan")
        module_name, _, pname = alias.rpartition(".")
        setattr(model.get_submodule(module_name), pname, owner_param)
