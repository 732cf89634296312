"""GPT family (GPT-2 and Llama flavours, Qwen3's q/k norms; GPT-MoE with a ``moe_config``)."""

from ...utils.lazy_exports import lazy_exports as _lazy_exports
from .. import registry as _registry
from . import convert_gpt as _convert
from .configuration_gpt import GPTConfig
from .presets import GPT_PRESETS

# The model classes load on first use (the registry and transformers' Auto classes name them without importing).
_MODELS = _registry.ModelClasses(__name__ + ".modeling_gpt", {
    "base": "GPTModel", "causal_lm": "GPTForCausalLM", "sequence_classification": "GPTForSequenceClassification",
    "token_classification": "GPTForTokenClassification", "question_answering": "GPTForQuestionAnswering"})
# GPT-2's double-heads model serves no training task of the registry (two losses) and transformers has no Auto
# class for it: loaded as GPTDoubleHeadsModel.from_pretrained, converted by convert_checkpoint.
_EXTRA_MODELS = _registry.ModelClasses(__name__ + ".modeling_gpt", {"GPTDoubleHeadsModel": "GPTDoubleHeadsModel"})

__all__ = ["GPTConfig", "GPTModel", "GPTForCausalLM", "GPTDoubleHeadsModel", "GPTForSequenceClassification",
           "GPTForTokenClassification", "GPTForQuestionAnswering", "GPTPreTrainedModel", "GPT_PRESETS"]
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(
    [*_MODELS.names.values(), *_EXTRA_MODELS.names.values(), "GPTPreTrainedModel"], ".modeling_gpt"), globals())

_HF_NAMES = {"gpt2": "GPT2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
             "mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
_HF_CAUSAL_LM = {kind: f"{name}ForCausalLM" for kind, name in _HF_NAMES.items()} | {"gpt2": "GPT2LMHeadModel"}
_HF_SEQ_CLS = {kind: f"{name}ForSequenceClassification" for kind, name in _HF_NAMES.items()}
_HF_BASE = {kind: f"{name}Model" for kind, name in _HF_NAMES.items()}
_HF_TOKEN_CLS = {kind: f"{name}ForTokenClassification" for kind, name in _HF_NAMES.items()}
_HF_QA = {kind: f"{name}ForQuestionAnswering" for kind, name in _HF_NAMES.items() if kind != "deepseek_v3"}

_registry.register_family(_registry.Family(
    name="gpt",
    config_class=GPTConfig,
    model_classes=_MODELS,
    presets=GPT_PRESETS,
    converter=_convert,
    hf_model_classes={"base": _HF_BASE.get, "causal_lm": _HF_CAUSAL_LM.get, "sequence_classification": _HF_SEQ_CLS.get,
                      "token_classification": _HF_TOKEN_CLS.get, "question_answering": _HF_QA.get,
                      "GPTDoubleHeadsModel": {"gpt2": "GPT2DoubleHeadsModel"}.get},
    extra_model_classes=_EXTRA_MODELS,
))
