"""The Qwen3 recipes through the CLI at test size: the tiny Qwen3-MoE pretraining (tasks/gpt_moe/
pretrain_qwen3_moe_tiny.yaml) with its per-layer expert loads in the logs and its checkpoint exported as transformers'
qwen3_moe; and LoRA from a Qwen3-MoE checkpoint folder made by transformers (tasks/gpt/finetune_lora_qwen3.yaml),
adapting the experts' projections by name, under ep2 too (its frozen head split over the two ranks); and the tiny
DeepSeek-V3 pretraining (tasks/gpt_moe/pretrain_deepseek_v3_tiny.yaml) with its balancing biases saved and exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from mindformers_py.cli import main

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "tasks" / "gpt_moe" / "pretrain_qwen3_moe_tiny.yaml"
LORA = ROOT / "tasks" / "gpt" / "finetune_lora_qwen3.yaml"
TEXT = "\n".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
EP2 = ["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--expert_parallel", "2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_recipes")
    (folder / "train.txt").write_text(TEXT)
    (folder / "val.txt").write_text(TEXT[:3000])
    pairs = [{"prompt": f"# Write the function number {i}:\n", "response": f"def function_{i}(x):\n    return x * {i}\n"}
             for i in range(64)]
    for name, rows in (("train.jsonl", pairs[:48]), ("val.jsonl", pairs[48:])):
        (folder / name).write_text("\n".join(json.dumps(r) for r in rows))
    return folder


def _logs(out: Path) -> list[dict]:
    return [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def pretrain(files: Path, out: Path, *flags: str) -> int:
    """The recipe at test size: 2 layers of width 64 with 4 experts of 32, 32-token blocks, 3 steps, fp32."""
    small = ["--model.num_hidden_layers", "2", "--model.hidden_size", "64", "--model.max_position_embeddings", "64",
             "--model.moe_config.expert_num", "4", "--model.moe_config.moe_intermediate_size", "32",
             "--tokenizer.vocab_size", "300", "--data.source", "files", "--data.train_files", str(files / "train.txt"),
             "--data.validation_files", str(files / "val.txt"), "--data.block_size", "32", "--max_steps", "3",
             "--logging_steps", "1", "--learning_rate", "0.01", "--disable_tqdm", "true", "--save_strategy", "no",
             "--eval_strategy", "no", "--generate.prompts", "[]", "--output_dir", str(out), "--report_to", "[]",
             "--per_device_train_batch_size", "8", "--bf16", "false"]
    return main(["run", str(PRETRAIN), *small, *flags])


def test_qwen3_moe_pretraining_recipe_logs_each_layer_and_exports(files, tmp_path, monkeypatch):
    """Stand-alone only: the recipe's model under expert parallelism is test_moe_parallel.py's (qwen3_moe_* layouts,
    gradients against stand-alone) and the CLI's MoE layouts are test_moe_recipe.py's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert pretrain(files, tmp_path / "sa") == 0
    logs = _logs(tmp_path / "sa")
    assert len(logs) == 3 and logs[-1]["loss"] < logs[0]["loss"]
    for h in logs:  # each MoE layer's most loaded expert against its mean; their mean is the overall figure
        layers = [h[f"load_imbalance/layer_{i}"] for i in range(2)]
        assert all(value >= 1 for value in layers) and sum(layers) / 2 == pytest.approx(h["load_imbalance"])
    config = json.loads((tmp_path / "sa" / "config.json").read_text())
    assert config["qk_norm"] and config["moe_config"]["shared_expert_num"] == 0
    assert main(["convert", str(tmp_path / "sa"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def qwen3_moe_folder(files, tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint folder as transformers writes it (per-expert tensors), with a tokenizer."""
    from mindformers_py.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("qwen3_moe_checkpoint")
    tokenizer = train_bpe_tokenizer([TEXT] * 2, 300)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def lora(files: Path, folder: Path, out: Path, *flags: str) -> int:
    return main(["run", str(LORA), "--model.name_or_path", str(folder), "--data.source", "files",
                 "--data.train_files", str(files / "train.jsonl"), "--data.validation_files", str(files / "val.jsonl"),
                 "--data.text_column", "prompt", "--data.target_column", "response", "--data.block_size", "32",
                 "--peft.r", "4", "--max_steps", "3", "--gradient_accumulation_steps", "1", "--warmup_steps", "0",
                 "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "[]",
                 "--disable_tqdm", "true", "--generate.prompts", "[]", "--bf16", "false", "--output_dir", str(out),
                 *flags])


def test_lora_recipe_from_a_qwen3_moe_folder_adapts_the_experts(files, qwen3_moe_folder, tmp_path, monkeypatch,
                                                                capfd):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert lora(files, qwen3_moe_folder, tmp_path / "sa", "--per_device_train_batch_size", "4") == 0
    # ep2 with the frozen head's rows split over the two ranks as well (shard_frozen_head)
    assert lora(files, qwen3_moe_folder, tmp_path / "ep2", "--per_device_train_batch_size", "2", *EP2,
                "--shard_frozen_head", "true") == 0
    # the recipe's fused_loss: the frozen head folded into the loss on one process and on each expert-parallel rank
    out, err = capfd.readouterr()
    assert err.count("causal-LM loss: fused linear cross-entropy (in the model's forward)") == 2
    assert "frozen head split over 2 ranks" in out + err  # (the layout line)
    saved = json.loads((tmp_path / "sa" / "adapter_config.json").read_text())
    assert saved["target_parameters"] == ["experts.down_proj", "experts.gate_proj", "experts.up_proj"]
    assert saved["base_model_name_or_path"] == str(qwen3_moe_folder)
    expected, got = _logs(tmp_path / "sa"), _logs(tmp_path / "ep2")
    assert [h["loss"] for h in got] == pytest.approx([h["loss"] for h in expected], rel=1e-4)
    assert expected[-1]["loss"] < expected[0]["loss"]


DEEPSEEK = ROOT / "tasks" / "gpt_moe" / "pretrain_deepseek_v3_tiny.yaml"


def test_deepseek_v3_pretraining_recipe_balances_its_experts_and_exports(files, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 recipe at test size: its selection biases move from zero (auxiliary-loss-free balancing)
    and are saved; the checkpoint exports as transformers' deepseek_v3, which reads the biases back."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "ds"
    small = ["--model.num_hidden_layers", "2", "--model.max_position_embeddings", "64", "--tokenizer.vocab_size", "300",
             "--data.source", "files", "--data.train_files", str(files / "train.txt"), "--data.validation_files",
             str(files / "val.txt"), "--data.block_size", "32", "--max_steps", "3", "--logging_steps", "1",
             "--learning_rate", "0.01", "--disable_tqdm", "true", "--save_strategy", "no", "--eval_strategy", "no",
             "--generate.prompts", "[]", "--output_dir", str(out), "--report_to", "[]",
             "--per_device_train_batch_size", "8", "--bf16", "false", "--model.moe_config.bias_update_rate", "0.01"]
    assert main(["run", str(DEEPSEEK), *small]) == 0
    logs = _logs(out)
    assert len(logs) == 3 and all(h["load_imbalance/layer_1"] >= 1 for h in logs)
    from safetensors.torch import load_file

    bias = load_file(out / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # three steps of +-0.01 moves
    assert main(["convert", str(out), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)
