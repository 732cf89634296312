"""Grouped key/value heads are not repeated to the query heads where that can be avoided: training saves no repeated
keys/values for backward (the same bytes as transformers' Llama, which lets SDPA take the groups), a decode step
attends with each key/value head's query heads as rows, and both give the repeated-heads result."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.layers.attention import attention_core
from mindformers_py.models.gpt.convert_gpt import config_to_hf, state_dict_to_hf

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def repeated(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask", [None, "padded"])
def test_a_decode_step_attends_grouped_heads_as_rows(mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 8, 1, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    if mask == "padded":
        mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
        mask[0, ..., :4] = False
    y, _ = attention_core(q, k, v, mask, is_causal=False)
    torch.testing.assert_close(y, repeated(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_training_attention_takes_the_groups_as_they_are():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 12, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 12, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 12, 16, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, _ = attention_core(q, k, v, None, is_causal=True)
    pointers = {t.data_ptr() for t in saved}
    assert k.data_ptr() in pointers and v.data_ptr() in pointers  # the grouped keys/values themselves
    query_sized = {t.data_ptr() for t in saved if tuple(t.shape) == (2, 8, 12, 16)}
    assert query_sized <= {q.data_ptr(), y.data_ptr()}  # no keys/values repeated to the 8 query heads
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                                is_causal=True)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_saved_for_backward_bytes_equal_transformers_llama_with_grouped_heads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from saved_activations import measure

    config = mf.GPTConfig(flavour="llama", vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    ours = mf.AutoModelForCausalLM.from_config(config)
    theirs = transformers.LlamaForCausalLM(config_to_hf(config))
    theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), config), strict=False)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    mine, reference = measure(ours, batch, bf16=False), measure(theirs, batch, bf16=False)
    assert mine["attention core"] == reference["attention core"]
    assert sum(mine.values()) <= sum(reference.values())
    sys.modules.pop("saved_activations", None)
