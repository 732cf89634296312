"""T5 family (T5 v1, T5 v1.1 / FLAN-T5, mT5): encoder-decoder models on the shared layers."""

from ...utils.lazy_exports import lazy_exports as _lazy_exports
from .. import registry as _registry
from . import convert_t5 as _convert
from .configuration_t5 import T5Config
from .presets import T5_PRESETS

# The model classes load on first use (the registry and transformers' Auto classes name them without importing).
_MODELING = __name__ + ".modeling_t5"
_MODELS = _registry.ModelClasses(_MODELING, {"base": "T5Model", "seq2seq_lm": "T5ForConditionalGeneration"})
_EXTRA_MODELS = _registry.ModelClasses(_MODELING, {"AutoModelForTextEncoding": "T5EncoderModel"})

__all__ = ["T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel", "T5PreTrainedModel", "T5Stack",
           "T5_PRESETS"]
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(
    [*_MODELS.names.values(), *_EXTRA_MODELS.names.values(), "T5PreTrainedModel", "T5Stack"], ".modeling_t5"), globals())

_HF_SEQ2SEQ = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration"}
_HF_BASE = {"t5": "T5Model", "mt5": "MT5Model"}

_registry.register_family(_registry.Family(
    name="t5",
    config_class=T5Config,
    model_classes=_MODELS,
    presets=T5_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": _HF_BASE.get, "seq2seq_lm": _HF_SEQ2SEQ.get},
    extra_model_classes=_EXTRA_MODELS,
))
