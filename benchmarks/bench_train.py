"""Training throughput: our Trainer against ``transformers.Trainer`` on the same GPT-2 weights and data.

Both trainers get the same GPT-2 checkpoint (4 layers, 256 wide, 4 heads, GPT-2's 50257-token vocabulary, its
default dropout), the same random token blocks (sequence 256, batch 8), the same AdamW settings (fused, lr 5e-4,
weight decay 0.01, clipping at 1.0, linear schedule), the same collator, logging every 10 steps, no checkpoints,
fp32 on CPU. Our side loads the checkpoint into our ``GPTForCausalLM`` (``--our-model ours``, the default) or
uses the same HF ``GPT2LMHeadModel`` (``--our-model hf``, which isolates the Trainer itself).

Each run is a fresh Python process (so neither trainer inherits process-wide settings from the other: ours
tunes the C allocator on CPU), and runs alternate between the trainers (``--rounds``), because the machine may be
shared. transformers' Trainer runs twice per round: as shipped (glibc's default allocator) and with the same
allocator setting ours makes (``keep_freed_cpu_memory``, applied before it trains), so the report gives both the
ratio a user sees and the ratio of the training loops alone. ``--one-process`` runs all of them alternately in
this process instead (one allocator setting for all, as a notebook that uses both trainers would have). The steady-state time of a run is measured between the end of its warmup steps and its last step
by the same ``TrainerCallback`` on both sides, as wall time and as this process's CPU time (steadier when other
jobs share the cores); the best run of each side is reported with the ratio.

    python benchmarks/bench_train.py                          # CPU, defaults above
    python benchmarks/bench_train.py --steps 6 --rounds 1      # quicker
    python benchmarks/bench_train.py --our-model hf            # same model on both sides: the Trainer alone
    python benchmarks/bench_train.py --threads 1               # one core: least disturbed by other jobs
    python benchmarks/bench_train.py --one-process             # both trainers alternating in one process

Where the time goes (measured on 2 shared CPU cores): at this size both trainers spend ~80% of a step in
matrix products (the 50257-wide LM head alone is three 2048 x 256 x 50257 products) and HF's per-step Python
overhead is negligible. What separates them is memory: glibc hands every tensor above 32 MiB a fresh mmap and
unmaps it when freed, so each step of the plain loop page-faults ~460k pages (~1.8 GB: logits, log-probs,
their gradients) back in, about a quarter of the step. Our engine keeps freed memory in the heap
(``TrainingArguments.cpu_keep_freed_memory``), after which a step faults ~0 pages. Our loop also waits for the
device only at logging steps, uses fused AdamW and ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, default_data_collator

import mindformers_py
from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory
from mindformers_py.trainer import Trainer, TrainingArguments

SIDES = ("hf", "hf_kept", "ours")
NAMES = {"hf": "transformers.Trainer", "hf_kept": "transformers.Trainer + kept heap", "ours": "mindformers_py.Trainer"}
RUNNERS = {}  # filled below: side -> run function


class StepClock(TrainerCallback):
    """Records wall and process CPU time at the end of every optimizer step (the same callback on both sides).

    CPU time is what this process actually ran: on a machine shared with other jobs it is much steadier than
    wall time, which also counts the time other processes held the cores."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def make_data(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def common_args(output_dir: str, opts: argparse.Namespace) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=opts.batch, max_steps=opts.warmup + opts.steps,
        learning_rate=5e-4, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=0,
        optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
        seed=42, dataloader_num_workers=0, use_cpu=opts.device == "cpu", bf16=opts.bf16,
    )


def run_hf(checkpoint: str, data, opts) -> tuple[float, float]:
    model = GPT2LMHeadModel.from_pretrained(checkpoint)
    return _run_transformers_trainer(model, data, opts)


def run_hf_kept(checkpoint: str, data, opts) -> tuple[float, float]:
    """transformers' Trainer with the allocator setting our Trainer makes on CPU (process-wide, so set here)."""
    if opts.device == "cpu":
        keep_freed_cpu_memory()
    return run_hf(checkpoint, data, opts)


def _run_transformers_trainer(model, data, opts) -> tuple[float, float]:
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(**common_args(out, opts))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       data_collator=default_data_collator, callbacks=[clock])
        trainer.train()
    return steady_seconds_per_step(clock, opts)


def run_ours(checkpoint: str, data, opts) -> tuple[float, float]:
    if opts.our_model == "ours":
        model = mindformers_py.AutoModelForCausalLM.from_pretrained(checkpoint)
    else:
        model = GPT2LMHeadModel.from_pretrained(checkpoint)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(**common_args(out, opts), plot_loss_curve=False, fused_loss=opts.fused_loss)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                          callbacks=[clock])
        trainer.train()
    return steady_seconds_per_step(clock, opts)


