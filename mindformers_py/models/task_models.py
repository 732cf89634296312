"""Task models written once: any family's base model with a task head on top (``<Family>For<Task>``), as
transformers 5 does with its generic models (``GenericForSequenceClassification``, ...): sequence classification
(pooled first token, or the last real token), token classification, extractive question answering, multiple choice
and next-sentence prediction. The head modules themselves (pooler, MLM head, sequence summary) are layers
(:mod:`mindformers_py.layers.heads`).

A family declares a task model in a few lines::

    class GPTForSequenceClassification(SequenceClassification, GPTPreTrainedModel):
        base_model_class = GPTModel
        head_name, pooling, head_bias = "score", "last", False

and gets transformers' module names (``score``/``classifier``, ``qa_outputs``, ...), outputs and losses. The task
model's ``forward`` takes its base model's own inputs, in the base model's order (``token_type_ids`` for BERT,
``position_ids`` and the cache for GPT), then its labels and ``num_items_in_batch``: its signature is the base
model's, extended (``inspect.signature`` shows it, so transformers' Trainer keeps the right dataset columns and
``generate`` checks the right arguments).

Every task model is also a pipeline stage (torchtitan's way): with its head module set to None it returns the base
model's output unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.modeling_outputs import (
    ModelOutput,
    MultipleChoiceModelOutput,
    NextSentencePredictorOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils.generic import can_return_tuple

from ..errors import MindFormersError
from ..layers.dropout import Dropout
from ..layers.loss import check_class_ids, choice_cross_entropy, question_answering_loss, \
    sequence_classification_loss, token_cross_entropy

POOLINGS = ("first", "last")
"""How a sequence classifier summarises a sequence: ``"first"``, the base model's pooled first token ([CLS], through
its pooler: BERT, RoBERTa); ``"last"``, the scores of the last real (non-padding) token (GPT-2, Llama)."""


def classifier_dropout(config: Any) -> float:
    """Dropout before a classifier: ``classifier_dropout`` when set, else ``hidden_dropout`` (transformers' rule)."""
    value = getattr(config, "classifier_dropout", None)
    return value if value is not None else getattr(config, "hidden_dropout", 0.0)


class TaskModel:
    """Mixin putting one task head on a family's base model (``self.model``); put it before the family's
    pretrained-model class in the bases.

    Class attributes a family sets: ``base_model_class`` (and ``base_model_kwargs`` for its constructor), and the
    head's own choices (``head_name``, ...). A head subclass defines :meth:`build_head` (its modules) and
    :meth:`head_output` (logits, loss and output from the base model's output)."""

    base_model_class: ClassVar[type[nn.Module]]
    """The family's base model class, built as ``self.model``."""
    base_model_kwargs: ClassVar[dict[str, Any]] = {}
    """Extra arguments of the base model's constructor (``add_pooling_layer`` for BERT)."""
    head_name: ClassVar[str] = "classifier"
    """Attribute (and checkpoint name) of the head's linear layer."""
    head_inputs: ClassVar[tuple[str, ...]] = ("labels",)
    """The head's own forward arguments, after the base model's."""
    excluded_inputs: ClassVar[tuple[str, ...]] = ("encoder_hidden_states", "encoder_attention_mask",
                                                  "past_key_values", "use_cache")
    """Base-model arguments a head does not take (a decoder's cross-attention inputs, the key/value cache)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = self.base_model_class(config, **self.base_model_kwargs)
        self.build_head(config)
        self.post_init()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "base_model_class" in cls.__dict__:  # a family's concrete head: its forward takes the base model's inputs
            cls.forward = _forward_taking(cls.base_model_class.forward, cls.excluded_inputs, cls.head_inputs)
            if "_whole_sequence_modules" not in cls.__dict__:  # what sequence parallelism gathers the sequence for
                cls._whole_sequence_modules = (cls.head_name,) if cls.scores_positions() else ()

    @classmethod
    def scores_positions(cls) -> bool:
        """Whether the head module reads every position (so it needs the whole sequence under sequence
        parallelism), rather than a pooled vector the base model's pooler gives."""
        return True

    def build_head(self, config: Any) -> None:
        """Create the head's modules."""
        raise NotImplementedError

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    **labels: Any) -> ModelOutput:
        """The head's output (logits, loss) from the base model's output ``out``; ``inputs`` are the head's own
        inputs (before :meth:`prepare_inputs`)."""
        raise NotImplementedError

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The base model's arguments for this head's inputs (multiple choice flattens its choices)."""
        return inputs

    def _head_forward(self, inputs: dict[str, Any], num_items_in_batch: Any, labels: dict[str, Any]) -> ModelOutput:
        out = self.model(**self.prepare_inputs(inputs))
        if getattr(self, self.head_name) is None:  # a pipeline stage before the last hands its hidden states on
            return out
        return self.head_output(out, inputs, num_items_in_batch=num_items_in_batch, **labels)


def _forward_taking(base_forward: Any, excluded: tuple[str, ...], head_inputs: tuple[str, ...]):
    """A ``forward(self, <the base model's named inputs but excluded>, <head inputs>, num_items_in_batch=None,
    **kwargs)`` running :meth:`TaskModel._head_forward`. The extra keywords (``output_hidden_states``,
    ``return_dict``, ...) go to the base model, as transformers' heads pass them; a base model that can keep a
    key/value cache is asked not to (no head output has one)."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    base = list(inspect.signature(base_forward).parameters.values())[1:]  # without self
    base_inputs = [p for p in base if p.kind is keyword and p.name not in excluded]
    own = [inspect.Parameter(name, keyword, default=None) for name in (*head_inputs, "num_items_in_batch")]
    signature = inspect.Signature([inspect.Parameter("self", keyword), *base_inputs, *own,
                                   inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    names = [p.name for p in base_inputs]
    takes_cache = any(p.name == "use_cache" for p in base)

    def forward(self, *args: Any, **kwargs: Any) -> ModelOutput:
        arguments = signature.bind(self, *args, **kwargs).arguments
        inputs = {name: arguments[name] for name in names if name in arguments}
        inputs.update(arguments.get("kwargs", {}))
        if takes_cache:
            inputs.setdefault("use_cache", False)
        labels = {name: arguments.get(name) for name in head_inputs}
        return self._head_forward(inputs, arguments.get("num_items_in_batch"), labels)

    forward.__doc__ = ("The base model's inputs, then the head's labels (" + ", ".join(head_inputs) + ") and "
                       "``num_items_in_batch`` (the items of the whole optimizer step the loss is divided by).")
    forward = can_return_tuple(forward)
    forward.__signature__ = signature
    return forward


class SequenceClassification(TaskModel):
    """One label (or score) per sequence: a linear ``head_name`` layer on the pooled sequence (``pooling``: the
    base model's pooled first token after dropout, or the last real token's scores, found from ``input_ids`` and
    ``config.pad_token_id`` for left and right padding alike); the loss of ``config.problem_type`` (single-label,
    multi-label or regression)."""

    pooling: ClassVar[str] = "first"
    head_bias: ClassVar[bool] = True
    output_class: ClassVar[type[ModelOutput]] = SequenceClassifierOutput

    @classmethod
    def scores_positions(cls) -> bool:
        return cls.pooling == "last"

    def build_head(self, config: Any) -> None:
        self.num_labels = config.num_labels
        self.dropout = Dropout(classifier_dropout(config) if self.pooling == "first" else 0.0)
        setattr(self, self.head_name, nn.Linear(config.hidden_size, self.num_outputs(config), bias=self.head_bias))

    def num_outputs(self, config: Any) -> int:
        return config.num_labels

    def pooled_logits(self, out: ModelOutput, inputs: dict[str, Any]) -> torch.Tensor:
        """Logits (rows, outputs) of each sequence."""
        head = getattr(self, self.head_name)
        if self.pooling == "first":
            return head(self.dropout(out.pooler_output))
        logits = head(out.last_hidden_state)  # (B, T, outputs): the head takes the whole sequence (sequence parallel)
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last_token_index(inputs.get("input_ids"), self.config.pad_token_id, logits)]

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None) -> ModelOutput:
        logits = self.pooled_logits(out, inputs)
        loss = sequence_classification_loss(logits, labels, self.config, num_items_in_batch) if labels is not None else None
        return self.output_class(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


def last_token_index(input_ids: torch.Tensor | None, pad_token_id: int | None, logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's last non-padding token (left and right padding alike); the last position without
    ``input_ids`` or a pad id (a padded batch then cannot be told apart: refused in one line)."""
    batch, length = logits.shape[:2]
    if input_ids is not None and pad_token_id is not None:
        not_pad = (input_ids != pad_token_id).int().to(logits.device)
        return (torch.arange(input_ids.shape[-1], device=logits.device) * not_pad).argmax(-1)
    if batch > 1 and input_ids is not None:
        raise MindFormersError("pad_token_id is not set in the config, so padded batches cannot be classified; set "
                               "config.pad_token_id")
    return torch.full((batch,), length - 1, device=logits.device)


class MultipleChoice(SequenceClassification):
    """One score per choice: inputs (B, choices, T) are classified as B·choices sequences by a one-output
    ``head_name`` layer and the scores compared across the choices (cross-entropy against the right choice's
    index); transformers' ``...ForMultipleChoice``."""

    output_class = MultipleChoiceModelOutput

    def num_outputs(self, config: Any) -> int:
        return 1

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """(B, choices, T) inputs (and (B, choices, T, C) embeddings) as B·choices sequences."""
        return {k: v.flatten(0, 1) if isinstance(v, torch.Tensor) and k in _PER_CHOICE else v for k, v in inputs.items()}

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None) -> ModelOutput:
        choices = next(inputs[k].shape[1] for k in ("input_ids", "inputs_embeds") if inputs.get(k) is not None)
        logits = self.pooled_logits(out, self.prepare_inputs(inputs)).view(-1, choices)  # (B, choices)
        loss = choice_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                         attentions=out.attentions)


