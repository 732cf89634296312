"""The BERT family: a bidirectional encoder (BERT, RoBERTa) built from the shared layers, and its task heads.

The encoder is the shared :class:`~mindformers_py.layers.TransformerBlock` in its post-norm form with
bidirectional attention; the embeddings add token, position and token-type tables and pass the sum through
:class:`~mindformers_py.layers.EmbeddingNorm`. Model code is single-device PyTorch; tensor, sequence and pipeline
parallelism are applied from outside (``mindformers_py.parallel``) following the plans declared on
:class:`BertConfig` and on the heads.

With ``config.is_decoder`` the same stack is causal and keeps a key/value cache (:class:`BertLMHeadModel`, BERT as
a left-to-right language model with ``generate``); with ``config.add_cross_attention`` too, each layer attends to an
encoder's output after its self-attention (the decoder of transformers' ``EncoderDecoderModel``, BERT-to-BERT).

The task models are the shared ones (:mod:`mindformers_py.models.task_models`: this base model with a head), with
transformers' names (``classifier``, ``qa_outputs``, ``nsp_head`` for ``cls.seq_relationship``).

Every model is also its own pipeline stage: without ``embed_tokens`` the base model takes the previous stage's
hidden states as ``inputs_embeds`` and skips the embedding phase; without ``pooler`` it returns no pooled output; a
head without its head module returns the base model's output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    CausalLMOutputWithCrossAttentions,
    MaskedLMOutput,
    ModelOutput,
)
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ...errors import ConfigError, MindFormersError
from ...layers import (
    Attention,
    EmbeddingNorm,
    LearnedPositionEmbedding,
    MaskedLMHead,
    Pooler,
    TransformerBlock,
    build_attention_mask,
    causal_lm_loss,
    padding_aware_position_ids,
)
from ...layers.heads import kept_positions
from ...layers.loss import token_cross_entropy
from ...layers.masks import key_padding_mask
from ..cache_names import accepts_cache_argument, cache_output, output_cache
from ..modeling_base import MindFormersPreTrainedModel
from ..task_models import MultipleChoice, NextSentencePrediction, QuestionAnswering, SequenceClassification, TaskModel, \
    TokenClassification
from .configuration_bert import BertConfig


class BertPreTrainedModel(MindFormersPreTrainedModel):
    """Weight init and config class of the BERT models (the rest is :class:`MindFormersPreTrainedModel`)."""

    config_class = BertConfig
    config: BertConfig
    base_model_prefix = "model"
    # Base checkpoints carry a pooler that heads without one (MLM, token classification, QA) do not use; MLM
    # checkpoints lack the one a classifier needs (it starts from random weights, as in transformers).
    _keys_to_ignore_on_load_unexpected = [r"^(model\.)?pooler\."]
    _keys_to_ignore_on_load_missing = [r"^(model\.)?pooler\."]
    _can_record_outputs = {
        "hidden_states": TransformerBlock,
        "attentions": OutputRecorder(Attention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(Attention, index=1, layer_name="cross_attn"),
    }


class BertModel(BertPreTrainedModel):
    """Embeddings, a stack of post-norm :class:`TransformerBlock` and, with ``add_pooling_layer``, the first-token
    :class:`Pooler`; returns the last hidden states and the pooled output. Bidirectional, or causal with a key/value
    cache when ``config.is_decoder`` (and cross-attending to ``encoder_hidden_states`` with
    ``config.add_cross_attention``).

    ``classification_pooler``: the pooler is RoBERTa's classification head (``classifier.dense``), which applies
    ``config.pooler_dropout`` before its dense layer; a base model's pooler has no dropout."""

    _whole_sequence_modules = ("pooler",)  # it reads the first token

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True, classification_pooler: bool = False) -> None:
        if config.add_cross_attention and not config.is_decoder:
            raise ConfigError("add_cross_attention=True needs is_decoder=True: cross-attention layers belong to a "
                              "decoder (transformers' EncoderDecoderModel sets both)")
        super().__init__(config)
        # transformers' tables: the padding token's row (and RoBERTa's padding position) stays zero, learns nothing
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                                        config.pad_token_id if config.padded_positions else None)
        self.embed_token_types = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.drop = EmbeddingNorm(config.hidden_size, config.norm_eps, config.hidden_dropout, config.norm_type,
                                  config.norm_bias)
        self.layers = nn.ModuleList(TransformerBlock(config, i, is_causal=config.is_decoder, post_norm=True,
                                                     cross_attention=config.add_cross_attention)
                                    for i in range(config.num_hidden_layers))
        dropout = config.pooler_dropout if classification_pooler else 0.0
        self.pooler = Pooler(config.hidden_size, dropout) if add_pooling_layer else None
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
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """Last hidden states (B, T, C) and pooled first tokens (B, C) of ``input_ids`` (or ``inputs_embeds``), with
        the padding ``attention_mask`` (B, T) and segment ``token_type_ids`` (B, T, zeros by default); with
        ``output_hidden_states`` / ``output_attentions``, every layer's hidden states / attention weights, and a
        tuple with ``return_dict=False``, as transformers' ``BertModel``.

        A decoder (``config.is_decoder``) also takes ``past_key_values`` (and keeps one with ``use_cache``, the
        config's by default) and, with cross-attention, the encoder's output ``encoder_hidden_states`` (B, S, C)
        with its padding mask ``encoder_attention_mask`` (B, S).

        On a pipeline stage without ``embed_tokens``, ``inputs_embeds`` is the previous stage's output and
        ``position_ids`` (which then must cover the whole sequence) give the length the mask is built for."""
        decoder = self.config.is_decoder
        use_cache = decoder and (self.config.use_cache if use_cache is None else use_cache)
        if use_cache and past_key_values is None and not self.training:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache()) if self.config.add_cross_attention \
                else DynamicCache()
        self_cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        past = int(self_cache.get_seq_length()) if self_cache is not None else 0
        if self.embed_tokens is None:  # a later pipeline stage: the residual stream arrives from the previous one
            if inputs_embeds is None:
                raise MindFormersError("this pipeline stage holds no embeddings: pass the previous stage's hidden states as inputs_embeds")
            hidden_states = inputs_embeds
            length = position_ids.shape[-1] if position_ids is not None else hidden_states.shape[1]
        else:
            if (input_ids is None) == (inputs_embeds is None):
                raise MindFormersError("pass exactly one of input_ids or inputs_embeds")
            # The length before the embedding norm: under sequence parallelism ``drop`` hands on a shard of it.
            length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            hidden_states = self._embed(input_ids, token_type_ids, position_ids, inputs_embeds, past)  # (B, T, C)
        kv_length, kv_offset = self_cache.get_mask_sizes(length, 0) if self_cache is not None else (length, 0)
        mask = build_attention_mask(attention_mask, query_length=length, kv_length=kv_length, kv_offset=kv_offset,
                                    past_length=past, causal=decoder, device=hidden_states.device)
        cross_mask = key_padding_mask(encoder_attention_mask) if encoder_hidden_states is not None else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, None, past_key_values,
                                  encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=cross_mask)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=hidden_states, pooler_output=pooled,
                                                            **cache_output(past_key_values if use_cache else None))

    def _embed(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
               position_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, past: int = 0) -> torch.Tensor:
        """Token + token-type + position embeddings (transformers' order of the sums), normed, with dropout; the
        positions continue after the ``past`` tokens a decoder's cache holds."""
        config = self.config
        ref = input_ids if input_ids is not None else inputs_embeds[..., 0]
        batch, length = ref.shape
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, token_type_ids, position_ids, past + length)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            if config.padded_positions and input_ids is not None:
                position_ids = padding_aware_position_ids(input_ids, config.pad_token_id, past)
            else:
                first = config.first_position + past
                position_ids = torch.arange(first, first + length, device=ref.device)[None]
        if token_type_ids is None:
            token_type_ids = torch.zeros(1, length, dtype=torch.long, device=ref.device)
        embeddings = inputs_embeds + self.embed_token_types(token_type_ids)
        embeddings = embeddings + self.embed_positions(position_ids)
        return self.drop(embeddings)

    def _check_inputs(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                      position_ids: torch.Tensor | None, length: int) -> None:
        """One-line errors for inputs the embedding tables cannot look up (instead of an index error)."""
        config = self.config
        if length > config.max_input_length:
            raise MindFormersError(
                f"an input of {length} tokens exceeds the model's limit of {config.max_input_length} "
                f"(max_position_embeddings={config.max_position_embeddings}); truncate it, e.g. "
                f"tokenizer(..., truncation=True, max_length={config.max_input_length})")
        if input_ids is not None and input_ids.numel() and int(input_ids.max()) >= config.vocab_size:
            raise MindFormersError(
                f"token id {int(input_ids.max())} is outside the model's vocabulary (vocab_size={config.vocab_size}): "
                "the tokenizer does not match the model's embedding size")
        if token_type_ids is not None and token_type_ids.numel() and int(token_type_ids.max()) >= config.type_vocab_size:
            raise MindFormersError(
                f"token_type_ids holds {int(token_type_ids.max())} but the model has type_vocab_size="
                f"{config.type_vocab_size} (valid: 0..{config.type_vocab_size - 1}); drop token_type_ids for "
                "models with one segment type")
        if position_ids is not None and position_ids.numel() and int(position_ids.max()) >= config.max_position_embeddings:
            raise MindFormersError(f"position id {int(position_ids.max())} exceeds the position table "
                                   f"(max_position_embeddings={config.max_position_embeddings})")


