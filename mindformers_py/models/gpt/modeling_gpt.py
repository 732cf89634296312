"""The GPT family: a decoder-only transformer in GPT-2 or Llama flavour, built from the shared layers.

Model code is single-device PyTorch; tensor/pipeline parallelism is applied from outside
(``mindformers_py.parallel``) following the plans declared on :class:`GPTConfig` and on the heads here.

Every model is also its own pipeline stage (torchtitan's way): a stage is the model with the parts it does not
hold set to None. Without ``embed_tokens`` the base model takes the previous stage's hidden states as
``inputs_embeds`` and skips the embedding phase (positions, embedding dropout); without ``norm`` it returns the
last layer's output; a head without its head module returns the base model's output unchanged.

GPT-MoE is this family with a ``moe_config``: the layers it names get a :class:`~mindformers_py.layers.moe.MoE`
instead of the MLP, the base model gathers their router statistics (``router_stats``, handed from pipeline stage to
stage like the hidden states) and the causal-LM head turns them into the router losses (load balancing, z-loss)
when ``output_router_logits`` is on, as transformers' Mixtral and Qwen-MoE do.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)

from ...errors import MindFormersError
from ...generation import FastGenerationMixin
from ...layers import LearnedPositionEmbedding, RotaryEmbedding, TransformerBlock, build_attention_mask, build_norm, \
    causal_lm_loss
from ...layers.loss import IGNORE_INDEX, question_answering_loss, sequence_classification_loss, \
    token_cross_entropy
from ...layers.loss import shift_labels as shift_labels_of
from ...layers.moe import MoE, GroupedExperts, Router, RouterMetrics, router_losses, stat_width
from ..cache_names import accepts_cache_argument, cache_output, output_cache
from ..modeling_base import MindFormersPreTrainedModel
from ..moe_outputs import MoECausalLMOutputWithPast, MoEModelOutputWithPast
from .configuration_gpt import GPTConfig


class GPTPreTrainedModel(MindFormersPreTrainedModel):
    """Weight init and config class of the GPT models (the rest is :class:`MindFormersPreTrainedModel`)."""

    config_class = GPTConfig
    config: GPTConfig
    base_model_prefix = "model"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, RotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq()[0])
        elif isinstance(module, Router):
            init.normal_(module.weight, 0.0, self.config.initializer_range)
        elif isinstance(module, GroupedExperts):
            for name, param in module.named_parameters(recurse=False):
                init.normal_(param, 0.0, self._residual_std() if name == "down_proj" else self.config.initializer_range)
        elif isinstance(module, nn.Linear) and self.weight_role(module) in ("o_proj", "down_proj"):
            # Residual-branch outputs start smaller so the residual stream does not grow with depth (GPT-2, Megatron).
            init.normal_(module.weight, 0.0, self._residual_std())

    def _residual_std(self) -> float:
        return self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)

    @property
    def pipeline_carry(self) -> tuple[str, ...]:
        """Outputs of the base model that travel from pipeline stage to stage beside the hidden states (and come
        back in as keyword arguments): an MoE model's router statistics, from which the last stage computes the
        router losses (only when ``output_router_logits`` puts them in the loss: statistics no loss reads would
        come back from the last stage without a gradient, which torch's schedules cannot send)."""
        return ("router_stats",) if self.config.moe is not None and self.config.output_router_logits else ()


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
        moe_layers = set(config.moe_layers())
        self.layers = nn.ModuleList(TransformerBlock(config, i, mlp=MoE.from_config(config) if i in moe_layers else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = build_norm(config.norm_type, config.hidden_size, config.norm_eps, bias=config.norm_bias)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @accepts_cache_argument
    @capture_outputs
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
        """Last hidden states (B, T, C) of ``input_ids`` (or ``inputs_embeds``); with ``output_hidden_states`` /
        ``output_attentions`` (or the config's), every layer's hidden states / attention weights, and a tuple with
        ``return_dict=False``, as transformers' models.

        On a pipeline stage without ``embed_tokens``, ``inputs_embeds`` is the previous stage's output and
        ``position_ids`` (which then must cover the whole sequence) give the length masks are built for.

        An MoE model also returns ``router_stats`` (B, layers, width), adding its layers' rows to the
        ``router_stats`` keyword argument (a previous pipeline stage's) or to zeros, and ``router_logits`` with
        ``output_router_logits``."""
        if self.embed_tokens is None:  # a later pipeline stage: the residual stream arrives from the previous one
            if inputs_embeds is None:
                raise MindFormersError("this pipeline stage holds no embeddings: pass the previous stage's hidden states as inputs_embeds")
            hidden_states = inputs_embeds
        elif (input_ids is None) == (inputs_embeds is None):
            raise MindFormersError("pass exactly one of input_ids or inputs_embeds")
        else:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        length = position_ids.shape[-1] if position_ids is not None else hidden_states.shape[1]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None and not self.training:
            past_key_values = DynamicCache()
        past_length = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=hidden_states.device)[None]
            self._check_context(past_length + length, f"sequence of {past_length + length} tokens ({past_length} cached + "
                                                      f"{length} new)")
        elif not torch.compiler.is_compiling():  # the positions decide (packed rows restart them): a data check
            self._check_context(int(position_ids.max()) + 1, f"position id {int(position_ids.max())}")
        if past_key_values is not None:
            kv_length, kv_offset = past_key_values.get_mask_sizes(length, 0)
        else:
            kv_length, kv_offset = length, 0
        mask = build_attention_mask(
            attention_mask, query_length=length, kv_length=kv_length, kv_offset=kv_offset, past_length=past_length,
            sliding_window=self.config.sliding_window, device=hidden_states.device, position_ids=position_ids,
        )
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = self.rotary_emb(position_ids, hidden_states.dtype)
        if self.embed_tokens is not None:  # the embedding phase runs on the stage that embeds
            if self.config.position_embedding_type == "learned":
                hidden_states = hidden_states + self.embed_positions(position_ids)
            hidden_states = self.drop(hidden_states)
        moe = self.config.moe
        if moe is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mask, rotary, past_key_values=past_key_values)
        else:
            router_stats = kwargs.get("router_stats")
            if router_stats is None:
                router_stats = hidden_states.new_zeros(hidden_states.shape[0], self.config.num_hidden_layers,
                                                       stat_width(moe.expert_num), dtype=torch.float32)
            token_mask = attention_mask[:, -length:] if attention_mask is not None and attention_mask.dim() == 2 else None
            for layer in self.layers:
                out = layer(hidden_states, mask, rotary, past_key_values=past_key_values, token_mask=token_mask)
                if isinstance(out, tuple):  # an MoE layer: its statistics go to its own row
                    hidden_states, stats = out
                    row = torch.tensor([layer.layer_idx], device=stats.device)
                    router_stats = router_stats.index_add(1, row, stats.unsqueeze(1))
                else:
                    hidden_states = out
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if moe is not None:
            return MoEModelOutputWithPast(last_hidden_state=hidden_states, router_stats=router_stats,
                                          **cache_output(past_key_values if use_cache else None))
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **cache_output(past_key_values if use_cache else None))

    def _check_context(self, needed: int, what: str) -> None:
        if needed > self.config.max_position_embeddings:
            raise MindFormersError(f"{what} exceeds the context length max_position_embeddings="
                                   f"{self.config.max_position_embeddings}; shorten the prompt or max_new_tokens")


