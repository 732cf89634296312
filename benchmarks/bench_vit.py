"""ViT speed against transformers: training images/s of our Trainer + our ``ViTForImageClassification`` against
``transformers.Trainer`` + transformers' ``ViTForImageClassification`` on the same weights and images, and inference
images/s of both models.

Both trainers get the same transformers ViT checkpoint (ours loads it through its converter), the same pre-processed
images (random pixels, so the image processor and augmentation are outside the measurement), the same AdamW settings
(fused, lr 1e-3, weight decay 0.05, clipping at 1.0, linear schedule), logging every 10 steps, no checkpoints, fp32.
Each training run is a fresh Python process and runs alternate between the sides (``--rounds``), because the machine
may be shared. transformers' Trainer runs as shipped (``hf``) and with the allocator setting our Trainer makes on CPU
(``hf_kept``, ``keep_freed_cpu_memory``), so the ratio of the training loops is measured with the same allocator
setting. Steady-state time is taken between the end of the warmup steps and the last step by the same callback on
both sides, as wall time and as process CPU time (steadier when other jobs share the cores); the best run of each
side is reported. Inference runs both models alternately in this process (``torch.no_grad``, eval mode), best of
``--repeats``.

    python benchmarks/bench_vit.py                                  # the digits recipe's model: 28 px, 64 wide, 4 layers
    python benchmarks/bench_vit.py --image 224 --patch 16 --hidden 192 --layers 12 --heads 3 --batch 8   # ViT-Ti
    python benchmarks/bench_vit.py --threads 1 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import transformers
from transformers import TrainerCallback, default_data_collator

import mindformers_py
from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory
from mindformers_py.trainer import Trainer, TrainingArguments

SIDES = ("hf", "hf_kept", "ours")
NAMES = {"hf": "transformers.Trainer + HF ViT", "hf_kept": "transformers.Trainer + HF ViT, kept heap",
         "ours": "mindformers_py.Trainer + our ViT"}


class StepClock(TrainerCallback):
    """Wall and process CPU time at the end of every optimizer step (the same callback on both sides)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def hf_config(opts) -> transformers.ViTConfig:
    return transformers.ViTConfig(image_size=opts.image, patch_size=opts.patch, hidden_size=opts.hidden,
                                  num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
                                  intermediate_size=2 * opts.hidden if opts.mlp is None else opts.mlp, num_labels=10)


def make_data(n: int, opts, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3, opts.image, opts.image, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return [{"pixel_values": p, "labels": y} for p, y in zip(pixels, labels)]


def common_args(output_dir: str, opts) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=opts.batch, max_steps=opts.warmup + opts.steps,
                learning_rate=1e-3, weight_decay=0.05, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=0,
                optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
                seed=42, dataloader_num_workers=0, use_cpu=True)


def train_once(side: str, checkpoint: str, opts) -> tuple[float, float]:
    """(wall, CPU) seconds per steady-state step of one side."""
    data = make_data((opts.warmup + opts.steps) * opts.batch, opts)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        if side == "ours":
            model = mindformers_py.AutoModelForImageClassification.from_pretrained(checkpoint)
            args = TrainingArguments(**common_args(out, opts), plot_loss_curve=False)
            trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                              callbacks=[clock])
        else:
            if side == "hf_kept":
                keep_freed_cpu_memory()
            model = transformers.ViTForImageClassification.from_pretrained(checkpoint)
            args = transformers.TrainingArguments(**common_args(out, opts))
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                           data_collator=default_data_collator, callbacks=[clock])
        trainer.train()
    w = opts.warmup - 1
    return (clock.wall[-1] - clock.wall[w]) / opts.steps, (clock.cpu[-1] - clock.cpu[w]) / opts.steps


def inference(checkpoint: str, opts) -> dict[str, float]:
    """Best images/s of each model over ``opts.repeats`` alternating timed passes."""
    models = {"hf": transformers.ViTForImageClassification.from_pretrained(checkpoint).eval(),
              "ours": mindformers_py.AutoModelForImageClassification.from_pretrained(checkpoint).eval()}
    pixels = torch.randn(opts.infer_batch, 3, opts.image, opts.image, generator=torch.Generator().manual_seed(1))
    best = {k: float("inf") for k in models}
    with torch.no_grad():
        diff = (models["hf"](pixels).logits - models["ours"](pixels).logits).abs().max().item()
        for _ in range(opts.repeats):
            for name, model in models.items():
                start = time.perf_counter()
                model(pixels)
                best[name] = min(best[name], time.perf_counter() - start)
    return {**{k: opts.infer_batch / v for k, v in best.items()}, "max_abs_logit_diff": diff}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", type=int, default=28)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=None, help="MLP width (default 2 x hidden, as the digits recipe)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--infer-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10, help="timed inference passes per model")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def quiet(opts) -> None:
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if opts.threads:
        torch.set_num_threads(opts.threads)


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
    quiet(opts)
    if opts.worker:
        wall, cpu = train_once(opts.worker, opts.checkpoint, opts)
        print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}))
        return
    with tempfile.TemporaryDirectory() as checkpoint:
        torch.manual_seed(0)
        transformers.ViTForImageClassification(hf_config(opts)).save_pretrained(checkpoint)
        print(f"ViT {opts.image}px / {opts.patch}px patches, width {opts.hidden}, {opts.layers} layers, {opts.heads} "
              f"heads, batch {opts.batch}, fp32 CPU, {torch.get_num_threads()} threads")
        runs: dict[str, list[dict]] = {side: [] for side in SIDES}
        for _ in range(opts.rounds):
            for side in SIDES:
                runs[side].append(measure(side, checkpoint, argv))
        best = {side: min(runs[side], key=lambda r: r["wall"]) for side in SIDES}
        print(f"{'training':<42} {'img/s (wall)':>12} {'img/s (CPU)':>12}")
        for side in SIDES:
            r = best[side]
            print(f"{NAMES[side]:<42} {opts.batch / r['wall']:>12.1f} {opts.batch / r['cpu']:>12.1f}")
        for ref in ("hf", "hf_kept"):
            print(f"ours / {ref}: {best[ref]['wall'] / best['ours']['wall']:.2f}x wall, "
                  f"{best[ref]['cpu'] / best['ours']['cpu']:.2f}x CPU time")
        infer = inference(checkpoint, opts)
        print(f"inference, batch {opts.infer_batch}: transformers {infer['hf']:.1f} img/s, ours {infer['ours']:.1f} "
              f"img/s, ours / transformers {infer['ours'] / infer['hf']:.2f}x "
              f"(max |logit diff| {infer['max_abs_logit_diff']:.1e})")


if __name__ == "__main__":
    main()
