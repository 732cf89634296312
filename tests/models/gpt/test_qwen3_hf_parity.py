"""Qwen3 and Qwen3-MoE checkpoints made with transformers' own config classes load into GPTForCausalLM (the Llama
flavour with ``qk_norm``; GPT-MoE without a shared expert) with transformers' logits to 1e-5 in fp32, its gradients
(the per-head q/k norms' included), router logits, load-balancing loss and loss, identical greedy tokens past the
sliding window, and export back exactly: every tensor equal, the same ``config.json``.

The tiny checkpoints (tests/support/hf_models.py) exercise what sets these architectures apart: Qwen3's ``head_dim`` that
is not ``hidden_size / heads``, biases on q/k/v/o (``attention_bias``), a sliding-window layer after a full one
(``max_window_layers``); Qwen3-MoE's renormalised top-2 of 4 experts, a dense layer (``mlp_only_layers``)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, assert_same_hidden_states_and_attentions, ours_and_theirs, saved_hf_model, tiny_hf_model
from mindformers_py.errors import MindFormersError
from mindformers_py.models.gpt.convert_gpt import config_to_hf
from support.tolerances import SAME_WEIGHTS_ANOTHER_PATH

KINDS = ["qwen3", "qwen3_moe"]
TOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def hf_dir(request, tmp_path_factory):
    return saved_hf_model(request.param, tmp_path_factory)


_pair = ours_and_theirs


def _batch():
    ids = torch.randint(3, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    return ids, mask


def test_config_carries_the_architecture(hf_dir):
    ours, hf = _pair(hf_dir)
    attention = ours.model.layers[0].self_attn
    assert ours.config.qk_norm and attention.q_norm.weight.shape == attention.k_norm.weight.shape == (16,)
    assert ours.config.head_dim == 16 != ours.config.hidden_size // ours.config.num_attention_heads
    if hf_dir[0] == "qwen3":
        assert attention.o_proj.bias is not None  # Qwen3's attention_bias covers the output projection
        assert ours.config.attention_kinds() == ["full_attention", "sliding_attention"] and ours.config.sliding_window == 5
        assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [None, 5]
    else:
        moe = ours.config.moe
        assert ours.config.moe_layers() == [0, 2] and moe.shared_expert_num == 0 and moe.norm_topk_prob
        assert moe.expert_num == 4 and moe.num_experts_chosen == 2 and moe.expert_size(ours.config.intermediate_size) == 24


def test_logits_match_hf_to_1e5(hf_dir):
    ours, hf = _pair(hf_dir)
    ids, mask = _batch()
    with torch.no_grad():
        full = (ours(ids).logits - hf(ids).logits).abs().max().item()
        padded = (ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits)[mask.bool()]
    assert full <= TOL and padded.abs().max().item() <= TOL, (full, padded.abs().max().item())


def test_loss_router_outputs_and_gradients_match_hf(hf_dir):
    """Through the loss (with the load-balancing loss for Qwen3-MoE): q/k norms, attention, router and experts."""
    kind = hf_dir[0]
    ours, hf = _pair(hf_dir)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100  # predicted from a padding position, whose logits are nobody's business
    extra = {"output_router_logits": True} if kind == "qwen3_moe" else {}
    a = ours(ids, attention_mask=mask, labels=labels, **extra)
    b = hf(ids, attention_mask=mask, labels=labels, **extra)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    if extra:
        assert abs(a.aux_loss.item() - b.aux_loss.item()) <= TOL
        assert len(a.router_logits) == len(b.router_logits) == 2
        for x, y in zip(a.router_logits, b.router_logits):
            assert (x - y)[mask.flatten().bool()].abs().max().item() <= TOL
    a.loss.backward()
    b.loss.backward()
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    names = ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"]
    if kind == "qwen3_moe":
        experts = "model.layers.0.mlp.experts."
        theirs[experts + "gate_proj"], theirs[experts + "up_proj"] = theirs[experts + "gate_up_proj"].chunk(2, dim=1)
        names += ["model.layers.0.mlp.gate.weight", experts + "gate_proj", experts + "up_proj", experts + "down_proj",
                  "model.layers.1.mlp.up_proj.weight"]
    for name in names:
        mine, ref = ours.get_parameter(name).grad, theirs[name]
        assert (mine - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name


def test_greedy_generation_token_identical_past_the_window(hf_dir):
    ours, hf = _pair(hf_dir)
    ids, mask = _batch()
    ids = ids.masked_fill(mask == 0, 0)
    # a static cache: transformers builds one mask per attention kind (compiling the decode step is tested apart)
    for extra in ({}, {"cache_implementation": "static", "disable_compile": True}):
        kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
        assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw)), extra


def test_hidden_states_and_attentions_as_transformers(hf_dir):
    ours, hf = _pair(hf_dir)
    assert_same_hidden_states_and_attentions(ours, hf, _batch()[0], TOL)


def test_round_trip_is_exact(hf_dir, tmp_path):
    """HF -> ours -> HF: every tensor equal, under transformers' own names and per-expert layout, and the same
    config.json (the architecture's fields; transformers' general defaults aside)."""
    kind, hf, path = hf_dir
    mf.convert_checkpoint(path, tmp_path / "ours", to="mindformers")
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    before = safetensors.torch.load_file(path / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    written, read = (json.loads((folder / "config.json").read_text()) for folder in (path, tmp_path / "back"))
    differ = {k for k in written.keys() | read.keys() if written.get(k) != read.get(k)} - {"add_cross_attention"}
    assert not differ, {k: (written.get(k), read.get(k)) for k in differ}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids, _ = _batch()
    with torch.no_grad():  # the same weights, mapped from another file: equal up to the kernels' summation order
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, **SAME_WEIGHTS_ANOTHER_PATH)


def test_stacked_experts_checkpoint_loads(tmp_path):
    """transformers 5's own in-memory layout (``save_original_format=False``: gate_up_proj stacked)."""
    hf = tiny_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert any(k.endswith("experts.gate_up_proj") for k in safetensors.torch.load_file(tmp_path / "model.safetensors"))
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, _ = _batch()
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= TOL


