"""BERT family (BERT and RoBERTa encoders)."""

import transformers as _transformers

from ...utils.lazy_exports import lazy_exports as _lazy_exports
from .. import registry as _registry
from . import convert_bert as _convert
from .configuration_bert import BertConfig
from .presets import BERT_PRESETS

# The model classes load on first use (the registry and transformers' Auto classes name them without importing).
_MODELING = __name__ + ".modeling_bert"
_MODELS = _registry.ModelClasses(_MODELING, {
    "base": "BertModel", "masked_lm": "BertForMaskedLM", "sequence_classification": "BertForSequenceClassification",
    "token_classification": "BertForTokenClassification", "question_answering": "BertForQuestionAnswering"})
_PRETRAINING = _registry.ModelClasses(_MODELING, {"AutoModelForPreTraining": "BertForPreTraining"})

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
           "BertForQuestionAnswering", "BertForPreTraining", "BertForPreTrainingOutput", "BertPreTrainedModel",
           "BERT_PRESETS"]
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(
    [*_MODELS.names.values(), *_PRETRAINING.names.values(), "BertForPreTrainingOutput", "BertPreTrainedModel"],
    ".modeling_bert"), globals())


def _hf_class(suffix: str):
    """transformers' class name of a head for an HF architecture: ``BertForMaskedLM``, ``RobertaModel``, ..."""
    return lambda kind: {"bert": "Bert", "roberta": "Roberta"}[kind] + suffix if kind in _convert.SUPPORTED_HF_TYPES else None


_registry.register_family(_registry.Family(
    name="bert",
    config_class=BertConfig,
    model_classes=_MODELS,
    presets=BERT_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": _hf_class("Model"), "masked_lm": _hf_class("ForMaskedLM"),
                      "sequence_classification": _hf_class("ForSequenceClassification"),
                      "token_classification": _hf_class("ForTokenClassification"),
                      "question_answering": _hf_class("ForQuestionAnswering")},
))
# The pretraining head (two losses) is no training task of the registry; transformers' Auto class still finds it.
_registry.register_model_class(_transformers.AutoModelForPreTraining, BertConfig, _PRETRAINING,
                               "AutoModelForPreTraining")
