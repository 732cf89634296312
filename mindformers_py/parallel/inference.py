"""A model sharded for generation: tensor, expert and pipeline parallelism without the training machinery.

Every rank runs the same ``generate`` loop on the same inputs; the layout only changes what one forward pass does:

* **tensor parallelism** applies the model's declared plan (:func:`~.tensor.apply_tensor_parallel`): each rank holds
  its share of the heads and the MLP (so its KV cache holds only its heads), the row-parallel projections all-reduce,
  and a vocabulary-sharded head gathers the logits in eval mode, so every rank sees the same logits;
* **expert parallelism** splits an MoE model's experts over the ``expert_parallel`` ranks
  (:func:`~.expert.apply_expert_parallel`); they all hold the same batch, and each token's rows travel to the ranks
  of its experts by all-to-all and back;
* **pipeline parallelism** gives each rank a contiguous range of layers (:func:`cut_for_generation`): a rank receives
  the previous stage's hidden states, runs its layers with its own KV cache, and hands them on; the last stage's
  logits are broadcast to every stage, whose ``generate`` loops then choose the same tokens.

Because every rank sees identical logits, greedy decoding is token-identical to one process (up to float rounding
of the sharded sums, which never changed a token in the tests), and sampling is identical when every rank starts
from the same random state.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import ConfigError
from ..models.cache_names import cache_output, output_cache
from .config import ParallelConfig
from .layout import Layout
from .expert import apply_expert_parallel
from .mesh import ParallelMesh
from .pipelining.stages import layer_ranges, stage_plan
from .tensor import apply_tensor_parallel


def inference_layout(parallel_config: ParallelConfig | dict, model_config: Any = None) -> Layout:
    """The layout a pool of generation workers runs, resolved once: the sizes as given (a ``stand_alone`` config
    asking for ``model_parallel=2`` means two processes), checked against the model. A mapping may leave out ``micro_batch_num``
    (pipeline micro-batches do not apply to generation). Refused in one line: ``auto_parallel`` (the planner plans
    training), sequence and context parallelism (a decode step has one token), data parallelism other than the ranks that hold an
    MoE model's experts, and pipeline stages of an encoder-decoder."""
    if isinstance(parallel_config, Mapping) and "micro_batch_num" not in parallel_config:
        parallel_config = {**parallel_config, "micro_batch_num": parallel_config.get("pipeline_stage", 1)}
    config = ParallelConfig.coerce(parallel_config, "parallel_config")
    if config.parallel_mode == "auto_parallel":
        raise ConfigError("parallel_config.parallel_mode='auto_parallel' plans training layouts; for generation give "
                          "model_parallel, pipeline_stage (and expert_parallel) in a 'semi_auto_parallel' config")
    if config.use_seq_parallel:
        raise ConfigError("parallel_config.use_seq_parallel=True does not apply to generation (a decode step has one "
                          "token to split); set it to False")
    if config.context_parallel > 1:
        raise ConfigError(f"parallel_config.context_parallel={config.context_parallel} does not apply to generation (it "
                          "splits training sequences; a decode step has one token to split); set it to 1 and use "
                          "model_parallel or pipeline_stage")
    if config.data_parallel != config.expert_parallel:
        raise ConfigError(
            f"parallel_config.data_parallel={config.data_parallel} is not valid for generation: every rank of a pool "
            f"generates the same batch, so data_parallel must equal expert_parallel={config.expert_parallel} (the "
            "ranks that share an MoE model's experts); use model_parallel or pipeline_stage to split a model")
    config = dataclasses.replace(config, parallel_mode="semi_auto_parallel")
    layout = config.resolve(config.required_world_size(), model_config)
    if layout.pp > 1 and getattr(model_config, "is_encoder_decoder", False):
        raise ConfigError(f"parallel_config.pipeline_stage={layout.pp} is not supported for generation with an "
                          "encoder-decoder model; split it with model_parallel instead")
    return layout


def generation_layout(model_config: Any, world_size: int) -> Layout | None:
    """A layout sharding the model over all ``world_size`` ranks for generation: tensor parallel with the vocabulary
    sharded too (embedding and head split like the rest), else tensor parallel alone, else pipeline stages; None when
    none of them fits the model (heads, vocabulary or layers that do not divide)."""
    for fields in (dict(model_parallel=world_size, vocab_emb_dp=False), dict(model_parallel=world_size),
                   dict(pipeline_stage=world_size)):
        try:
            return inference_layout({"parallel_mode": "semi_auto_parallel", **fields}, model_config)
        except ConfigError:
            continue
    return None


