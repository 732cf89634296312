"""The BERT family: a bidirectional encoder (BERT, RoBERTa) built from the shared layers, and its task heads.

The encoder is the shared :class:`~mindformers_py.layers.TransformerBlock` in its post-norm form with
bidirectional attention; the embeddings add token, position and token-type tables and pass the sum through
:class:`~mindformers_py.layers.EmbeddingNorm`. Model code is single-device PyTorch; tensor, sequence and pipeline
parallelism are applied from outside (``mindformers_py.parallel``) following the plans declared on
:class:`BertConfig` and on the heads.

Every model is also its own pipeline stage: without ``embed_tokens`` the base model takes the previous stage's
hidden states as ``inputs_embeds`` and skips the embedding phase; without ``pooler`` it returns no pooled output; a
head without its head module returns the base model's output unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    ModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from ...errors import MindFormersError
from ...layers import (
    EmbeddingNorm,
    LearnedPositionEmbedding,
    MaskedLMHead,
    Pooler,
    TransformerBlock,
    build_attention_mask,
    padding_aware_position_ids,
)
from ...layers.loss import check_class_ids, question_answering_loss, sequence_classification_loss, \
    token_cross_entropy
from ..modeling_base import MindFormersPreTrainedModel
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


class BertModel(BertPreTrainedModel):
    """Embeddings, a stack of post-norm :class:`TransformerBlock` with bidirectional attention and, with
    ``add_pooling_layer``, the first-token :class:`Pooler`; returns the last hidden states and the pooled output."""

    _whole_sequence_modules = ("pooler",)  # it reads the first token

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.embed_token_types = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.drop = EmbeddingNorm(config.hidden_size, config.norm_eps, config.hidden_dropout, config.norm_type,
                                  config.norm_bias)
        self.layers = nn.ModuleList(TransformerBlock(config, i, is_causal=False, post_norm=True)
                                    for i in range(config.num_hidden_layers))
        self.pooler = Pooler(config.hidden_size, config.pooler_dropout) if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """Last hidden states (B, T, C) and pooled first tokens (B, C) of ``input_ids`` (or ``inputs_embeds``), with
        the padding ``attention_mask`` (B, T) and segment ``token_type_ids`` (B, T, zeros by default); with
        ``output_hidden_states`` / ``output_attentions``, every layer's hidden states / attention weights, and a
        tuple with ``return_dict=False``, as transformers' ``BertModel``.

        On a pipeline stage without ``embed_tokens``, ``inputs_embeds`` is the previous stage's output and
        ``position_ids`` (which then must cover the whole sequence) give the length the mask is built for."""
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
            hidden_states = self._embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # (B, T, C)
        mask = build_attention_mask(attention_mask, query_length=length, kv_length=length, causal=False,
                                    device=hidden_states.device)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)

    def _embed(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
               position_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """Token + token-type + position embeddings (transformers' order of the sums), normed, with dropout."""
        config = self.config
        ref = input_ids if input_ids is not None else inputs_embeds[..., 0]
        batch, length = ref.shape
        if not torch.compiler.is_compiling():
            self._check_inputs(input_ids, token_type_ids, position_ids, length)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            if config.padded_positions and input_ids is not None:
                position_ids = padding_aware_position_ids(input_ids, config.pad_token_id)
            else:
                position_ids = torch.arange(config.first_position, config.first_position + length, device=ref.device)[None]
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


def _classifier_dropout(config: BertConfig) -> float:
    return config.hidden_dropout if config.classifier_dropout is None else config.classifier_dropout


class BertForMaskedLM(BertPreTrainedModel):
    """BERT with the masked-language-modelling head: scores over the vocabulary for every position (the decoder
    shares the token embedding's weight and has its own bias)."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("lm_head",)  # its dense + norm run on whole rows

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.model = BertModel(config, add_pooling_layer=False)
        self.lm_head = MaskedLMHead(config.hidden_size, config.vocab_size, config.mlm_head_act or config.hidden_act,
                                    config.norm_eps, config.norm_type)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """Logits (B, T, V); with ``labels`` (B, T: the original ids at masked positions, -100 elsewhere), the
        cross-entropy over the labelled positions."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        if self.lm_head is None:  # a pipeline stage before the last hands its hidden states on
            return out
        logits = self.lm_head(out.last_hidden_state)
        loss = token_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertForSequenceClassification(BertPreTrainedModel):
    """BERT with a linear ``classifier`` on the pooled first token, after dropout; single-label, multi-label or
    regression by ``config.problem_type``."""

    _pp_plan = {"classifier": (["pooler_output"], ["logits"])}

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = BertModel(config, add_pooling_layer=True)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        """Logits (B, num_labels); with ``labels``, the loss of ``config.problem_type``."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        if self.classifier is None:
            return out
        logits = self.classifier(self.dropout(out.pooler_output))
        loss = sequence_classification_loss(logits, labels, self.config, num_items_in_batch) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertForTokenClassification(BertPreTrainedModel):
    """BERT with a linear ``classifier`` on every token, after dropout (named entities, tagging)."""

    _pp_plan = {"classifier": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("classifier",)

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = BertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        """Logits (B, T, num_labels); with ``labels`` (B, T, -100 ignored), the token cross-entropy."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        if self.classifier is None:
            return out
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            check_class_ids(labels, self.config.num_labels)
            loss = token_cross_entropy(logits, labels, num_items_in_batch)
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertForQuestionAnswering(BertPreTrainedModel):
    """BERT with a ``qa_outputs`` head giving each token a start and an end logit for an extractive answer span."""

    _pp_plan = {"qa_outputs": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("qa_outputs",)

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.model = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        """Start and end logits (B, T); with ``start_positions`` and ``end_positions``, the span loss."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        if self.qa_outputs is None:
            return out
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in self.qa_outputs(out.last_hidden_state).split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start_logits, end_logits, start_positions, end_positions, num_items_in_batch)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=out.hidden_states, attentions=out.attentions)


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


class BertForPreTraining(BertPreTrainedModel):
    """BERT's pretraining objective: the masked-LM head on every position and a next-sentence head
    (``nsp_head``, 2 classes) on the pooled first token; the loss is the sum of both cross-entropies, each a mean
    over its items, as transformers' ``BertForPreTraining``."""

    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head.decoder": "colwise_gather_output"}
    _whole_sequence_modules = ("lm_head", "nsp_head")
    # Two losses with different items (masked tokens, pairs): Trainers average it per micro-batch, as transformers'.
    accepts_loss_kwargs = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.model = BertModel(config, add_pooling_layer=True)
        self.lm_head = MaskedLMHead(config.hidden_size, config.vocab_size, config.mlm_head_act or config.hidden_act,
                                    config.norm_eps, config.norm_type)
        self.nsp_head = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        next_sentence_label: torch.LongTensor | None = None,
        **kwargs,
    ) -> BertForPreTrainingOutput:
        """Vocabulary logits (B, T, V) and next-sentence logits (B, 2); with both ``labels`` (masked ids, -100
        elsewhere) and ``next_sentence_label`` (0: B follows A, 1: B is random), the summed loss."""
        out = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        prediction_logits = self.lm_head(out.last_hidden_state)
        relationship_logits = self.nsp_head(out.pooler_output)
        loss = None
        if labels is not None and next_sentence_label is not None:
            nsp = F.cross_entropy(relationship_logits.float().view(-1, 2), next_sentence_label.view(-1))
            loss = token_cross_entropy(prediction_logits, labels) + nsp
        return BertForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits,
                                        seq_relationship_logits=relationship_logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions)
