"""The CPU dropout of :mod:`mindformers_py.layers.dropout` draws its own mask: it must keep the distribution of
``torch.nn.functional.dropout`` (keep probability, the scale of kept values, the expectation), give the gradient of
the mask it applied, follow torch's seed, and leave eval mode and p = 0 alone. Attention dropout (which now takes the
explicit path on the CPU) must still average to the attention without dropout."""

import pytest
import torch
import torch.nn.functional as F

from mindformers_py.layers.attention import attention_core
from mindformers_py.layers.dropout import Dropout, dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_probability_scale_and_expectation_match_torch(dtype, p):
    torch.manual_seed(0)
    x = torch.ones(1_000_001, dtype=dtype)  # odd: the last 32-bit draw is used for one number
    ours, theirs = dropout(x, p), F.dropout(x, p, True)
    assert ours.dtype == dtype and ours.shape == x.shape
    kept = ours != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.002
    # kept values carry one scale, torch's up to the 1/32768 rounding of the keep probability (in bf16: the same)
    scale, torch_scale = ours[kept].unique(), theirs[theirs != 0].unique()
    assert scale.numel() == 1
    torch.testing.assert_close(scale, torch_scale, rtol=2e-5, atol=0)
    assert abs(ours.float().mean().item() - theirs.float().mean().item()) < 0.004


def test_gradient_is_the_applied_mask_and_the_seed_reproduces_it():
    x = torch.randn(3, 7, 11, requires_grad=True)
    torch.manual_seed(1)
    y = dropout(x, 0.3)
    grad = torch.randn_like(y)
    y.backward(grad)
    kept = y != 0
    ratio = (y[kept] / x[kept]).detach()
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1 / 0.7), rtol=1e-4, atol=0)
    torch.testing.assert_close(x.grad, torch.where(kept, grad / 0.7, 0.0), rtol=1e-4, atol=1e-6)
    torch.manual_seed(1)
    assert torch.equal(dropout(x, 0.3), y)
    assert not torch.equal(dropout(x, 0.3), y)  # the generator moved on


def test_eval_mode_and_zero_probability_are_the_identity():
    x = torch.randn(4, 5)
    assert dropout(x, 0.0) is x and dropout(x, 0.5, training=False) is x
    module = Dropout(0.5).eval()
    assert module(x) is x and isinstance(module, torch.nn.Dropout) and module.p == 0.5
    with pytest.raises(ValueError):
        dropout(x, 1.5)  # torch's own check of p


def test_probability_next_to_one_drops_almost_everything():
    """p within 1/65536 of 1 rounds to 'keep nothing' at 15 bits: torch's dropout takes it (no division by zero)."""
    x = torch.ones(100_000)
    assert torch.count_nonzero(dropout(x, 0.99999)).item() < 20


def test_attention_dropout_averages_to_attention_without_dropout():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    plain, _ = attention_core(q, k, v, None, is_causal=True)
    torch.manual_seed(0)
    draws = torch.stack([attention_core(q, k, v, None, is_causal=True, dropout=0.5)[0] for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), plain, atol=0.06, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention_core(q.bfloat16().requires_grad_(), k.bfloat16(), v.bfloat16(), None, True, 0.1)
    assert out.dtype == torch.bfloat16 and out.requires_grad
