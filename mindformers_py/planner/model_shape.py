"""The sizes of a model that the planner's memory and time estimates depend on (:class:`ModelShape`), and the one
place that reads them from a model description: our configs (``GPTConfig`` and presets) and HF ``config.json``
dicts of every architecture the planner covers (decoders, mixtures of experts, encoders, encoder-decoders, vision
encoders).

The readers here know transformers' architectures only. A reader for an HF ``model_type`` is registered with
:func:`register_shape_reader`; model types our own families convert (``gpt2``, ``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``qwen3_moe``, ...) are read through the family's converter, so the planner sees exactly the model we would build. Our own configs are
read as their family says (its registry entry's ``planner_config``: BERT, T5 and ViT as the HF config they export
to), else field by field, GPT-style. Parameter counts are exact for the HF classes named in each reader (the tests
compare them with transformers' models on the meta device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..layers.moe.config import moe_config_of
from ..models import registry  # the family table (it imports the built-in families on first read)
from ..parallel.config import RecomputeConfig

# Activation tensors the MLP activation function keeps for backward, counted in intermediate-size units (the
# activation's input included): transformers writes these out in Python (pow, tanh, products). ``gelu_new`` is not
# among them: layers/mlp.py runs it as one fused op that keeps only its input, the default.
ACTIVATION_SAVED_TENSORS = {"gelu_fast": 4, "gelu_python": 3, "quick_gelu": 2}
DEFAULT_ACTIVATION_SAVED = 1
HEADS = ("lm", "mlm", "classifier")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a transformer that memory and time depend on.

    The defaults of the fields after ``dropout`` describe a dense decoder-only model; mixtures of experts,
    encoders, encoder-decoders and vision encoders set them (see the readers below).
    """

    hidden: int
    """Model width."""
    layers: int
    """Transformer layers (the decoder's, for encoder-decoders)."""
    heads: int
    """Query heads per layer."""
    kv_heads: int
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int
    """Size of one attention head."""
    ffn: int
    """Intermediate size of a dense MLP."""
    vocab: int
    """Token ids (0 for models without a vocabulary, e.g. vision encoders)."""
    max_positions: int
    """Longest sequence the model accepts (rows of a learned position table)."""
    gated_mlp: bool
    """Gated MLP (SwiGLU/GeGLU: three matrices instead of two)."""
    rope: bool
    """Rotary position embeddings (applied to q and k in every layer)."""
    rms_norm: bool
    """RMSNorm (else LayerNorm)."""
    norm_bias: bool
    """LayerNorm with a bias."""
    qkv_bias: bool
    """Biases on the q/k/v projections."""
    out_bias: bool
    """Bias on the attention output projection."""
    mlp_bias: bool
    """Biases in the MLP projections."""
    tied_embeddings: bool
    """The output head shares the token embedding."""
    learned_positions: bool
    """A learned absolute position table."""
    act_saved: int
    """Intermediate-size tensors the MLP activation keeps for backward."""
    dropout: bool
    """Any dropout is active (its masks are kept for backward)."""
    causal: bool = True
    """Self-attention is causal; fused attention kernels then skip the masked half of the scores."""
    qk_norm: bool = False
    """Per-head RMSNorms of the queries and keys (Qwen3): ``2 · head_dim`` parameters per layer, whole on every
    tensor-parallel rank, and their inputs, statistics and outputs kept for backward."""
    experts: int = 1
    """Routed experts per MoE layer (1: dense model)."""
    top_k: int = 1
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Intermediate size of one routed expert (0: ``ffn``)."""
    shared_expert_ffn: int = 0
    """Intermediate size of the always-active shared expert(s) of an MoE layer (0: none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by a learned sigmoid gate (Qwen-MoE)."""
    moe_layers: int | None = None
    """How many of ``layers`` are MoE layers (None: all of them when ``experts > 1``); the others are dense."""
    encoder_layers: int = 0
    """Encoder layers of an encoder-decoder model; each of its ``layers`` decoder layers then adds cross-attention
    over the encoder's output."""
    relative_attention_buckets: int = 0
    """T5's relative position buckets: a ``buckets x heads`` bias table in the first layer of each stack."""
    token_types: int = 0
    """Rows of a token-type (segment) embedding table (BERT)."""
    head: str = "lm"
    """Output head: ``"lm"`` (vocabulary projection), ``"mlm"`` (BERT's dense + norm + vocabulary projection with
    an output bias) or ``"classifier"`` (``num_labels`` outputs from the first token, e.g. ViT)."""
    num_labels: int = 0
    """Outputs of a ``"classifier"`` head."""
    patch_inputs: int = 0
    """Vision encoders: values in one image patch (channels x patch x patch), projected to ``hidden``; the
    sequence is the patches plus a class token."""
    post_norm: bool = False
    """Norms after each residual branch (BERT) instead of before (GPT-2, Llama, T5, ViT)."""
    final_norm: bool = True
    """A norm after the last layer (of each stack)."""
    model_type: str = ""
    """Where the shape came from (``mindformers_gpt``, ``llama``, ``mixtral``, ``t5``, ...), for display."""

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """Read a GPT-style config (HF field names; missing fields take GPT-2 defaults), with the experts of its
        ``moe_config`` section (GPT-MoE)."""
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        gated = bool(getattr(cfg, "gated_mlp", False))
        act = getattr(cfg, "hidden_act", "gelu_new")
        position = getattr(cfg, "position_embedding_type", "learned")
        dropout = any(float(getattr(cfg, name, 0.0) or 0.0) > 0
                      for name in ("hidden_dropout", "attention_dropout", "embedding_dropout"))
        ffn = getattr(cfg, "intermediate_size", None) or 4 * hidden
        moe = moe_config_of(cfg)
        experts = {} if moe is None else dict(
            experts=moe.expert_num, top_k=moe.num_experts_chosen, expert_ffn=moe.expert_size(ffn),
            shared_expert_ffn=moe.shared_expert_size(ffn), shared_expert_gate=moe.use_shared_expert_gating,
            moe_layers=len(moe.routed_layers(cfg.num_hidden_layers)))
        return cls(
            hidden=hidden, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
            ffn=ffn, vocab=cfg.vocab_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1024), gated_mlp=gated,
            rope=position == "rope", rms_norm=getattr(cfg, "norm_type", "layernorm") == "rmsnorm",
            norm_bias=bool(getattr(cfg, "norm_bias", True)), qkv_bias=bool(getattr(cfg, "attention_bias", True)),
            out_bias=bool(getattr(cfg, "attention_out_bias", True)), mlp_bias=bool(getattr(cfg, "mlp_bias", True)),
            qk_norm=bool(getattr(cfg, "qk_norm", False)),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), learned_positions=position == "learned",
            act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED), dropout=dropout,
            model_type=getattr(cfg, "model_type", "") or "", **experts,
        )

    # -- sizes ---------------------------------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        """Width of the query projection (heads x head size)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of each key/value projection."""
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether some layers route tokens to experts."""
        return self.experts > 1

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        if not self.is_moe:
            return 0
        return self.layers if self.moe_layers is None else self.moe_layers

    @property
    def total_layers(self) -> int:
        """Every transformer layer a pipeline splits (encoder and decoder)."""
        return self.layers + self.encoder_layers

    def layer_kinds(self) -> list[tuple[str, int]]:
        """(kind, count) of the transformer layers: ``"encoder"`` (bidirectional self-attention and MLP),
        ``"dense"`` (causal self-attention and MLP), ``"moe"`` (the MLP a mixture of experts) and ``"cross"`` (an
        encoder-decoder's decoder layer, with cross-attention)."""
        kinds = [("encoder", self.encoder_layers), ("moe", self.num_moe_layers)]
        if self.encoder_layers:
            kinds.append(("cross", self.layers))
        else:
            kinds.append(("dense" if self.causal else "encoder", self.layers - self.num_moe_layers))
        return [(kind, count) for kind, count in kinds if count]

    @property
    def routed_ffn(self) -> int:
        """Intermediate size of one routed expert."""
        return self.expert_ffn or self.ffn

    @property
    def norm_params(self) -> int:
        """Parameters of one norm."""
        return self.hidden * (2 if not self.rms_norm and self.norm_bias else 1)

    def attention_params(self, tp: int = 1) -> int:
        """Parameters of one attention block on one of ``tp`` tensor-parallel ranks."""
        q, kv, h = self.q_width, self.kv_width, self.hidden
        sharded = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        return sharded // tp + (h if self.out_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    def _mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def mlp_params(self, tp: int = 1) -> int:
        """Parameters of one dense MLP on one of ``tp`` tensor-parallel ranks."""
        mats = self._mlp_matrices()
        biases = (mats - 1) * self.ffn if self.mlp_bias else 0
        return (mats * self.hidden * self.ffn + biases) // tp + (self.hidden if self.mlp_bias else 0)

    def expert_params(self, tp: int = 1, ep: int = 1) -> int:
        """Routed-expert parameters of one MoE layer on one rank: ``experts / ep`` experts, each split over ``tp``
        tensor-parallel ranks (Megatron's default: expert tensor parallelism follows the dense layers')."""
        one = self._mlp_matrices() * self.hidden * self.routed_ffn
        return self.experts // ep * one // tp

    def moe_dense_params(self, tp: int = 1) -> int:
        """The parts of one MoE layer every expert-parallel rank holds: the router, the shared expert and its
        gate."""
        shared = self._mlp_matrices() * self.hidden * self.shared_expert_ffn // tp
        return self.hidden * self.experts + shared + (self.hidden if self.shared_expert_gate else 0)

    def cross_attention_params(self, tp: int = 1) -> int:
        """Cross-attention block and its norm in one decoder layer of an encoder-decoder model (0 otherwise)."""
        if not self.encoder_layers:
            return 0
        return self.attention_params(tp) + self.norm_params

    def dense_layer_params(self, tp: int = 1) -> int:
        """Parameters of one dense (non-MoE) decoder-style layer on one tensor-parallel rank."""
        return self.attention_params(tp) + self.mlp_params(tp) + 2 * self.norm_params

    def stack_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters of every transformer layer together on one rank that holds all layers (the relative
        position tables of T5 included)."""
        dense_layers = self.layers - self.num_moe_layers
        moe = self.attention_params(tp) + 2 * self.norm_params + self.moe_dense_params(tp) + self.expert_params(tp, ep)
        total = dense_layers * self.dense_layer_params(tp) + self.num_moe_layers * moe
        total += self.layers * self.cross_attention_params(tp)
        total += self.encoder_layers * self.dense_layer_params(tp)
        stacks = 2 if self.encoder_layers else 1
        total += stacks * self.relative_attention_buckets * self.heads // tp
        return total

    def expert_stack_params(self, tp: int = 1, ep: int = 1) -> int:
        """The routed-expert share of :meth:`stack_params` (reduced over ``dp / ep`` ranks, not ``dp``)."""
        return self.num_moe_layers * self.expert_params(tp, ep)

    def layer_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters of one transformer layer on one rank: exact for uniform stacks, the mean layer otherwise."""
        if self.total_layers == self.layers and not self.is_moe and not self.relative_attention_buckets:
            return self.dense_layer_params(tp)
        return math.ceil(self.stack_params(tp, ep) / self.total_layers)

    def embedding_params(self, tp: int = 1) -> int:
        """Input embeddings on one of ``tp`` vocabulary shards: tokens, learned positions, token types, image
        patches and the class token."""
        params = self.vocab * self.hidden // tp
        params += self.max_positions * self.hidden if self.learned_positions else 0
        params += self.token_types * self.hidden
        if self.patch_inputs:
            params += self.patch_inputs * self.hidden + 2 * self.hidden  # projection + bias, class token
        if self.post_norm:  # BERT normalises the summed embeddings
            params += self.norm_params
        return params

    def head_params(self, tp: int = 1) -> int:
        """Final norm(s) and output head (the head counted even when tied: pipeline stages hold a copy)."""
        norms = (2 if self.encoder_layers else 1) * self.norm_params if self.final_norm else 0
        if self.head == "classifier":
            return norms + self.hidden * self.num_labels + self.num_labels
        if self.head == "mlm":  # dense + norm + vocabulary projection + output bias
            return norms + self.hidden * self.hidden + self.hidden + self.norm_params + self.vocab * self.hidden // tp \
                + self.vocab // tp
        return norms + self.vocab * self.hidden // tp

    def total_params(self) -> int:
        """Parameters of the whole model on one device (a tied head counted once)."""
        head = self.head_params()
        if self.tied_embeddings and self.head != "classifier":
            head -= self.vocab * self.hidden
        return self.embedding_params() + self.stack_params() + head

    def active_layer_matmul_params(self) -> float:
        """Matrix parameters one token passes through in the transformer layers: ``top_k`` routed experts (and
        the shared one) in MoE layers, every matrix in dense ones; biases and norms left out."""
        h = self.hidden
        attn = 2 * h * self.q_width + 2 * h * self.kv_width
        mats = self._mlp_matrices()
        dense_mlp = mats * h * self.ffn
        moe_mlp = mats * h * (self.top_k * self.routed_ffn + self.shared_expert_ffn) + h * self.experts
        total = (self.layers - self.num_moe_layers) * (attn + dense_mlp) + self.num_moe_layers * (attn + moe_mlp)
        total += self.layers * attn if self.encoder_layers else 0  # cross-attention
        total += self.encoder_layers * (attn + dense_mlp)
        return float(total)

    def head_matmul_params(self) -> int:
        """Matrix parameters of the output head that every token passes through."""
        if self.head == "classifier":
            return 0  # one token per sequence: negligible
        dense = self.hidden * self.hidden if self.head == "mlm" else 0
        return dense + self.vocab * self.hidden

    def flops_per_token(self, seq: int, recompute: RecomputeConfig | None = None) -> float:
        """Training FLOPs per token: ``6·N`` for the matrix products (N the active matrix parameters, the head
        included, the embedding lookups not) plus ``12·L·q_width·s`` for attention scores (PaLM's convention:
        the causal half is counted), plus the forward re-run by recompute."""
        layers_with_attention = self.total_layers + (self.layers if self.encoder_layers else 0)
        attention = 12 * layers_with_attention * self.q_width * seq
        flops = 6 * (self.active_layer_matmul_params() + self.head_matmul_params()) + attention
        if recompute is not None and recompute.enabled:
            share = recomputed_share(recompute, self.total_layers)
            per_layer = self.active_layer_matmul_params() / self.total_layers
            attention_layer = attention / 3 / self.total_layers  # the forward third
            if recompute.recompute == "full":
                extra = 2 * per_layer + attention_layer
            else:
                parts = recompute.select_recompute
                extra = attention_layer if parts else 0
                h = self.hidden
                attn = 2 * h * self.q_width + 2 * h * self.kv_width
                extra += 2 * attn if "self_attn" in parts else 0
                extra += 2 * (per_layer - attn) if "mlp" in parts else 0
            flops += share * self.total_layers * extra
        return float(flops)


def recomputed_share(recompute: RecomputeConfig, layers_per_chunk: int, stage: int = 0) -> float:
    """Fraction of a chunk's layers that ``recompute`` applies to."""
    if not recompute.enabled or layers_per_chunk == 0:
        return 0.0
    chosen = sum(recompute.recomputes_layer(i, stage) for i in range(layers_per_chunk))
    return chosen / layers_per_chunk


# ---------------------------------------------------------------------------------------------------------------
# Reading shapes from HF config.json dicts
# ---------------------------------------------------------------------------------------------------------------

ShapeReader = Callable[[Mapping[str, Any]], ModelShape]
SHAPE_READERS: dict[str, ShapeReader] = {}


def register_shape_reader(*model_types: str) -> Callable[[ShapeReader], ShapeReader]:
    """Register a function reading a :class:`ModelShape` from HF ``config.json`` dicts of ``model_types``."""

    def register(reader: ShapeReader) -> ShapeReader:
        for model_type in model_types:
            SHAPE_READERS[model_type] = reader
        return reader

    return register


def _require(cfg: Mapping[str, Any], *names: str) -> list[Any]:
    """The values of ``names``, refusing a config that lacks one or holds a non-positive size."""
    values = []
    for name in names:
        value = cfg.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config {name}={value!r} is not valid for model_type={cfg.get('model_type')!r}; "
                              "expected a positive integer")
        values.append(value)
    return values