def shard_for_inference(model: nn.Module, layout: Layout, mesh: ParallelMesh) -> nn.Module:
    """Shard ``model`` (on this rank's device, in eval mode, the same weights on every rank) for generation under
    ``layout``, in place: its pipeline stage's layers only, then tensor and expert parallelism. Returns ``model``."""
    if mesh.pp > 1:
        cut_for_generation(model, mesh.pp_rank, mesh.pp, mesh.pp_mesh.get_group())
    if mesh.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh, vocab_parallel=layout.vocab_parallel)
    apply_expert_parallel(model, mesh)
    return model


# -- pipeline stages for generation -----------------------------------------------------------------------------


class PipelinedGenerationMixin:
    """The forward of one pipeline stage of a causal LM during generation (see the module docstring): takes the
    model's arguments, returns what the whole model returns (the logits, broadcast from the last stage, and this
    stage's cache). Attributes set by :func:`cut_for_generation`: ``pp_group``, ``pp_ranks`` (global ranks of the
    stages, in order) and ``pp_index``."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        index, ranks, group = self.pp_index, self.pp_ranks, self.pp_group
        first, last = index == 0, index == len(ranks) - 1
        reference = input_ids if input_ids is not None else inputs_embeds
        batch, length = reference.shape[:2]
        if not first:  # the residual stream of the previous stage, for these positions
            param = next(self.parameters())
            inputs_embeds = torch.empty(batch, length, self.config.hidden_size, dtype=param.dtype, device=param.device)
            dist.recv(inputs_embeds, src=ranks[index - 1], group=group)
            input_ids = None
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              logits_to_keep=logits_to_keep, **kwargs)
        if not last:
            dist.send(out.last_hidden_state.contiguous(), dst=ranks[index + 1], group=group)
            logits = None
        else:
            logits = out.logits
        logits = _broadcast_from_last(logits, ranks, group, reference.device)
        return CausalLMOutputWithPast(logits=logits, **cache_output(output_cache(out)))


def _broadcast_from_last(logits: torch.Tensor | None, ranks: list[int], group: Any, device: torch.device) -> torch.Tensor:
    """The last stage's logits (as float32, which the token choice uses) on every stage: their shape, then them."""
    shape = torch.tensor(list(logits.shape) if logits is not None else [0, 0, 0], device=device)
    dist.broadcast(shape, src=ranks[-1], group=group)
    logits = logits.float() if logits is not None else torch.empty(shape.tolist(), dtype=torch.float32, device=device)
    dist.broadcast(logits, src=ranks[-1], group=group)
    return logits


_STAGE_CLASSES: dict[type, type] = {}


def cut_for_generation(model: nn.Module, pp_rank: int, pp_size: int, group: Any) -> nn.Module:
    """Cut a causal LM in place to pipeline stage ``pp_rank`` of ``pp_size`` for generation: its contiguous range of
    layers, renumbered from 0 with a config of that many layers (so ``generate`` sizes this stage's KV cache for them
    and positions and masks read it), the embeddings on the first stage and the final norm and head on the last
    (:func:`~.pipelining.stages.stage_plan`). Its forward becomes :class:`PipelinedGenerationMixin`'s."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError("pipeline stages for generation serve decoder-only models; split an encoder-decoder with "
                          "model_parallel")
    plan = stage_plan(model)
    base = getattr(model, model.base_model_prefix)
    layers = getattr(base, plan.stacks[0])
    held = layer_ranges(len(layers), pp_size)[pp_rank]
    kept = nn.ModuleList(layers[i] for i in held)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    setattr(base, plan.stacks[0], kept)
    for name in plan.first if pp_rank > 0 else ():
        setattr(base, name, None)
    if pp_rank < pp_size - 1:
        for name in plan.after[0]:
            setattr(base, name, None)
        for name in plan.head:
            setattr(model, name, None)
    config = copy.copy(model.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:  # each kept layer keeps its attention kind (sliding/full)
        config.layer_types = [config.layer_types[i] for i in held]
    model.config = base.config = config
    cls = type(model)
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"{cls.__name__}GenerationStage", (PipelinedGenerationMixin, cls),
                                   {"__module__": cls.__module__})
    model.__class__ = _STAGE_CLASSES[cls]
    model.pp_group, model.pp_index = group, pp_rank
    model.pp_ranks = dist.get_process_group_ranks(group)
    return model


# -- what a rank holds ----------------------------------------------------------------------------------------------


def local_bytes(model: nn.Module) -> int:
    """Bytes of the weights and buffers this rank holds (its shards of DTensors)."""
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def cache_bytes(cache: Any) -> int:
    """Bytes of the keys and values a transformers ``Cache`` (or an encoder-decoder pair of them) holds."""
    caches = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(cache, "self_attention_cache") \
        else [cache]
    total = 0
    for one in caches:
        for layer in one.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total
