"""T5Config: the encoder-decoder family (T5 v1, T5 v1.1 / FLAN-T5, mT5), chosen by ``feed_forward_proj`` and
``tie_word_embeddings``."""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from transformers import PretrainedConfig

from ...errors import ConfigError
from ..cache_names import CACHE_NAMES

FEED_FORWARD_ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")
"""Activations a ``feed_forward_proj`` may name (``"relu"``, or gated: ``"gated-gelu"``, ...)."""
GATED_GELU = "gelu_new"  # T5 v1.1's "gated-gelu" is the tanh-approximated GELU (as transformers maps it)


class _Derived:
    """A field the shared layers read whose value T5 fixes (or derives from ``source``): read-only, and setting it
    is refused in one line naming the field."""

    def __init__(self, getter, doc: str, source: str | None = None) -> None:
        self.getter, self.__doc__, self.source = getter, doc, source

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else self.getter(obj)

    def __set__(self, obj, value) -> None:
        hint = f"set {self.source} instead" if self.source else "T5 has no other setting"
        raise ConfigError(f"{self.name}={value!r} cannot be set on T5Config ({self.__doc__.rstrip('.')}); {hint}")


class T5Config(PretrainedConfig):
    """Configuration of :class:`T5Model`, :class:`T5ForConditionalGeneration` and :class:`T5EncoderModel`.

    ``feed_forward_proj="relu"`` with tied embeddings is the original T5 (v1): the decoder output is scaled by
    ``hidden_size ** -0.5`` before the tied LM head. ``feed_forward_proj="gated-gelu"`` with
    ``tie_word_embeddings=False`` is T5 v1.1, FLAN-T5 and mT5. transformers' names (``d_model``, ``d_kv``, ``d_ff``,
    ``num_layers``, ``num_heads``, ``layer_norm_epsilon``, ``n_positions``) and MindFormers' (``seq_length``,
    ``ffn_hidden_size``) are aliases of the fields below.

    Attention has no scaling (T5 folds it into the initialisation), no biases anywhere, RMS norms without mean or
    bias, and a relative position bias per stack (bidirectional in the encoder, causal in the decoder).
    """

    model_type = "mindformers_t5"
    keys_to_ignore_at_inference = [*CACHE_NAMES, "encoder_last_hidden_state"]
    # Not remote code: our classes are registered with transformers' Auto classes on import (see GPTConfig).
    auto_map: ClassVar[Mapping[str, str]] = MappingProxyType({})
    attribute_map: ClassVar[dict[str, str]] = {
        "d_model": "hidden_size",
        "d_kv": "head_dim",
        "d_ff": "intermediate_size",
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "layer_norm_epsilon": "norm_eps",
        "n_positions": "max_position_embeddings",
        "seq_length": "max_position_embeddings",
        "ffn_hidden_size": "intermediate_size",
    }
    # How tensor parallelism shards each layer: heads of self- and cross-attention and of the relative position
    # bias, the feed-forward's hidden units, and (with vocab_emb_dp=False) the shared vocabulary.
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "shared": "embedding_rowwise",
        **{f"{stack}.position_bias.relative_attention_bias": "colwise" for stack in ("encoder", "decoder")},
        **{f"{stack}.layers.*.{attn}.{proj}_proj": "colwise"
           for stack, attns in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "cross_attn")))
           for attn in attns for proj in "qkv"},
        **{f"{stack}.layers.*.{attn}.o_proj": "rowwise"
           for stack, attns in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "cross_attn")))
           for attn in attns},
        **{f"{stack}.layers.*.mlp.{proj}": style for stack in ("encoder", "decoder")
           for proj, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))},
    }
    # How pipeline parallelism cuts the base model (module -> (inputs, outputs)), in order: the shared embedding
    # and both position biases on the first stage, the encoder's layers then the decoder's over the stages (the
    # encoder's final norm on the stage of its last layer), the decoder's final norm on the last stage.
    base_model_pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "shared": (["input_ids", "decoder_input_ids"], ["inputs_embeds", "decoder_inputs_embeds"]),
        "encoder.position_bias": ([], ["encoder_position_bias"]),
        "decoder.position_bias": ([], ["decoder_position_bias"]),
        "encoder.layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "encoder.norm": (["hidden_states"], ["encoder_hidden_states"]),
        "decoder.layers": (["hidden_states", "encoder_hidden_states"], ["hidden_states"]),
        "decoder.norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32128
    """Number of token ids (T5's SentencePiece vocabulary with its 100 sentinel tokens, padded)."""
    hidden_size: int = 512
    """Model width (transformers' ``d_model``)."""
    head_dim: int = 64
    """Size of one attention head (``d_kv``); heads × head_dim need not equal ``hidden_size``."""
    intermediate_size: int = 2048
    """Feed-forward hidden size (``d_ff``)."""
    num_hidden_layers: int = 6
    """Encoder layers (``num_layers``)."""
    num_decoder_layers: int | None = None
    """Decoder layers; None means as many as the encoder."""
    num_attention_heads: int = 8
    """Attention heads per layer (``num_heads``)."""
    relative_attention_num_buckets: int = 32
    """Distance buckets of the relative position bias."""
    relative_attention_max_distance: int = 128
    """Distances from here on share the last bucket."""
    max_position_embeddings: int = 512
    """The sequence length the model was trained for (``n_positions``; T5 trained on 512 tokens). The relative
    position bias has no length limit, so longer inputs run, as in transformers (which does not read it either)."""
    dropout_rate: float = 0.1
    """Dropout after the embeddings, on attention probabilities, inside the feed-forward, on every residual branch
    and after each stack's final norm."""
    norm_eps: float = 1e-6
    """Epsilon of the RMS norms (``layer_norm_epsilon``)."""
    initializer_factor: float = 1.0
    """Scale of the weight init (T5's: each matrix ~ N(0, factor · fan_in^-0.5), embeddings ~ N(0, factor))."""
    feed_forward_proj: str = "relu"
    """Feed-forward kind: ``"relu"`` (T5 v1) or ``"gated-gelu"`` (v1.1, FLAN-T5, mT5); ``"<act>"`` or
    ``"gated-<act>"`` for act in relu, gelu, gelu_new, silu."""
    tie_word_embeddings: bool = True
    """Share the LM head weight with the token embedding (T5 v1); False for v1.1 / FLAN-T5 / mT5."""
    scale_decoder_outputs: bool | None = None
    """Scale the decoder output by ``hidden_size ** -0.5`` before the LM head; None means: when the embeddings
    are tied (transformers' rule). mT5 checkpoints never scale."""
    use_cache: bool = True
    """Return the decoder's key/value cache from forward passes (generation)."""
    is_encoder_decoder: bool = True
    """An encoder-decoder model (read by transformers' generation)."""
    pad_token_id: int | None = 0
    """Padding token id; also T5's decoder start token."""
    eos_token_id: int | list[int] | None = 1
    """End-of-sequence token id(s)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (T5 has none)."""
    decoder_start_token_id: int | None = 0
    """The token every decoder input starts with (the labels are shifted right behind it); T5 uses the pad id."""
    task_specific_params: dict | None = None
    """Per-pipeline settings, e.g. ``{"summarization": {"prefix": "summarize: ", "num_beams": 4}}`` (transformers'
    legacy field, read by the ``summarization``/``translation_xx_to_yy`` pipelines)."""
    prefix: str | None = None
    """Text put before every pipeline input when the task has no prefix of its own."""
    hf_architecture: str | None = None
    """The HF ``model_type`` this config was converted from (``t5`` or ``mt5``); export goes back to it. None
    means ``t5``."""

    def __post_init__(self, **kwargs: Any) -> None:
        # transformers' and MindFormers' names arrive as extra kwargs; apply them before checking the sizes.
        for alias in [k for k in kwargs if k in self.attribute_map]:
            setattr(self, alias, kwargs.pop(alias))
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_hidden_layers
        self._check_feed_forward()
        for name in ("vocab_size", "hidden_size", "head_dim", "intermediate_size", "num_hidden_layers",
                     "num_decoder_layers", "num_attention_heads", "relative_attention_num_buckets",
                     "relative_attention_max_distance", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.relative_attention_num_buckets < 4:
            raise ConfigError(f"relative_attention_num_buckets={self.relative_attention_num_buckets} must be at least 4 "
                              "(exact and logarithmic buckets in both directions)")
        super().__post_init__(**kwargs)

    def _check_feed_forward(self) -> None:
        valid = [*FEED_FORWARD_ACTIVATIONS, *(f"gated-{a}" for a in FEED_FORWARD_ACTIVATIONS)]
        if self.feed_forward_proj not in valid:
            raise ConfigError(f"feed_forward_proj={self.feed_forward_proj!r} is not valid; choose one of: "
                              f"{', '.join(repr(v) for v in valid)}")

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> PretrainedConfig:
        """transformers' accessor; the decoder's view (``decoder=True``, which sizes generation caches) counts the
        decoder's layers, so a decoder deeper than the encoder gets a cache layer for each of its layers."""
        if decoder and not encoder and self.num_decoder_layers != self.num_hidden_layers:
            view = copy.copy(self)
            view.num_hidden_layers = self.num_decoder_layers
            return view
        return super().get_text_config(decoder=decoder, encoder=encoder)

    # -- the shared layers' field names, derived from T5's -------------------------------------------------------

    @property
    def gated_mlp(self) -> bool:
        """Gated feed-forward (``gated-<act>``)."""
        return self.feed_forward_proj.startswith("gated-")

    @property
    def hidden_act(self) -> str:
        """Feed-forward activation; ``gated-gelu`` is the tanh approximation, as transformers maps it."""
        act = self.feed_forward_proj.removeprefix("gated-")
        return GATED_GELU if self.feed_forward_proj == "gated-gelu" else act

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads: one per query head (T5 has no grouped-query attention)."""
        return self.num_attention_heads

    @property
    def position_limit(self) -> None:
        """No limit on the sequence length: relative positions are bucketed, whatever the distance."""
        return None

    @property
    def scales_decoder_outputs(self) -> bool:
        """Whether the decoder output is scaled by ``hidden_size ** -0.5`` (resolving ``scale_decoder_outputs``)."""
        return self.tie_word_embeddings if self.scale_decoder_outputs is None else bool(self.scale_decoder_outputs)

    norm_type = _Derived(lambda self: "rmsnorm", "T5's norm: RMS, no mean, no bias.")
    norm_bias = _Derived(lambda self: False, "No norm biases.")
    attention_bias = _Derived(lambda self: False, "No q/k/v biases.")
    attention_out_bias = _Derived(lambda self: False, "No attention output bias.")
    mlp_bias = _Derived(lambda self: False, "No feed-forward biases.")
    attention_scale = _Derived(lambda self: 1.0, "Scores are not scaled by head_dim ** -0.5 (T5).")
    attention_dropout = _Derived(lambda self: self.dropout_rate, "Dropout on attention probabilities.", "dropout_rate")
    hidden_dropout = _Derived(lambda self: self.dropout_rate, "Dropout on each residual branch.", "dropout_rate")
    mlp_dropout = _Derived(lambda self: self.dropout_rate, "Dropout inside the feed-forward, before its output.",
                           "dropout_rate")
    norm_casts_to_weight_dtype = _Derived(lambda self: True, "Half-precision norms return their own dtype, so float32 "
                                          "feed-forward outputs (kept in float32 under float16) meet float16 layers.")
