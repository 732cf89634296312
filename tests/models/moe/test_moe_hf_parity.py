"""HF Mixtral and Qwen2-MoE checkpoints load into GPTForCausalLM (GPT-MoE) with transformers' logits, router logits,
load-balancing loss and loss (output_router_logits), the same gradients, identical greedy generation, and export
back to the per-expert checkpoint layout transformers writes."""

import pytest
import safetensors.torch
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, ours_and_theirs, saved_hf_model

KINDS = ["mixtral", "qwen2_moe"]


@pytest.fixture(scope="module", params=KINDS)
def hf_dir(request, tmp_path_factory):
    return saved_hf_model(request.param, tmp_path_factory)


_pair = ours_and_theirs


def test_config_maps_routing_and_experts(hf_dir):
    ours, hf = _pair(hf_dir)
    moe = ours.config.moe
    assert moe.routing_policy == "dropless" and moe.num_experts_chosen == 2 and moe.aux_loss_factor == 0.02
    if hf_dir[0] == "qwen2_moe":
        assert ours.config.moe_layers() == [0, 2] and moe.norm_topk_prob is False
        assert moe.shared_expert_size(ours.config.intermediate_size) == 40 and moe.use_shared_expert_gating
    else:
        assert ours.config.moe_layers() == [0, 1] and moe.norm_topk_prob is True and moe.shared_expert_num == 0


def test_logits_router_logits_and_loss_match_hf(hf_dir):
    """Padded batch: the load-balancing loss skips padding exactly as transformers' (attention mask)."""
    ours, hf = _pair(hf_dir)
    ids = torch.randint(3, VOCAB, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100  # predicted from a padding position, whose logits are nobody's business
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        b = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        plain = ours(ids, attention_mask=mask, labels=labels)
    keep = mask.bool()
    assert (a.logits[keep] - b.logits[keep]).abs().max().item() <= 1e-4
    assert len(a.router_logits) == len(b.router_logits) == len(ours.config.moe_layers())
    for x, y in zip(a.router_logits, b.router_logits):
        assert x.shape == y.shape and (x - y)[keep.flatten()].abs().max().item() <= 1e-4
    assert abs(a.aux_loss.item() - b.aux_loss.item()) <= 1e-5
    assert abs(a.loss.item() - b.loss.item()) <= 1e-5
    # without output_router_logits, as in transformers: no aux_loss, and the loss is the cross-entropy alone
    assert plain.aux_loss is None and abs(plain.loss.item() - (b.loss - 0.02 * b.aux_loss).item()) <= 1e-5


def test_gradients_match_hf(hf_dir):
    """Through the loss with the router loss: router, experts (transformers stacks them in memory, gate rows above
    up rows), attention."""
    ours, hf = _pair(hf_dir)
    ids = torch.randint(3, VOCAB, (2, 12))
    ours(ids, labels=ids, output_router_logits=True).loss.backward()
    hf(ids, labels=ids, output_router_logits=True).loss.backward()
    theirs = {name: p.grad for name, p in hf.named_parameters()}
    experts = "model.layers.0.mlp.experts."
    theirs[experts + "gate_proj"], theirs[experts + "up_proj"] = theirs[experts + "gate_up_proj"].chunk(2, dim=1)
    for name in ("model.layers.0.mlp.gate.weight", experts + "gate_proj", experts + "up_proj", experts + "down_proj",
                 "model.layers.0.self_attn.q_proj.weight"):
        mine = ours.get_parameter(name).grad
        assert (mine - theirs[name]).abs().max().item() <= 1e-5 * max(1.0, theirs[name].abs().max().item()), name


def test_greedy_generation_token_identical(hf_dir):
    ours, hf = _pair(hf_dir)
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


def test_export_to_hf_roundtrip(hf_dir, tmp_path):
    kind, hf, path = hf_dir
    ours_dir = tmp_path / "ours"
    mf.convert_checkpoint(path, ours_dir, to="mindformers")
    back = tmp_path / "back"
    mf.convert_checkpoint(ours_dir, back, to="hf")
    # the per-expert layout transformers itself writes
    assert set(safetensors.torch.load_file(back / "model.safetensors")) == set(safetensors.torch.load_file(path / "model.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        assert (reloaded(ids).logits - hf(ids).logits).abs().max().item() == 0


def test_stacked_checkpoint_loads(hf_dir, tmp_path):
    """Checkpoints saved by transformers 5 without reverting to the original per-expert format."""
    kind, hf, _ = hf_dir
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert any(k.endswith("experts.gate_up_proj") for k in safetensors.torch.load_file(tmp_path / "model.safetensors"))
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_exports_hf_cannot_represent_are_refused(tmp_path):
    from mindformers_py.errors import MindFormersError
    from mindformers_py.models.gpt.convert_gpt import config_to_hf

    base = dict(flavour="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    capped = mf.GPTConfig(**base, moe_config={"expert_num": 4, "num_experts_chosen": 2})
    with pytest.raises(MindFormersError, match="routing_policy='dropless'"):
        config_to_hf(capped)
    dense_layer = mf.GPTConfig(**base, hf_architecture="mixtral",
                               moe_config={"expert_num": 4, "routing_policy": "dropless", "mlp_only_layers": [1]})
    with pytest.raises(MindFormersError, match="mlp_only_layers"):
        config_to_hf(dense_layer)
    ungated = mf.GPTConfig(**base, hf_architecture="qwen2_moe",
                           moe_config={"expert_num": 4, "routing_policy": "dropless", "shared_expert_num": 1})
    with pytest.raises(MindFormersError, match="gated shared expert"):
        config_to_hf(ungated)


def test_hidden_states_attentions_and_tuples_as_transformers(hf_dir):
    ours, hf = _pair(hf_dir)
    ours.set_attn_implementation("eager")
    hf.set_attn_implementation("eager")
    ids = torch.randint(3, VOCAB, (2, 10))
    with torch.no_grad():
        a = ours(ids, output_hidden_states=True, output_attentions=True)
        b = hf(ids, output_hidden_states=True, output_attentions=True)
        assert len(a.hidden_states) == len(b.hidden_states) and len(a.attentions) == len(b.attentions)
        for x, y in zip(a.hidden_states + a.attentions, b.hidden_states + b.attentions):
            assert (x - y).abs().max().item() <= 1e-4
        mine = ours(ids, labels=ids, output_router_logits=True, return_dict=False)
        theirs = hf(ids, labels=ids, output_router_logits=True, return_dict=False)
    # transformers' fields in transformers' order (loss, aux_loss, logits, cache, router logits), ours adding the
    # router statistics last
    assert len(mine) == len(theirs) + 1
    for x, y in zip(mine[:3], theirs[:3]):
        assert (x - y).abs().max().item() <= 1e-4
