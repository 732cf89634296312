"""BERT recipes: MLM masks are drawn per sample, so every layout masks the same tokens (the recipes under the parallel
layouts are compared with stand-alone in test_recipe_layouts.py), and the MiniLM fine-tuning recipe trains,
evaluates and predicts (small settings here; the full run's accuracy is measured in the model card)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindformers_py.cli import main
from mindformers_py.data.masking import DataCollatorForMaskedLM, mask_sample

ROOT = Path(__file__).resolve().parents[2]
# The MiniLM fine-tuning recipes at test size
SMALL_FINETUNE = ["--max_steps", "3", "--per_device_train_batch_size", "8", "--data.block_size", "32",
                  "--data.max_eval_samples", "32", "--eval_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]


def run_cli(*args, capsys):
    code = main(["run", *map(str, args)])
    return code, capsys.readouterr()


def test_masks_depend_on_the_sample_not_on_the_batch():
    """A global batch masked whole, or as two data-parallel halves, or in another order, masks each sample alike."""
    from support.bert_models import wordpiece_tokenizer

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
