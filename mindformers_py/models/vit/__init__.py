"""ViT family (Vision Transformer): image classification on the shared encoder block."""

from ...utils.lazy_exports import lazy_exports as _lazy_exports
from .. import registry as _registry
from . import convert_vit as _convert
from .configuration_vit import ViTConfig
from .presets import VIT_PRESETS

# The model classes load on first use (the registry and transformers' Auto classes name them without importing).
_MODELING = __name__ + ".modeling_vit"
_MODELS = _registry.ModelClasses(_MODELING, {"base": "ViTModel", "image_classification": "ViTForImageClassification"})
_EXTRA_MODELS = _registry.ModelClasses(_MODELING, {"AutoModelForMaskedImageModeling": "ViTForMaskedImageModeling"})

__all__ = ["ViTConfig", "ViTModel", "ViTForImageClassification", "ViTForMaskedImageModeling", "ViTPreTrainedModel",
           "VIT_PRESETS"]
__getattr__, __dir__ = _lazy_exports(__name__, dict.fromkeys(
    [*_MODELS.names.values(), *_EXTRA_MODELS.names.values(), "ViTPreTrainedModel"], _MODELING), globals())

_registry.register_family(_registry.Family(
    name="vit",
    config_class=ViTConfig,
    model_classes=_MODELS,
    presets=VIT_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": lambda kind: "ViTModel", "image_classification": lambda kind: "ViTForImageClassification",
                      "AutoModelForMaskedImageModeling": lambda kind: "ViTForMaskedImageModeling"},
    extra_model_classes=_EXTRA_MODELS,
))
