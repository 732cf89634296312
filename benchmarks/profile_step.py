"""Where a training step's time goes: ``torch.profiler`` around steady-state steps of our Trainer (or transformers').

The family's benchmark model and data (:mod:`family_models`) train with the arguments of ``bench_families.py``;
after ``--warmup`` steps the profiler records ``--steps`` steps, and the self time of every operator is summed into
categories (matrix products, attention, compiled graphs, dtype casts, loss, optimizer, other element-wise work)
and printed per step with the top operators.

    python benchmarks/profile_step.py --family gpt --precision bf16
    python benchmarks/profile_step.py --family gpt --precision bf16 --compile
    python benchmarks/profile_step.py --family t5 --precision fp32 --side hf   # transformers' Trainer instead
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from transformers import TrainerCallback, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
from family_models import FAMILIES  # noqa: E402

from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory  # noqa: E402
from mindformers_py.trainer import Trainer, TrainingArguments  # noqa: E402

# Operator name fragments -> category; the first match wins, in this order.
CATEGORIES = (
    ("compiled graph (fused kernels)", ("CompiledFxGraph",)),
    ("loss (log-softmax, NLL)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("attention", ("scaled_dot_product", "flash_attention", "_softmax", "bmm")),
    ("matrix products", ("aten::mm", "aten::addmm", "aten::linear", "mkldnn", "_mkl_linear", "grouped_mm",
                         "aten::matmul", "aten::baddbmm")),
    ("dtype casts and copies", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")),
    ("optimizer and clipping", ("_fused_adamw", "adam", "linalg_vector_norm", "foreach", "clip")),
    ("dropout", ("bernoulli", "native_dropout", "dropout", "aten::random_")),
)


class ProfileSteps(TrainerCallback):
    """Starts the profiler at the beginning of step ``start`` and stops it after ``count`` steps."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count = start, count
        self.prof: profile | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.start:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None and state.global_step == self.start + self.count:
            self.prof.__exit__(None, None, None)


def category(name: str) -> str:
    for label, fragments in CATEGORIES:
        if any(f in name for f in fragments):
            return label
    return "other element-wise / norms / indexing" if name.startswith("aten::") else "framework (autograd, Python)"


def run(opts: argparse.Namespace) -> ProfileSteps:
    family = FAMILIES[opts.family]
    recorder = ProfileSteps(opts.warmup, opts.steps)
    args = dict(per_device_train_batch_size=family.batch, max_steps=opts.warmup + opts.steps, learning_rate=5e-4,
                weight_decay=0.01, max_grad_norm=1.0, optim="adamw_torch_fused", logging_steps=1000,
                save_strategy="no", report_to="none", disable_tqdm=True, seed=42, use_cpu=True,
                bf16=opts.precision == "bf16")
    with tempfile.TemporaryDirectory() as ckpt, tempfile.TemporaryDirectory() as out:
        family.save_checkpoint(ckpt)
        data = family.make_data(family.batch * (opts.warmup + opts.steps), 0)
        model = family.load(opts.side, ckpt)
        if opts.side == "ours":
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, plot_loss_curve=False,
                                                                  torch_compile=opts.compile, **args),
                              train_dataset=data, data_collator=default_data_collator, callbacks=[recorder])
        else:
            keep_freed_cpu_memory()  # the allocator setting our Trainer makes, so the comparison is of the loops
            trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(output_dir=out, **args),
                                           train_dataset=data, data_collator=default_data_collator,
                                           callbacks=[recorder])
        trainer.train()
    return recorder


def report(recorder: ProfileSteps, steps: int, top: int) -> None:
    events = recorder.prof.key_averages()
    per_category: dict[str, float] = defaultdict(float)
    for event in events:
        per_category[category(event.key)] += event.self_cpu_time_total / 1e3 / steps
    total = sum(per_category.values())
    print(f"self CPU time per step: {total:.1f} ms (profiled; the profiler adds a little per operator)")
    for label, ms in sorted(per_category.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<40} {ms:8.1f} ms  {ms / total:6.1%}")
    print(f"top {top} operators by self time per step:")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {event.key[:60]:<60} {event.self_cpu_time_total / 1e3 / steps:8.2f} ms  x{event.count // steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--side", choices=("ours", "hf"), default="ours")
    parser.add_argument("--compile", action="store_true", help="our Trainer with torch_compile=True")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"{opts.family}, {opts.precision}, {'our' if opts.side == 'ours' else 'transformers'} Trainer"
          f"{', torch_compile' if opts.compile else ''}, {torch.get_num_threads()} threads")
    report(run(opts), opts.steps, opts.top)


if __name__ == "__main__":
    main()
