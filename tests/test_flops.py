"""``benchmarks/flops.py``: a step's FLOPs are counted from the shapes of its products and fused attention calls (no
torch ``FlopCounterMode``, whose SDPA formula asserts on grouped key/value heads in torch 2.11), equal the Llama
formula ``6NT + 12LHDST`` for our model and transformers' with grouped key/value heads, in fp32 and under bf16
autocast (where our CPU attention takes the explicit path); emulated dtypes have no meaningful peak."""

from pathlib import Path

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.models.gpt.convert_gpt import config_to_hf

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def flops(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import flops as module

    return module


def tiny_llama() -> mf.GPTConfig:
    return mf.GPTConfig(flavour="llama", vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64)


@pytest.mark.parametrize("bf16", [False, True])
def test_counted_step_flops_equal_the_llama_formula_with_grouped_heads(flops, bf16):
    config = tiny_llama()
    torch.manual_seed(0)
    models = {"ours": mf.AutoModelForCausalLM.from_config(config),
              "transformers": transformers.LlamaForCausalLM(config_to_hf(config))}
    ids = torch.randint(0, 200, (3, 16), generator=torch.Generator().manual_seed(0))
    expected = flops.llama_step_flops(config, 3, 16)
    assert expected == flops.llama_step_flops(config_to_hf(config), 3, 16)
    for name, model in models.items():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            assert flops.step_flops(model, {"input_ids": ids, "labels": ids}) == expected, name


def test_fused_attention_is_counted_from_query_heads_in_either_layout(flops):
    q, k, v = torch.empty(2, 8, 5, 16), torch.empty(2, 2, 7, 16), torch.empty(2, 2, 7, 16)  # (B, H, S, D), GQA
    forward = 2 * 2 * 8 * 5 * 7 * (16 + 16)
    assert flops._attention_flops("_scaled_dot_product_flash_attention", (q, k, v)) == forward
    grad = torch.empty_like(q)
    assert flops._attention_flops("_scaled_dot_product_efficient_attention_backward", (grad, q, k, v)) == 2 * forward
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    assert flops._attention_flops("_flash_attention_forward", tuple(bshd)) == forward


def test_counted_attention_does_not_use_torch_flop_counter(flops, monkeypatch):
    import torch.utils.flop_counter as flop_counter

    def refuse(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", refuse)
    q = torch.randn(1, 4, 8, 16, requires_grad=True)
    k = torch.randn(1, 4, 8, 16, requires_grad=True)
    with flops.CountFlops() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True).sum().backward()
    assert counter.by_kind["attention"] == 3 * 2 * 4 * 8 * 8 * 32


@pytest.mark.parametrize("native", [True, False])
def test_a_peak_is_meaningful_only_in_a_native_dtype(flops, monkeypatch, native):
    monkeypatch.setattr(flops, "native_bf16", lambda device: native)
    assert flops.peak_is_meaningful(torch.float32, "cpu")
    assert flops.peak_is_meaningful(torch.bfloat16, "cpu") is native
    assert not flops.peak_is_meaningful(torch.float16, "cpu")
