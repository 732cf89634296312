"""ViTConfig: the Vision Transformer (Dosovitskiy et al. 2021) as transformers' ``ViTConfig`` describes it."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig

from ...errors import ConfigError


class ViTConfig(PretrainedConfig):
    """Configuration of :class:`ViTModel` and :class:`ViTForImageClassification` (a transformers ``PretrainedConfig``).

    The encoder is the pre-LN block every family shares (LayerNorm with bias, bidirectional multi-head attention
    with biases, a two-layer GELU MLP); the fields below are the sizes, the image geometry and the regularisation.
    transformers' ViT names are accepted as aliases (``qkv_bias``, ``layer_norm_eps``, ``hidden_dropout_prob``,
    ``attention_probs_dropout_prob``), as are MindFormers' (``num_layers``, ``num_heads``, ``ffn_hidden_size``).
    """

    model_type = "mindformers_vit"
    attribute_map: ClassVar[dict[str, str]] = {
        "qkv_bias": "attention_bias",
        "layer_norm_eps": "norm_eps",
        "hidden_dropout_prob": "hidden_dropout",
        "attention_probs_dropout_prob": "attention_dropout",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "ffn_hidden_size": "intermediate_size",
    }
    # How tensor parallelism shards each layer (HF's plan vocabulary, applied by mindformers_py.parallel). The patch
    # embedding, the final norm and the pooler stay whole on every rank.
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # How pipeline parallelism cuts the base model: the patch embedding on the first stage, the norm and the pooler on
    # the last.
    base_model_pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "embeddings": (["pixel_values"], ["hidden_states"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
        "pooler": (["hidden_states"], ["pooler_output"]),
    }
    # The shared TransformerBlock reads these; ViT's block is fixed (transformers' ViTLayer), so they are not fields.
    norm_type: ClassVar[str] = "layernorm"
    norm_bias: ClassVar[bool] = True
    gated_mlp: ClassVar[bool] = False
    attention_out_bias: ClassVar[bool] = True
    mlp_bias: ClassVar[bool] = True

    image_size: int | list[int] = 224
    """Side of the square images the positions are learned for, or their ``[height, width]``."""
    patch_size: int = 16
    """Side of the square patches an image is cut into; the image size must be a multiple of it."""
    num_channels: int = 3
    """Channels of the input images (3 for RGB). Grayscale pixel values given to an RGB model are repeated over the
    three channels."""
    hidden_size: int = 768
    """Model width (size of each patch vector)."""
    num_hidden_layers: int = 12
    """Number of encoder layers."""
    num_attention_heads: int = 12
    """Attention heads per layer."""
    intermediate_size: int | None = None
    """MLP hidden size; None means 4·hidden_size."""
    hidden_act: str = "gelu"
    """MLP activation (a transformers ACT2FN name; ViT uses the exact ``gelu``)."""
    norm_eps: float = 1e-12
    """Epsilon of the LayerNorms (transformers' ``layer_norm_eps``)."""
    attention_bias: bool = True
    """Biases on the query/key/value projections (transformers' ``qkv_bias``)."""
    hidden_dropout: float = 0.0
    """Dropout after the embeddings and on each residual branch (transformers' ``hidden_dropout_prob``)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (transformers' ``attention_probs_dropout_prob``)."""
    initializer_range: float = 0.02
    """Std of the (truncated) normal weight init."""
    pooler_output_size: int | None = None
    """Output size of :class:`ViTModel`'s pooler (dense + activation on the class token); None means hidden_size."""
    pooler_act: str = "tanh"
    """Activation of the pooler."""
    encoder_stride: int = 16
    """Upsampling factor of :class:`ViTForMaskedImageModeling`'s decoder (a 1x1 convolution and a pixel shuffle);
    equal to ``patch_size`` to reconstruct images of the input's size."""

    def __post_init__(self, **kwargs: Any) -> None:
        # Aliases arrive as extra kwargs; apply them before checking the sizes.
        for alias in [k for k in kwargs if k in self.attribute_map]:
            setattr(self, alias, kwargs.pop(alias))
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.pooler_output_size is None:
            self.pooler_output_size = self.hidden_size
        if isinstance(self.image_size, tuple):
            self.image_size = list(self.image_size)
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
                     "num_channels", "pooler_output_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                              f"{self.num_attention_heads}; choose divisible sizes")
        height, width = self.image_hw
        if height % self.patch_size or width % self.patch_size:
            raise ConfigError(f"image_size={self.image_size!r} is not a multiple of patch_size={self.patch_size}; "
                              "choose an image size the patches tile exactly")
        super().__post_init__(**kwargs)

    @property
    def image_hw(self) -> tuple[int, int]:
        """``image_size`` as (height, width)."""
        size = self.image_size
        if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
            return int(size[0]), int(size[1])
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size, size
        raise ConfigError(f"image_size={size!r} must be a positive integer or [height, width]")

    @property
    def num_patches(self) -> int:
        """Patches of one image at ``image_size``."""
        height, width = self.image_hw
        return (height // self.patch_size) * (width // self.patch_size)

    @property
    def fixed_sequence_length(self) -> int:
        """Tokens the encoder sees for an image of ``image_size``: the class token and the patches. Read by
        :meth:`ParallelConfig.validate_for`: sequence parallelism splits them evenly over the tensor-parallel ranks."""
        return self.num_patches + 1

    @property
    def num_key_value_heads(self) -> int:
        """One key/value head per query head (multi-head attention)."""
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads
