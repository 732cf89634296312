"""Does bf16 autocast train the recipes as well as fp32? The evidence behind the default precision (``bf16="auto"``).

Each recipe runs twice from the same seed on the same data, once with ``bf16=False`` and once with ``bf16=True``
(autocast; weights, gradients and AdamW state stay fp32), shortened to ``--steps`` optimizer steps with an
evaluation every ``--eval-every`` steps and no checkpoints. From the two runs' ``log.jsonl``: the training loss at
every logging step (a mean over its 10 steps) and the evaluation loss at every evaluation. Printed per recipe: the
largest relative gap between the curves, the mean gap, and the final evaluation losses; the verdict compares them
with ``--tolerance`` (default 2% relative, about the run-to-run spread of these recipes under a different seed,
which ``--seed-spread`` measures: the fp32 run again with another seed).

    python benchmarks/bf16_loss_curves.py                                  # every recipe, 200 steps each
    python benchmarks/bf16_loss_curves.py --recipes gpt --steps 800        # the whole demo run
    python benchmarks/bf16_loss_curves.py --recipes gpt bert --seed-spread
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
import warnings
from pathlib import Path

import transformers

from mindformers_py.recipes.loader import load_recipe
from mindformers_py.recipes.runner import run_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "gpt": "tasks/gpt/pretrain_tiny.yaml",
    "moe": "tasks/gpt_moe/pretrain_tiny.yaml",
    "bert": "tasks/bert/pretrain_mlm_tiny.yaml",
    "t5": "tasks/t5/pretrain_span_tiny.yaml",
    "t5_summarization": "tasks/t5/finetune_summarization.yaml",
    "vit": "tasks/vit/finetune_digits.yaml",
}


def run(recipe: str, bf16: bool, opts: argparse.Namespace, seed: int = 42) -> dict:
    """Train ``recipe`` shortened; returns its logged training and evaluation losses and its wall time."""
    with tempfile.TemporaryDirectory() as out:
        overrides = ["--output_dir", out, "--overwrite_output_dir", "true", "--max_steps", str(opts.steps),
                     "--eval_steps", str(opts.eval_every), "--eval_strategy", "steps", "--logging_steps", "10",
                     "--save_strategy", "no", "--report_to", "none", "--plot_loss_curve", "false",
                     "--disable_tqdm", "true", "--bf16", str(bf16).lower(), "--seed", str(seed),
                     "--generate.prompts", "[]"]
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            run_recipe(load_recipe(ROOT / RECIPES[recipe]), overrides)
        seconds = time.perf_counter() - start
        logs = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines() if line.strip()]
    train = {e["step"]: e["loss"] for e in logs if "loss" in e and "eval_loss" not in e}
    evals = {e["step"]: e["eval_loss"] for e in logs if "eval_loss" in e}
    return {"train": train, "eval": evals, "seconds": seconds}


def gaps(a: dict[int, float], b: dict[int, float]) -> list[float]:
    """Relative gaps |b - a| / a at the steps both curves have."""
    return [abs(b[s] - a[s]) / abs(a[s]) for s in sorted(set(a) & set(b))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest relative gap accepted")
    parser.add_argument("--seed-spread", action="store_true", help="also run fp32 with another seed, for scale")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    rows = []
    for recipe in opts.recipes:
        fp32 = run(recipe, False, opts)
        print(f"{recipe} fp32: {fp32['seconds']:.0f} s, eval losses {fp32['eval']}", flush=True)
        bf16 = run(recipe, True, opts)
        print(f"{recipe} bf16: {bf16['seconds']:.0f} s, eval losses {bf16['eval']}", flush=True)
        row = {"recipe": recipe, "train": gaps(fp32["train"], bf16["train"]), "eval": gaps(fp32["eval"], bf16["eval"]),
               "final": (fp32["eval"][max(fp32["eval"])], bf16["eval"][max(bf16["eval"])]),
               "seconds": (fp32["seconds"], bf16["seconds"])}
        if opts.seed_spread:
            other = run(recipe, False, opts, seed=43)
            row["seed_train"], row["seed_eval"] = gaps(fp32["train"], other["train"]), gaps(fp32["eval"], other["eval"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=float), flush=True)
    print(f"\nbf16 autocast against fp32, {opts.steps} steps per recipe, evaluation every {opts.eval_every}; gaps are "
          "relative, |bf16 - fp32| / fp32")
    header = (f"{'recipe':17} {'train max':>9} {'train mean':>10} {'eval max':>9} {'final eval fp32 -> bf16':>24} "
              f"{'time fp32 -> bf16':>18} {'verdict':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        worst = max(row["train"] + row["eval"])
        print(f"{row['recipe']:17} {max(row['train']):9.2%} {sum(row['train']) / len(row['train']):10.2%} "
              f"{max(row['eval']):9.2%} {row['final'][0]:11.4f} -> {row['final'][1]:.4f} "
              f"{row['seconds'][0]:7.0f}s -> {row['seconds'][1]:.0f}s {'within' if worst <= opts.tolerance else 'OUTSIDE':>8}")
        if "seed_train" in row:
            print(f"{'  (fp32, seed 43)':17} {max(row['seed_train']):9.2%} "
                  f"{sum(row['seed_train']) / len(row['seed_train']):10.2%} {max(row['seed_eval']):9.2%}")


if __name__ == "__main__":
    main()
