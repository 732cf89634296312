"""The T5 summarisation recipe fine-tunes, generates during evaluation and reports ROUGE / BLEU beside its baselines
(small settings; both T5 recipes under the parallel layouts are compared with stand-alone in
test_recipe_layouts.py)."""

import json
from pathlib import Path


from mindformers_py.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL_MODEL = ["--model.num_layers", "1", "--model.hidden_size", "32", "--model.head_dim", "8",
               "--model.num_attention_heads", "4", "--model.intermediate_size", "64"]
SMALL_DATA = ["--data.max_files", "12", "--tokenizer.vocab_size", "600", "--data.block_size", "48",
              "--data.max_eval_samples", "16"]


def run(recipe: str, *args, capsys) -> None:
    code = main(["run", str(ROOT / "tasks" / "t5" / recipe), *map(str, args)])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]


def test_summarization_recipe_reports_rouge_bleu_and_baselines(tmp_path, capsys):
    run("finetune_summarization.yaml", "--model.name_or_path", "t5_tiny", *SMALL_MODEL, *SMALL_DATA,
        "--data.max_target_length", "12", "--max_steps", "3", "--eval_steps", "3", "--logging_steps", "1",
        "--report_to", "none", "--generation_max_length", "8", "--output_dir", tmp_path / "out", "--eval_on_start",
        "true", "--generate.max_new_tokens", "6", "--generate.num_beams", "1", "--disable_tqdm", "true", capsys=capsys)
    out = tmp_path / "out"
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    keys = set().union(*logged)
    for prefix in ("eval", "baseline_function_name"):
        assert {f"{prefix}_rougeL", f"{prefix}_bleu"} <= keys, prefix
    # The model before fine-tuning (eval_on_start) at step 0, the trained one at step 3; each evaluation generated
    # for data.max_eval_samples=16 held-out functions, however many steps ran.
    evals = [r for r in logged if "eval_rougeL" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert all(round(r["eval_samples_per_second"] * r["eval_runtime"]) == 16 for r in evals)
    config = json.loads((out / "config.json").read_text())
    assert config["task_specific_params"]["summarization"]["prefix"] == "summarize: "
    assert (out / "samples.txt").read_text().count("----- sample") == 2