def _dropout(cfg: Mapping[str, Any], *names: str) -> bool:
    return any(float(cfg.get(name) or 0.0) > 0 for name in names)


@register_shape_reader("mixtral")
def _mixtral(cfg: Mapping[str, Any]) -> ModelShape:
    """``MixtralForCausalLM``: Llama attention, every MLP a top-k mixture of SwiGLU experts with a linear router."""
    hidden, layers, heads, experts = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_local_experts")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, ffn=cfg.get("intermediate_size", 14336),
        vocab=cfg.get("vocab_size", 32000), max_positions=cfg.get("max_position_embeddings", 32768),
        gated_mlp=True, rope=True, rms_norm=True, norm_bias=False, qkv_bias=False, out_bias=False, mlp_bias=False,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), learned_positions=False,
        act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "attention_dropout"),
        experts=experts, top_k=cfg.get("num_experts_per_tok", 2), expert_ffn=cfg.get("intermediate_size", 14336),
        model_type="mixtral",
    )


@register_shape_reader("qwen2_moe")
def _qwen2_moe(cfg: Mapping[str, Any]) -> ModelShape:
    """``Qwen2MoeForCausalLM``: q/k/v biases, MoE layers every ``decoder_sparse_step`` layers (except
    ``mlp_only_layers``) with a gated shared expert."""
    hidden, layers, heads, experts = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_experts")
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, ffn=cfg.get("intermediate_size", 5632),
        vocab=cfg.get("vocab_size", 151936), max_positions=cfg.get("max_position_embeddings", 32768),
        gated_mlp=True, rope=True, rms_norm=True, norm_bias=False, qkv_bias=bool(cfg.get("qkv_bias", True)),
        out_bias=False, mlp_bias=False, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        learned_positions=False, act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "attention_dropout"),
        experts=experts, top_k=cfg.get("num_experts_per_tok", 4), expert_ffn=cfg.get("moe_intermediate_size", 1408),
        shared_expert_ffn=cfg.get("shared_expert_intermediate_size", 0) or 0,
        shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")), moe_layers=moe_layers,
        model_type="qwen2_moe",
    )


