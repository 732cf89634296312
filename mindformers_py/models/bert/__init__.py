"""BERT family (BERT and RoBERTa encoders; as decoders too: causal LM, the decoder of an encoder-decoder)."""

from ...utils.lazy_exports import lazy_exports as _lazy_exports
from .. import registry as _registry
from . import convert_bert as _convert
from .configuration_bert import BertConfig
from .presets import BERT_PRESETS

# The model classes load on first use (the registry and transformers' Auto classes name them without importing).
_MODELING = __name__ + ".modeling_bert"
_MODELS = _registry.ModelClasses(_MODELING, {
    "base": "BertModel", "masked_lm": "BertForMaskedLM", "causal_lm": "BertLMHeadModel",
    "sequence_classification": "BertForSequenceClassification", "token_classification": "BertForTokenClassification",
    "question_answering": "BertForQuestionAnswering", "multiple_choice": "BertForMultipleChoice"})
# Heads that are no training task of the registry (two losses, or BERT's pretraining pair task), loaded by
# transformers' Auto classes of these names and ours.
_EXTRA_MODELS = _registry.ModelClasses(_MODELING, {
    "AutoModelForPreTraining": "BertForPreTraining", "AutoModelForNextSentencePrediction": "BertForNextSentencePrediction"})

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertLMHeadModel", "BertForSequenceClassification",
           "BertForTokenClassification", "BertForQuestionAnswering", "BertForMultipleChoice",
           "BertForNextSentencePrediction", "BertForPreTraining", "BertForPreTrainingOutput", "BertPreTrainedModel",
           "BERT_PRESETS"]
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(
    [*_MODELS.names.values(), *_EXTRA_MODELS.names.values(), "BertForPreTrainingOutput", "BertPreTrainedModel"],
    _MODELING), globals())


def _hf_class(bert: str, roberta: str | None = None):
    """transformers' class name of a head for an HF architecture (``BertForMaskedLM``, ``RobertaModel``, ...):
    ``bert`` for BERT, ``roberta`` (default: the same with ``Roberta``) for RoBERTa."""
    return {"bert": bert, "roberta": roberta or bert.replace("Bert", "Roberta", 1)}.get


_registry.register_family(_registry.Family(
    name="bert",
    config_class=BertConfig,
    model_classes=_MODELS,
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
    extra_model_classes=_EXTRA_MODELS,
))
