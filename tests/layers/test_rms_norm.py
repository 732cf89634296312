"""RMSNorm's hand-written backward against transformers' own norms (Llama's and T5's): the same outputs bit for bit,
the same gradients, a differentiable backward for double backward, and less kept for backward."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from mindformers_py.layers.norms import RMSNorm, _RMSNormFunction

CASES = [  # (input dtype, weight dtype, T5's rule)
    (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, False),  # bf16 activations, fp32 weights (a mixed-precision model)
    (torch.float32, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.bfloat16, True),  # T5: a float32 feed-forward output meets a bf16 norm
]


def pair(width, weight_dtype, t5):
    torch.manual_seed(0)
    ours = RMSNorm(width, eps=1e-6, cast_to_weight_dtype=t5)
    theirs = T5LayerNorm(width, eps=1e-6) if t5 else LlamaRMSNorm(width, eps=1e-6)
    ours.weight.data.uniform_(0.5, 1.5)
    theirs.weight.data.copy_(ours.weight.data)
    return ours.to(weight_dtype), theirs.to(weight_dtype)


@pytest.mark.parametrize("dtype,weight_dtype,t5", CASES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 7, 4, 16)])  # hidden states; per-head (Qwen3's q/k norms)
def test_outputs_and_gradients_are_transformers(dtype, weight_dtype, t5, shape):
    ours, theirs = pair(shape[-1], weight_dtype, t5)
    x = torch.randn(shape, dtype=dtype) * 3
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = ours(mine), theirs(ref)
    assert out.grad_fn.name() == "_RMSNormFunctionBackward"
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    grad = torch.randn(shape).to(out.dtype)
    out.backward(grad)
    expected.backward(grad)
    for got, want in ((mine.grad, ref.grad), (ours.weight.grad, theirs.weight.grad)):
        assert got.dtype == want.dtype
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 1e-5 * scale if dtype == torch.float32 == weight_dtype \
            else torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("train_input,train_weight", [(True, False), (False, True)])
def test_only_the_wanted_gradient(train_input, train_weight):
    ours, theirs = pair(32, torch.float32, False)
    ours.weight.requires_grad_(train_weight)
    theirs.weight.requires_grad_(train_weight)
    x = torch.randn(4, 32)
    mine, ref = x.clone().requires_grad_(train_input), x.clone().requires_grad_(train_input)
    ours(mine).square().sum().backward()
    theirs(ref).square().sum().backward()
    assert (mine.grad is None) == (not train_input) and (ours.weight.grad is None) == (not train_weight)
    got, want = (mine.grad, ref.grad) if train_input else (ours.weight.grad, theirs.weight.grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_double_backward_is_transformers():
    """A gradient penalty differentiates the input's gradient again: the backward is itself differentiable."""
    ours, theirs = pair(16, torch.float32, False)
    x = torch.randn(6, 16)
    results = []
    for norm, inp in ((ours, x.clone().requires_grad_()), (theirs, x.clone().requires_grad_())):
        (grad,) = torch.autograd.grad(norm(inp).pow(3).sum(), inp, create_graph=True)
        grad.square().sum().backward()
        results.append((inp.grad, norm.weight.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def kept_bytes(norm, x):
    """Bytes of the distinct tensors autograd keeps for the norm's backward, the input's own storage left out (the
    residual stream a block keeps anyway)."""
    kept = {}

    own = {x.untyped_storage().data_ptr(), norm.weight.untyped_storage().data_ptr()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_only_the_row_statistics(dtype):
    ours, theirs = pair(256, dtype, False)
    x = torch.randn(8, 128, 256, dtype=dtype, requires_grad=True)
    assert kept_bytes(ours, x) == 8 * 128 * 4  # one float32 inverse RMS per row
    # transformers' keeps the normalised rows (and in bf16 their float32 copy too): 256x as much and more
    assert kept_bytes(theirs, x) >= 8 * 128 * 256 * dtype.itemsize


def test_reference_ops_where_no_backward_runs_or_under_compile_tracing():
    ours, _ = pair(32, torch.float32, False)
    x = torch.randn(2, 32, requires_grad=True)
    with torch.no_grad():
        assert ours(x).grad_fn is None
    assert ours(x.detach()).grad_fn is not None  # the weight trains
    ours.weight.requires_grad_(False)
    assert ours(x.detach()).grad_fn is None
    assert issubclass(_RMSNormFunction, torch.autograd.Function)
