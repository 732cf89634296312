"""LoRA against full fine-tuning at the same number of steps, from the same pretrained model and data: held-out loss
(and accuracy for classification), trainable parameters, AdamW state and time per optimizer step.

``gpt`` runs ``tasks/gpt/finetune_lora.yaml`` (docstring -> function pairs from the standard library, on the
pretraining recipe's model: run ``tasks/gpt/pretrain_tiny.yaml`` first, or pass ``--base`` any GPT-2 / Llama
folder); ``bert`` runs ``tasks/bert/finetune_classification_lora.yaml`` (the packaged all-MiniLM-L6-v2 on the
docstring package-classification task). Full fine-tuning is the same recipe with ``--peft null`` and its own
learning rate (``--full-lr``). The AdamW state is read from each run's final checkpoint (the tensors of
``optimizer.pt``); the step time is ``train_runtime / steps`` (data loading and the final checkpoint included, no
evaluation). One process, one run after the other, or each side in its own process (``--only``) into one ``--out``.

    python benchmarks/compare_lora.py gpt --steps 200
    python benchmarks/compare_lora.py bert --steps 100
    # side by side on a machine shared with others (the model cards' runs), one thread each:
    OMP_NUM_THREADS=1 python benchmarks/compare_lora.py gpt --out runs/compare_gpt --only lora &
    OMP_NUM_THREADS=1 python benchmarks/compare_lora.py gpt --out runs/compare_gpt --only full; wait
    python benchmarks/compare_lora.py gpt --out runs/compare_gpt          # the table from the two finished runs
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from mindformers_py.recipes import load_recipe, run_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"gpt": ROOT / "tasks" / "gpt" / "finetune_lora.yaml",
           "bert": ROOT / "tasks" / "bert" / "finetune_classification_lora.yaml"}
FULL_LR = {"gpt": 3e-4, "bert": 1e-4}  # full fine-tuning's own rates (the BERT one is finetune_classification.yaml's)


def _numel(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _optimizer_bytes(checkpoint: Path) -> int:
    state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)["state"]
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))


def finished_row(out: Path, steps: int) -> dict[str, float] | None:
    """The figures of a run that ended in ``out`` (its log's last training summary and evaluation, its final
    checkpoint's AdamW state, its saved weights), or None when it has not finished ``steps`` steps."""
    log, checkpoint = out / "log.jsonl", out / f"checkpoint-{steps}"
    if not log.is_file() or not checkpoint.is_dir():
        return None
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [r for r in records if "train_runtime" in r and r.get("step") == steps]
    evals = [r for r in records if "eval_loss" in r and r.get("step") == steps]
    if not train or not evals:
        return None
    weights = out / "adapter_model.safetensors"
    row = {"eval_loss": evals[-1]["eval_loss"], "step_s": train[-1]["train_runtime"] / steps,
           "optimizer_bytes": _optimizer_bytes(checkpoint),
           "trainable": _numel(weights if weights.is_file() else out / "model.safetensors")}
    if "eval_accuracy" in evals[-1]:
        row["eval_accuracy"] = evals[-1]["eval_accuracy"]
    return row


def run(kind: str, out: Path, steps: int, flags: list[str]) -> dict[str, float]:
    """Run the recipe into ``out`` for ``steps`` steps (unless a finished run is there already) and read its row."""
    row = finished_row(out, steps)
    if row is not None:
        return row
    run_recipe(load_recipe(RECIPES[kind]), [
        "--output_dir", str(out), "--overwrite_output_dir", "true", "--max_steps", str(steps), "--eval_strategy",
        "no", "--save_strategy", "steps", "--save_steps", str(steps), "--save_total_limit", "null", "--report_to",
        "[]", "--disable_tqdm", "true", "--generate.prompts", "[]", *flags])
    row = finished_row(out, steps)
    assert row is not None, f"the run in {out} left no final evaluation or checkpoint"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(RECIPES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--base", help="the pretrained model folder (default: the recipe's)")
    parser.add_argument("--full-lr", type=float, help="full fine-tuning's learning rate (default: gpt 3e-4, bert 1e-4)")
    parser.add_argument("--out", help="folder for the two runs (default: a temporary one); runs finished there are "
                                      "read, not repeated")
    parser.add_argument("--only", choices=("lora", "full"),
                        help="run one side only (e.g. the two in parallel); the table needs both in --out")
    cli = parser.parse_args()
    out = Path(cli.out or tempfile.mkdtemp(prefix="compare_lora-"))
    base = ["--model.name_or_path", cli.base] if cli.base else []
    flags = {"lora": base, "full": [*base, "--peft", "null", "--learning_rate", str(cli.full_lr or FULL_LR[cli.kind])]}
    rows = {name: run(cli.kind, out / name, cli.steps, flags[name]) if cli.only in (None, name)
            else finished_row(out / name, cli.steps) for name in ("lora", "full")}
    if None in rows.values():
        print(f"{cli.only} done in {out / cli.only}; run the other side into {out} for the table")
        return
    lora, full = rows["lora"], rows["full"]
    print(f"{cli.kind}: {cli.steps} steps each, from the same model and data")
    print(f"{'':6} {'held-out loss':>13} {'accuracy':>9} {'trainable':>12} {'AdamW state':>12} {'s/step':>7}")
    for name, row in rows.items():
        accuracy = f"{row['eval_accuracy']:.1%}" if "eval_accuracy" in row else "-"
        print(f"{name:6} {row['eval_loss']:13.4f} {accuracy:>9} {row['trainable']:12,} "
              f"{row['optimizer_bytes'] / 2**20:10.2f} MiB {row['step_s']:7.3f}")
    print(f"LoRA / full: trainable {lora['trainable'] / full['trainable']:.2%}, AdamW state "
          f"{lora['optimizer_bytes'] / full['optimizer_bytes']:.2%}, step time {lora['step_s'] / full['step_s']:.2f}x")


if __name__ == "__main__":
    main()
