"""DeepSeek-V3 checkpoints made with transformers' own ``DeepseekV3Config`` load into GPTForCausalLM (multi-head
latent attention, ``attention_type="mla"``) with transformers' logits to 1e-5 in fp32, its loss and gradients,
identical greedy tokens through the compressed cache (the latent and the shared rotary key only, the up-projection
absorbed into the decode steps), and export back exactly: every tensor equal, the same ``config.json``.

The tiny checkpoints (tests/support/hf_models.py) carry what sets the architecture apart: a query latent, interleaved rotary
pairs, YaRN with its mscale in the softmax scale, head sizes that differ for q/k and v; the MoE one (4 layers, the
first dense, 8 routed experts in 4 groups beside a shared expert, a non-zero ``e_score_correction_bias``) routes
with the ``deepseek_v3`` router (``MoEConfig.router_type``)."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, assert_same_hidden_states_and_attentions, tiny_deepseek_v3_config
from mindformers_py.layers.latent_attention import LatentAttention
from mindformers_py.models.gpt.convert_gpt import config_to_hf
from support.tolerances import SAME_WEIGHTS_ANOTHER_PATH

TOL = 1e-5


def _tiny_deepseek(moe: bool, **overrides):
    """A seeded tiny transformers DeepSeek-V3 with every norm and the experts' selection bias randomised (a default
    init leaves them at 1 and 0, which would hide mapping mistakes)."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(moe, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, tmp_path_factory):
    hf = _tiny_deepseek(request.param == "moe")
    path = tmp_path_factory.mktemp(f"deepseek_v3_{request.param}")
    hf.save_pretrained(path)
    return request.param, hf, path


def _pair(saved):
    _, hf, path = saved
    ours = mf.AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(ours, mf.GPTForCausalLM) and ours.config.hf_architecture == "deepseek_v3"
    return ours, hf


def _batch(length: int = 20):
    ids = torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    return ids, mask


def test_config_carries_the_architecture(saved):
    kind, _, _ = saved
    ours, _ = _pair(saved)
    config, attention = ours.config, ours.model.layers[0].self_attn
    assert isinstance(attention, LatentAttention) and config.attention_type == "mla"
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim, config.rope_interleave) == (24, 16, 8, 4, 12, True)
    assert config.head_dim == 4  # the rotary width, as transformers sets it
    assert not hasattr(attention, "k_proj") and attention.q_b_proj.weight.shape == (4 * 12, 24)
    if kind == "dense":
        assert config.moe is None
    else:
        moe = config.moe
        assert config.moe_layers() == [1, 2, 3] and moe.router_type == "deepseek_v3"
        assert (moe.expert_num, moe.num_experts_chosen, moe.n_group, moe.topk_group, moe.shared_expert_num) == (8, 2, 4, 2, 1)
        assert moe.routed_scaling_factor == 2.5 and moe.expert_size(config.intermediate_size) == 16


def test_logits_match_hf_to_1e5(saved):
    ours, hf = _pair(saved)
    ids, mask = _batch()
    with torch.no_grad():
        full = (ours(ids).logits - hf(ids).logits).abs().max().item()
        padded = (ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits)[mask.bool()]
    assert full <= TOL and padded.abs().max().item() <= TOL, (full, padded.abs().max().item())