class GPTForCausalLM(GPTPreTrainedModel, FastGenerationMixin):
    """GPT with a language-modelling head; ``generate`` is transformers' ``GenerationMixin.generate`` with a lean
    static-cache loop for greedy/sampling requests (:class:`~mindformers_py.generation.FastGenerationMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("lm_head",)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.model = GPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        moe = config.moe
        # The Trainer's ``training_metrics`` hook: router loads and losses of the training steps, for the logs.
        self.training_metrics = None if moe is None else RouterMetrics(
            config.num_hidden_layers, moe.expert_num, moe.num_experts_chosen, config.moe_layers(), moe.routing_policy == "topk",
            moe.z_loss_factor > 0)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @accepts_cache_argument
    @can_return_tuple
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
        """Logits for every position (or the last ``logits_to_keep``); with ``labels``, the next-token loss.

        An MoE model with ``output_router_logits`` (argument or config) also returns the load-balancing ``aux_loss``
        and each MoE layer's ``router_logits``, and with ``labels`` its loss includes the router losses
        (:meth:`router_loss`), as transformers' Mixtral does. ``shift_labels`` (a keyword argument, transformers'
        convention) are labels already shifted: position t is scored against ``shift_labels[t]``."""
        shift_labels = kwargs.pop("shift_labels", None)  # labels already shifted (transformers' convention)
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, **kwargs)
        if self.lm_head is None:  # a pipeline stage before the last hands its hidden states on
            return out
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = causal_lm_loss(logits, labels, num_items_in_batch, shift_labels) if labels is not None else None
        if self.config.moe is None:
            return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_output(output_cache(out)),
                                          hidden_states=out.hidden_states, attentions=out.attentions)
        aux_loss = None
        requested = kwargs.get("output_router_logits")
        if self.config.output_router_logits if requested is None else requested:
            aux_loss, router_loss = self.router_loss(out.router_stats, labels, num_items_in_batch,
                                                     shift_labels=shift_labels)
            if loss is not None:
                loss = loss + router_loss
        return MoECausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **cache_output(output_cache(out)),
                                         hidden_states=out.hidden_states, attentions=out.attentions,
                                         router_logits=out.router_logits, router_stats=out.router_stats)

    def router_loss(self, router_stats: torch.Tensor, labels: torch.Tensor | None = None,
                    num_items_in_batch: int | torch.Tensor | None = None,
                    counted: bool = True, shift_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux_loss, loss)``: this forward's load-balancing loss (transformers' ``aux_loss``) and the router
        losses to add to the language-model loss, ``aux_loss_factor`` x load balancing + ``z_loss_factor`` x z-loss.

        With ``labels`` the added losses are this batch's share of the step's, weighted by its label tokens out of
        ``num_items_in_batch`` (see :func:`~mindformers_py.layers.moe.router_losses`), so gradient accumulation and
        data-parallel or pipeline splits add up to the step's; in training they are then counted for the logs
        (unless ``counted`` is False)."""
        moe = self.config.moe
        aux, z = router_losses(router_stats, moe.expert_num, moe.aux_loss_scope)
        if labels is None:
            return aux, moe.aux_loss_factor * aux + moe.z_loss_factor * z
        targets = shift_labels if shift_labels is not None else shift_labels_of(labels)
        items = (targets != IGNORE_INDEX).sum(-1).to(router_stats.device)
        aux_share, z_share = router_losses(router_stats, moe.expert_num, moe.aux_loss_scope, items, num_items_in_batch)
        if counted and self.training and self.training_metrics is not None:
            self.training_metrics.add(router_stats, aux_share, z_share)
        return aux, moe.aux_loss_factor * aux_share + moe.z_loss_factor * z_share

    def carried_loss(self, carried: dict[str, torch.Tensor], labels: tuple[torch.Tensor, ...],
                     num_items_in_batch: int | torch.Tensor | None = None, counted: bool = True,
                     labels_shifted: bool = False) -> torch.Tensor | None:
        """On the last pipeline stage: the router losses computed from the ``router_stats`` the stages carried
        (see :attr:`pipeline_carry`), or None when they are not part of the loss. ``counted=False``: a call on
        placeholder tensors, kept out of the logged metrics; ``labels_shifted``: the labels are ``shift_labels``."""
        stats = carried.get("router_stats")
        if stats is None or not self.config.output_router_logits:
            return None
        if labels_shifted:
            return self.router_loss(stats, labels[0], num_items_in_batch, counted, shift_labels=labels[0])[1]
        return self.router_loss(stats, labels[0], num_items_in_batch, counted)[1]


