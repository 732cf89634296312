"""Named ViT presets, usable with ``AutoConfig.for_model`` / ``from_pretrained`` and listed by
``AutoConfig.show_support_list()``. Shapes follow the published ViT-Ti/S/B/L (Dosovitskiy et al. 2021; Touvron et al.
2021 for Ti and S) at 224 pixels with 16-pixel patches, as ``google/vit-base-patch16-224``."""

from __future__ import annotations

VIT_PRESETS: dict[str, dict] = {
    "vit_tiny": dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768),
    "vit_small_patch16_224": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
    "vit_base_patch16_224": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "vit_large_patch16_224": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
for _preset in VIT_PRESETS.values():
    _preset.update(image_size=224, patch_size=16, num_channels=3)
