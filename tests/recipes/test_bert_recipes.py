"""BERT recipes: MLM pretraining gives stand_alone's per-step losses under the parallel layouts launched by the CLI
(masks are drawn per sample, so every layout masks the same tokens), and the MiniLM fine-tuning recipe trains,
evaluates and predicts (small settings here; the full run's accuracy is measured in the model card)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindformers_py.cli import main
from mindformers_py.data.masking import DataCollatorForMaskedLM, mask_sample

ROOT = Path(__file__).resolve().parents[2]
MLM = ROOT / "tasks" / "bert" / "pretrain_mlm_tiny.yaml"
SMALL_MLM = ["--model.num_hidden_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
             "--model.intermediate_size", "64", "--tokenizer.vocab_size", "600", "--data.max_files", "12",
             "--data.block_size", "32", "--data.max_eval_samples", "8", "--max_steps", "3", "--logging_steps", "1",
             "--warmup_steps", "0", "--per_device_train_batch_size", "8", "--report_to", "none",
             "--save_strategy", "no", "--eval_strategy", "no", "--generate.prompts", "[]", "--disable_tqdm", "true",
             "--bf16", "false"]  # fp32: layouts are compared with stand-alone to 1e-4
LAYOUTS = {
    "dp2_zero3": ["--data_parallel", "2", "--optimizer_shard", "3", "--per_device_train_batch_size", "4"],
    "tp2_sequence_vocab_parallel": ["--model_parallel", "2", "--use_seq_parallel", "true", "--vocab_emb_dp", "false"],
    "pp2": ["--pipeline_stage", "2", "--micro_batch_num", "2"],
}

# The MiniLM fine-tuning recipes at test size
SMALL_FINETUNE = ["--max_steps", "3", "--per_device_train_batch_size", "8", "--data.block_size", "32",
                  "--data.max_eval_samples", "32", "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]


def run_cli(*args, capsys):
    code = main(["run", *map(str, args)])
    return code, capsys.readouterr()


def losses(outdir: Path) -> list[float]:
    history = json.loads((outdir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


def test_mlm_recipe_gives_stand_alone_losses_under_parallel_layouts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MINDFORMERS_PY_CACHE", str(tmp_path / "cache"))
    code, out = run_cli(MLM, *SMALL_MLM, "--output_dir", tmp_path / "sa", capsys=capsys)
    assert code == 0, out.err
    reference = losses(tmp_path / "sa")
    assert len(reference) == 3 and all(4.0 < loss < 8.0 for loss in reference)  # about ln(600) at the start
    assert json.loads((tmp_path / "sa" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    for name, layout in LAYOUTS.items():
        code, out = run_cli(MLM, *SMALL_MLM, "--output_dir", tmp_path / name, "--parallel_mode", "semi_auto_parallel",
                            *layout, capsys=capsys)
        assert code == 0, (name, out.err)
        got = losses(tmp_path / name)
        assert len(got) == 3 and all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(reference, got)), (name, reference, got)


def test_masks_depend_on_the_sample_not_on_the_batch():
    """A global batch masked whole, or as two data-parallel halves, or in another order, masks each sample alike."""
    from bert_models import wordpiece_tokenizer

    tokenizer = wordpiece_tokenizer(Path(__import__("tempfile").mkdtemp()))
    texts = ["the capital of france is paris", "berlin is the capital of germany", "rome lives in italy",
             "how many people live in london", "the river seine flows through paris"]
    rows = [{"input_ids": ids} for ids in tokenizer(texts)["input_ids"]]
    collate = DataCollatorForMaskedLM(tokenizer, mlm_probability=0.4, seed=3)
    whole = collate(rows)
    halves = [collate(rows[:2]), collate(rows[2:])]
    reordered = collate(rows[::-1])
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        part, j = (halves[0], i) if i < 2 else (halves[1], i - 2)
        for batch, k in ((part, j), (reordered, len(rows) - 1 - i)):
            assert torch.equal(batch["input_ids"][k, :n], whole["input_ids"][i, :n])
            assert torch.equal(batch["labels"][k, :n], whole["labels"][i, :n])
    assert (whole["labels"] != -100).any()
    # special tokens are never chosen; another seed masks differently
    assert (whole["labels"][whole["input_ids"] == tokenizer.cls_token_id] == -100).all()
    ids = rows[0]["input_ids"]
    special = [False] * len(ids)
    assert mask_sample(ids, special, mask_token_id=4, vocab_size=100, seed=3, mlm_probability=0.5) != \
        mask_sample(ids, special, mask_token_id=4, vocab_size=100, seed=4, mlm_probability=0.5)


def test_minilm_finetuning_recipe_trains_evaluates_and_predicts(tmp_path, capsys, monkeypatch):
    recipe = ROOT / "tasks" / "bert" / "finetune_classification.yaml"
    code, out = run_cli(recipe, *SMALL_FINETUNE, "--output_dir", tmp_path / "out", capsys=capsys)
    assert code == 0, out.err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"] and len(config["id2label"]) == 10
    assert {"asyncio", "email", "tkinter"} <= set(config["id2label"].values())
    assert "'label':" in out.out  # the pipeline ran on the recipe's prompts
    resolved = tmp_path / "out" / "run_config.yaml"
    code, out = run_cli(resolved, "--run_mode", "eval", "--model.name_or_path", tmp_path / "out", "--output_dir",
                        tmp_path / "eval", capsys=capsys)
    assert code == 0, out.err
    code, out = run_cli(resolved, "--run_mode", "predict", "--model.name_or_path", tmp_path / "out", "--output_dir",
                        tmp_path / "predict", capsys=capsys)
    assert code == 0, out.err
    assert (tmp_path / "predict" / "predictions.txt").read_text().count("'label':") == 3


def test_minilm_lora_recipe_trains_the_adapter_and_predicts_from_its_folder(tmp_path, capsys):
    """The LoRA recipe on the packaged MiniLM: only the adapter and the new classifier are trained and saved (peft's
    SEQ_CLS format, 77,578 tensors' elements as the model card says), and the saved folder predicts."""
    import math

    from safetensors import safe_open

    recipe = ROOT / "tasks" / "bert" / "finetune_classification_lora.yaml"
    code, out = run_cli(recipe, *SMALL_FINETUNE, "--output_dir", tmp_path / "out", capsys=capsys)
    assert code == 0, out.err
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["task_type"] == "SEQ_CLS" and "classifier" in saved["modules_to_save"]
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert sum(math.prod(f.get_slice(k).get_shape()) for k in names) == 6 * 2 * 8 * (384 + 384) + 384 * 10 + 10
    assert {n.split(".")[-2] for n in names} == {"lora_A", "lora_B", "classifier"}
    # Predicted again from the saved folder: its base model, sized by the run's labels (run_config.yaml), then the
    # adapter; a pipeline given the folder alone cannot know the labels, and says what is missing.
    code, out = run_cli(tmp_path / "out" / "run_config.yaml", "--run_mode", "predict", "--model.name_or_path",
                        tmp_path / "out", "--output_dir", tmp_path / "predict", capsys=capsys)
    assert code == 0, out.err
    assert (tmp_path / "predict" / "predictions.txt").read_text().count("'label':") == 2
    from mindformers_py import pipeline
    from mindformers_py.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"size mismatch for .*classifier.*: load its base model with the run's"):
        pipeline("text-classification", model=str(tmp_path / "out"))