def test_decoder_sparse_step_and_sliding_window_of_qwen3_moe(tmp_path):
    """Every second layer routed (``decoder_sparse_step=2``) and every layer sliding (Qwen3-MoE has no
    ``layer_types``), as transformers builds them; exported back with the same fields."""
    hf = tiny_hf_model("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[], use_sliding_window=True,
                       sliding_window=4)
    ours = mf.GPTForCausalLM(hf.config).eval()
    ours.load_state_dict(mf.models.gpt.convert_gpt.state_dict_from_hf(hf.state_dict(), ours.config))
    assert ours.config.moe_layers() == [1] and ours.config.attention_kinds() == ["sliding_attention"] * 3
    ids, mask = _batch()
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= TOL
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))
    back = config_to_hf(ours.config)
    assert (back.decoder_sparse_step, back.mlp_only_layers, back.sliding_window) == (2, [], 4)


def test_exports_qwen3_cannot_represent_are_refused():
    base = dict(flavour="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                qk_norm=True)
    shared = mf.GPTConfig(**base, hf_architecture="qwen3_moe", moe_config={
        "expert_num": 4, "routing_policy": "dropless", "shared_expert_num": 1})
    with pytest.raises(MindFormersError, match="qwen3_moe: it needs moe_config.shared_expert_num=0"):
        config_to_hf(shared)
    with pytest.raises(MindFormersError, match="llama: it needs qk_norm=False"):
        config_to_hf(mf.GPTConfig(**base, hf_architecture="llama"))
    plain = mf.GPTConfig(**{**base, "qk_norm": False}, hf_architecture="qwen3")
    with pytest.raises(MindFormersError, match="qwen3: it needs qk_norm=True"):
        config_to_hf(plain)
    assert config_to_hf(mf.GPTConfig(**base)).model_type == "qwen3"  # chosen by its features
    assert config_to_hf(mf.GPTConfig(**base, moe_config={"expert_num": 4, "routing_policy": "dropless"})
                        ).model_type == "qwen3_moe"