class _VocabularyHead:
    """The masked-LM head (``lm_head``: transform, norm, and a decoder over the vocabulary sharing the token
    embedding's weight) of :class:`BertForMaskedLM`, :class:`BertLMHeadModel` and :class:`BertForPreTraining`."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}
    _whole_sequence_modules = ("lm_head",)  # its dense + norm run on whole rows

    def _vocabulary_head(self, config: BertConfig) -> MaskedLMHead:
        return MaskedLMHead(config.hidden_size, config.vocab_size, config.mlm_head_act or config.hidden_act,
                            config.norm_eps, config.norm_type)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value


class BertForMaskedLM(_VocabularyHead, TaskModel, BertPreTrainedModel):
    """BERT with the masked-language-modelling head: scores over the vocabulary for every position (the decoder
    shares the token embedding's weight and has its own bias); with ``labels`` (the original ids at masked
    positions, -100 elsewhere), the cross-entropy over the labelled positions."""

    base_model_class = BertModel
    base_model_kwargs = {"add_pooling_layer": False}
    head_name = "lm_head"
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def build_head(self, config: BertConfig) -> None:
        self.lm_head = self._vocabulary_head(config)

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None) -> MaskedLMOutput:
        logits = self.lm_head(out.last_hidden_state)
        loss = token_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertLMHeadModel(_VocabularyHead, BertPreTrainedModel, GenerationMixin):
    """BERT (or RoBERTa: transformers' ``RobertaForCausalLM``) as a left-to-right language model: the masked-LM
    head on a causal stack (``config.is_decoder``), the next-token loss, transformers' ``generate``. With
    ``config.add_cross_attention`` it is the decoder of transformers' ``EncoderDecoderModel`` (BERT-to-BERT)."""

    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.model = BertModel(config, add_pooling_layer=False)
        self.lm_head = self._vocabulary_head(config)
        self.post_init()

    @accepts_cache_argument
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithCrossAttentions:
        """Vocabulary logits of every position (or the last ``logits_to_keep``); with ``labels``, the next-token
        loss (``shift_labels`` too: those pre-shifted targets are scored instead), as transformers'
        ``BertLMHeadModel``, which keeps no cache while computing a loss."""
        shifted = kwargs.pop("shift_labels", None)
        if labels is not None:
            use_cache = False
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, encoder_hidden_states,
                         encoder_attention_mask, past_key_values, use_cache, **kwargs)
        if self.lm_head is None:  # a pipeline stage before the last hands its hidden states on
            return out
        hidden = kept_positions(out.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch=num_items_in_batch, shift_labels=shifted)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits, **cache_output(output_cache(out)),
                                                 hidden_states=out.hidden_states, attentions=out.attentions,
                                                 cross_attentions=out.cross_attentions)


