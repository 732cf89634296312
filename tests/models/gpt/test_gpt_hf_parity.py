"""HF checkpoints of gpt2/llama/mistral/qwen2 load into GPTForCausalLM with equal logits and greedy tokens, and
export back to the HF class with equal logits."""

import pytest
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, tiny_hf_model

KINDS = ["gpt2", "llama", "mistral", "qwen2"]


@pytest.fixture(params=KINDS)
def hf_dir(request, tmp_path):
    model = tiny_hf_model(request.param)
    path = tmp_path / request.param
    model.save_pretrained(path)
    return request.param, model, path


def test_logits_match_hf(hf_dir):
    kind, hf, path = hf_dir
    ours = mf.AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(ours, mf.GPTForCausalLM) and ours.config.hf_architecture == kind
    ids = torch.randint(3, VOCAB, (2, 17))
    with torch.no_grad():
        diff = (ours(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_padded_batch_logits_match_hf(hf_dir):
    kind, hf, path = hf_dir
    ours = mf.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, position_ids=pos).logits
        b = hf(ids, attention_mask=mask, position_ids=pos).logits
    keep = mask.bool()
    assert (a[keep] - b[keep]).abs().max().item() <= 1e-4


def test_greedy_generation_token_identical(hf_dir):
    kind, hf, path = hf_dir
    ours = mf.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(3, VOCAB, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


def test_export_to_hf_roundtrip(hf_dir, tmp_path):
    kind, hf, path = hf_dir
    ours_dir = tmp_path / "ours"
    mf.convert_checkpoint(path, ours_dir, to="mindformers")
    ours = mf.AutoModelForCausalLM.from_pretrained(ours_dir)
    back = tmp_path / "back"
    mf.convert_checkpoint(ours_dir, back, to="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        assert (reloaded(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_transformers_auto_loads_our_checkpoint(tmp_path):
    model = mf.AutoModelForCausalLM.from_pretrained("llama_tiny")
    model.save_pretrained(tmp_path / "m")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert isinstance(loaded, mf.GPTForCausalLM)
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_sharded_hf_checkpoint_loads(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_cli_convert(tmp_path):
    from mindformers_py.cli import main

    tiny_hf_model("gpt2").save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ours"), "--to", "mindformers"]) == 0
    assert mf.AutoConfig.from_pretrained(tmp_path / "ours").model_type == "mindformers_gpt"
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "hf"]) == 2


def test_llama3_scaled_rope_matches_hf(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = tiny_hf_model("llama", rope_parameters=rope)
    hf.save_pretrained(tmp_path)
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ours.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(3, VOCAB, (1, 40))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
