"""Packed documents as metadata: the block-sparse path equals the dense-mask path (forward and backward, grouped
heads, rows of their own or one row of positions for the batch, lengths that are not a multiple of the tile), its
block mask is a correct FlexAttention BlockMask (FlexAttention's own forward on it gives the same output), the
metadata is O(T) (4 x 8,192 tokens in under 1 MiB, where the dense mask is 256 MiB), and a packed row's forward and
backward through GPT (GPT-2 flavour) and GPT-MoE (Qwen3-MoE's shape: Llama flavour with per-head q/k norms, a dense layer then an MoE one) equal each document
run alone (<= 1e-6, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindformers_py as mf
from mindformers_py.layers.attention import attention_core
from mindformers_py.layers.document_mask import DocumentMask
from mindformers_py.layers.masks import build_attention_mask


def positions(*lengths: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def test_the_three_ways_of_giving_documents_agree_and_the_dense_mask_is_transformers_rule():
    pos = positions(3, 130, 1, 126)[None]
    by_positions = DocumentMask.from_position_ids(pos)
    by_cu = DocumentMask.from_cu_seqlens(torch.tensor([0, 3, 133, 134, 260]))
    by_ids = DocumentMask.from_document_ids(torch.repeat_interleave(torch.tensor([7, 2, 9, 4]),
                                                                    torch.tensor([3, 130, 1, 126]))[None])
    assert torch.equal(by_positions.documents, by_cu.documents) and torch.equal(by_cu.documents, by_ids.documents)
    dense = by_positions.dense()
    docs = by_positions.documents[0]
    expected = torch.ones(260, 260, dtype=torch.bool).tril() & (docs[:, None] == docs[None, :])
    assert torch.equal(dense[0, 0], expected)
    built = build_attention_mask(None, query_length=260, kv_length=260, position_ids=pos)
    assert isinstance(built, DocumentMask) and torch.equal(built.dense(), dense)
    # what still needs the matrix gets it: padding, a sliding window
    assert not isinstance(build_attention_mask(torch.ones(1, 260), query_length=260, kv_length=260, position_ids=pos),
                          DocumentMask)
    assert isinstance(build_attention_mask(None, query_length=260, kv_length=260, position_ids=pos, sliding_window=8),
                      torch.Tensor)


@pytest.mark.parametrize("rows", [[(40, 200, 5, 155), (400,)], [(130, 270)]], ids=["own rows", "shared row"])
def test_block_path_equals_dense_path_forward_and_backward(rows):
    mask = DocumentMask.from_position_ids(torch.stack([positions(*r) for r in rows]))
    batch = 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, 400, 16, generator=g, requires_grad=True)
    k = torch.randn(batch, 2, 400, 16, generator=g, requires_grad=True)  # grouped-query heads
    v = torch.randn(batch, 2, 400, 16, generator=g, requires_grad=True)
    out, _ = attention_core(q, k, v, mask, False)
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                               attn_mask=mask.dense())
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-6)
    # returned weights or dropout take the dense fallback, with the same mask
    _, weights = attention_core(q, k, v, mask, False, return_weights=True)
    assert torch.equal(weights[:, 0] == 0, ~mask.dense().expand(batch, -1, -1, -1)[:, 0])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_block_mask_is_flex_attentions_and_small():
    from torch.nn.attention.flex_attention import flex_attention

    mask = DocumentMask.from_position_ids(positions(100, 200, 5, 51)[None])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 356, 16, generator=g) for _ in range(3))
    with torch.no_grad():  # FlexAttention's CPU kernel (unfused outside torch.compile) runs forward only
        flex = flex_attention(q, k, v, block_mask=mask.block_mask)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(mask.attend(q, k, v), dense, rtol=0, atol=1e-6)
    big = DocumentMask.from_position_ids(torch.stack([positions(*[512] * 16)] * 4))  # 4 x 8,192 tokens
    assert big.nbytes < 2**20
    assert big.block_mask.kv_num_blocks.sum() + big.block_mask.full_kv_num_blocks.sum() == 4 * 16 * (4 * 5 // 2)


MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "moe_intermediate_size": 16,
       "aux_loss_factor": 0.0, "mlp_only_layers": [0]}
"""Dropless top-k routing, token by token, without router losses: those are normalised over a forward's routed
tokens (transformers' definition), so a row's and its documents' differ by their definition, not by attention.
Layer 0 keeps a dense (SwiGLU) MLP: one Qwen3-shaped model covers the dense layer and GPT-MoE's expert layer."""


@pytest.mark.parametrize("family", ["gpt2", "qwen3_moe"])
def test_a_packed_row_equals_its_documents_run_alone(family):
    torch.manual_seed(0)
    extra = {"moe_config": MOE, "qk_norm": True} if family == "qwen3_moe" else {}
    config = mf.GPTConfig(flavour="gpt2" if family == "gpt2" else "llama", vocab_size=64, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=None if family == "gpt2" else 2, max_position_embeddings=256, **extra)
    model = mf.GPTForCausalLM(config)
    lengths = [60, 140, 3, 53]
    ids = torch.randint(1, 64, (1, sum(lengths)))
    labels = ids.masked_fill(positions(*lengths)[None] == 0, -100)
    items = int((labels[:, 1:] != -100).sum())
    packed = model(input_ids=ids, position_ids=positions(*lengths)[None], labels=labels, num_items_in_batch=items)
    packed_grads = torch.autograd.grad(packed.loss, list(model.parameters()))
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    alone = [model(input_ids=ids[:, s:e], labels=labels[:, s:e], num_items_in_batch=items)
             for s, e in zip(starts, starts[1:])]
    logits = torch.cat([out.logits for out in alone], dim=1)
    torch.testing.assert_close(packed.logits, logits, rtol=0, atol=1e-6)
    loss = sum(out.loss for out in alone)
    torch.testing.assert_close(packed.loss, loss, rtol=0, atol=1e-6)
    for ours, theirs in zip(packed_grads, torch.autograd.grad(loss, list(model.parameters()))):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
