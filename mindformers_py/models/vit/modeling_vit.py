"""The Vision Transformer (ViT): patch embeddings, the shared pre-LN encoder block, a final LayerNorm, and a
classifier on the class token. Numerically transformers' ``ViTModel`` / ``ViTForImageClassification`` (whose
weights load into these modules, see ``convert_vit.py``), with Llama-style module names so the shared layers and
the tensor-parallel plans line up.

Model code is single-device PyTorch; tensor/pipeline parallelism is applied from outside (``mindformers_py.parallel``)
following the plans declared on :class:`ViTConfig` and on the head. Every model is also its own pipeline stage: a
base model whose ``embeddings`` are None takes the previous stage's hidden states as ``inputs_embeds`` and skips the
embedding phase; without ``norm`` it returns the last layer's output; a head without its ``classifier`` returns the
base model's output unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput, MaskedImageModelingOutput
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from ...errors import MindFormersError
from ...layers import TransformerBlock, build_attention_mask, build_norm
from ...layers.dropout import Dropout
from ...layers.heads import Pooler
from ...layers.loss import IGNORE_INDEX, sequence_classification_loss
from ...layers.patch_embedding import PatchEmbedding
from ..modeling_base import MindFormersPreTrainedModel
from .configuration_vit import ViTConfig


class ViTPreTrainedModel(MindFormersPreTrainedModel):
    """Weight init and config class of the ViT models (the rest is :class:`MindFormersPreTrainedModel`)."""

    config_class = ViTConfig
    config: ViTConfig
    base_model_prefix = "model"
    main_input_name = "pixel_values"
    input_modalities = ("image",)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # linear and conv weights normal(initializer_range), norms 1 / 0
        if isinstance(module, PatchEmbedding):  # as transformers' ViT: truncated normal class token and positions
            nn.init.trunc_normal_(module.position_embeddings, std=self.config.initializer_range)
            nn.init.trunc_normal_(module.cls_token, std=self.config.initializer_range)
            if module.mask_token is not None:
                nn.init.zeros_(module.mask_token)


class ViTModel(ViTPreTrainedModel):
    """Patch embeddings, a stack of bidirectional :class:`TransformerBlock`, a final LayerNorm and (optionally) a pooler
    on the class token; returns the last hidden states (B, 1 + patches, C) and the pooled output (B, C)."""

    _whole_sequence_modules = ("pooler",)  # it reads the class token
    # Image-classification checkpoints have no pooler (transformers' classifier drops it); it starts from its init.
    _keys_to_ignore_on_load_missing = [r"^pooler\."]

    def __init__(self, config: ViTConfig, add_pooling_layer: bool = True, use_mask_token: bool = False) -> None:
        super().__init__(config)
        self.embeddings = PatchEmbedding(config.image_hw, config.patch_size, config.num_channels, config.hidden_size,
                                         use_mask_token)
        self.drop = Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(TransformerBlock(config, i, is_causal=False) for i in range(config.num_hidden_layers))
        self.norm = build_norm(config.norm_type, config.hidden_size, config.norm_eps, bias=config.norm_bias)
        self.pooler = Pooler(config.hidden_size, out_size=config.pooler_output_size, act=config.pooler_act) \
            if add_pooling_layer else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> PatchEmbedding:
        return self.embeddings

    @capture_outputs(tie_last_hidden_states=False)  # hidden_states[-1] is the last layer's output before the norm
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        bool_masked_pos: torch.BoolTensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """Hidden states of ``pixel_values`` (B, C, H, W) and the pooled class token; with ``output_hidden_states`` /
        ``output_attentions`` (or the config's), every layer's hidden states / attention weights, and a tuple with
        ``return_dict=False``, as transformers' ``ViTModel``.

        ``interpolate_pos_encoding`` takes images of another size than ``config.image_size`` (positions resized
        bicubically); ``attention_mask`` (B, 1 + patches) hides tokens from attention; ``bool_masked_pos`` (B,
        patches) replaces the marked patches by the mask token (a model built with ``use_mask_token``). On a pipeline
        stage without ``embeddings``, ``inputs_embeds`` is the previous stage's output."""
        if self.embeddings is None:  # a later pipeline stage: the residual stream arrives from the previous one
            if inputs_embeds is None:
                raise MindFormersError("this pipeline stage holds no embeddings: pass the previous stage's hidden states as inputs_embeds")
            hidden_states = inputs_embeds
        elif pixel_values is None:
            raise MindFormersError("pass pixel_values (batch, channels, height, width), as the image processor returns them")
        else:
            hidden_states = self.drop(self.embeddings(pixel_values, bool(interpolate_pos_encoding), bool_masked_pos))
        mask = None
        if attention_mask is not None:
            length = attention_mask.shape[-1]
            mask = build_attention_mask(attention_mask, query_length=length, kv_length=length, causal=False)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        if self.norm is not None:
            hidden_states = self.norm(hidden_states)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)


