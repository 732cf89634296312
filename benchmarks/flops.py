"""The two numbers a share-of-peak (MFU) needs, measured or counted here rather than taken on trust.

:func:`matmul_peak` is the device's dense matrix-product rate in a dtype: the best of a few large square products
(the shapes BLAS, oneDNN and cuBLAS reach their best on), with the thread count the caller uses, within a time
budget that holds on slow dtypes too: a product that alone takes longer than its share of the budget is timed once
and the larger sizes are skipped. :func:`peak_is_meaningful` says where a peak means something: a dtype the device
only emulates (bf16 on a CPU without AVX-512 BF16 / AMX, where oneDNN converts to fp32: ~3 s for one 1024² product
on a 2-core AVX2 EPYC) has no peak worth a share; callers skip it there.

:func:`step_flops` counts the floating-point operations of one training step (forward and backward) as executed:
every dense matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions) from its operand shapes, and
every fused attention call (any ``scaled_dot_product`` / flash / efficient kernel, forward or backward) analytically
from its query and key shapes: ``4·B·H_q·S_q·S_k·D`` forward (QKᵀ and the product with V, taking the query heads,
so grouped key/value heads count right on any torch version), twice that backward, and the full ``S_q × S_k`` even
when causal (the PaLM / Megatron MFU convention; an unfused causal attention computes the full product too).
torch's own ``FlopCounterMode`` is not used: its SDPA formula asserts on transformers' grouped-query calls in torch
2.11 ("sdpa_flop_count: query/key/value shapes are incompatible"), which crashed the first GPU run.

:func:`llama_step_flops` is the same count from a Llama-shaped config alone (``6·N·T`` for the N weights of the
matrix products, output head included, plus ``12·L·H_q·D·S·T`` for attention): what :func:`step_flops` counts for
such a model, without running it (a 1B model's step on a GPU needs no extra pass to be counted).

:func:`products_alone_rate` answers how close to the peak a step *could* get: it records the matrix products of one
forward + backward (their shapes, strides and dtypes, as executed under autocast) and replays only them. Small
models multiply small matrices, which run far below the large-square peak; the replayed rate is the ceiling of a
step's share of the peak even if all other work (norms, activations, softmax, dropout, the optimizer) took no time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mindformers_py.engine.precision import native_bf16


def peak_is_meaningful(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether ``device`` computes ``dtype`` products natively (fp32 always; bf16 where
    :func:`~mindformers_py.engine.precision.native_bf16` says so; fp16 on CUDA only)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return native_bf16(device)
    return dtype == torch.float16 and torch.device(device).type == "cuda"


def matmul_peak(dtype: torch.dtype, device: str = "cpu", sizes: tuple[int, ...] | None = None,
                budget_s: float = 3.0) -> float:
    """Best measured FLOP/s of ``n x n @ n x n`` products in ``dtype`` on ``device``, within about ``budget_s``
    seconds in all (plus at most one product's time).

    ``sizes`` defaults to 8192 on CUDA (where smaller squares do not fill an H100) and (1024, 2048, 3072) on the
    CPU. Each size gets an equal share of the budget: one product warms the kernels up; when that one alone took
    longer than the share (an emulated dtype, a slow machine) its rate is kept and the larger sizes are skipped,
    else products are timed until the share is spent and the best third of it counts."""
    if sizes is None:
        sizes = (8192,) if torch.device(device).type == "cuda" else (1024, 2048, 3072)
    share = budget_s / len(sizes)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        start = _now(device)
        a @ b  # warms the kernels up (and is the only product when it is this slow)
        first = _now(device) - start
        if first >= share:
            best = max(best, 2 * n**3 / first)
            break
        deadline = _now(device) + share - first
        while _now(device) < deadline:
            calls, start = 0, _now(device)
            while calls < 200:
                a @ b
                calls += 1
                if _now(device) - start >= share / 3:
                    break
            best = max(best, 2 * n**3 * calls / (_now(device) - start))
    return best


def _now(device: str) -> float:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


# -- counting the FLOPs of a step -----------------------------------------------------------------------------------

_PRODUCTS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2),
             torch.ops.aten.bmm.default: (0, 1), torch.ops.aten.baddbmm.default: (1, 2)}
# Fused attention kernels whose operands are (B, S, H, D); the ``_scaled_dot_product_*`` ones take (B, H, S, D).
_BSHD_ATTENTION = ("_flash_attention_", "_efficient_attention_")


def _is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or name.startswith(_BSHD_ATTENTION)


def _attention_flops(name: str, args: tuple) -> int:
    """FLOPs of one fused attention call from its query (B.., H_q, S_q, D) and key/value (B.., H_kv, S_k, D)
    operands: QKᵀ and the product with V over the query heads, full S_q x S_k; a backward call (whose first
    operand is the output's gradient) counts twice its forward."""
    backward = name.endswith("backward")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    q, k, v = tensors[1:4] if backward else tensors[0:3]
    if name.startswith(_BSHD_ATTENTION):
        q, k, v = (t.transpose(-2, -3) for t in (q, k, v))
    rows = math.prod(q.shape[:-2])  # batch x query heads
    forward = 2 * rows * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return 2 * forward if backward else forward


class CountFlops(TorchDispatchMode):
    """Counts the FLOPs of dense matrix products, convolutions and fused attention executed under it (see the
    module docstring); ``total`` is the sum, ``by_kind`` the parts (``matmul``, ``attention``, ``conv``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind = {"matmul": 0, "attention": 0, "conv": 0}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func in _PRODUCTS:
            a, b = (args[i] for i in _PRODUCTS[func])
            self.by_kind["matmul"] += 2 * a.numel() * b.shape[-1]
        elif _is_attention(name):
            self.by_kind["attention"] += _attention_flops(name, args)
        elif name == "convolution":  # (input, weight, ...) -> output
            self.by_kind["conv"] += 2 * out.numel() * math.prod(args[1].shape[1:])
        elif name == "convolution_backward":  # (grad_output, input, weight, ...): input and weight gradients
            self.by_kind["conv"] += 4 * args[0].numel() * math.prod(args[2].shape[1:])
        return out


def step_flops(model: torch.nn.Module, batch: Mapping[str, Any]) -> int:
    """FLOPs of one forward + backward of ``model`` on ``batch`` (its ``.loss``) as :class:`CountFlops` counts
    them; the gradients it makes are dropped."""
    was_training = model.training
    model.train()
    with CountFlops() as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return counter.total


def llama_step_flops(config: Any, batch: int, seq: int) -> int:
    """FLOPs of one training step of a dense Llama-shaped decoder (``config``: transformers' ``LlamaConfig`` or our
    ``GPTConfig``) on ``batch`` rows of ``seq`` tokens, from its shape alone: ``6·N·T`` for the N weights of its
    matrix products (attention and MLP projections of every layer, and the output head, tied or not) over
    T = batch x seq tokens, plus attention's ``12·L·H_q·D·S·T`` (:func:`step_flops` counts the same)."""
    width, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or width // heads
    per_layer = width * head_dim * (2 * heads + 2 * kv_heads) + 3 * width * config.intermediate_size
    weights = layers * per_layer + width * config.vocab_size
    tokens = batch * seq
    return 6 * weights * tokens + 12 * layers * heads * head_dim * seq * tokens


class _RecordProducts(TorchDispatchMode):
    """Records (op, operand sizes and strides, dtype, FLOPs) of every dense matrix product executed under it."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            a, b = (args[i] for i in _PRODUCTS[func])
            flops = 2 * a.numel() * b.shape[-1]
            operands = [(t.shape, t.stride()) for t in args if isinstance(t, torch.Tensor)]
            self.products.append((func, operands, a.dtype, flops))
        return func(*args, **(kwargs or {}))


def products_alone_rate(model: torch.nn.Module, batch: Mapping[str, Any], dtype: torch.dtype,
                        repeats: int = 5) -> float:
    """FLOP/s of one forward + backward's matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``) replayed alone on
    random operands of the same sizes, strides and dtypes; ``dtype`` bf16 runs the pass under CPU autocast."""
    was_training = model.training
    model.train()
    recorder = _RecordProducts()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), recorder:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    calls = [(func, [torch.empty_strided(size, stride, dtype=dt).normal_() for size, stride in operands])
             for func, operands, dt, _ in recorder.products]
    total = sum(flops for *_, flops in recorder.products)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms the kernels up
        start = time.perf_counter()
        for func, operands in calls:
            func(*operands)
        best = min(best, time.perf_counter() - start)
    return total / best