def test_loss_and_gradients_match_hf(saved):
    """Through the loss: every projection of latent attention (the rotary key's share of kv_a_proj_with_mqa
    included), the latent norms and, in the MoE model, the router and the experts."""
    kind, _, _ = saved
    ours, hf = _pair(saved)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100
    a, b = ours(ids, attention_mask=mask, labels=labels), hf(ids, attention_mask=mask, labels=labels)
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    a.loss.backward()
    b.loss.backward()
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    attn = "model.layers.1.self_attn."
    names = [attn + n + ".weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                            "kv_a_layernorm", "kv_b_proj", "o_proj")] + ["lm_head.weight"]
    names.append("model.layers.0.mlp.up_proj.weight")
    if kind == "moe":
        experts = "model.layers.1.mlp.experts."
        theirs[experts + "gate_proj"], theirs[experts + "up_proj"] = theirs[experts + "gate_up_proj"].chunk(2, dim=1)
        theirs["model.layers.1.mlp.shared_expert.up_proj.weight"] = theirs["model.layers.1.mlp.shared_experts.up_proj.weight"]
        names += ["model.layers.1.mlp.gate.weight", experts + "gate_proj", experts + "down_proj",
                  "model.layers.1.mlp.shared_expert.up_proj.weight"]
    for name in names:
        mine, ref = ours.get_parameter(name).grad, theirs[name]
        assert (mine - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item()), name


def test_greedy_generation_token_identical(saved):
    """Through the compressed cache (our lean loop's preallocated cache, transformers' static one, GenerationMixin's
    dynamic one) and without a cache, left-padded."""
    ours, hf = _pair(saved)
    ids, mask = _batch(8)
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = hf.generate(ids, **kw)
    for extra in ({}, {"cache_implementation": "static", "disable_compile": True}, {"use_cache": False},
                  {"num_beams": 1, "return_dict_in_generate": True}):  # the last: GenerationMixin's own loop
        out = ours.generate(ids, **kw, **extra)
        assert torch.equal(getattr(out, "sequences", out), reference), extra


def test_compiled_and_fixed_shape_steps_take_the_latent_cache(saved, monkeypatch):
    """The compiled decode step (dynamo capture only) and the fixed-shape step a CUDA graph would replay (run
    uncaptured on the CPU: the whole preallocated latent cache under a key mask, written at a slot tensor) give
    transformers' tokens, left-padded rows included. (The cache is the attention's: checked on the dense model.)"""
    from transformers import CompileConfig
    from mindformers_py.generation import fast_generate, graphed_step

    if saved[0] != "dense":
        pytest.skip("the latent cache is the attention's, checked on the dense checkpoint")
    ours, hf = _pair(saved)
    ids, mask = _batch(8)
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = hf.generate(ids, **kw)
    compiled = ours.generate(ids, cache_implementation="static", compile_config=CompileConfig(backend="eager"), **kw)
    assert torch.equal(compiled, reference)
    monkeypatch.setattr(fast_generate, "wants_cuda_graph", lambda model, config, device: True)
    built = []
    monkeypatch.setattr(fast_generate, "StaticShapeStep",
                        lambda *args: built.append(graphed_step.StaticShapeStep(*args[:-1], capture=False)) or built[-1])
    fixed = ours.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    assert built and torch.equal(fixed, reference)


def test_decode_steps_attend_on_the_latents(saved, monkeypatch):
    """A decode step absorbs kv_b_proj (it never expands the cache) and gives the logits of a full forward; the
    cache holds kv_lora_rank + qk_rope_head_dim values per token and layer (16 + 4 here; 576 at DeepSeek-V3's
    shape, against 2 x 128 heads x 160 expanded)."""
    ours, _ = _pair(saved)
    ids, _ = _batch(12)
    absorbed = []
    original = LatentAttention._absorbed
    monkeypatch.setattr(LatentAttention, "_absorbed", lambda self, *a: absorbed.append(1) or original(self, *a))
    cache = transformers.DynamicCache()
    with torch.no_grad():
        ours(ids[:, :-1], past_key_values=cache, use_cache=True)
        assert not absorbed  # the prompt is expanded
        step = ours(ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
        full = ours(ids).logits[:, -1]
    assert len(absorbed) == ours.config.num_hidden_layers
    assert (step - full).abs().max().item() <= TOL
    config = ours.config
    for layer in cache.layers:
        assert layer.keys.shape == (3, 1, 12, config.kv_lora_rank) and layer.values.shape == (3, 1, 12, config.qk_rope_head_dim)
    per_token = sum(layer.keys[0, :, 0].nbytes + layer.values[0, :, 0].nbytes for layer in cache.layers)
    assert per_token == config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # fp32 bytes


def test_lora_on_the_latent_projections_decodes_through_the_adapter(saved):
    """LoRA naming MLA's projections (peft ``target_modules``): a decode step with an adapter on ``kv_b_proj``
    expands the latents through it (absorbing the bare weight would leave the adapter out) and gives the full
    forward's logits."""
    import peft

    if saved[0] != "dense":
        pytest.skip("the attention's projections: checked on the dense checkpoint")
    ours, _ = _pair(saved)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    model = peft.get_peft_model(ours, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)).eval()
    wrapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped == set(targets)
    ids, _ = _batch(12)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
        full = model(input_ids=ids).logits[:, -1]
    assert (step - full).abs().max().item() <= TOL
    with model.disable_adapter(), torch.no_grad():
        assert (model(input_ids=ids).logits[:, -1] - full).abs().max().item() > 1e-3  # the adapter counts


def test_hidden_states_and_attentions_as_transformers(saved):
    ours, hf = _pair(saved)
    assert_same_hidden_states_and_attentions(ours, hf, _batch()[0], TOL)


def test_round_trip_is_exact(saved, tmp_path):
    """HF -> ours -> HF: every tensor equal under transformers' names (per-expert tensors, shared_experts, the
    router's weight and e_score_correction_bias), and the same config.json."""
    kind, hf, path = saved
    mf.convert_checkpoint(path, tmp_path / "ours", to="mindformers")
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    before = safetensors.torch.load_file(path / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    if kind == "moe":
        assert before["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    written, read = (json.loads((folder / "config.json").read_text()) for folder in (path, tmp_path / "back"))
    differ = {k for k in written.keys() | read.keys() if written.get(k) != read.get(k)} - {"add_cross_attention"}
    if kind == "dense":  # a model without experts has no router settings to write back: transformers' defaults
        differ -= {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
                   "topk_group", "routed_scaling_factor"}
    assert not differ, {k: (written.get(k), read.get(k)) for k in differ}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, **SAME_WEIGHTS_ANOTHER_PATH)


def test_rotary_over_halves_and_one_query_projection():
    """DeepSeek-V2-Lite's shape (no query latent: one q_proj) with rotary positions over halves
    (rope_interleave=False) and plain RoPE (the default scale)."""
    hf = _tiny_deepseek(False, q_lora_rank=None, rope_interleave=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ours = mf.GPTForCausalLM(hf.config).eval()
    from mindformers_py.models.gpt.convert_gpt import state_dict_from_hf
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), ours.config))
    assert ours.model.layers[0].self_attn.q_proj is not None and ours.config.q_lora_rank is None
    ids, _ = _batch()
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= TOL
    assert config_to_hf(ours.config).q_lora_rank is None


