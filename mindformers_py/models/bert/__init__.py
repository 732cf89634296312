"""BERT family (BERT and RoBERTa encoders)."""

from .configuration_bert import BertConfig
from .modeling_bert import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForPreTrainingOutput,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
)
from .presets import BERT_PRESETS

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
           "BertForQuestionAnswering", "BertForPreTraining", "BertForPreTrainingOutput", "BertPreTrainedModel",
           "BERT_PRESETS"]

import transformers as _transformers

from .. import registry as _registry
from . import convert_bert as _convert


def _hf_class(suffix: str):
    """transformers' class name of a head for an HF architecture: ``BertForMaskedLM``, ``RobertaModel``, ..."""
    return lambda kind: {"bert": "Bert", "roberta": "Roberta"}[kind] + suffix if kind in _convert.SUPPORTED_HF_TYPES else None


_registry.register_family(_registry.Family(
    name="bert",
    config_class=BertConfig,
    model_classes={"base": BertModel, "masked_lm": BertForMaskedLM, "sequence_classification": BertForSequenceClassification,
                   "token_classification": BertForTokenClassification, "question_answering": BertForQuestionAnswering},
    presets=BERT_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": _hf_class("Model"), "masked_lm": _hf_class("ForMaskedLM"),
                      "sequence_classification": _hf_class("ForSequenceClassification"),
                      "token_classification": _hf_class("ForTokenClassification"),
                      "question_answering": _hf_class("ForQuestionAnswering")},
))
# The pretraining head (two losses) is no training task of the registry; transformers' Auto class still finds it.
_transformers.AutoModelForPreTraining.register(BertConfig, BertForPreTraining, exist_ok=True)
