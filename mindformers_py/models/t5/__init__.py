"""T5 family (T5 v1, T5 v1.1 / FLAN-T5, mT5): encoder-decoder models on the shared layers."""

from .configuration_t5 import T5Config
from .modeling_t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model, T5PreTrainedModel, T5Stack
from .presets import T5_PRESETS

__all__ = ["T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel", "T5PreTrainedModel", "T5Stack",
           "T5_PRESETS"]

from .. import registry as _registry
from . import convert_t5 as _convert

_HF_SEQ2SEQ = {"t5": "T5ForConditionalGeneration", "mt5": "MT5ForConditionalGeneration"}
_HF_BASE = {"t5": "T5Model", "mt5": "MT5Model"}

_registry.register_family(_registry.Family(
    name="t5",
    config_class=T5Config,
    model_classes={"base": T5Model, "seq2seq_lm": T5ForConditionalGeneration},
    presets=T5_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": _HF_BASE.get, "seq2seq_lm": _HF_SEQ2SEQ.get},
    extra_model_classes={"AutoModelForTextEncoding": T5EncoderModel},
))
