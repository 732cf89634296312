"""The transformer layer shared by every family: self-attention + MLP with residual connections, the norms before
each sublayer (pre-norm: GPT-2, Llama, ViT, T5) or after each residual sum (post-norm: BERT, RoBERTa).

A layer reads its sizes from any config that uses the common field names (``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``hidden_act``,
``gated_mlp``, ``attention_bias``, ``attention_out_bias``, ``mlp_bias``, ``norm_type``, ``norm_eps``,
``norm_bias``, ``attention_dropout``, ``hidden_dropout``; optionally ``attention_scale``, ``mlp_dropout`` and GPT-2's
attention options), so families differ by config values, not code.

A mixture-of-experts layer is the same block with a :class:`~mindformers_py.layers.moe.layer.MoE` given as ``mlp``; it
then also returns that layer's router statistics. An encoder-decoder's decoder layer is the same block with
``cross_attention=True``: a cross-attention sublayer to the encoder output sits between self-attention and the MLP
(T5, BART, a BERT decoder).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import Attention
from .dropout import Dropout
from .latent_attention import LatentAttention, latent_softmax_scale
from .mlp import MLP
from .moe.layer import MoE
from .norms import build_norm


class TransformerBlock(GradientCheckpointingLayer):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with ``post_norm``, ``norm(x + attn(x))`` then
    ``norm(x + mlp(x))`` (the original Transformer's and BERT's order).

    Submodule names follow the Llama convention (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
    ``mlp``) so tensor-parallel plans and HF weight names line up. Being a ``GradientCheckpointingLayer``, it
    honours HF's ``model.gradient_checkpointing_enable()``. A post-norm block has no ``input_layernorm``; its
    norms are ``post_attention_layernorm`` (after the attention's residual sum) and ``post_feedforward_layernorm``
    (after the MLP's).

    ``mlp`` replaces the config's MLP with another feed-forward module: an :class:`MoE` makes this a
    mixture-of-experts layer, whose ``forward`` returns ``(hidden_states, router statistics)``.

    With ``cross_attention``, a cross-attention sublayer to the encoder output (``cross_attn``) runs after
    self-attention: pre-norm ``x + cross_attn(cross_attn_layernorm(x), encoder output)`` (T5), post-norm
    ``cross_attn_layernorm(x + cross_attn(x, encoder output))`` (a BERT decoder).

    Attention options read from the config when it has them: ``attention_scale`` (the softmax scale; None for
    ``head_dim ** -0.5``), ``scale_attn_by_inverse_layer_idx`` (layer i's scale further divided by i + 1) and
    ``reorder_and_upcast_attn`` (scores and softmax in float32 under the eager implementation), GPT-2's options;
    ``qk_norm`` (per-head RMSNorms of queries and keys, Qwen3); ``sliding_window`` with ``attention_kinds()`` (the
    window of each ``"sliding_attention"`` layer); ``attention_type="mla"`` (multi-head latent attention,
    :class:`~mindformers_py.layers.latent_attention.LatentAttention`, sized by ``q_lora_rank``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, with ``rope_interleave``; its softmax scale from
    ``rope_parameters`` as transformers' DeepSeek-V3 sets it).
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True, post_norm: bool = False,
                 mlp: nn.Module | None = None, cross_attention: bool = False) -> None:
        super().__init__()
        norm = lambda: build_norm(config.norm_type, config.hidden_size, config.norm_eps, bias=config.norm_bias,  # noqa: E731
                                  cast_to_weight_dtype=getattr(config, "norm_casts_to_weight_dtype", False))
        self.post_norm = post_norm
        if not post_norm:
            self.input_layernorm = norm()
        self.self_attn = self._attention(config, layer_idx, is_causal)
        self.cross_attn = None
        if cross_attention:
            self.cross_attn_layernorm = norm()
            self.cross_attn = self._attention(config, layer_idx, is_causal=False, cross_attention=True)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.gated_mlp, config.mlp_bias,
                       dropout=getattr(config, "mlp_dropout", 0.0)) if mlp is None else mlp
        self.dropout = Dropout(config.hidden_dropout)
        if post_norm:
            self.post_feedforward_layernorm = norm()
        self.layer_idx = layer_idx
        self.routed = isinstance(self.mlp, MoE)  # read at build time: recompute may wrap ``mlp`` later

    @staticmethod
    def _attention(config, layer_idx: int, is_causal: bool,
                   cross_attention: bool = False) -> Attention | LatentAttention:
        if getattr(config, "attention_type", "mha") == "mla" and not cross_attention:
            qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            return LatentAttention(
                config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
                config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, bias=config.attention_bias,
                dropout=config.attention_dropout, layer_idx=layer_idx, config=config,
                scale=latent_softmax_scale(qk_head_dim, getattr(config, "rope_parameters", None)),
                rope_interleave=bool(getattr(config, "rope_interleave", True)))
        scale = getattr(config, "attention_scale", None)
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale = (config.head_dim ** -0.5 if scale is None else scale) / (layer_idx + 1)
        return Attention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            qkv_bias=config.attention_bias, out_bias=config.attention_out_bias, dropout=config.attention_dropout,
            is_causal=is_causal, layer_idx=layer_idx, scale=scale, config=config, cross_attention=cross_attention,
            upcast=bool(getattr(config, "reorder_and_upcast_attn", False)),
            qk_norm=bool(getattr(config, "qk_norm", False)), norm_eps=config.norm_eps,
            sliding_window=_window_of(config, layer_idx) if not cross_attention else None,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values=None,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``position_bias``: the additive bias of self-attention (see :class:`Attention`); ``encoder_hidden_states``
        (B, S, C) and its boolean ``encoder_attention_mask``: what a cross-attention layer attends to.
        ``past_key_values`` may be an ``EncoderDecoderCache``: self-attention uses its self-attention part.
        ``token_mask`` (B, T) marks real tokens for an MoE layer's router statistics."""
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        if self.post_norm:
            attn, _ = self.self_attn(hidden_states, attention_mask, position_embeddings, self_cache,
                                     position_bias=position_bias)
            hidden_states = self.post_attention_layernorm(hidden_states + self.dropout(attn))
            if self._cross_attends(encoder_hidden_states, past_key_values):
                attn, _ = self.cross_attn(hidden_states, encoder_attention_mask, None, past_key_values,
                                          key_value_states=encoder_hidden_states)
                hidden_states = self.cross_attn_layernorm(hidden_states + self.dropout(attn))
            fed, stats = self._feed_forward(hidden_states, token_mask)
            hidden_states = self.post_feedforward_layernorm(hidden_states + self.dropout(fed))
            return (hidden_states, stats) if self.routed else hidden_states
        attn, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings, self_cache,
                                 position_bias=position_bias)
        hidden_states = hidden_states + self.dropout(attn)
        if self._cross_attends(encoder_hidden_states, past_key_values):
            attn, _ = self.cross_attn(self.cross_attn_layernorm(hidden_states), encoder_attention_mask, None,
                                      past_key_values, key_value_states=encoder_hidden_states)
            hidden_states = hidden_states + self.dropout(attn)
        fed, stats = self._feed_forward(self.post_attention_layernorm(hidden_states), token_mask)
        hidden_states = hidden_states + self.dropout(fed)
        return (hidden_states, stats) if self.routed else hidden_states

    def _cross_attends(self, encoder_hidden_states: torch.Tensor | None, cache) -> bool:
        """Whether the cross-attention sublayer runs: with an encoder output given, or its keys and values cached
        (transformers' layers skip it without an encoder output: a BERT decoder then is a plain causal LM)."""
        if self.cross_attn is None:
            return False
        return encoder_hidden_states is not None or bool(getattr(cache, "is_updated", {}).get(self.layer_idx))

    def _feed_forward(self, x: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's output and, for an MoE layer, its router statistics."""
        if self.routed:
            return self.mlp(x, token_mask)
        return self.mlp(x), None


def _window_of(config, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` (None for full attention), from a config's ``sliding_window`` and,
    when it has them, its per-layer ``attention_kinds()``."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "attention_kinds", None)
    if window is None or kinds is None:
        return window
    return window if kinds()[layer_idx] == "sliding_attention" else None
