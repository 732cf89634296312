"""Fresh models start from the initialisation their architecture prescribes, role by role.

transformers 5 initialises models defined outside its package leaf by leaf, skipping modules without parameters of
their own (an attention, a block): an init written for such a parent silently never runs. These tests compare the
spread of every weight with what the architecture prescribes (T5: transformers' own model of the same config), and
check that transformers' loader keeps a checkpoint's weights rather than re-initialising them.
"""

import math

import pytest
import torch
import transformers

import mindformers_py as mf

# transformers' T5 names -> ours (the last part of the name)
T5_ROLES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "wi": "up_proj", "wo": "down_proj",
            "relative_attention_bias": "relative_attention_bias", "shared": "shared"}


def _spread_by_role(model: torch.nn.Module, roles: dict[str, str] | None = None) -> dict[str, float]:
    """Pooled standard deviation of the weights of each role (the module's last name part)."""
    chunks: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        role = parts[-2] if parts[-1] == "weight" else parts[-1]
        role = roles.get(role, None) if roles is not None else role
        if role is not None:
            chunks.setdefault(role, []).append(param.detach().flatten())
    return {role: torch.cat(ts).std().item() for role, ts in chunks.items()}


def test_t5_weights_spread_as_transformers_t5():
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4))
    ours = mf.T5ForConditionalGeneration(mf.T5Config(
        vocab_size=512, hidden_size=128, head_dim=32, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4))
    expected, got = _spread_by_role(hf, T5_ROLES), _spread_by_role(ours)
    assert set(expected) <= set(got)
    for role, std in expected.items():
        assert got[role] == pytest.approx(std, rel=0.15), role
    # the prescribed values themselves: q ~ (d_model * d_kv)^-0.5, k/v ~ d_model^-0.5, wo ~ d_ff^-0.5
    assert got["q_proj"] == pytest.approx((128 * 32) ** -0.5, rel=0.1)
    assert got["k_proj"] == pytest.approx(128**-0.5, rel=0.1)
    assert got["down_proj"] == pytest.approx(256**-0.5, rel=0.1)


@pytest.mark.parametrize("preset", ["llama_tiny", "gpt_tiny", "gpt_moe_tiny"])
def test_gpt_residual_outputs_start_smaller(preset):
    """GPT-2 / Megatron: the projections that write into the residual stream (attention output, MLP or experts'
    down projection) start at initializer_range / sqrt(2 * layers); the other matrices at initializer_range."""
    torch.manual_seed(0)
    model = mf.AutoModelForCausalLM.from_pretrained(preset)
    config = model.config
    spread = _spread_by_role(model)
    residual = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    for role in ("o_proj", "down_proj"):
        assert spread[role] == pytest.approx(residual, rel=0.1), role
    for role in ("q_proj", "k_proj", "v_proj", "up_proj"):
        assert spread[role] == pytest.approx(config.initializer_range, rel=0.1), role


@pytest.mark.parametrize("kind", ["t5", "gpt"])
def test_transformers_loader_keeps_checkpoint_weights(kind, tmp_path):
    """transformers' Auto classes on our checkpoint: every weight as saved (no role-based init runs over them)."""
    torch.manual_seed(0)
    if kind == "t5":
        model = mf.T5ForConditionalGeneration(mf.T5Config(vocab_size=128, hidden_size=32, head_dim=8, intermediate_size=64,
                                                          num_hidden_layers=1, num_attention_heads=4))
        auto = transformers.AutoModelForSeq2SeqLM
    else:
        model = mf.AutoModelForCausalLM.from_pretrained("llama_tiny", num_hidden_layers=2, vocab_size=128)
        auto = transformers.AutoModelForCausalLM
    with torch.no_grad():  # weights no init would produce
        for param in model.parameters():
            param.add_(0.5)
    model.save_pretrained(tmp_path)
    loaded = auto.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