class BertForSequenceClassification(SequenceClassification, BertPreTrainedModel):
    """BERT with a linear ``classifier`` on the pooled first token, after dropout; single-label, multi-label or
    regression by ``config.problem_type``. (RoBERTa's classification head is the pooler with
    ``config.pooler_dropout`` before its dense layer.)"""

    base_model_class = BertModel
    base_model_kwargs = {"add_pooling_layer": True, "classification_pooler": True}
    _pp_plan = {"classifier": (["pooler_output"], ["logits"])}


class BertForMultipleChoice(MultipleChoice, BertPreTrainedModel):
    """BERT scoring each choice of (B, choices, T) inputs with a one-output ``classifier`` on its pooled first
    token (transformers' ``BertForMultipleChoice`` / ``RobertaForMultipleChoice``)."""

    base_model_class = BertModel
    _pp_plan = {"classifier": (["pooler_output"], ["logits"])}


class BertForNextSentencePrediction(NextSentencePrediction, BertPreTrainedModel):
    """BERT's next-sentence head (``nsp_head``, transformers' ``cls.seq_relationship``) on the pooled first token."""

    base_model_class = BertModel
    _pp_plan = {"nsp_head": (["pooler_output"], ["logits"])}


class BertForTokenClassification(TokenClassification, BertPreTrainedModel):
    """BERT with a linear ``classifier`` on every token, after dropout (named entities, tagging)."""

    base_model_class = BertModel
    base_model_kwargs = {"add_pooling_layer": False}
    _pp_plan = {"classifier": (["hidden_states"], ["logits"])}


