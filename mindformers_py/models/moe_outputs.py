"""Model outputs of mixture-of-experts models (transformers' MoE outputs plus the router statistics) and of
models with multi-token prediction (``mtp_loss``).

``router_stats`` (B, layers, width; see :func:`mindformers_py.layers.moe.layer.router_statistics`) is what the router
losses are computed from. It is a field of the outputs so that a pipeline stage hands it to the next one and the
last stage computes the losses from it; it comes last, after transformers' own fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast, MoeModelOutputWithPast


@dataclass
class MoEModelOutputWithPast(MoeModelOutputWithPast):
    """transformers' ``MoeModelOutputWithPast`` (last hidden state, cache, hidden states, attentions, router logits)
    and ``router_stats``, each layer's router statistics per sequence (zeros for dense layers)."""

    router_stats: torch.Tensor | None = None


@dataclass
class MoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """transformers' ``MoeCausalLMOutputWithPast`` (loss, aux_loss, logits, cache, hidden states, attentions, router
    logits) and ``router_stats``, each layer's router statistics per sequence; ``mtp_loss``: the weighted
    multi-token-prediction loss included in ``loss`` (a model with MTP modules, given labels)."""

    router_stats: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None


@dataclass
class CausalLMOutputWithMTP(CausalLMOutputWithPast):
    """transformers' ``CausalLMOutputWithPast`` and ``mtp_loss``, the weighted multi-token-prediction loss included
    in ``loss`` (a dense model with MTP modules, given labels)."""

    mtp_loss: torch.Tensor | None = None
