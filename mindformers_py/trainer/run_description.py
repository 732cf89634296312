"""The lines a run prints when it starts, saying what it is doing: the layout it started (and what the
``auto_parallel`` planner chose), the precision it trains in and why, whether it compiles its layers and why."""

from __future__ import annotations

import torch

from ..engine import Engine
from .arguments import TrainingArguments


def layout_line(engine: Engine) -> str:
    """What this run started: ``2 processes (data_parallel): dp=2 tp=1 pp=1 ep=1, ZeRO-3, recompute=full``, and
    for ``auto_parallel`` what the planner chose and why."""
    processes = f"{engine.world_size} process{'es' if engine.world_size > 1 else ''}"
    line = f"{processes} ({engine.layout.parallel_mode}): {engine.layout.describe()}"
    return line + (f"; auto_parallel {engine.plan_summary}" if engine.plan_summary else "")


def compile_line(args: TrainingArguments) -> str:
    """Whether the run compiles its layers and why, e.g. ``compile: off, chosen by torch_compile='auto': training on
    cpu, where compiled layers are slower than eager ones``: a compiled run's first step takes much longer."""
    what = ("each transformer layer (the first step pays the compilation)" if args.torch_compile else "off (eager)")
    if getattr(args, "_torch_compile_auto", None) is args.torch_compile:  # "auto" decided
        return f"compile: {what}, chosen by torch_compile='auto': {args._torch_compile_reason}"
    return f"compile: {what}; torch_compile={args.torch_compile}"


def weights_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The floating dtype most of ``model``'s parameter elements have (None without floating parameters): an
    adapter run of a bf16 checkpoint keeps its frozen base in bf16, whatever the autocast setting."""
    counts: dict[torch.dtype, int] = {}
    for parameter in model.parameters():
        if parameter.is_floating_point():
            counts[parameter.dtype] = counts.get(parameter.dtype, 0) + parameter.numel()
    return max(counts, key=counts.get) if counts else None


def _half_weights_clause(weights: torch.dtype | None, native: bool, device: torch.device) -> str:
    """What a model loaded in bf16 or fp16 changes: its products run in that dtype with autocast or without, and a
    CPU without native bf16 emulates them (an adapter step of a bf16 Llama 1B took minutes here, not seconds)."""
    if weights not in (torch.bfloat16, torch.float16):
        return ""
    name = "bf16" if weights == torch.bfloat16 else "fp16"
    clause = f"; the model's weights are {name} (as loaded): its products run in {name}"
    if weights == torch.bfloat16 and not native and device.type == "cpu":
        clause += (", emulated on this CPU and far slower than fp32; load it in float32 (dtype=torch.float32; "
                   "a recipe: --model.dtype float32) to train in fp32 at twice the weights' memory")
    return clause


def precision_line(args: TrainingArguments, device: torch.device, weights: torch.dtype | None = None) -> str:
    """Which precision the run trains in and why, e.g. ``bf16 autocast ..., chosen by bf16='auto': this CPU computes
    bf16 natively (avx512_bf16)``: the same recipe runs about twice as fast or slow on another machine, and this
    says which case a run is. ``weights``: the model's parameters' dtype (:func:`weights_dtype`); a model loaded in
    bf16 or fp16 computes in it, which the line then says."""
    from ..engine.precision import _CPU_BF16_CAPABILITIES, native_bf16

    native = native_bf16(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        hardware = f"this GPU (compute capability {major}.{minor}) {'has' if native else 'has no'} bf16 tensor cores"
    elif device.type == "cpu":
        found = [name for name in _CPU_BF16_CAPABILITIES if torch.cpu.get_capabilities().get(name)]
        hardware = (f"this CPU computes bf16 natively ({', '.join(found)})" if native else
                    "oneDNN is capped below this CPU's bf16 instructions (ONEDNN_MAX_CPU_ISA)" if found else
                    "this CPU has no native bf16 (AVX-512 BF16, AMX or ARM's BF16)")
    else:
        hardware = f"{device.type} is not known to compute bf16 natively"
    if args.bf16:
        what = "bf16 autocast (matrix products in bf16; weights, gradients and optimizer state in fp32)"
    else:
        what = "fp16 autocast" if args.fp16 else "fp32"
    half = _half_weights_clause(weights, native, device)
    if getattr(args, "_bf16_auto", None) is args.bf16:  # bf16="auto" decided (known where the arguments were made)
        why = "bf16='auto' gives way to fp16=True" if args.fp16 else \
            f"chosen by bf16='auto': {hardware}" + ("" if native else ", where bf16 would be slower than fp32")
        return f"precision: {what}, {why}{half}"
    slower = "" if native or not args.bf16 else " (bf16 emulated: slower than fp32)"
    return f"precision: {what}; bf16={args.bf16}: {hardware}{slower}{half}"
