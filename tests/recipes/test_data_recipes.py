"""The data recipes through the CLI, as the guide runs them: `mindformers-py preprocess` a JSONL, then
tasks/gpt/pretrain_megatron.yaml on its files (documents masked, the data position in the checkpoint, a resumed run
going on from it), and tasks/gpt/finetune_packed.yaml's packed instruction rows; tiny models, two steps each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindformers_py.cli import main
from mindformers_py.data.tokenizers.bpe_wordpiece import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.num_hidden_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "2",
        "--model.num_key_value_heads", "1", "--model.intermediate_size", "64", "--report_to", "none",
        "--generate.prompts", "[]", "--logging_steps", "1", "--bf16", "false"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_recipe")
    texts = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 4) for i in range(300)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_bpe_tokenizer(texts, vocab_size=300, save_dir=root / "tokenizer")
    assert main(["preprocess", "--input", str(root / "corpus.jsonl"), "--output-prefix", str(root / "corpus"),
                 "--tokenizer", str(root / "tokenizer"), "--append-eod", "--workers", "1"]) == 0
    return root


def test_pretraining_from_a_megatron_corpus_saves_and_resumes_its_data_position(corpus, capsys):
    out = corpus / "run"
    common = ["run", str(ROOT / "tasks/gpt/pretrain_megatron.yaml"), *TINY, "--tokenizer.name_or_path",
              str(corpus / "tokenizer"), "--data.data_path", f"[{corpus / 'corpus_text_document'}]",
              "--data.block_size", "64", "--model.max_position_embeddings", "64", "--per_device_train_batch_size", "2",
              "--eval_strategy", "no", "--save_steps", "2", "--output_dir", str(out)]
    assert main([*common, "--max_steps", "2"]) == 0
    position = json.loads((out / "checkpoint-2" / "data_state.json").read_text())
    assert position["samples_consumed"] == 4 and position["global_batch_size"] == 2
    assert list((corpus / "cache" / "GPTDataset_indices").glob("*-shuffle_index.npy"))  # cached beside the data
    assert main([*common, "--max_steps", "3", "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    capsys.readouterr()


def test_packed_fine_tuning_recipe_trains_on_packed_rows(corpus, capsys):
    code = main(["run", str(ROOT / "tasks/gpt/finetune_packed.yaml"), *TINY, "--run_mode", "train",
                 "--model.name_or_path", "gpt_tiny", "--tokenizer.name_or_path", str(corpus / "tokenizer"),
                 "--data.max_files", "10", "--data.block_size", "128", "--model.max_position_embeddings", "128",
                 "--max_steps", "2", "--eval_strategy", "no", "--save_strategy", "no",
                 "--output_dir", str(corpus / "sft")])
    assert code == 0, capsys.readouterr().err
    history = json.loads((corpus / "sft" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "loss" in h] == [1, 2]