_PER_CHOICE = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


class NextSentencePrediction(SequenceClassification):
    """Whether the second segment follows the first (BERT's pretraining pair task): two scores from the pooled
    first token, no dropout; cross-entropy against ``labels`` (0: it follows, 1: it is random)."""

    head_name = "nsp_head"

    def build_head(self, config: Any) -> None:
        self.dropout = nn.Identity()
        self.nsp_head = nn.Linear(config.hidden_size, 2)

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None) -> ModelOutput:
        logits = self.pooled_logits(out, inputs)
        loss = choice_cross_entropy(logits, labels, num_items_in_batch) if labels is not None else None
        return NextSentencePredictorOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                           attentions=out.attentions)


class TokenClassification(TaskModel):
    """One label per token: a linear ``head_name`` layer on every token after dropout (``classifier_dropout``, else
    ``hidden_dropout``); the token cross-entropy, -100 ignored, with one-line errors for labels outside
    ``num_labels``."""

    def build_head(self, config: Any) -> None:
        self.num_labels = config.num_labels
        self.dropout = Dropout(classifier_dropout(config))
        setattr(self, self.head_name, nn.Linear(config.hidden_size, config.num_labels))

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    labels: torch.Tensor | None = None) -> ModelOutput:
        logits = getattr(self, self.head_name)(self.dropout(out.last_hidden_state))
        loss = None
        if labels is not None:
            check_class_ids(labels, self.config.num_labels)
            loss = token_cross_entropy(logits, labels, num_items_in_batch)
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class QuestionAnswering(TaskModel):
    """Extractive question answering: ``qa_outputs`` gives each token a start and an end logit; with
    ``start_positions`` and ``end_positions``, the mean of the two cross-entropies."""

    head_name = "qa_outputs"
    head_inputs = ("start_positions", "end_positions")

    def build_head(self, config: Any) -> None:
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

    def head_output(self, out: ModelOutput, inputs: dict[str, Any], num_items_in_batch: Any = None,
                    start_positions: torch.Tensor | None = None,
                    end_positions: torch.Tensor | None = None) -> ModelOutput:
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in self.qa_outputs(out.last_hidden_state).split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start_logits, end_logits, start_positions, end_positions, num_items_in_batch)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=out.hidden_states, attentions=out.attentions)
