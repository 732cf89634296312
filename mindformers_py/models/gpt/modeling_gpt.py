"""The GPT family: a decoder-only transformer in GPT-2 or Llama flavour, built from the shared layers.

Model code is single-device PyTorch; tensor/pipeline parallelism is applied from outside
(``mindformers_py.parallel``) following the plans declared on :class:`GPTConfig` and on the heads here.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.loss.loss_utils import ForSequenceClassificationLoss
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, SequenceClassifierOutputWithPast

from ...errors import MindFormersError
from ...generation import FastGenerationMixin
from ...layers import LearnedPositionEmbedding, RotaryEmbedding, TransformerBlock, build_attention_mask, build_norm, causal_lm_loss
from .configuration_gpt import GPTConfig


class GPTPreTrainedModel(PreTrainedModel):
    """Weight init, HF plumbing (save/load, gradient checkpointing, SDPA) shared by the GPT models."""

    config_class = GPTConfig
    config: GPTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq()[0])
        elif isinstance(module, TransformerBlock):
            # Residual-branch outputs start smaller so the residual stream does not grow with depth (GPT-2, Megatron).
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
            module.self_attn.o_proj.weight.normal_(0.0, std)
            module.mlp.down_proj.weight.normal_(0.0, std)


class GPTModel(GPTPreTrainedModel):
    """Embeddings, a stack of :class:`TransformerBlock` and a final norm; returns the last hidden states."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned":
            self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_parameters)
        self.drop = nn.Dropout(config.embedding_dropout)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config.norm_type, config.hidden_size, config.norm_eps, bias=config.norm_bias)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise MindFormersError("pass exactly one of input_ids or inputs_embeds")
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        batch, length = hidden_states.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and not self.training:
            past_key_values = DynamicCache()
        past_length = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        if past_length + length > self.config.max_position_embeddings:
            raise MindFormersError(
                f"sequence of {past_length + length} tokens ({past_length} cached + {length} new) exceeds the context "
                f"length max_position_embeddings={self.config.max_position_embeddings}; shorten the prompt or max_new_tokens"
            )
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=hidden_states.device)[None]
        if past_key_values is not None:
            kv_length, kv_offset = past_key_values.get_mask_sizes(length, 0)
        else:
            kv_length, kv_offset = length, 0
        mask = build_attention_mask(
            attention_mask, query_length=length, kv_length=kv_length, kv_offset=kv_offset, past_length=past_length,
            sliding_window=self.config.sliding_window, device=hidden_states.device,
        )
        rotary = None
        if self.config.position_embedding_type == "learned":
            hidden_states = hidden_states + self.embed_positions(position_ids)
        else:
            rotary = self.rotary_emb(position_ids, hidden_states.dtype)
        hidden_states = self.drop(hidden_states)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, rotary, past_key_values=past_key_values)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values if use_cache else None)


class GPTForCausalLM(GPTPreTrainedModel, FastGenerationMixin):
    """GPT with a language-modelling head; ``generate`` is transformers' ``GenerationMixin.generate`` with a lean
    static-cache loop for greedy/sampling requests (:class:`~mindformers_py.generation.FastGenerationMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.model = GPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits for every position (or the last ``logits_to_keep``); with ``labels``, the next-token loss."""
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = causal_lm_loss(logits, labels, num_items_in_batch) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


class GPTForSequenceClassification(GPTPreTrainedModel):
    """GPT with a linear ``score`` head on the last real (non-padding) token, as HF's GPT-2/Llama classifiers."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = GPTModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        hidden = self.model(input_ids, attention_mask, position_ids, None, inputs_embeds, use_cache=False).last_hidden_state
        logits = self.score(hidden)  # (B, T, num_labels)
        batch = logits.shape[0]
        if input_ids is not None and self.config.pad_token_id is not None:
            # Rightmost non-pad token; works for left and right padding alike.
            not_pad = (input_ids != self.config.pad_token_id).int()
            last = (torch.arange(input_ids.shape[-1], device=logits.device) * not_pad).argmax(-1)
        elif batch > 1 and input_ids is not None:
            raise MindFormersError("pad_token_id is not set in the config, so padded batches cannot be classified; set config.pad_token_id")
        else:
            last = torch.full((batch,), logits.shape[1] - 1, device=logits.device)
        pooled = logits[torch.arange(batch, device=logits.device), last]
        loss = ForSequenceClassificationLoss(labels, pooled, self.config) if labels is not None else None
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled)