def test_selective_recompute_of_the_latent_attention_core():
    """recompute.select_recompute=['attention_core'] checkpoints latent attention's core too: same loss and
    gradients as without."""
    import copy

    from mindformers_py.parallel import RecomputeConfig
    from mindformers_py.parallel.recompute import apply_recompute

    plain = _tiny_deepseek(False)
    ours = mf.GPTForCausalLM(plain.config).train()
    from mindformers_py.models.gpt.convert_gpt import state_dict_from_hf
    ours.load_state_dict(state_dict_from_hf(plain.state_dict(), ours.config))
    recomputed = apply_recompute(copy.deepcopy(ours), RecomputeConfig(recompute="selective",
                                                                      select_recompute=["attention_core"]))
    assert all("core" in vars(layer.self_attn) for layer in recomputed.model.layers)
    ids, _ = _batch()
    for model in (ours, recomputed):
        model(ids, labels=ids).loss.backward()
    for (name, a), b in zip(ours.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_init_weights_resets_the_router_state():
    """What transformers' common tests ask of a model built on the meta device: ``_init_weights`` gives every
    buffer a value, the router's selection bias included (zeros, as transformers initialises it)."""
    ours = mf.GPTForCausalLM(tiny_deepseek_v3_config(True))
    router = ours.model.layers[1].mlp.gate
    buffers = dict(router.named_buffers(recurse=False))
    assert "e_score_correction_bias" in buffers
    with torch.no_grad():
        for buffer in buffers.values():
            buffer.fill_(7)
    ours._init_weights(router)
    assert all(not buffer.any() for buffer in router.buffers(recurse=False))


def test_multi_token_prediction_layer_count_round_trips():
    from mindformers_py.models.gpt.convert_gpt import config_from_hf

    for count in (0, 2):
        hf = tiny_deepseek_v3_config(False, num_mtp_layers=count)
        ours = config_from_hf(hf.to_dict())
        assert ours.num_nextn_predict_layers == count and config_to_hf(ours).num_mtp_layers == count


def test_bad_latent_sizes_are_refused():
    with pytest.raises(mf.errors.ConfigError, match="kv_lora_rank=None is not valid with attention_type='mla'"):
        mf.GPTConfig(flavour="llama", attention_type="mla", qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(mf.errors.ConfigError, match="attention_type='gqa' is not valid"):
        mf.GPTConfig(flavour="llama", attention_type="gqa")
    with pytest.raises(mf.errors.ConfigError, match="head_dim=16 is not valid with attention_type='mla'"):
        mf.GPTConfig(flavour="llama", attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                     v_head_dim=8, head_dim=16)


def test_tiny_preset_builds_and_exports_as_deepseek_v3():
    ours = mf.AutoModelForCausalLM.from_pretrained("deepseek_v3_tiny")
    assert isinstance(ours.model.layers[0].self_attn, LatentAttention) and ours.config.moe_layers() == [1, 2, 3]
    hf = config_to_hf(ours.config)
    assert isinstance(hf, transformers.DeepseekV3Config) and hf.first_k_dense_replace == 1 and hf.n_group == 4
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf)
    assert ours.num_parameters() == theirs.num_parameters()