@register_shape_reader("bert", "roberta")
def _bert(cfg: Mapping[str, Any]) -> ModelShape:
    """``BertForMaskedLM`` / ``RobertaForMaskedLM``: post-norm encoder with biases, learned positions and token
    types, the masked-LM head (dense + norm + tied vocabulary projection with a bias); no pooler."""
    hidden, layers, heads = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads")
    act = cfg.get("hidden_act", "gelu")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=cfg.get("intermediate_size") or 4 * hidden, vocab=cfg.get("vocab_size", 30522),
        max_positions=cfg.get("max_position_embeddings", 512), gated_mlp=False, rope=False, rms_norm=False,
        norm_bias=True, qkv_bias=True, out_bias=True, mlp_bias=True,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), learned_positions=True,
        act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED),
        dropout=_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
        causal=False,
        token_types=cfg.get("type_vocab_size", 2), head="mlm", post_norm=True, final_norm=False,
        model_type=str(cfg.get("model_type")),
    )


@register_shape_reader("t5", "mt5")
def _t5(cfg: Mapping[str, Any]) -> ModelShape:
    """``T5ForConditionalGeneration`` / ``MT5ForConditionalGeneration``: encoder and decoder stacks of RMS-normed
    layers without biases, relative position buckets in each stack's first layer, a shared embedding, ReLU or
    gated-GELU feed-forward."""
    hidden, layers, heads, head_dim = _require(cfg, "d_model", "num_layers", "num_heads", "d_kv")
    decoder_layers = cfg.get("num_decoder_layers") or layers
    projection = str(cfg.get("feed_forward_proj", "relu"))
    return ModelShape(
        hidden=hidden, layers=decoder_layers, heads=heads, kv_heads=heads, head_dim=head_dim,
        ffn=cfg.get("d_ff", 2048), vocab=cfg.get("vocab_size", 32128), max_positions=0,
        gated_mlp=projection.startswith("gated"), rope=False, rms_norm=True, norm_bias=False, qkv_bias=False,
        out_bias=False, mlp_bias=False, tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        learned_positions=False, act_saved=DEFAULT_ACTIVATION_SAVED, dropout=_dropout(cfg, "dropout_rate"),
        encoder_layers=layers, relative_attention_buckets=cfg.get("relative_attention_num_buckets", 32),
        model_type=str(cfg.get("model_type")),
    )


