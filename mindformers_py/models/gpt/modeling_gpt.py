"""The GPT family: a decoder-only transformer in GPT-2 or Llama flavour, built from the shared layers.

Model code is single-device PyTorch; tensor/pipeline parallelism is applied from outside
(``mindformers_py.parallel``) following the plans declared on :class:`GPTConfig` and on the heads here.

Every model is also its own pipeline stage (torchtitan's way): a stage is the model with the parts it does not
hold set to None. Without ``embed_tokens`` the base model takes the previous stage's hidden states as
``inputs_embeds`` and skips the embedding phase (positions, embedding dropout); without ``norm`` it returns the
last layer's output; a head without its head module returns the base model's output unchanged.

GPT-MoE is this family with a ``moe_config``: the layers it names get a :class:`~mindformers_py.layers.moe.layer.MoE`
instead of the MLP, the base model gathers their router statistics (``router_stats``, handed from pipeline stage to
stage like the hidden states) and the causal-LM head turns them into the router losses (load balancing, z-loss)
when ``output_router_logits`` is on, as transformers' Mixtral and Qwen-MoE do.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, \
    SequenceClassifierOutputWithPast
from transformers.models.gpt2.modeling_gpt2 import GPT2DoubleHeadsModelOutput

from ...errors import MindFormersError
from ...generation import FastGenerationMixin
from ...layers import LearnedPositionEmbedding, RotaryEmbedding, TransformerBlock, build_attention_mask, build_norm, \
    causal_lm_loss
from ...layers.heads import SequenceSummary, kept_positions
from ...layers.dropout import Dropout
from ...layers.masks import key_padding_mask
from ...layers.loss import IGNORE_INDEX, choice_cross_entropy, shift_labels as next_token_targets
from ...layers.loss.fused_head import fusable_head, fused_head_loss
from ...layers.moe.layer import MoE, GroupedExperts, Router, RouterMetrics, router_losses, stat_width
from ..cache_names import accepts_cache_argument, cache_output, output_cache
from ..modeling_base import MindFormersPreTrainedModel
from ..moe_outputs import CausalLMOutputWithMTP, MoECausalLMOutputWithPast, MoEModelOutputWithPast
from ..task_models import QuestionAnswering, SequenceClassification, TokenClassification
from .configuration_gpt import GPTConfig
from .multi_token_head import (
    MetricsGroup,
    MTPMetrics,
    build_multi_token_prediction,
    multi_token_logits,
    multi_token_prediction_loss,
)


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
            for buffer in module.buffers(recurse=False):  # a router kind's state (a selection bias, load counts)
                init.zeros_(buffer)
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

    embeds_inputs: bool = True
    """Whether this model embeds its inputs: False on a later pipeline stage that holds a copy of the embedding for
    multi-token prediction only (set by the pipeline's cut, see ``GPTForCausalLM.pipeline_last_stage_copies``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.embedding_padding_idx)
        if config.position_embedding_type == "learned":
            self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_parameters)
        self.drop = Dropout(config.embedding_dropout)
        moe_layers = set(config.moe_layers())
        self.layers = nn.ModuleList(TransformerBlock(config, i, mlp=MoE.from_config(config) if i in moe_layers else None,
                                                     cross_attention=config.cross_attends)
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
        token_type_ids: torch.LongTensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Last hidden states (B, T, C) of ``input_ids`` (or ``inputs_embeds``); with ``output_hidden_states`` /
        ``output_attentions`` (or the config's), every layer's hidden states / attention weights, and a tuple with
        ``return_dict=False``, as transformers' models.

        On a pipeline stage without ``embed_tokens``, ``inputs_embeds`` is the previous stage's output and
        ``position_ids`` (which then must cover the whole sequence) give the length masks are built for.

        ``token_type_ids`` (B, T), GPT-2's segment ids, are embedded with the token embedding and added, as
        transformers' GPT-2 does (a Llama-flavoured model ignores them, as transformers' Llama does). A GPT-2 with
        ``config.add_cross_attention`` (the decoder of an encoder-decoder) attends to ``encoder_hidden_states``
        (B, S, C), padded as ``encoder_attention_mask`` (B, S) says, and keeps an ``EncoderDecoderCache``.

        ``mtp_inputs=True`` (the causal-LM head's, for multi-token prediction) puts the last layer's inputs to the
        MTP modules on the output's ``mtp_inputs`` attribute.

        An MoE model also returns ``router_stats`` (B, layers, width), adding its layers' rows to the
        ``router_stats`` keyword argument (a previous pipeline stage's) or to zeros, and ``router_logits`` with
        ``output_router_logits``."""
        if self.embed_tokens is None or not self.embeds_inputs:  # a later pipeline stage: the residual stream
            # arrives from the previous one
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
        if self.config.cross_attends and past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            past_key_values = EncoderDecoderCache(past_key_values, DynamicCache())
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        past_length = int(self_cache.get_seq_length()) if self_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=hidden_states.device)[None]
            self._check_context(past_length + length, f"sequence of {past_length + length} tokens ({past_length} cached + "
                                                      f"{length} new)")
        elif self.config.position_limit is not None and not torch.compiler.is_compiling():
            # the positions decide (packed rows restart them): a data check, which waits for the device, so only
            # where there is a limit (learned positions; rotary ones have none): a decode step on a GPU must not wait
            last = int(position_ids.max())
            self._check_context(last + 1, f"position id {last}")
        if self_cache is not None:
            kv_length, kv_offset = self_cache.get_mask_sizes(length, 0)
        else:
            kv_length, kv_offset = length, 0
        kinds = self.config.attention_kinds()
        # transformers' generation may hand one ready mask per attention kind (a static cache, layer_types).
        masks = {kind: build_attention_mask(
            attention_mask.get(kind) if isinstance(attention_mask, dict) else attention_mask, query_length=length, kv_length=kv_length, kv_offset=kv_offset, past_length=past_length,
            sliding_window=self.config.sliding_window if kind == "sliding_attention" else None,
            device=hidden_states.device, position_ids=position_ids,
        ) for kind in set(kinds)}  # one mask per attention kind, shared by the layers of that kind
        rotary = None
        if self.config.position_embedding_type == "rope":
            rotary = self.rotary_emb(position_ids, hidden_states.dtype)
        if self.embed_tokens is not None and self.embeds_inputs:  # the embedding phase runs on the stage that embeds
            if self.config.position_embedding_type == "learned":
                hidden_states = hidden_states + self.embed_positions(position_ids)
                if token_type_ids is not None:  # GPT-2's segments share the token embedding
                    hidden_states = hidden_states + self.embed_tokens(token_type_ids)
            hidden_states = self.drop(hidden_states)
        moe = self.config.moe
        token_mask = None
        if moe is None:
            cross = dict(encoder_hidden_states=encoder_hidden_states,
                         encoder_attention_mask=key_padding_mask(encoder_attention_mask)) if self.config.cross_attends else {}
            for layer in self.layers:
                hidden_states = layer(hidden_states, masks[kinds[layer.layer_idx]], rotary, past_key_values=past_key_values,
                                      **cross)
        else:
            router_stats = kwargs.get("router_stats")
            if router_stats is None:
                router_stats = hidden_states.new_zeros(hidden_states.shape[0], self.config.num_hidden_layers,
                                                       stat_width(moe.expert_num), dtype=torch.float32)
            else:  # summed in fp32 on every stage: a bf16 mixed-precision wrapper (FSDP2's) casts a stage's inputs
                router_stats = router_stats.float()
            padding = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            token_mask = attention_mask[:, -length:] if padding else None
            for layer in self.layers:
                out = layer(hidden_states, masks[kinds[layer.layer_idx]], rotary, past_key_values=past_key_values,
                            token_mask=token_mask)
                if isinstance(out, tuple):  # an MoE layer: its statistics go to its own row
                    hidden_states, stats = out
                    row = torch.tensor([layer.layer_idx], device=stats.device)
                    router_stats = router_stats.index_add(1, row, stats.unsqueeze(1))
                else:
                    hidden_states = out
        # what multi-token prediction reads (GPTForCausalLM with use_mtp): the hidden states before the final norm,
        # the mask and rotary positions of the last layer's kind, the MoE token mask
        mtp_inputs = dict(hidden_states=hidden_states, attention_mask=masks[kinds[-1]], position_embeddings=rotary,
                          token_mask=token_mask) if kwargs.get("mtp_inputs") else None
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        if moe is not None:
            output = MoEModelOutputWithPast(last_hidden_state=hidden_states, router_stats=router_stats,
                                            **cache_output(past_key_values if use_cache else None))
        else:
            output = BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                             **cache_output(past_key_values if use_cache else None))
        if mtp_inputs is not None:
            output.mtp_inputs = mtp_inputs  # an attribute, not a field: tuples and pipeline stages never see it
        return output

    def _check_context(self, needed: int, what: str) -> None:
        """Learned positions end at their table (rotary ones have no end: transformers runs them at any length)."""
        limit = self.config.position_limit
        if limit is not None and needed > limit:
            raise MindFormersError(f"{what} exceeds the context length max_position_embeddings={limit}; shorten the "
                                   "prompt or max_new_tokens")


class GPTForCausalLM(GPTPreTrainedModel, FastGenerationMixin):
    """GPT with a language-modelling head; ``generate`` is transformers' ``GenerationMixin.generate`` with a lean
    static-cache loop for greedy/sampling requests (:class:`~mindformers_py.generation.FastGenerationMixin`).

    With ``config.use_mtp`` (see :attr:`GPTConfig.use_mtp`: by default, when a DeepSeek-V3 checkpoint holds its
    multi-token-prediction layers) it also holds ``mtp``, ``num_nextn_predict_layers`` DeepSeek-V3 MTP modules
    (:mod:`~mindformers_py.models.gpt.multi_token_head`), trained with the model: with ``labels`` the loss is the
    main loss plus ``mtp_loss_weight`` x their loss, which the output's ``mtp_loss`` gives apart (and the Trainer
    logs as ``mtp_loss``). Without labels (generation) they do not run."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"]), "mtp": (["hidden_states"], ["mtp_logits"])}
    _whole_sequence_modules = ("lm_head",)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.model = GPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = build_multi_token_prediction(config) if config.builds_mtp else None
        if config.use_mtp is None:  # settled now the model is built: a checkpoint read later cannot change it
            config.use_mtp = False
        moe = config.moe
        # The Trainer's ``training_metrics`` hook: router loads and losses of the training steps, the MTP loss,
        # for the logs.
        self.router_metrics = None if moe is None else RouterMetrics(
            config.num_hidden_layers, moe.expert_num, moe.num_experts_chosen, config.moe_layers(), moe.routing_policy == "topk",
            moe.z_loss_factor > 0)
        self.mtp_metrics = MTPMetrics() if self.mtp is not None else None
        # set by the Trainer's fused loss for a call (layers.loss.fused_head.loss_without_logits)
        self.fuse_loss_with_head, self.fused_loss_taken = False, False
        trackers = [t for t in (self.router_metrics, self.mtp_metrics) if t is not None]
        self.training_metrics = trackers[0] if len(trackers) == 1 else MetricsGroup(*trackers) if trackers else None
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
        token_type_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits for every position (or the last ``logits_to_keep``); with ``labels``, the next-token loss (with a
        ``shift_labels`` keyword too, those pre-shifted targets are scored instead, as transformers does).

        An MoE model with ``output_router_logits`` (argument or config) also returns the load-balancing ``aux_loss``
        and each MoE layer's ``router_logits``, and with ``labels`` its loss includes the router losses
        (:meth:`router_loss`), as transformers' Mixtral does. With multi-token prediction built and ``labels``, the
        loss includes the weighted MTP loss, also returned as ``mtp_loss`` (see the class docstring)."""
        shifted = kwargs.pop("shift_labels", None)  # transformers' pre-shifted targets (sequence/context parallel)
        # ... and multi-token prediction's, with the tokens it embeds, made before the sequence was cut (see
        # tokens_ahead)
        ahead_ids, ahead_targets = kwargs.pop("mtp_input_ids", None), kwargs.pop("mtp_shift_labels", None)
        # the last pipeline stage asks for the MTP logits (an attribute of the output), the loss being taken later
        mtp_logits_wanted = bool(kwargs.pop("return_mtp_logits", False)) and self.mtp is not None
        predicts_ahead = self.mtp is not None and (labels is not None or mtp_logits_wanted)
        if predicts_ahead and shifted is not None and (ahead_ids is None or ahead_targets is None):
            raise MindFormersError("multi-token prediction (use_mtp) with shift_labels (a sequence cut into chunks) "
                                   "needs mtp_input_ids and mtp_shift_labels made before the cut, as context "
                                   "parallelism's batches carry them; pass labels aligned with the inputs instead")
        # token_type_ids (GPT-2's segments) named here: transformers' generate passes only the inputs forward names
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                         token_type_ids=token_type_ids, **kwargs, **({"mtp_inputs": True} if predicts_ahead else {}))
        if self.lm_head is None:  # a pipeline stage before the last hands its hidden states on
            return out
        hidden = kept_positions(out.last_hidden_state, logits_to_keep)
        loss = mtp = mtp_logits = None
        if self._fuses_head_now(labels, predicts_ahead, logits_to_keep):
            # (TrainingArguments.fused_loss: the loss straight from the hidden states, no logits made or returned)
            targets = shifted if shifted is not None else labels
            logits, loss = None, fused_head_loss(self.lm_head, hidden, targets, num_items_in_batch,
                                                 shift=shifted is None)
        else:
            logits = self.lm_head(hidden)  # (B, T, V)
        if labels is not None and logits is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch=num_items_in_batch, shift_labels=shifted)
        if predicts_ahead:
            mtp_logits = multi_token_logits(self, out.mtp_inputs, input_ids, ahead_ids)
        if predicts_ahead and labels is not None:
            mtp = multi_token_prediction_loss(self, mtp_logits, labels, num_items_in_batch, targets=ahead_targets)
            loss = loss + mtp
        output = self._lm_output(out, loss, logits, mtp, shifted, labels, num_items_in_batch, kwargs)
        if mtp_logits_wanted:
            output.mtp_logits = torch.stack(mtp_logits, dim=1)  # an attribute, not a field: (B, D, T, V)
        return output

    def _fuses_head_now(self, labels: torch.Tensor | None, predicts_ahead: bool,
                        logits_to_keep: int | torch.Tensor) -> bool:
        """Whether this call computes its loss with the head fused (see :mod:`~mindformers_py.layers.loss.fused_head`):
        asked for, labels given, every position scored, no multi-token prediction (its modules read the logits'
        inputs their own way), and a head :func:`fusable_head` allows. Recorded in ``fused_loss_taken``."""
        if not self.fuse_loss_with_head or labels is None:
            return False
        self.fused_loss_taken = (not predicts_ahead and isinstance(logits_to_keep, int) and logits_to_keep == 0
                                 and fusable_head(self.lm_head))
        return self.fused_loss_taken

    @property
    def tokens_ahead(self) -> int:
        """How many tokens beyond the next one the loss predicts (multi-token prediction's depth, else 0): a batch
        cut into chunks (context parallelism) then carries ``mtp_input_ids`` and ``mtp_shift_labels``, made from
        the whole sequence before the cut (:func:`~mindformers_py.layers.multi_token_prediction.tokens_ahead`)."""
        return self.config.num_nextn_predict_layers if self.config.builds_mtp else 0

    @property
    def pipeline_outputs(self) -> tuple[str, ...]:
        """Outputs the last pipeline stage returns beside the task's and the carried state, for
        :meth:`carried_loss`: the MTP modules' logits (they need the labels, which only the loss sees). Read from
        the config: every stage's cut of the model answers the same (evaluation takes the loss on every rank)."""
        return ("mtp_logits",) if self.config.builds_mtp else ()

    @property
    def pipeline_last_stage_copies(self) -> tuple[str, ...]:
        """Modules of the first pipeline stage the last stage holds a copy of: the embedding, which the MTP modules
        read (its gradient is summed over both copies, as a tied embedding's)."""
        return ("embed_tokens",) if self.config.builds_mtp else ()

    def _lm_output(self, out: Any, loss: torch.Tensor | None, logits: torch.Tensor, mtp: torch.Tensor | None,
                   shifted: torch.Tensor | None, labels: torch.Tensor | None,
                   num_items_in_batch: int | torch.Tensor | None, kwargs: dict[str, Any]) -> Any:
        """The output of :meth:`forward` (router losses added for an MoE model)."""
        if self.config.moe is None:
            output = CausalLMOutputWithPast(loss=loss, logits=logits, **cache_output(output_cache(out)),
                                            hidden_states=out.hidden_states, attentions=out.attentions)
            if self.mtp is not None:
                output = CausalLMOutputWithMTP(**output, mtp_loss=mtp)
            return output
        aux_loss = None
        requested = kwargs.get("output_router_logits")
        if self.config.output_router_logits if requested is None else requested:
            aux_loss, router_loss = self.router_loss(out.router_stats, labels, num_items_in_batch, shift_labels=shifted)
            if loss is not None:
                loss = loss + router_loss
        elif labels is not None and self.training:
            # the loss stays transformers' (no router loss without output_router_logits, as a Qwen3-MoE checkpoint
            # sets it), but the run's logs still get the expert loads
            self.router_loss(out.router_stats.detach(), labels, num_items_in_batch, shift_labels=shifted)
        return MoECausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **cache_output(output_cache(out)),
                                         hidden_states=out.hidden_states, attentions=out.attentions,
                                         router_logits=out.router_logits, router_stats=out.router_stats, mtp_loss=mtp)

    def router_loss(self, router_stats: torch.Tensor, labels: torch.Tensor | None = None,
                    num_items_in_batch: int | torch.Tensor | None = None,
                    counted: bool = True, shift_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux_loss, loss)``: this forward's load-balancing loss (transformers' ``aux_loss``) and the router
        losses to add to the language-model loss, ``aux_loss_factor`` x load balancing + ``z_loss_factor`` x z-loss.

        With ``labels`` the added losses are this batch's share of the step's, weighted by its label tokens out of
        ``num_items_in_batch`` (see :func:`~mindformers_py.layers.moe.layer.router_losses`), so gradient accumulation and
        data-parallel or pipeline splits add up to the step's; in training they are then counted for the logs
        (unless ``counted`` is False)."""
        moe = self.config.moe
        aux, z = router_losses(router_stats, moe.expert_num, moe.aux_loss_scope)
        if labels is None:
            return aux, moe.aux_loss_factor * aux + moe.z_loss_factor * z
        targets = next_token_targets(labels) if shift_labels is None else shift_labels
        items = (targets != IGNORE_INDEX).sum(-1).to(router_stats.device)
        aux_share, z_share = router_losses(router_stats, moe.expert_num, moe.aux_loss_scope, items, num_items_in_batch)
        if counted and self.training and self.router_metrics is not None:
            self.router_metrics.add(router_stats, aux_share, z_share)
        return aux, moe.aux_loss_factor * aux_share + moe.z_loss_factor * z_share

    def carried_loss(self, carried: dict[str, torch.Tensor], labels: tuple[torch.Tensor, ...],
                     num_items_in_batch: int | torch.Tensor | None = None, counted: bool = True,
                     labels_shifted: bool = False) -> torch.Tensor | None:
        """On the last pipeline stage: the router losses computed from the ``router_stats`` the stages carried
        (see :attr:`pipeline_carry`) plus the MTP loss from the ``mtp_logits`` the stage returned (see
        :attr:`pipeline_outputs`), or None when neither is part of the loss. ``counted=False``: a call on
        placeholder tensors, kept out of the logged metrics; ``labels_shifted``: the labels are ``shift_labels``."""
        loss = None
        stats = carried.get("router_stats")
        if stats is not None and self.config.output_router_logits:
            shift = {"shift_labels": labels[0]} if labels_shifted else {}
            loss = self.router_loss(stats, labels[0], num_items_in_batch, counted, **shift)[1]
        mtp_logits = carried.get("mtp_logits")
        if mtp_logits is not None:
            if labels_shifted:  # (the layout checks refuse context x pipeline parallelism with it)
                raise MindFormersError("multi-token prediction (use_mtp) under pipeline stages needs labels aligned "
                                       "with the inputs, not shift_labels (context parallelism); set use_mtp=False")
            mtp = multi_token_prediction_loss(self, list(mtp_logits.unbind(1)), labels[0], num_items_in_batch, counted)
            loss = mtp if loss is None else loss + mtp
        return loss


class GPTDoubleHeadsModel(GPTPreTrainedModel, GenerationMixin):
    """GPT-2 with the language-modelling head and a multiple-choice head (``multiple_choice_head``: a
    :class:`~mindformers_py.layers.heads.SequenceSummary` of each choice's token at ``mc_token_ids``), transformers'
    ``GPT2DoubleHeadsModel`` (Radford et al. 2018's fine-tuning setup). Inputs may have leading dimensions
    (batch, choices, length); the LM loss is the next-token cross-entropy, the multiple-choice loss the
    cross-entropy over the choices, each a mean, as there."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _whole_sequence_modules = ("lm_head", "multiple_choice_head")  # every position, and the chosen ones
    # Two losses with different items (tokens, choices): Trainers average it per micro-batch, as transformers'.
    accepts_loss_kwargs = False

    def __init__(self, config: GPTConfig) -> None:
        config.num_labels = 1  # one score per choice, as transformers sets it
        super().__init__(config)
        self.model = GPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        outputs = (config.num_labels if config.summary_proj_to_labels else config.hidden_size) \
            if config.summary_use_proj else None
        self.multiple_choice_head = SequenceSummary(config.hidden_size, config.summary_type, outputs,
                                                    config.summary_activation, config.summary_first_dropout)
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
        past_key_values: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        mc_token_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        mc_labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> GPT2DoubleHeadsModelOutput:
        """LM logits (..., T, V) and choice scores (B, choices) of (B, choices, T) inputs (any leading dimensions);
        ``mc_token_ids`` (B, choices) is each choice's classification token (its last token without it). With
        ``labels`` the LM loss, with ``mc_labels`` (B,) the multiple-choice loss."""
        reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
        lead = reference.shape[:-1]
        flat = lambda t: None if t is None else t.reshape(-1, *t.shape[len(lead):])  # noqa: E731
        out = self.model(flat(input_ids), flat(attention_mask), flat(position_ids), past_key_values, flat(inputs_embeds),
                         use_cache, flat(token_type_ids), **kwargs)
        hidden = out.last_hidden_state.reshape(*lead, *out.last_hidden_state.shape[1:])  # (..., T, C)
        logits = self.lm_head(hidden)
        mc_logits = self.multiple_choice_head(hidden, mc_token_ids).squeeze(-1)
        mc_loss = choice_cross_entropy(mc_logits.view(-1, mc_logits.shape[-1]), mc_labels) if mc_labels is not None else None
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return GPT2DoubleHeadsModelOutput(loss=loss, mc_loss=mc_loss, logits=logits, mc_logits=mc_logits,
                                          **cache_output(output_cache(out)), hidden_states=out.hidden_states,
                                          attentions=out.attentions)


class GPTForSequenceClassification(SequenceClassification, GPTPreTrainedModel):
    """GPT with a linear ``score`` head on the last real (non-padding) token, as HF's GPT-2/Llama classifiers;
    single-label, multi-label or regression by ``config.problem_type``."""

    base_model_class = GPTModel
    head_name, pooling, head_bias = "score", "last", False
    output_class = SequenceClassifierOutputWithPast
    _pp_plan = {"score": (["hidden_states"], ["logits"])}


class GPTForTokenClassification(TokenClassification, GPTPreTrainedModel):
    """GPT with a linear ``score`` head on every token (HF's ``LlamaForTokenClassification``; GPT-2's is named
    ``classifier``, renamed on conversion), after dropout of ``classifier_dropout``."""

    base_model_class = GPTModel
    head_name = "score"
    _pp_plan = {"score": (["hidden_states"], ["logits"])}


class GPTForQuestionAnswering(QuestionAnswering, GPTPreTrainedModel):
    """GPT with a ``qa_outputs`` head giving each token a start and an end logit for an extractive answer span."""

    base_model_class = GPTModel
    _pp_plan = {"qa_outputs": (["hidden_states"], ["logits"])}
