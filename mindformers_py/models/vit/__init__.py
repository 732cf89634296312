"""ViT family (Vision Transformer): image classification on the shared encoder block."""

from .configuration_vit import ViTConfig
from .modeling_vit import ViTForImageClassification, ViTModel, ViTPreTrainedModel
from .presets import VIT_PRESETS

__all__ = ["ViTConfig", "ViTModel", "ViTForImageClassification", "ViTPreTrainedModel", "VIT_PRESETS"]

from .. import registry as _registry
from . import convert_vit as _convert

_registry.register_family(_registry.Family(
    name="vit",
    config_class=ViTConfig,
    model_classes={"base": ViTModel, "image_classification": ViTForImageClassification},
    presets=VIT_PRESETS,
    converter=_convert,
    planner_config=_registry.hf_export,  # the planner reads its HF export's shape
    hf_model_classes={"base": lambda kind: "ViTModel", "image_classification": lambda kind: "ViTForImageClassification"},
))
