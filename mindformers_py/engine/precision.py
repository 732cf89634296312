"""Which precision a run trains in when it is not told: bf16 autocast where the hardware computes bf16 natively.

``TrainingArguments.bf16="auto"`` (the default) resolves here. bf16 autocast keeps fp32 weights, gradients and AdamW
state and runs the matrix products in bf16; on hardware with bf16 matrix units that is several times the fp32 rate,
and the loss curves stay close to fp32's (the GPT demo recipe within 1% over its first 80 steps:
``benchmarks/bf16_loss_curves.py``). Where bf16 is only emulated it would be slower than fp32, so ``"auto"``
means fp32 there:

* CUDA: compute capability 8.0 or newer (Ampere, Hopper, Blackwell, ...), which have bf16 tensor cores;
* CPU: the AVX-512 BF16 or AMX-BF16 instructions (x86: Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and
  later), or the BF16 extension on ARM (``torch.cpu.get_capabilities()``);
* anything else: fp32.

On the CPU the bf16 products run in oneDNN, so a cap on oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA`` or its
older name ``DNNL_MAX_CPU_ISA`` below ``AVX512_CORE_BF16``) makes them emulated even where the CPU has the
instructions: ``"auto"`` follows the cap. That is also how an AVX2-only machine is reproduced on a newer one
(``ONEDNN_MAX_CPU_ISA=AVX2``, with ``ATEN_CPU_CAPABILITY=avx2`` for torch's own kernels).
"""

from __future__ import annotations

import os

import torch

AUTO = "auto"
"""The ``bf16`` setting that lets the hardware decide."""

_CPU_BF16_CAPABILITIES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")

# oneDNN's x86 instruction-set caps without bf16 dot products, in its own spelling (AVX2_VNNI_2 converts bf16 but
# does not multiply it natively). Any other value (unset, DEFAULT, ALL, AVX512_CORE_BF16 and newer) leaves bf16 native.
_ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                       "AVX512_CORE_VNNI"})


def _onednn_capped_below_bf16() -> bool:
    """Whether the environment caps oneDNN's instruction set below the bf16 dot products."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return cap.strip().upper() in _ONEDNN_CAPS_WITHOUT_BF16


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` (a CUDA device or the CPU) computes bf16 matrix products natively."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        if _onednn_capped_below_bf16():
            return False
        capabilities = torch.cpu.get_capabilities()
        return any(bool(capabilities.get(name)) for name in _CPU_BF16_CAPABILITIES)
    return False


def training_device(use_cpu: bool) -> torch.device:
    """The device a Trainer trains on: the current CUDA device when one is visible and not ``use_cpu``, else the
    CPU (the engines' rule)."""
    if torch.cuda.is_available() and not use_cpu:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_bf16(bf16: bool | str, fp16: bool, use_cpu: bool) -> bool:
    """The bf16 flag a run uses: ``bf16`` itself when it is a bool; for ``"auto"``, True when the training device
    has native bf16 and fp16 was not asked for."""
    if bf16 != AUTO:
        return bool(bf16)
    return not fp16 and native_bf16(training_device(use_cpu))
