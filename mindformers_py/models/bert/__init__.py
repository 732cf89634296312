"""BERT family (BERT and RoBERTa encoders; as decoders too: causal LM, the decoder of an encoder-decoder)."""

from .configuration_bert import BertConfig
from .modeling_bert import (
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForPreTrainingOutput,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
    BertPreTrainedModel,
)
from .presets import BERT_PRESETS

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertLMHeadModel", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertForMultipleChoice",
           "BertForNextSentencePrediction", "BertForPreTraining", "BertForPreTrainingOutput", "BertPreTrainedModel",
           "BERT_PRESETS"]

from .. import registry as _registry
from . import convert_bert as _convert


def _hf_class(bert: str, roberta: str | None = None):
    """transformers' class name of a head for an HF architecture (``BertForMaskedLM``, ``RobertaModel``, ...):
    ``bert`` for BERT, ``roberta`` (default: the same with ``Roberta``) for RoBERTa."""
    return {"bert": bert, "roberta": roberta or bert.replace("Bert", "Roberta", 1)}.get


_registry.register_family(_registry.Family(
    name="bert",
    config_class=BertConfig,
    model_classes={"base": BertModel, "masked_lm": BertForMaskedLM, "causal_lm": BertLMHeadModel,
                   "sequence_classification": BertForSequenceClassification,
                   "token_classification": BertForTokenClassification, "question_answering": BertForQuestionAnswering,
                   "multiple_choice": BertForMultipleChoice},
    presets=BERT_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": _hf_class("BertModel"), "masked_lm": _hf_class("BertForMaskedLM"),
                      "causal_lm": _hf_class("BertLMHeadModel", "RobertaForCausalLM"),
                      "sequence_classification": _hf_class("BertForSequenceClassification"),
                      "token_classification": _hf_class("BertForTokenClassification"),
                      "question_answering": _hf_class("BertForQuestionAnswering"),
                      "multiple_choice": _hf_class("BertForMultipleChoice"),
                      "AutoModelForPreTraining": {"bert": "BertForPreTraining"}.get,  # RoBERTa has neither
                      "AutoModelForNextSentencePrediction": {"bert": "BertForNextSentencePrediction"}.get},
    # Heads that are no training task of the registry (two losses, or BERT's pretraining pair task), loaded by
    # transformers' Auto classes of these names and ours.
    extra_model_classes={"AutoModelForPreTraining": BertForPreTraining,
                         "AutoModelForNextSentencePrediction": BertForNextSentencePrediction},
))
