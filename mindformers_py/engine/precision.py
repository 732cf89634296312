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
"""

from __future__ import annotations

import torch

AUTO = "auto"
"""The ``bf16`` setting that lets the hardware decide."""

_CPU_BF16_CAPABILITIES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` (a CUDA device or the CPU) computes bf16 matrix products natively."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
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
