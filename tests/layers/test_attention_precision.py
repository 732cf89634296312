"""Under bf16 autocast on the CPU the attention core takes the faster of two paths: for short sequences the
explicit softmax(q kᵀ) v in bf16 (as transformers' eager attention under autocast), for long ones SDPA in fp32
(torch's bf16 CPU kernels are slower), handing bf16 back. Both must agree with fp32 attention of the bf16 inputs to
bf16 precision for boolean, additive and causal masks, the long path exactly (fp32 SDPA rounded once), and
gradients must reach the inputs in their own dtype."""

import pytest
import torch
import torch.nn.functional as F

from mindformers_py.layers.attention import _EXPLICIT_MAX_SCORES, attention_core


def _inputs(length: int, mask_kind: str, heads: int = 4):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    mask = {"none": None, "bool": torch.rand(2, 1, length, length, generator=g) > 0.3,
            "additive": torch.randn(1, heads, length, length, generator=g)}[mask_kind]
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_short_sequences_match_fp32_attention_to_bf16_precision(mask_kind):
    q, k, v, mask = _inputs(10, mask_kind)
    causal = mask is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_core(q, k, v, mask, is_causal=causal)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0.03, rtol=0.02)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


@pytest.mark.parametrize("mask_kind", ["none", "additive"])
def test_long_sequences_are_fp32_sdpa_rounded_once(mask_kind):
    length = int(_EXPLICIT_MAX_SCORES ** 0.5) + 8
    q, k, v, mask = _inputs(length, mask_kind, heads=1)
    causal = mask is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_core(q, k, v, mask, is_causal=causal)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())
