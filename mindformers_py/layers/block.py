"""The transformer layer shared by every family: pre-norm self-attention + MLP with residual connections.

A layer reads its sizes from any config that uses the common field names (``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``hidden_act``,
``gated_mlp``, ``attention_bias``, ``attention_out_bias``, ``mlp_bias``, ``norm_type``, ``norm_eps``,
``norm_bias``, ``attention_dropout``, ``hidden_dropout``; optionally ``attention_scale`` and ``mlp_dropout``), so
families differ by config values, not code.

An encoder-decoder's decoder layer is the same block with ``cross_attention=True``: a cross-attention sublayer to
the encoder output sits between self-attention and the MLP (T5, BART).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import Attention
from .mlp import MLP
from .norms import build_norm


class TransformerBlock(GradientCheckpointingLayer):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Submodule names follow the Llama convention (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
    ``mlp``) so tensor-parallel plans and HF weight names line up. Being a ``GradientCheckpointingLayer``, it
    honours HF's ``model.gradient_checkpointing_enable()``.

    With ``cross_attention``, ``x + cross_attn(norm(x), encoder output)`` runs after self-attention, its norm and
    attention named ``cross_attn_layernorm`` and ``cross_attn``.
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True, cross_attention: bool = False) -> None:
        super().__init__()
        norm = lambda: build_norm(config.norm_type, config.hidden_size, config.norm_eps, bias=config.norm_bias)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qkv_bias=config.attention_bias,
            out_bias=config.attention_out_bias,
            dropout=config.attention_dropout,
            is_causal=is_causal,
            layer_idx=layer_idx,
            scale=getattr(config, "attention_scale", None),
            config=config,
        )
        self.cross_attn = None
        if cross_attention:
            self.cross_attn_layernorm = norm()
            self.cross_attn = Attention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                qkv_bias=config.attention_bias, out_bias=config.attention_out_bias, dropout=config.attention_dropout,
                is_causal=False, layer_idx=layer_idx, scale=getattr(config, "attention_scale", None), config=config,
                cross_attention=True,
            )
        self.post_attention_layernorm = norm()
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.gated_mlp, config.mlp_bias,
                       dropout=getattr(config, "mlp_dropout", 0.0))
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values=None,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_bias``: the additive bias of self-attention (see :class:`Attention`); ``encoder_hidden_states``
        (B, S, C) and its boolean ``encoder_attention_mask``: what a cross-attention layer attends to.
        ``past_key_values`` may be an ``EncoderDecoderCache``: self-attention uses its self-attention part."""
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        attn, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_embeddings, self_cache,
                                 position_bias=position_bias)
        hidden_states = hidden_states + self.dropout(attn)
        if self.cross_attn is not None:
            attn, _ = self.cross_attn(self.cross_attn_layernorm(hidden_states), encoder_attention_mask, None,
                                      past_key_values, key_value_states=encoder_hidden_states)
            hidden_states = hidden_states + self.dropout(attn)
        return hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
