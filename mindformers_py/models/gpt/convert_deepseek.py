"""HF ``deepseek_v3`` <-> the GPT family: multi-head latent attention (``attention_type="mla"``), routed and shared
experts behind the DeepSeek-V3 router (sigmoid scores, group-limited top-k, a per-expert selection bias), the first
``first_k_dense_replace`` layers dense, and the multi-token-prediction layers a checkpoint may carry.

Weights: the attention's names are transformers' (``q_a_proj``, ``kv_a_proj_with_mqa``, ...); the MoE block's
``mlp.shared_experts`` is our ``mlp.shared_expert`` (one MLP of ``n_shared_experts · moe_intermediate_size``),
``mlp.gate.weight`` and ``mlp.gate.e_score_correction_bias`` keep their names, per-expert tensors are stacked as for
Qwen3-MoE (``convert_gpt``). A DeepSeek checkpoint's MTP layers sit after the decoder layers, as
``model.layers.<num_hidden_layers + i>.*`` (``enorm``, ``hnorm``, ``eh_proj``, the block, ``shared_head``): they load
into ``GPTForCausalLM.mtp`` (built when the file holds them, see ``GPTConfig.use_mtp``) and export back under those
names (:func:`mtp_from_hf`, :func:`mtp_to_hf`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ...errors import MindFormersError
from .configuration_gpt import GPTConfig

# The MLA and router fields that have the same name on both sides.
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
_ROUTER_FIELDS = ("n_group", "topk_group", "routed_scaling_factor")
# transformers' DeepSeek-V3 defaults of the fields a config.json may leave out (its DeepseekV3Config).
_HF_DEFAULTS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    rope_interleave=True, n_group=8, topk_group=4, routed_scaling_factor=2.5, n_routed_experts=256,
                    n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
                    norm_topk_prob=True)
SEQUENCE_BALANCE_FACTOR = 0.0001
"""The DeepSeek-V3 report's sequence-wise balance factor α, the default weight of the balance loss when a
``config.json`` names none (DeepSeek's own carry ``aux_loss_alpha``)."""


def latent_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our config's latent-attention fields and multi-token-prediction layer count from a ``deepseek_v3``
    ``config.json`` dict."""
    out = {"attention_type": "mla", **{k: hf.get(k, _HF_DEFAULTS[k]) for k in _MLA_FIELDS}}
    out["attention_bias"] = out["attention_out_bias"] = hf.get("attention_bias", False)
    # transformers' default is one such layer (its config.json says 1 even where the weights hold none)
    out["num_nextn_predict_layers"] = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1))
    return out


def moe_from_hf(hf: dict[str, Any], num_layers: int) -> dict[str, Any] | None:
    """The ``moe_config`` of a DeepSeek-V3 config: experts from layer ``first_k_dense_replace`` on (None when every
    layer is dense), routed by the ``deepseek_v3`` router in float32 (as transformers'), never dropped."""
    get = lambda name: hf.get(name, _HF_DEFAULTS[name]) if hf.get(name) is not None else _HF_DEFAULTS[name]  # noqa: E731
    dense = min(get("first_k_dense_replace"), num_layers)
    if dense >= num_layers:
        return None
    return dict(router_type="deepseek_v3", routing_policy="dropless", router_dense_type="float32",
                expert_num=hf.get("n_routed_experts", hf.get("num_local_experts", _HF_DEFAULTS["n_routed_experts"])),
                num_experts_chosen=get("num_experts_per_tok"), moe_intermediate_size=get("moe_intermediate_size"),
                shared_expert_num=get("n_shared_experts"), norm_topk_prob=get("norm_topk_prob"),
                mlp_only_layers=list(range(dense)), aux_loss_scope="sequence",
                aux_loss_factor=hf.get("aux_loss_alpha", SEQUENCE_BALANCE_FACTOR),
                **{k: get(k) for k in _ROUTER_FIELDS})


def config_to_hf_kwargs(config: GPTConfig) -> dict[str, Any]:
    """The ``DeepseekV3Config`` keyword arguments of ``config``'s attention, experts and multi-token-prediction
    layer count (beside the Llama-like fields the caller gives)."""
    kwargs: dict[str, Any] = {k: getattr(config, k) for k in _MLA_FIELDS}
    kwargs["attention_bias"] = config.attention_bias
    kwargs["num_mtp_layers"] = config.num_nextn_predict_layers
    moe = config.moe
    if moe is None:  # every layer dense
        kwargs["first_k_dense_replace"] = config.num_hidden_layers
        return kwargs
    kwargs.update(n_routed_experts=moe.expert_num, num_experts_per_tok=moe.num_experts_chosen,
                  moe_intermediate_size=moe.expert_size(config.intermediate_size), n_shared_experts=moe.shared_expert_num,
                  norm_topk_prob=moe.norm_topk_prob, first_k_dense_replace=len(moe.mlp_only_layers),
                  output_router_logits=config.output_router_logits, **{k: getattr(moe, k) for k in _ROUTER_FIELDS})
    return kwargs


def check_exportable(config: GPTConfig) -> None:
    """Refuse what transformers' DeepSeek-V3 cannot represent (a one-line error naming the field)."""
    wanted = dict(attention_type="mla", position_embedding_type="rope", norm_type="rmsnorm", gated_mlp=True,
                  attention_out_bias=config.attention_bias, mlp_bias=False, qk_norm=False, sliding_window=None)
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise MindFormersError(f"cannot export to HF deepseek_v3: it needs {field}={value!r}, the model has "
                                   f"{getattr(config, field)!r}")
    moe = config.moe
    if moe is None:
        return
    dense = len(moe.mlp_only_layers)
    wanted_moe = dict(router_type="deepseek_v3", routing_policy="dropless", decoder_sparse_step=1,
                      mlp_only_layers=tuple(range(dense)), use_shared_expert_gating=False,
                      shared_expert_intermediate_size=None, router_jitter_noise=0.0)
    for field, value in wanted_moe.items():
        if getattr(moe, field) != value:
            raise MindFormersError(f"cannot export to HF deepseek_v3: it needs moe_config.{field}={value!r} (its "
                                   f"dense layers are the first first_k_dense_replace), the model has "
                                   f"{getattr(moe, field)!r}")


# --------------------------------------------------------------------------- weights
_SHARED_HF, _SHARED_OURS = ".mlp.shared_experts.", ".mlp.shared_expert."


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def mtp_keys(state: dict[str, torch.Tensor], num_layers: int) -> set[str]:
    """The keys of ``state`` that belong to multi-token-prediction layers: ``model.layers.<i>.*`` with ``i`` at or
    past ``num_layers`` (the decoder layers' count), where DeepSeek's checkpoints put them."""
    return {k for k in state if (m := _LAYER_KEY.match(k)) and int(m[1]) >= num_layers}


def mtp_from_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's MTP layers (``model.layers.<L + k - 1>.*``, experts already stacked) under our
    ``mtp.layers.<k - 1>.*`` names; their copies of the main model's embedding and head are dropped (the modules
    share the main model's, and export writes them back from those). ``config.use_mtp`` left at None is settled
    here: True when the checkpoint holds such layers, so the model builds the modules they load into."""
    from ...layers.multi_token_prediction import module_name

    keys = mtp_keys(state, config.num_hidden_layers)
    if config.use_mtp is None:
        config.use_mtp = bool(keys)
    out = {}
    for key, value in state.items():
        if key not in keys:
            out[key] = value
            continue
        m = _LAYER_KEY.match(key)
        name = module_name(m[2])
        if name is not None:
            out[f"mtp.layers.{int(m[1]) - config.num_hidden_layers}.{name}"] = value
    return out


def mtp_to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our ``mtp.layers.<j>.*`` under the checkpoint's ``model.layers.<L + j>.*`` names (the block's tensors directly
    under the layer), with each layer's ``embed_tokens.weight`` and ``shared_head.head.weight``: the main model's
    embedding and output head, as DeepSeek's checkpoints store them."""
    from ...layers.multi_token_prediction import SHARED_TENSORS, checkpoint_name

    out, layers = {}, set()
    for key, value in state.items():
        m = _MTP_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        layer = config.num_hidden_layers + int(m[1])
        layers.add(layer)
        out[f"model.layers.{layer}.{checkpoint_name(m[2])}"] = value
    head = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
    for layer in sorted(layers):
        for name, tensor in zip(SHARED_TENSORS, (state.get("model.embed_tokens.weight"), head)):
            if tensor is not None:  # a copy: safetensors refuses two names on one storage
                out[f"model.layers.{layer}.{name}"] = tensor.clone()
    return out


def rename_from_hf(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's shared experts under our name (the experts are stacked by the caller)."""
    return {k.replace(_SHARED_HF, _SHARED_OURS): v for k, v in hf_state.items()}


def rename_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our shared expert under DeepSeek's name."""
    return {k.replace(_SHARED_OURS, _SHARED_HF): v for k, v in state.items()}
