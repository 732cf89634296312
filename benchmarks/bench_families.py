"""Training speed of every family against ``transformers.Trainer``, in fp32, in bf16 and with no precision flag,
with the share of this machine's matrix-product peak.

For each family (:mod:`family_models`: GPT, GPT-MoE, BERT, T5, ViT) both trainers start from the same transformers
checkpoint and train on the same examples with the same AdamW settings (fused, lr 5e-4, weight decay 0.01, clipping
at 1.0, linear schedule), logging every 10 steps, no checkpoints. The sides, each run in a fresh process and
alternated over ``--rounds`` (the machine may be shared):

* ``hf``: transformers' Trainer as shipped;
* ``hf_kept``: the same with the allocator setting our Trainer makes on CPU (``keep_freed_cpu_memory``), so the
  ratio against it is that of the training loops alone;
* ``ours``: our Trainer with its defaults;
* ``ours_compile``: our Trainer with ``torch_compile=True`` (each transformer layer compiled; the compilation is in
  the first step's time).

Precisions: ``fp32`` (``bf16=False`` on both sides), ``bf16`` (``bf16=True`` on both: autocast, fp32 weights and
optimizer state) and ``default`` (no precision argument on either side: what a user gets).

Reported per run: steady-state seconds per step (between the end of the warmup steps and the last step, wall and
process CPU time) and the time from creating the Trainer to the end of its first step. The summary gives the best
run of each side, the ratios, the achieved matrix-product rate (FLOPs of one step counted by
:func:`flops.step_flops` / steady step time) as a share of the peak measured here (:func:`flops.matmul_peak`,
same threads) and each issue target as met or missed.

    python benchmarks/bench_families.py                                     # everything (long: 5 x 3 x 4 sides)
    python benchmarks/bench_families.py --families gpt --precisions bf16    # one cell
    python benchmarks/bench_families.py --families t5 vit --rounds 1 --sides hf_kept ours
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import StepClock, quiet, steady_seconds_per_step  # noqa: E402
from family_models import FAMILIES  # noqa: E402
from flops import matmul_peak, peak_is_meaningful, products_alone_rate, step_flops  # noqa: E402

from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory  # noqa: E402
from mindformers_py.trainer import Trainer, TrainingArguments  # noqa: E402

SIDES = ("hf", "hf_kept", "ours", "ours_compile")
NAMES = {"hf": "transformers.Trainer", "hf_kept": "transformers.Trainer, kept heap", "ours": "mindformers_py.Trainer",
         "ours_compile": "mindformers_py.Trainer, torch_compile"}
PRECISIONS = ("fp32", "bf16", "default")
TARGETS = {"bf16": 1.3, "fp32": 1.0}  # ours / transformers, issue 23
PEAK_SHARE_TARGET = 0.70  # bf16 training FLOP/s of the default GPT / the bf16 matmul peak


def precision_args(precision: str) -> dict:
    return {} if precision == "default" else {"bf16": precision == "bf16"}


def common_args(output_dir: str, family, opts: argparse.Namespace) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=family.batch, max_steps=opts.warmup + opts.steps,
                learning_rate=5e-4, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=0,
                optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
                seed=42, dataloader_num_workers=0, use_cpu=opts.device == "cpu",
                **precision_args(opts.precision))


def train_once(side: str, checkpoint: str, opts: argparse.Namespace) -> dict:
    """One measured run of ``side`` in this process."""
    family = FAMILIES[opts.family]
    data = family.make_data((opts.warmup + opts.steps) * family.batch, 0)
    clock = StepClock()
    if side == "hf_kept" and opts.device == "cpu":
        keep_freed_cpu_memory()  # what our Trainer sets on CPU, process-wide: before anything trains
    model = family.load(side, checkpoint)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        if side.startswith("ours"):
            compile_args = {"torch_compile": True} if side == "ours_compile" else {}  # "ours": the default, "auto"
            args = TrainingArguments(**common_args(out, family, opts), plot_loss_curve=False, **compile_args)
            trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                              callbacks=[clock])
            bf16 = bool(args.bf16)  # resolved: bf16="auto" (the default) is a bool after construction
        else:
            args = transformers.TrainingArguments(**common_args(out, family, opts))
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                           data_collator=default_data_collator, callbacks=[clock])
            bf16 = bool(args.bf16)
        trainer.train()
    wall, cpu = steady_seconds_per_step(clock, opts)
    return {"wall": wall, "cpu": cpu, "first": clock.wall[0] - start, "threads": torch.get_num_threads(),
            "bf16": bf16}


def measure(side: str, checkpoint: str, family: str, precision: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv, "--worker", side, "--checkpoint", checkpoint,
                           "--family", family, "--precision", precision], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{family} {precision} {side} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="default: all, less bf16 where the device only emulates it")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps per run before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def best(runs: list[dict], kind: str = "wall") -> float:
    return min(r[kind] for r in runs)


def main() -> None:
    argv = sys.argv[1:]
    opts = parse_args(argv)
    quiet(opts.threads)
    if opts.worker:
        print("RESULT " + json.dumps(train_once(opts.worker, opts.checkpoint, opts)))
        return
    # A peak (and bf16 runs by default) only where the device computes the dtype natively: emulated bf16 on an AVX2
    # CPU takes seconds per 1024² product, and its rate is no peak a share could be taken of.
    native = peak_is_meaningful(torch.bfloat16, opts.device)
    if opts.precisions is None:
        opts.precisions = [p for p in PRECISIONS if native or p != "bf16"]
        if not native:
            print(f"bf16 is emulated on this {opts.device} (no native bf16 products): bf16 runs left out (ask for "
                  "them with --precisions bf16)", flush=True)
    peaks = {"fp32": matmul_peak(torch.float32, opts.device),
             "bf16": matmul_peak(torch.bfloat16, opts.device) if native else None}
    print(f"matrix-product peak measured here ({torch.get_num_threads()} threads): fp32 {peaks['fp32'] / 1e9:.0f} "
          "GFLOP/s, bf16 " + (f"{peaks['bf16'] / 1e9:.0f} GFLOP/s" if native else "not measured (emulated)"),
          flush=True)
    results: dict[tuple[str, str], dict[str, list[dict]]] = {}
    flops: dict[str, int] = {}
    ceilings: dict[tuple[str, str], tuple[float, str]] = {}
    for name in opts.families:
        family = FAMILIES[name]
        with tempfile.TemporaryDirectory() as ckpt:
            model = family.save_checkpoint(ckpt)
            batch = default_data_collator(family.make_data(family.batch, 0))
            flops[name] = step_flops(model, batch)
            del model
            ours = family.load("ours", ckpt)
            for precision in opts.precisions:
                dtype = torch.float32 if precision == "fp32" else torch.bfloat16
                if precision == "default" and not TrainingArguments(output_dir=ckpt, use_cpu=True).bf16:
                    dtype = torch.float32
                if dtype == torch.bfloat16 and not native:
                    continue  # replaying emulated bf16 products gives no ceiling of a share of a peak
                ceilings[name, precision] = (products_alone_rate(ours, batch, dtype),
                                             "bf16" if dtype == torch.bfloat16 else "fp32")
            del ours
            for precision in opts.precisions:
                cell = results[name, precision] = {side: [] for side in opts.sides}
                for r in range(opts.rounds):
                    for side in opts.sides:
                        res = measure(side, ckpt, name, precision, argv)
                        cell[side].append(res)
                        items = family.batch * family.items_per_example
                        print(f"  {name} {precision:7s} round {r + 1}: {NAMES[side]:38s} {items / res['wall']:8.0f} "
                              f"{family.unit}/s (cpu time {items / res['cpu']:8.0f}), first step {res['first']:6.2f} s, "
                              f"{'bf16' if res['bf16'] else 'fp32'}", flush=True)
    report(results, flops, ceilings, peaks, opts)


def report(results: dict, flops: dict[str, int], ceilings: dict[tuple[str, str], tuple[float, str]], peaks: dict[str, float],
           opts: argparse.Namespace) -> None:
    threads = next(iter(next(iter(results.values())).values()))[0]["threads"]
    print(f"\nbest of {opts.rounds} round(s), {opts.steps} measured steps after {opts.warmup}, {threads} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; ratios are ours / transformers "
          "(wall; process CPU time in brackets)")
    reference = "hf_kept" if "hf_kept" in opts.sides else "hf"
    header = (f"{'family':6} {'precision':9} {'side':38} {'items/s':>9} {'/ hf':>13} {'/ hf_kept':>13} "
              f"{'GFLOP/s':>8} {'of peak':>8} {'1st step':>9}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for (name, precision), cell in results.items():
        family = FAMILIES[name]
        items = family.batch * family.items_per_example
        for side, runs in cell.items():
            wall = best(runs)
            ratios = []
            for ref in ("hf", "hf_kept"):
                if ref in cell and side.startswith("ours"):
                    ratios.append(f"{best(cell[ref]) / wall:5.2f}x ({best(cell[ref], 'cpu') / best(runs, 'cpu'):4.2f})")
                else:
                    ratios.append("")
            dtype = "bf16" if runs[0]["bf16"] else "fp32"
            rate = flops[name] / wall
            share = f"{rate / peaks[dtype]:8.1%}" if peaks[dtype] else f"{'-':>8}"
            print(f"{name:6} {precision:9} {NAMES[side]:38} {items / wall:9.0f} {ratios[0]:>13} {ratios[1]:>13} "
                  f"{rate / 1e9:8.0f} {share} {min(r['first'] for r in runs):8.2f}s")
        for side in (s for s in cell if s.startswith("ours")):
            if precision in TARGETS and reference in cell:
                ratio = best(cell[reference]) / best(cell[side])
                verdicts.append(f"{name} {precision} {NAMES[side]} / {NAMES[reference]}: {ratio:.2f}x, target >= "
                                f"{TARGETS[precision]}x: {'met' if ratio >= TARGETS[precision] else 'MISSED'}")
            if name == "gpt" and precision == "bf16" and peaks["bf16"] and (name, precision) in ceilings:
                share = flops[name] / best(cell[side]) / peaks["bf16"]
                verdicts.append(f"gpt bf16 {NAMES[side]}: {share:.1%} of the bf16 matmul peak, target >= "
                                f"{PEAK_SHARE_TARGET:.0%}: {'met' if share >= PEAK_SHARE_TARGET else 'MISSED'} "
                                f"(ceiling at this model's shapes: {ceilings[name, precision][0] / peaks['bf16']:.0%})")
    print("\nFLOPs per step (flops.step_flops): " + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in flops.items()))
    print("ceiling of the share of peak: our step's matrix products replayed alone at its shapes "
          "(flops.products_alone_rate): " + ", ".join(
              f"{name} {precision} {rate / 1e9:.0f} GFLOP/s = {rate / peaks[dtype]:.0%}"
              for (name, precision), (rate, dtype) in ceilings.items()))
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
