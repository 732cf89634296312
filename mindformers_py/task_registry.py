"""The task registry: one entry per training task, the single source of truth for what a task means.

(Not to be confused with ``tasks/``, the runnable YAML recipes.) Each :class:`TaskSpec` says which Auto class
loads the task's model and which transformers class names belong to it, which batch keys hold its labels and
whether they are shifted, what counts as one item of the loss (tokens, sequences, images) and how to count them,
the loss itself, the model outputs it is computed from, the default collator and metrics, the pipeline that serves
the task and how a recipe prepares its data. The Trainer (which hands the task to its engine: pipeline stages
read their inputs, outputs and labels from it), the recipe runner, checkpoint conversion, the Auto classes and
the pipelines read it; ``parallel/`` does not.

=========================  ===================  ======================  ==========  ==============================
task                       aliases              Auto class              items       pipeline
=========================  ===================  ======================  ==========  ==============================
``causal_lm``              text_generation      AutoModelForCausalLM    tokens      text-generation
``masked_lm``              fill_mask            AutoModelForMaskedLM    tokens      fill-mask
``sequence_classification``text_classification  AutoModelFor...Classif. sequences   text-classification
``token_classification``   (ner)                AutoModelForTokenCl...  tokens      token-classification
``question_answering``     (qa)                 AutoModelForQuestion... sequences   question-answering
``multiple_choice``                             AutoModelForMultipleCh. sequences   (none)
``seq2seq_lm``             translation, ...     AutoModelForSeq2SeqLM   tokens      text2text-generation
``image_classification``                        AutoModelForImageCl...  images      image-classification
=========================  ===================  ======================  ==========  ==============================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    default_data_collator,
)
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    ImageClassifierOutput,
    MaskedLMOutput,
    ModelOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .errors import invalid_choice
from .layers.loss import IGNORE_INDEX, causal_lm_loss, choice_cross_entropy, question_answering_loss, \
    sequence_classification_loss, token_cross_entropy

ITEM_KINDS = ("tokens", "sequences", "images")

LossFunction = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Any, Any], torch.Tensor]
"""``loss(outputs, labels, config, num_items_in_batch)``: ``outputs`` are the model outputs named by
:attr:`TaskSpec.output_fields`, ``labels`` the batch tensors named by :attr:`TaskSpec.label_names`."""


@dataclass(frozen=True)
class TaskSpec:
    """Everything the runtime needs to know about one training task."""

    name: str
    """Registry name (``"causal_lm"``); also the key of a family's model classes."""
    auto_class: str
    """Name of the Auto class loading the task's model, in ``mindformers_py`` and in transformers."""
    class_suffixes: tuple[str, ...]
    """Endings of model class names (ours and transformers') that serve the task: how an ``architectures`` entry
    of a ``config.json`` or a model object is mapped to the task."""
    label_names: tuple[str, ...]
    """Batch keys holding the labels, in the order the loss takes them."""
    output_fields: tuple[str, ...]
    """Model output fields the loss is computed from (and a pipeline's last stage hands over)."""
    output_class: type[ModelOutput]
    """The transformers output class of the task's models (used to present a pipelined model's outputs)."""
    loss: LossFunction
    """The task's loss (the same function the models' heads call), normalised by ``num_items_in_batch``."""
    items: str
    """What one item of the loss is: ``"tokens"``, ``"sequences"`` or ``"images"``; also the unit of throughput."""
    shifted_labels: bool = False
    """Whether position t is scored against ``labels[t + 1]`` (causal LM), so each row's first label never counts."""
    model_input: str = "input_ids"
    """The batch key the model's first stage reads (``pixel_values`` for images)."""
    aliases: tuple[str, ...] = ()
    """Other accepted names: MindFormers' task names (``text_generation``) and transformers' pipeline names."""
    pipeline: str | None = None
    """The transformers task name of the pipeline serving this task (``mindformers_py.pipeline(name)``)."""
    metrics: tuple[str, ...] = ()
    """Default evaluation metrics: names of the evaluate modules shipped in ``mindformers_py/metrics``."""
    perplexity: bool = False
    """Whether the loss is a token cross-entropy, so evaluation reports ``exp(loss)`` as perplexity."""
    collator: Callable[[Any], Callable[[list[Any]], Any]] | None = None
    """``collator(tokenizer_or_None)``: the default collator of the task's batches."""
    recipe_data: str | None = None
    """Name of the function in :mod:`mindformers_py.data.recipe_data` that prepares a recipe's datasets."""
    processor: str = "tokenizer"
    """The task's processing class, which a recipe loads (from the checkpoint, else made for the model), hands to
    the data preparation and the Trainer (which saves it with every checkpoint) and gives the pipeline:
    ``"tokenizer"`` or ``"image_processor"``."""

    def count_items(self, batch: Mapping[str, Any]) -> int | None:
        """Items of this task's loss in one batch (None when the batch has no labels): label entries that are not
        -100, without each row's first position when labels are shifted (or the batch's ``shift_labels``, already
        shifted, as transformers' Trainer counts them); for tasks with several label tensors (question answering),
        the rows."""
        labels = batch.get(self.label_names[0])
        if not isinstance(labels, torch.Tensor):
            return None
        if len(self.label_names) > 1:
            return int(labels.shape[0])
        if self.shifted_labels and isinstance(batch.get("shift_labels"), torch.Tensor):
            labels = batch["shift_labels"]
        elif self.shifted_labels and labels.ndim >= 2:
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())

    def count_throughput(self, batch: Mapping[str, Any]) -> int:
        """Units of work in one batch for throughput: images (rows of ``pixel_values``) for image tasks, else
        non-padding input tokens (``attention_mask`` sum, else the size of the model input)."""
        inputs = batch.get(self.model_input)
        if self.items == "images":
            return int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) else 0
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            return int(mask.sum())
        return inputs.numel() if isinstance(inputs, torch.Tensor) else 0

    def compute_loss(self, outputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], config: Any,
                     num_items_in_batch: Any = None, labels_shifted: bool = False) -> torch.Tensor:
        """:attr:`loss` of ``outputs`` against ``labels``; ``labels_shifted``: a causal LM's labels come already
        shifted (the batch's ``shift_labels``) and are scored as they are."""
        if labels_shifted and self.shifted_labels:
            return token_cross_entropy(outputs[0], labels[0], num_items_in_batch)
        return self.loss(outputs, labels, config, num_items_in_batch)

    def outputs_of(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The :attr:`output_fields` of a model output (a ``ModelOutput``, a mapping or a tuple in field order)."""
        if isinstance(output, Mapping):
            return tuple(output[f] for f in self.output_fields)
        if isinstance(output, torch.Tensor):
            return (output,)
        return tuple(output)


# -- losses in the registry's uniform signature ------------------------------------------------------------------


def _causal_lm(outputs, labels, config, num_items):
    return causal_lm_loss(outputs[0], labels[0], num_items_in_batch=num_items)


def _token_level(outputs, labels, config, num_items):
    return token_cross_entropy(outputs[0], labels[0], num_items)


def _sequence_level(outputs, labels, config, num_items):
    return sequence_classification_loss(outputs[0], labels[0], config, num_items)


def _choices(outputs, labels, config, num_items):
    return choice_cross_entropy(outputs[0], labels[0], num_items)


def _spans(outputs, labels, config, num_items):
    return question_answering_loss(outputs[0], outputs[1], labels[0], labels[1], num_items)


# -- collators --------------------------------------------------------------------------------------------------


def _has_pad(tokenizer: Any) -> bool:
    return tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None


def _causal_lm_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    from .data.collators import DataCollatorForCausalLM, StackingCausalLMCollator

    return DataCollatorForCausalLM(tokenizer) if _has_pad(tokenizer) else StackingCausalLMCollator()


def _masked_lm_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    from .data.masking import DataCollatorForMaskedLM

    # Masks drawn per sample (seed + its tokens), so every layout masks the same tokens.
    return DataCollatorForMaskedLM(tokenizer)


def _padding_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    return DataCollatorWithPadding(tokenizer) if _has_pad(tokenizer) else default_data_collator


def _token_classification_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    return DataCollatorForTokenClassification(tokenizer) if _has_pad(tokenizer) else default_data_collator


def _multiple_choice_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    from transformers import DataCollatorForMultipleChoice

    return DataCollatorForMultipleChoice(tokenizer) if _has_pad(tokenizer) else default_data_collator


def _seq2seq_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX) if _has_pad(tokenizer) \
        else default_data_collator


def _stacking_collator(tokenizer: Any) -> Callable[[list[Any]], Any]:
    return default_data_collator


# -- the table --------------------------------------------------------------------------------------------------

TASKS: dict[str, TaskSpec] = {}
"""Registry name -> spec."""
_BY_ALIAS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> None:
    """Add ``spec`` under its name and aliases."""
    if spec.items not in ITEM_KINDS:
        raise invalid_choice(f"{spec.name}.items", spec.items, ITEM_KINDS)
    TASKS[spec.name] = spec
    for name in (spec.name, *spec.aliases):
        _BY_ALIAS[name] = spec


for _spec in (
    TaskSpec("causal_lm", "AutoModelForCausalLM", ("ForCausalLM", "LMHeadModel"), ("labels",), ("logits",),
             CausalLMOutputWithPast, _causal_lm, "tokens", shifted_labels=True,
             aliases=("text_generation", "text-generation"), pipeline="text-generation", perplexity=True,
             collator=_causal_lm_collator, recipe_data="causal_lm_data"),
    TaskSpec("masked_lm", "AutoModelForMaskedLM", ("ForMaskedLM",), ("labels",), ("logits",), MaskedLMOutput,
             _token_level, "tokens", aliases=("fill_mask", "fill-mask"), pipeline="fill-mask", perplexity=True,
             collator=_masked_lm_collator, recipe_data="masked_lm_data"),
    TaskSpec("sequence_classification", "AutoModelForSequenceClassification", ("ForSequenceClassification",),
             ("labels",), ("logits",), SequenceClassifierOutput, _sequence_level, "sequences",
             aliases=("text_classification", "text-classification"), pipeline="text-classification",
             metrics=("accuracy", "f1"), collator=_padding_collator, recipe_data="sequence_classification_data"),
    TaskSpec("token_classification", "AutoModelForTokenClassification", ("ForTokenClassification",), ("labels",),
             ("logits",), TokenClassifierOutput, _token_level, "tokens", aliases=("token-classification", "ner"),
             pipeline="token-classification", metrics=("seqeval",),
             collator=_token_classification_collator),
    TaskSpec("question_answering", "AutoModelForQuestionAnswering", ("ForQuestionAnswering",),
             ("start_positions", "end_positions"), ("start_logits", "end_logits"), QuestionAnsweringModelOutput,
             _spans, "sequences", aliases=("question-answering", "qa"), pipeline="question-answering",
             metrics=("squad",), collator=_padding_collator),
    TaskSpec("multiple_choice", "AutoModelForMultipleChoice", ("ForMultipleChoice",), ("labels",), ("logits",),
             MultipleChoiceModelOutput, _choices, "sequences", aliases=("multiple-choice",), metrics=("accuracy",),
             collator=_multiple_choice_collator),
    TaskSpec("seq2seq_lm", "AutoModelForSeq2SeqLM", ("ForConditionalGeneration", "ForSeq2SeqLM"), ("labels",),
             ("logits",), Seq2SeqLMOutput, _token_level, "tokens",
             aliases=("translation", "text2text_generation", "text2text-generation", "summarization"),
             pipeline="text2text-generation", metrics=("rouge", "bleu"), perplexity=True, collator=_seq2seq_collator,
             recipe_data="seq2seq_data"),
    TaskSpec("image_classification", "AutoModelForImageClassification", ("ForImageClassification",), ("labels",),
             ("logits",), ImageClassifierOutput, _sequence_level, "images", model_input="pixel_values",
             aliases=("image-classification",), pipeline="image-classification", metrics=("accuracy",),
             collator=_stacking_collator, recipe_data="image_classification_data", processor="image_processor"),
):
    register_task(_spec)


def get_task(name: str) -> TaskSpec:
    """The spec for a registry name or alias; an unknown name raises a one-line ConfigError listing them."""
    spec = _BY_ALIAS.get(name)
    if spec is None:
        raise invalid_choice("task", name, task_names())
    return spec


def task_names() -> list[str]:
    """Every accepted task name: registry names, then aliases."""
    return list(TASKS) + [a for a in _BY_ALIAS if a not in TASKS]


def task_for_class_name(class_name: str) -> TaskSpec | None:
    """The task a model class name serves by its ending (``GPT2LMHeadModel`` -> causal_lm); None for base models."""
    return next((spec for spec in TASKS.values() if class_name.endswith(spec.class_suffixes)), None)


def task_for_architectures(architectures: Sequence[str] | None) -> TaskSpec | None:
    """The task of a ``config.json``'s ``architectures`` (its first entry); None for a base model or none given."""
    return task_for_class_name(architectures[0]) if architectures else None


def task_of_model(model: Any) -> TaskSpec | None:
    """The task a model object trains, from its class name (the class behind FSDP/DDP wrappers and peft)."""
    for cls in type(model).__mro__:
        spec = task_for_class_name(cls.__name__)
        if spec is not None:
            return spec
    base = getattr(model, "get_base_model", None)  # a peft model: its wrapped model's class says it
    if callable(base) and base() is not model:
        return task_of_model(base())
    return None


__all__ = ["ITEM_KINDS", "TASKS", "TaskSpec", "get_task", "register_task", "task_for_architectures",
           "task_for_class_name", "task_names", "task_of_model"]
