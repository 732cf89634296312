"""BertConfig: the encoder family (BERT, and RoBERTa by two options), built from the shared post-norm layers."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig

from ...errors import ConfigError
from ..cache_names import CACHE_NAMES


class BertConfig(PretrainedConfig):
    """Configuration of :class:`BertModel` and its heads (a transformers ``PretrainedConfig``).

    The defaults are BERT-base's. RoBERTa is the same architecture with ``padded_positions=True`` (positions
    numbered from ``pad_token_id + 1``), one token type, ``pooler_dropout`` on its classification head and the
    exact GELU in its MLM head; converted RoBERTa checkpoints set these. transformers' BERT field names
    (``hidden_dropout_prob``, ``attention_probs_dropout_prob``, ``layer_norm_eps``) and MindFormers' (``num_layers``,
    ``num_heads``, ``seq_length``, ``ffn_hidden_size``) are accepted as aliases.
    """

    model_type = "mindformers_bert"
    keys_to_ignore_at_inference = [*CACHE_NAMES]
    attribute_map: ClassVar[dict[str, str]] = {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "seq_length": "max_position_embeddings",
        "ffn_hidden_size": "intermediate_size",
        "hidden_dropout_prob": "hidden_dropout",
        "attention_probs_dropout_prob": "attention_dropout",
        "layer_norm_eps": "norm_eps",
    }
    # How tensor parallelism shards each layer (HF's plan vocabulary, applied by mindformers_py.parallel); the
    # token-type and position tables are small and stay whole on every rank.
    base_model_tp_plan: ClassVar[dict[str, str]] = {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # How pipeline parallelism cuts the base model: module name -> (inputs, outputs). The embeddings and their
    # norm (``drop``) live on the first stage, the pooler on the last.
    base_model_pp_plan: ClassVar[dict[str, tuple[list[str], list[str]]]] = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "embed_positions": (["position_ids"], ["position_embeds"]),
        "embed_token_types": (["token_type_ids"], ["token_type_embeds"]),
        "drop": (["inputs_embeds"], ["hidden_states"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "pooler": (["hidden_states"], ["pooler_output"]),
    }

    vocab_size: int = 30522
    """Number of token ids."""
    hidden_size: int = 768
    """Model width."""
    num_hidden_layers: int = 12
    """Number of transformer layers."""
    num_attention_heads: int = 12
    """Attention heads per layer."""
    num_key_value_heads: int | None = None
    """Key/value heads per layer; None means one per query head (BERT's multi-head attention)."""
    head_dim: int | None = None
    """Size of one attention head; None means ``hidden_size // num_attention_heads``."""
    intermediate_size: int | None = None
    """MLP hidden size; None means 4·hidden."""
    hidden_act: str = "gelu"
    """MLP activation (a transformers ACT2FN name; BERT's ``gelu`` is the exact, erf-based one)."""
    max_position_embeddings: int = 512
    """Rows of the learned position table: the longest input (RoBERTa's table also holds ``pad_token_id + 1``
    unused leading rows)."""
    type_vocab_size: int = 2
    """Token types (segments A/B of a sentence pair); RoBERTa has one."""
    padded_positions: bool = False
    """RoBERTa's positions: real tokens are numbered from ``pad_token_id + 1`` on, padding sits at
    ``pad_token_id``. False numbers every token from 0 (BERT)."""
    norm_type: str = "layernorm"
    """``"layernorm"`` or ``"rmsnorm"``."""
    norm_eps: float = 1e-12
    """Epsilon of the norms."""
    norm_bias: bool = True
    """Whether LayerNorm has a bias."""
    gated_mlp: bool = False
    """Gated MLP instead of BERT's two-layer MLP."""
    attention_bias: bool = True
    """Biases on the q/k/v projections."""
    attention_out_bias: bool = True
    """Bias on the attention output projection."""
    mlp_bias: bool = True
    """Biases in the MLP projections."""
    hidden_dropout: float = 0.1
    """Dropout on the embeddings and on each residual branch (transformers' ``hidden_dropout_prob``)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (transformers' ``attention_probs_dropout_prob``)."""
    classifier_dropout: float | None = None
    """Dropout before the classification heads; None means ``hidden_dropout``."""
    pooler_dropout: float = 0.0
    """Dropout on the first token before the pooler's dense layer: RoBERTa's classification head has it (set to
    its classifier dropout on conversion), BERT's pooler has none."""
    mlm_head_act: str | None = None
    """Activation inside the MLM head; None means ``hidden_act`` (BERT). RoBERTa's is always ``gelu``."""
    tie_word_embeddings: bool = True
    """Share the MLM decoder weight with the token embedding."""
    initializer_range: float = 0.02
    """Std of the normal weight init."""
    pad_token_id: int | None = 0
    """Padding token id (RoBERTa: also the position of padding, see ``padded_positions``)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (unused by the model; kept for tokenizers that have one)."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id (unused by the model)."""
    is_decoder: bool = False
    """Causal self-attention with a key/value cache: BERT as a left-to-right language model
    (:class:`BertLMHeadModel`) or as the decoder of an encoder-decoder (transformers' ``is_decoder``)."""
    add_cross_attention: bool = False
    """A cross-attention sublayer in every layer, attending to an encoder's output (``encoder_hidden_states``): the
    decoder of transformers' ``EncoderDecoderModel``. Needs ``is_decoder``."""
    use_cache: bool = True
    """A decoder returns its key/value cache from forward passes (generation); encoders keep none."""
    hf_architecture: str | None = None
    """The HF ``model_type`` this config was converted from (``bert`` or ``roberta``); export goes back to it. None
    means ``roberta`` when ``padded_positions`` is set, else ``bert``."""

    def __post_init__(self, **kwargs: Any) -> None:
        # Aliases arrive as extra kwargs; apply them before deriving head_dim & co. from them.
        for alias in [k for k in kwargs if k in self.attribute_map]:
            setattr(self, alias, kwargs.pop(alias))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
                     "type_vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; "
                    "set head_dim explicitly or choose divisible sizes"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.padded_positions and self.pad_token_id is None:
            raise ConfigError("padded_positions=True numbers positions from pad_token_id + 1, so pad_token_id must be set")
        super().__post_init__(**kwargs)

    @property
    def first_position(self) -> int:
        """Position id of a sequence's first token: 0, or ``pad_token_id + 1`` with ``padded_positions``."""
        return self.pad_token_id + 1 if self.padded_positions else 0

    @property
    def max_input_length(self) -> int:
        """The longest input the position table can number."""
        return self.max_position_embeddings - self.first_position