class BertForQuestionAnswering(QuestionAnswering, BertPreTrainedModel):
    """BERT with a ``qa_outputs`` head giving each token a start and an end logit for an extractive answer span."""

    base_model_class = BertModel
    base_model_kwargs = {"add_pooling_layer": False}
    _pp_plan = {"qa_outputs": (["hidden_states"], ["logits"])}


@dataclass
class BertForPreTrainingOutput(ModelOutput):
    """Output of :class:`BertForPreTraining` (the fields of transformers' class of the same name)."""

    loss: torch.FloatTensor | None = None
    """Masked-LM plus next-sentence loss (with labels)."""
    prediction_logits: torch.FloatTensor | None = None
    """Vocabulary scores of every position (B, T, V)."""
    seq_relationship_logits: torch.FloatTensor | None = None
    """Is-next / not-next scores of each pair (B, 2)."""
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    """Every layer's hidden states, with ``output_hidden_states``."""
    attentions: tuple[torch.FloatTensor, ...] | None = None
    """Every layer's attention weights, with ``output_attentions``."""


class BertForPreTraining(_VocabularyHead, TaskModel, BertPreTrainedModel):
    """BERT's pretraining objective: the masked-LM head on every position and a next-sentence head
    (``nsp_head``, 2 classes) on the pooled first token; the loss is the sum of both cross-entropies, each a mean
    over its items, as transformers' ``BertForPreTraining``."""

    base_model_class = BertModel
    head_name = "lm_head"
    head_inputs = ("labels", "next_sentence_label")
    _whole_sequence_modules = ("lm_head", "nsp_head")
    # Two losses with different items (masked tokens, pairs): Trainers average it per micro-batch, as transformers'.
    accepts_loss_kwargs = False

    def build_head(self, config: BertConfig) -> None:
        self.lm_head = self._vocabulary_head(config)
        self.nsp_head = nn.Linear(config.hidden_size, 2)

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None,
                    next_sentence_label: torch.Tensor | None = None) -> BertForPreTrainingOutput:
        """Vocabulary logits (B, T, V) and next-sentence logits (B, 2); with both ``labels`` (masked ids, -100
        elsewhere) and ``next_sentence_label`` (0: B follows A, 1: B is random), the summed loss."""
        prediction_logits = self.lm_head(out.last_hidden_state)
        relationship_logits = self.nsp_head(out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            nsp = F.cross_entropy(relationship_logits.float().view(-1, 2), next_sentence_label.view(-1))
            loss = token_cross_entropy(prediction_logits, labels) + nsp
        return BertForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits,
                                        seq_relationship_logits=relationship_logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions)