@register_shape_reader("vit")
def _vit(cfg: Mapping[str, Any]) -> ModelShape:
    """``ViTForImageClassification``: pre-norm encoder over image patches plus a class token, a linear
    classifier on the class token."""
    hidden, layers, heads, image, patch = _require(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "image_size", "patch_size")
    channels = cfg.get("num_channels", 3)
    patches = (image // patch) ** 2
    act = cfg.get("hidden_act", "gelu")
    return ModelShape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=cfg.get("intermediate_size") or 4 * hidden, vocab=0, max_positions=patches + 1, gated_mlp=False,
        rope=False, rms_norm=False, norm_bias=True, qkv_bias=bool(cfg.get("qkv_bias", True)), out_bias=True,
        mlp_bias=True, tied_embeddings=False, learned_positions=True,
        act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED),
        dropout=_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
        causal=False,
        head="classifier", num_labels=len(cfg.get("id2label") or {}) or 2, patch_inputs=channels * patch * patch,
        model_type="vit",
    )


def image_sequence_length(shape: ModelShape) -> int:
    """Tokens a vision encoder sees per image (patches + class token); 0 for text models."""
    return shape.max_positions if shape.patch_inputs else 0


def shape_from_config(config: Any) -> ModelShape:
    """The shape of a model config (a ``PretrainedConfig``): one of our families' as the family reads it (its
    ``planner_config``, the HF config of the same shape), a transformers one by the reader of its ``model_type``;
    GPT-style configs field by field."""
    model_type = getattr(config, "model_type", None)
    family = registry.family_for_model_type(str(model_type)) if model_type else None
    if family is not None and family.planner_config is not None and model_type == family.config_class.model_type:
        return replace(shape_from_hf_dict(family.planner_config(config)), model_type=str(model_type))
    if model_type in SHAPE_READERS:
        return SHAPE_READERS[model_type](config.to_dict())
    return ModelShape.from_config(config)


