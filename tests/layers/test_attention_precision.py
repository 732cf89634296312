"""Under bf16 autocast on the CPU the attention core runs SDPA in fp32 (torch's bf16 CPU kernels are slower there)
and hands bf16 back: the result is fp32 SDPA of the bf16 inputs, rounded once, for boolean, additive and causal
masks, and gradients reach the inputs in their own dtype."""

import pytest
import torch
import torch.nn.functional as F

from mindformers_py.layers.attention import attention_core


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_cpu_bf16_autocast_attention_is_fp32_sdpa_rounded_once(mask_kind):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    mask = {"none": None, "bool": torch.rand(2, 1, 10, 10, generator=g) > 0.3,
            "additive": torch.randn(1, 4, 10, 10, generator=g)}[mask_kind]
    causal = mask is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_core(q, k, v, mask, is_causal=causal)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