class ViTForImageClassification(ViTPreTrainedModel):
    """ViT with a linear ``classifier`` on the class token's final hidden state (transformers'
    ``ViTForImageClassification``); single-label, multi-label or regression by ``config.problem_type``."""

    _pp_plan = {"classifier": (["hidden_states"], ["logits"])}
    _whole_sequence_modules = ("classifier",)  # it reads the class token

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = ViTModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> ImageClassifierOutput:
        """Logits (B, num_labels) of the class token; with ``labels``, the loss of ``config.problem_type``
        (divided by ``num_items_in_batch`` when given, the items of a whole optimizer step)."""
        out = self.model(pixel_values, interpolate_pos_encoding, attention_mask, inputs_embeds, **kwargs)
        if self.classifier is None:  # a pipeline stage before the last hands its hidden states on
            return out
        # Every token is classified and the class token's row kept: the same numbers as classifying the class token
        # alone, and the head then takes the whole sequence, as under sequence parallelism it arrives (the extra
        # work is num_labels columns per token, well under 1% of the encoder's).
        logits = self.classifier(out.last_hidden_state)[:, 0]  # (B, num_labels)
        loss = None
        if labels is not None:
            self._check_labels(labels)
            loss = sequence_classification_loss(logits, labels, self.config, num_items_in_batch)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)

    def _check_labels(self, labels: torch.Tensor) -> None:
        """Class ids outside ``num_labels`` get a one-line error rather than an index error deep in the loss. Checked
        where the labels are on the host (no device to wait for); on an accelerator the loss's own check applies."""
        if labels.device.type != "cpu" or labels.is_floating_point() or self.config.num_labels < 2 \
                or torch.compiler.is_compiling():
            return
        bad = ((labels >= self.config.num_labels) | (labels < 0)) & (labels != IGNORE_INDEX)
        if bool(bad.any()):
            raise MindFormersError(f"label {int(labels[bad][0])} is outside num_labels={self.config.num_labels} "
                                   f"(class ids 0..{self.config.num_labels - 1}, or -100 to ignore a row)")


class ViTForMaskedImageModeling(ViTPreTrainedModel):
    """ViT reconstructing masked patches (SimMIM, transformers' ``ViTForMaskedImageModeling``): the patches
    ``bool_masked_pos`` marks are replaced by a learned mask token, and a ``decoder`` (a 1x1 convolution to
    ``encoder_stride ** 2 * num_channels`` channels and a pixel shuffle) turns the patch tokens back into pixels;
    the loss is the L1 distance of the masked pixels, as there."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__(config)
        self.model = ViTModel(config, add_pooling_layer=False, use_mask_token=True)
        self.decoder = nn.Sequential(
            nn.Conv2d(config.hidden_size, config.encoder_stride**2 * config.num_channels, kernel_size=1),
            nn.PixelShuffle(config.encoder_stride),
        )
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.BoolTensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs,
    ) -> MaskedImageModelingOutput:
        """The reconstructed pixels (B, C, H, W) of ``pixel_values``; with ``bool_masked_pos`` (B, patches), the
        patches it marks are masked and the loss is their pixels' mean absolute error."""
        config = self.config
        if bool_masked_pos is not None and config.patch_size != config.encoder_stride:
            raise MindFormersError(f"bool_masked_pos needs patch_size == encoder_stride to reconstruct images of the "
                                   f"input's size; the config has patch_size={config.patch_size}, encoder_stride="
                                   f"{config.encoder_stride}")
        out = self.model(pixel_values, interpolate_pos_encoding, bool_masked_pos=bool_masked_pos, **kwargs)
        patches = out.last_hidden_state[:, 1:]  # (B, N, C) without the class token
        batch, length, channels = patches.shape
        side = math.floor(length**0.5)
        reconstructed = self.decoder(patches.permute(0, 2, 1).reshape(batch, channels, side, side))
        loss = None
        if bool_masked_pos is not None:
            rows, cols = config.image_hw[0] // config.patch_size, config.image_hw[1] // config.patch_size
            mask = bool_masked_pos.reshape(-1, rows, cols).repeat_interleave(config.patch_size, 1) \
                .repeat_interleave(config.patch_size, 2).unsqueeze(1)  # (B, 1, H, W)
            error = F.l1_loss(pixel_values, reconstructed, reduction="none")
            loss = (error * mask).sum() / (mask.sum() + 1e-5) / config.num_channels
        return MaskedImageModelingOutput(loss=loss, reconstruction=reconstructed, hidden_states=out.hidden_states,
                                         attentions=out.attentions)