def shape_from_hf_dict(cfg: Mapping[str, Any], where: str = "config.json") -> ModelShape:
    """The shape of the model an HF ``config.json`` dict describes.

    Types our families convert are read through the family's converter (the same model we would build); the
    others through :data:`SHAPE_READERS`.
    """
    model_type = cfg.get("model_type")
    family = registry.family_for_model_type(str(model_type)) if model_type else None
    if model_type in SHAPE_READERS:  # a reader of its own (architectures beyond the GPT-style field set)
        return SHAPE_READERS[str(model_type)](cfg)
    if family is not None and family.converter is not None and model_type in family.hf_types:
        return replace(shape_from_config(family.converter.config_from_hf(dict(cfg))), model_type=str(model_type))
    if family is not None and model_type == family.config_class.model_type:
        return shape_from_config(family.config_class(**{k: v for k, v in cfg.items() if k != "model_type"}))
    known = sorted({*SHAPE_READERS, *registry.all_model_types()})
    raise ConfigError(f"model_type={model_type!r} in {where} is not one the planner reads; choose one of: "
                      f"{', '.join(known)}")


def as_shape(model: Any) -> ModelShape:
    """``model`` as a :class:`ModelShape`: a shape, an HF ``config.json`` dict or one of our model configs."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping):
        return shape_from_hf_dict(model)
    return shape_from_config(model)
