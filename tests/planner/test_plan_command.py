"""``mindformers-py plan``: from a preset, a recipe, an HF config.json or a checkpoint folder; every family the
planner reads; JSON for tools; one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import mindformers_py as mf
from mindformers_py.cli import main
from mindformers_py.parallel import ParallelConfig
from mindformers_py.planner.device_spec import load_device

ROOT = Path(__file__).resolve().parents[2]

# meta-llama/Meta-Llama-3-70B config.json (the fields the planner reads).
LLAMA_3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768}


def plan_cli(*args, capsys):
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(*args, capsys) -> dict:
    code, out, err = plan_cli(*args, "--json", capsys=capsys)
    assert code == 0, err
    return json.loads(out)


def write_config(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def check_report(report: dict) -> None:
    """The chosen layout fits, is the fastest that fits, uses every device, and its step time is its terms."""
    chosen = report["chosen"]
    fitting = [c for c in report["candidates"] if c["fits"]]
    assert chosen["fits"] and chosen["tokens_per_second"] == max(c["tokens_per_second"] for c in fitting)
    assert chosen["data_parallel"] * chosen["model_parallel"] * chosen["pipeline_stage"] == report["devices"]
    assert chosen["memory_bytes"]["total"] <= load_device(report["device"]["name"]).usable_bytes
    for c in report["candidates"]:
        terms = {k: v for k, v in c["step_seconds"].items() if k != "total"}
        assert sum(terms.values()) == pytest.approx(c["step_seconds"]["total"])
    config = ParallelConfig.from_dict(chosen["parallel_config"])
    config.validate_for(report["devices"])


def test_plan_from_a_preset_prints_the_layouts_that_fit_with_the_choice_marked(capsys):
    code, out, err = plan_cli("llama_1b", "--devices", 16, "--global_batch", 64, "--seq_length", 2048, capsys=capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert "llama_1b" in lines[0] and "1.24 B parameters" in lines[0] and "16 x h100_80gb" in lines[1]
    chosen = [line for line in lines if line.startswith("*  dp=")]
    assert len(chosen) == 1
    header = next(line for line in lines if "mem/rank" in line)
    for column in ("compute", "TP", "EP", "DP", "PP", "bubble", "tokens/s", "MFU"):
        assert column in header
    section = out.split("as a recipe's parallel section: ")[1]
    config = ParallelConfig.from_dict(yaml.safe_load(section))  # pastes into a recipe as it is
    assert config.parallel_mode == "semi_auto_parallel" and config.required_world_size() == 16


def test_plan_from_a_recipe_takes_its_batch_block_size_and_model(capsys):
    recipe = ROOT / "tasks" / "gpt" / "pretrain_tiny.yaml"
    report = plan_json(recipe, "--devices", 4, "--device", "a100_80gb", capsys=capsys)
    # every layout plans the recipe's global batch (16 per rank x its 1 data-parallel rank), so throughputs compare
    assert report["global_batch"] == 16 and report["seq_length"] == 128
    assert report["batch_origin"].startswith("the recipe's: 16 per rank x 1 data-parallel rank")
    assert {c["per_device_batch"] * c["data_parallel"] for c in report["candidates"]} == {16}
    assert report["model"]["layers"] == 4 and report["model"]["hidden"] == 256
    check_report(report)
    overridden = plan_json(recipe, "--devices", 4, "--global_batch", 32, "--seq_length", 64, capsys=capsys)
    assert overridden["global_batch"] == 32 and overridden["seq_length"] == 64


def test_plan_from_an_hf_llama_3_70b_config(tmp_path, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = write_config(tmp_path, LLAMA_3_70B)
    report = plan_json(path, "--devices", 512, "--device", "a100_80gb", "--global_batch", 1024, "--seq_length",
                       4096, capsys=capsys)
    with torch.device("meta"):
        reference = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA_3_70B.items() if k != "architectures"}))
    assert report["model"]["parameters"] == reference.num_parameters()
    check_report(report)
    assert report["chosen"]["model_parallel"] <= 8  # tensor parallelism stays within a node
    assert 0 < report["chosen"]["mfu"] < 1
    # A checkpoint folder holding the same config.json plans the same.
    folder = plan_json(tmp_path, "--devices", 512, "--device", "a100_80gb", "--global_batch", 1024,
                       "--seq_length", 4096, capsys=capsys)
    assert folder["chosen"]["layout"] == report["chosen"]["layout"]


def test_plan_of_a_mixture_of_experts_weighs_expert_parallelism(tmp_path, capsys):
    code, out, err = plan_cli(write_config(tmp_path, MIXTRAL_8X7B), "--devices", 64, "--global_batch", 256,
                              "--seq_length", 4096, capsys=capsys)
    assert code == 0, err
    section = yaml.safe_load(out.split("as a recipe's parallel section: ")[1])
    assert ParallelConfig.from_dict(section).required_world_size() == 64
    report = plan_json(write_config(tmp_path, MIXTRAL_8X7B), "--devices", 64, "--global_batch", 256,
                       "--seq_length", 4096, capsys=capsys)
    check_report(report)
    assert report["model"]["experts"] == 8 and report["model"]["top_k"] == 2
    by_ep = {}
    for c in report["candidates"]:
        assert c["data_parallel"] % c["expert_parallel"] == 0 and 8 % c["expert_parallel"] == 0
        by_ep.setdefault(c["expert_parallel"], []).append(c)
    assert set(by_ep) == {1, 2, 4, 8}
    assert all(c["step_seconds"]["expert_parallel"] == 0 for c in by_ep[1])
    assert all(c["step_seconds"]["expert_parallel"] > 0 for c in by_ep[8])


@pytest.mark.parametrize("config, seq", [
    ({"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
      "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936,
      "max_position_embeddings": 8192}, 4096),
    ({"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
      "intermediate_size": 4096, "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2}, 512),
    ({"model_type": "t5", "d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 24, "num_heads": 16,
      "vocab_size": 32128, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}, 512),
    ({"model_type": "vit", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
      "intermediate_size": 4096, "image_size": 224, "patch_size": 16}, 197),
], ids=["qwen2_moe", "bert", "t5", "vit"])
def test_plan_reads_every_family(tmp_path, capsys, config, seq):
    report = plan_json(write_config(tmp_path, config), "--devices", 16, "--device", "a100_80gb", capsys=capsys)
    check_report(report)
    assert report["seq_length"] == seq  # the model's context; T5's pretraining length; ViT's patches + class token
    assert report["global_batch"] == 16  # one sequence per device unless told


def test_device_fields_can_be_overridden(capsys):
    base = plan_json("gpt_small", "--devices", 8, "--device", "a100_40gb", capsys=capsys)
    assert base["device"]["memory_bytes"] == 40 * 1024**3 and base["device"]["devices_per_node"] == 8
    report = plan_json("gpt_small", "--devices", 8, "--device", "a100_40gb", "--set", "memory=96GiB", "--set",
                       "inter_node_bandwidth=50e9", "--devices_per_node", 4, capsys=capsys)
    assert report["device"]["memory_bytes"] == 96 * 1024**3
    assert report["device"]["inter_node_bandwidth"] == 50e9 and report["device"]["devices_per_node"] == 4
    assert all(c["model_parallel"] <= 4 for c in report["candidates"])


@pytest.mark.parametrize("args, message", [
    (["gpt_small", "--devices", 8, "--device", "tpu_v9"], "device='tpu_v9' is not known; choose one of: a100_40gb"),
    (["gpt_small", "--devices", 8, "--set", "warp_drive=1"], "device field 'warp_drive' is not known"),
    (["gpt_small", "--devices", 8, "--set", "memory"], "--set 'memory' is not valid; expected FIELD=VALUE"),
    (["gpt_small", "--devices", 8, "--set", "flops=fast"], "device field flops='fast' is not valid"),
    (["gpt_small", "--devices", 8, "--set", "memory=lots"], "device field memory='lots' is not valid"),
    (["gpt_small", "--devices", 0], "devices=0 is not valid"),
    (["no_such_preset", "--devices", 8], "'no_such_preset' is no local folder, no preset (presets: gpt_tiny, "),
    (["gpt_smal", "--devices", 8], "'gpt_smal' is no local folder, no preset (did you mean the preset 'gpt_small'?)"),
    (["runs/nope", "--devices", 8], "'runs/nope' is no local folder, no preset"),
    (["./runs/nope", "--devices", 8], "no such folder: './runs/nope'"),
    (["missing/config.json", "--devices", 8], "config file missing/config.json does not exist"),
    (["missing.yaml", "--devices", 8], "recipe missing.yaml does not exist"),
    (["gpt_small", "--devices", 3, "--global_batch", 2], "found no valid layout for world_size=3"),
])
def test_bad_input_is_one_line(capsys, args, message):
    code, out, err = plan_cli(*args, capsys=capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_damaged_or_unknown_configs_are_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama", "hidden_size": ')
    code, _, err = plan_cli(broken, "--devices", 8, capsys=capsys)
    assert code == 2 and "is not valid JSON" in err and len(err.strip().splitlines()) == 1
    code, _, err = plan_cli(write_config(tmp_path, {"model_type": "mamba"}, "mamba.json"), "--devices", 8, capsys=capsys)
    assert code == 2 and "model_type='mamba'" in err and "choose one of" in err
    bad = write_config(tmp_path, {"model_type": "mixtral", "hidden_size": 0}, "bad.json")  # read as our GPT-MoE
    code, _, err = plan_cli(bad, "--devices", 8, capsys=capsys)
    assert code == 2 and "hidden_size=0" in err and len(err.strip().splitlines()) == 1
    vit = write_config(tmp_path, {"model_type": "vit", "hidden_size": 768, "num_hidden_layers": 12,
                                  "num_attention_heads": 12, "image_size": 224, "patch_size": 16}, "vit.json")
    code, _, err = plan_cli(vit, "--devices", 8, "--seq_length", 1024, capsys=capsys)
    assert code == 2 and "seq_length=1024 does not apply to vit" in err


def test_a_model_that_fits_no_layout_is_one_line(tmp_path, capsys):
    code, _, err = plan_cli(write_config(tmp_path, LLAMA_3_70B), "--devices", 2, "--seq_length", 4096, capsys=capsys)
    assert code == 2 and "no layout that fits memory_budget=80.00 GiB per rank" in err
    assert len(err.strip().splitlines()) == 1


def test_plan_is_in_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "plan" in capsys.readouterr().out
    assert mf.__version__


def test_the_planner_does_not_split_a_fixed_token_count_sequence_parallelism_cannot(capsys):
    """The ViT recipe's 50 tokens (49 patches and the class token): tp4 layouts are planned without sequence
    parallelism (it cannot split 50 tokens over 4 ranks; they were dropped whole), tp2 ones with it."""
    report = plan_json(ROOT / "tasks" / "vit" / "finetune_digits.yaml", "--devices", "8", "--top", "0", capsys=capsys)
    layouts = [c["parallel_config"] for c in report["candidates"]]
    tp4 = [c for c in layouts if c.get("model_parallel") == 4]
    tp2 = [c for c in layouts if c.get("model_parallel") == 2]
    assert tp4 and not any(c.get("use_seq_parallel") for c in tp4)
    assert tp2 and all(c.get("use_seq_parallel") for c in tp2)
