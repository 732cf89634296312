"""The sizes of a model that the planner's memory and time estimates depend on (:class:`ModelShape`): parameters,
matrix products and FLOPs per token, by layer kind and per rank of a layout. :mod:`.shape_readers` reads a shape
from our configs and HF ``config.json`` dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..layers.moe.config import moe_config_of
from ..parallel.config import RecomputeConfig

# Activation tensors the MLP activation function keeps for backward, counted in intermediate-size units (the
# activation's input included): transformers writes these out in Python (pow, tanh, products). ``gelu_new`` is not
# among them: layers/mlp.py runs it as one fused op that keeps only its input, the default.
ACTIVATION_SAVED_TENSORS = {"gelu_fast": 4, "gelu_python": 3, "quick_gelu": 2}
DEFAULT_ACTIVATION_SAVED = 1
HEADS = ("lm", "mlm", "classifier")


def _latent_attention_fields(cfg: Any) -> dict[str, int]:
    """The :class:`ModelShape` fields of multi-head latent attention and multi-token prediction read from a
    config with DeepSeek's field names (HF ``deepseek_v3``'s and ours); empty for other models."""
    fields = {"mtp_layers": int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)}
    kv_rank = int(getattr(cfg, "kv_lora_rank", 0) or 0)
    if kv_rank:
        rope = int(cfg.qk_rope_head_dim)
        fields.update(kv_lora_rank=kv_rank, q_lora_rank=int(getattr(cfg, "q_lora_rank", 0) or 0),
                      qk_rope_head_dim=rope, v_head_dim=int(cfg.v_head_dim),
                      head_dim=int(cfg.qk_nope_head_dim) + rope)
    return fields


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
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): rank of the queries' low-rank down-projection (0: queries
    projected from the hidden state directly). The latent and its norm are whole on every tensor-parallel rank."""
    kv_lora_rank: int = 0
    """Multi-head latent attention: rank of the compressed key/value latent ``c_kv`` (0: ordinary attention). Keys
    and values are up-projected from it per head in training (``head_dim`` is then the query/key head size,
    ``qk_nope_head_dim + qk_rope_head_dim``); decoding caches only the latent and the shared rope key."""
    qk_rope_head_dim: int = 0
    """Multi-head latent attention: the rotary part of each query/key head; its key part is one head shared by all
    heads, projected with the latent."""
    v_head_dim: int = 0
    """Size of one value head when it differs from ``head_dim`` (multi-head latent attention; 0: ``head_dim``)."""
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3's ``num_nextn_predict_layers``) on the last pipeline stage: each
    one more transformer layer of the stack's last kind, two norms, a ``2·hidden x hidden`` projection and a norm
    before the output head, which it shares with the model (it runs the head once more per token)."""
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
        latent = _latent_attention_fields(cfg)
        head_dim = latent.pop("head_dim", head_dim)
        return cls(
            hidden=hidden, layers=cfg.num_hidden_layers, heads=heads,
            kv_heads=heads if "kv_lora_rank" in latent else getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn=ffn, vocab=cfg.vocab_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1024), gated_mlp=gated,
            rope=position == "rope", rms_norm=getattr(cfg, "norm_type", "layernorm") == "rmsnorm",
            norm_bias=bool(getattr(cfg, "norm_bias", True)), qkv_bias=bool(getattr(cfg, "attention_bias", True)),
            out_bias=bool(getattr(cfg, "attention_out_bias", True)), mlp_bias=bool(getattr(cfg, "mlp_bias", True)),
            qk_norm=bool(getattr(cfg, "qk_norm", False)),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), learned_positions=position == "learned",
            act_saved=ACTIVATION_SAVED_TENSORS.get(act, DEFAULT_ACTIVATION_SAVED), dropout=dropout,
            model_type=getattr(cfg, "model_type", "") or "", **{**experts, **latent},
        )

    # -- sizes ---------------------------------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        """Width of the query projection (heads x head size)."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of each key/value projection (of the keys, under multi-head latent attention)."""
        return self.kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Width of the values and of the attention output (``q_width`` except under latent attention)."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (keys and values from a compressed latent)."""
        return self.kv_lora_rank > 0

    def attention_gemms(self, tokens: float, tp: int = 1) -> list[tuple[float, float, float, float]]:
        """The attention projections of one layer for ``tokens`` tokens on one of ``tp`` ranks, as matrix
        products ``(m, n, k, count)``: q/k/v then the output for ordinary attention; under latent attention the
        down-projections (whole on every rank), then the per-head up-projections and the output (split by heads)."""
        h = self.hidden
        if not self.latent_attention:
            return [(tokens, (self.q_width + 2 * self.kv_width) / tp, h, 1), (tokens, h, self.v_width / tp, 1)]
        nope = self.head_dim - self.qk_rope_head_dim
        gemms = [(tokens, self.kv_lora_rank + self.qk_rope_head_dim, h, 1),
                 (tokens, self.heads * (nope + (self.v_head_dim or self.head_dim)) / tp, self.kv_lora_rank, 1),
                 (tokens, h, self.v_width / tp, 1)]
        if self.q_lora_rank:
            return [(tokens, self.q_lora_rank, h, 1), (tokens, self.q_width / tp, self.q_lora_rank, 1), *gemms]
        return [(tokens, self.q_width / tp, h, 1), *gemms]

    def attention_matmul_params(self) -> int:
        """Matrix parameters of one attention block (biases and norms left out)."""
        return int(sum(n * k * count for _, n, k, count in self.attention_gemms(1)))

    @property
    def score_width(self) -> float:
        """Mean width of attention's two products per token (``q kᵀ`` over query/key heads, ``p v`` over value
        heads): ``q_width`` for ordinary attention."""
        return (self.q_width + self.v_width) / 2

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
        if self.latent_attention:  # the latents' projections and norms whole, the per-head ones split by heads
            rope, kv_rank, q_rank = self.qk_rope_head_dim, self.kv_lora_rank, self.q_lora_rank
            nope = self.head_dim - rope
            whole = h * (kv_rank + rope) + kv_rank
            sharded = kv_rank * self.heads * (nope + self.v_width // self.heads) + self.v_width * h
            if q_rank:
                whole += h * q_rank + q_rank
                sharded += q_rank * q
            else:
                sharded += h * q
            return whole + sharded // tp + (h if self.out_bias else 0)
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

    def mtp_layer_kind(self) -> str:
        """The kind (see :meth:`layer_kinds`) of a multi-token prediction module's layer: the stack's last."""
        return "moe" if self.num_moe_layers else ("dense" if self.causal else "encoder")

    def mtp_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters of the multi-token prediction modules on the last pipeline stage (the head and the
        embedding they share with the model not counted again): per module a layer of the stack's last kind, the
        ``2·hidden x hidden`` projection (whole on every rank) and three norms."""
        if not self.mtp_layers:
            return 0
        layer = self.attention_params(tp) + 2 * self.norm_params
        if self.mtp_layer_kind() == "moe":
            layer += self.moe_dense_params(tp) + self.expert_params(tp, ep)
        else:
            layer += self.mlp_params(tp)
        return self.mtp_layers * (layer + 2 * self.hidden * self.hidden + 3 * self.norm_params)

    def mtp_expert_params(self, tp: int = 1, ep: int = 1) -> int:
        """The routed-expert share of :meth:`mtp_params`."""
        return self.mtp_layers * self.expert_params(tp, ep) if self.mtp_layer_kind() == "moe" else 0

    def total_params(self) -> int:
        """Parameters of the whole model on one device (a tied head counted once; multi-token prediction modules
        included)."""
        head = self.head_params()
        if self.tied_embeddings and self.head != "classifier":
            head -= self.vocab * self.hidden
        return self.embedding_params() + self.stack_params() + head + self.mtp_params()

    def active_layer_matmul_params(self) -> float:
        """Matrix parameters one token passes through in the transformer layers: ``top_k`` routed experts (and
        the shared one) in MoE layers, every matrix in dense ones; biases and norms left out."""
        h = self.hidden
        attn = self.attention_matmul_params()
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

    def mtp_matmul_params(self) -> float:
        """Matrix parameters every token passes through in the multi-token prediction modules: per module, one
        layer of the stack's last kind, the ``2·hidden x hidden`` projection and the shared output head again."""
        if not self.mtp_layers:
            return 0.0
        h = self.hidden
        mats = self._mlp_matrices()
        mlp = mats * h * (self.top_k * self.routed_ffn + self.shared_expert_ffn) + h * self.experts \
            if self.mtp_layer_kind() == "moe" else mats * h * self.ffn
        return float(self.mtp_layers * (self.attention_matmul_params() + mlp + 2 * h * h + self.head_matmul_params()))

    def flops_per_token(self, seq: int, recompute: RecomputeConfig | None = None) -> float:
        """Training FLOPs per token: ``6·N`` for the matrix products (N the active matrix parameters, the head
        and the multi-token prediction modules included, the embedding lookups not) plus ``12·L·w·s`` for
        attention scores (``w`` the :attr:`score_width`; PaLM's convention: the causal half is counted), plus the
        forward re-run by recompute."""
        layers_with_attention = self.total_layers + (self.layers if self.encoder_layers else 0)
        attention = 12 * layers_with_attention * self.score_width * seq
        flops = 6 * (self.active_layer_matmul_params() + self.head_matmul_params() + self.mtp_matmul_params()) \
            + attention + 12 * self.mtp_layers * self.score_width * seq
        if recompute is not None and recompute.enabled:
            share = recomputed_share(recompute, self.total_layers)
            per_layer = self.active_layer_matmul_params() / self.total_layers
            attention_layer = attention / 3 / self.total_layers  # the forward third
            if recompute.recompute == "full":
                extra = 2 * per_layer + attention_layer
            else:
                parts = recompute.select_recompute
                extra = attention_layer if parts else 0
                attn = self.attention_matmul_params()
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