class GPTForSequenceClassification(GPTPreTrainedModel):
    """GPT with a linear ``score`` head on the last real (non-padding) token, as HF's GPT-2/Llama classifiers;
    single-label, multi-label or regression by ``config.problem_type``."""

    _pp_plan = {"score": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("score",)  # pools or scores every position

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = GPTModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        """Logits (B, num_labels) of each row's last real token (found from ``input_ids`` and
        ``config.pad_token_id``); with ``labels``, the loss of ``config.problem_type``."""
        out = self.model(input_ids, attention_mask, position_ids, None, inputs_embeds, use_cache=False, **kwargs)
        if self.score is None:
            return out
        logits = self.score(out.last_hidden_state)  # (B, T, num_labels)
        pooled = logits[torch.arange(logits.shape[0], device=logits.device), self._last_token(input_ids, logits)]
        loss = sequence_classification_loss(pooled, labels, self.config, num_items_in_batch) if labels is not None else None
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=out.hidden_states,
                                                attentions=out.attentions)

    def _last_token(self, input_ids: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
        """Index of each row's last non-padding token; works for left and right padding alike."""
        batch, length = logits.shape[:2]
        if input_ids is not None and self.config.pad_token_id is not None:
            not_pad = (input_ids != self.config.pad_token_id).int()
            return (torch.arange(input_ids.shape[-1], device=logits.device) * not_pad).argmax(-1)
        if batch > 1 and input_ids is not None:
            raise MindFormersError("pad_token_id is not set in the config, so padded batches cannot be classified; set config.pad_token_id")
        return torch.full((batch,), length - 1, device=logits.device)


class GPTForTokenClassification(GPTPreTrainedModel):
    """GPT with a linear ``score`` head on every token (HF's ``LlamaForTokenClassification``; GPT-2's is named
    ``classifier``, renamed on conversion), after dropout of ``classifier_dropout``."""

    _pp_plan = {"score": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("score",)  # pools or scores every position

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = GPTModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout if config.classifier_dropout is None else config.classifier_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        """Logits (B, T, num_labels); with ``labels`` (B, T, -100 ignored), the token cross-entropy."""
        out = self.model(input_ids, attention_mask, position_ids, None, inputs_embeds, use_cache=False, **kwargs)
        if self.score is None:
            return out
        logits = self.score(self.dropout(out.last_hidden_state))
        loss = token_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class GPTForQuestionAnswering(GPTPreTrainedModel):
    """GPT with a ``qa_outputs`` head giving each token a start and an end logit for an extractive answer span."""

    _pp_plan = {"qa_outputs": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("qa_outputs",)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.model = GPTModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        """Start and end logits (B, T); with ``start_positions`` and ``end_positions``, the span loss."""
        out = self.model(input_ids, attention_mask, position_ids, None, inputs_embeds, use_cache=False, **kwargs)
        if self.qa_outputs is None:
            return out
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in self.qa_outputs(out.last_hidden_state).split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start_logits, end_logits, start_positions, end_positions, num_items_in_batch)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=out.hidden_states, attentions=out.attentions)