def steady_seconds_per_step(clock: StepClock, opts) -> tuple[float, float]:
    """(wall, CPU) seconds per step between the end of the warmup steps and the last step."""
    assert len(clock.wall) == opts.warmup + opts.steps, len(clock.wall)
    w = opts.warmup - 1
    return (clock.wall[-1] - clock.wall[w]) / opts.steps, (clock.cpu[-1] - clock.cpu[w]) / opts.steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each trainer")
    parser.add_argument("--our-model", choices=("ours", "hf"), default="ours")
    parser.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=False,
                        help="our Trainer's chunked linear cross-entropy (TrainingArguments.fused_loss)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device's dense peak TFLOP/s for the dtype used (e.g. 989 for H100 bf16): print MFU")
    parser.add_argument("--one-process", action="store_true",
                        help="run every trainer alternately in this process (one allocator setting for all)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def quiet(threads: int | None) -> None:
    """A measured process: no warnings or progress bars from transformers; ``threads`` intra-op threads if given."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)


def worker(opts: argparse.Namespace) -> None:
    """One measured run in this process; prints its (wall, cpu) seconds per step as JSON."""
    quiet(opts.threads)
    data = make_data((opts.warmup + opts.steps) * opts.batch, opts.seq, opts.vocab)
    wall, cpu = RUNNERS[opts.worker](opts.checkpoint, data, opts)
    print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}))


def measure_here(side: str, checkpoint: str, opts: argparse.Namespace) -> dict:
    """One run in this process (``--one-process``)."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    data = make_data((opts.warmup + opts.steps) * opts.batch, opts.seq, opts.vocab)
    wall, cpu = RUNNERS[side](checkpoint, data, opts)
    return {"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}


def measure(side: str, checkpoint: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv, "--worker", side, "--checkpoint", checkpoint],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{side} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    argv = sys.argv[1:]
    opts = parse_args(argv)
    if opts.worker:
        worker(opts)
        return
    tokens_per_step = opts.batch * opts.seq
    # In one process the allocator setting is shared: the kept-heap HF run is the plain one.
    sides = ("hf", "ours") if opts.one_process else SIDES
    if opts.one_process:
        if opts.threads:
            torch.set_num_threads(opts.threads)
        if opts.device == "cpu":
            keep_freed_cpu_memory()  # what our Trainer would set anyway: every run, HF's first one too, shares it
    results: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=opts.layers, n_embd=opts.hidden, n_head=opts.heads, n_positions=opts.seq,
                            vocab_size=opts.vocab)
        transformers.logging.disable_progress_bar()
        reference = GPT2LMHeadModel(config)
        num_params = reference.num_parameters()
        reference.save_pretrained(ckpt)
        for r in range(opts.rounds):
            for side in sides:
                res = measure_here(side, ckpt, opts) if opts.one_process else measure(side, ckpt, argv)
                results[side].append(res)
                print(f"  round {r + 1}: {NAMES[side]:34s} wall {res['wall']:.3f} s/step "
                      f"({tokens_per_step / res['wall']:5.0f} tokens/s), cpu {res['cpu']:.3f} s/step", flush=True)
    print(f"GPT-2 {opts.layers} layers x {opts.hidden} wide, {opts.heads} heads, vocab {opts.vocab}, seq {opts.seq}, "
          f"batch {opts.batch}, {'bf16' if opts.bf16 else 'fp32'} on {opts.device}, torch threads "
          f"{results['hf'][0]['threads']}, our model: {opts.our_model}, fused loss: {opts.fused_loss}, "
          f"{'one process' if opts.one_process else 'a process per run'}")
    for kind in ("wall", "cpu"):
        best = {side: min(r[kind] for r in runs) for side, runs in results.items()}
        med = {side: statistics.median(r[kind] for r in runs) for side, runs in results.items()}
        speeds = ", ".join(f"{NAMES[side]} {tokens_per_step / best[side]:.0f}" for side in results)
        print(f"{kind:4s} tokens/s (best of {opts.rounds}): {speeds}")
        for side in (s for s in results if s != "ours"):
            print(f"     mindformers_py.Trainer / {NAMES[side]}: {best[side] / best['ours']:.2f}x "
                  f"(medians {med[side] / med['ours']:.2f}x)")
    if opts.peak_tflops:
        # Model FLOPs per token: 6N for the parameter matmuls (forward + backward) plus 12*L*h*s for attention.
        flops_per_token = 6 * num_params + 12 * opts.layers * opts.hidden * opts.seq
        for side, runs in results.items():
            achieved = flops_per_token * tokens_per_step / min(r["wall"] for r in runs)
            print(f"MFU {NAMES[side]}: {achieved / (opts.peak_tflops * 1e12):.1%} "
                  f"({achieved / 1e12:.1f} of {opts.peak_tflops:g} TFLOP/s)")


RUNNERS.update(hf=run_hf, hf_kept=run_hf_kept, ours=run_ours)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
