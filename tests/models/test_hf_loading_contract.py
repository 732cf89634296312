"""transformers' loading contract, part three (issue 37): each case loads the same tiny checkpoint with transformers'
Auto classes and ours and compares what comes back (logits in fp32, ``output_loading_info``, configs): fewer layers
and missing tensors, a stale index beside a single file, ``AutoConfig``'s keywords, config aliases, the
mismatched-keys format, ``config=`` as a folder, ``max_memory`` / ``offload_folder``, ``from_config``'s
``trust_remote_code`` and an adapter folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import mindformers_py as mf
from support.hf_models import tiny_hf_model
from mindformers_py.errors import ConfigError

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 77]])


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Tiny transformers checkpoints (Llama, Qwen2 with its layer_types, GPT-2) saved as transformers saves them."""
    root = tmp_path_factory.mktemp("hf_loading")
    for kind in ("llama", "qwen2", "gpt2"):
        tiny_hf_model(kind).save_pretrained(root / kind)
    return root


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _close(ours, theirs) -> bool:
    return bool((_logits(ours) - _logits(theirs)).abs().max() <= 1e-4)


# -- 5. fewer layers, missing tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fewer_layers_load_and_report_the_unused_tensors(hf_folders, kind):
    folder = hf_folders / kind
    theirs, their_info = transformers.AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=1,
                                                                           output_loading_info=True)
    ours, info = mf.AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=1, output_loading_info=True)
    assert info == their_info and len(info["unexpected_keys"]) >= 9 and not info["missing_keys"]
    assert ours.config.num_hidden_layers == 1 and _close(ours, theirs)
    # a config with fewer layers, given as config=
    config = transformers.AutoConfig.from_pretrained(folder, num_hidden_layers=1)
    assert _close(mf.AutoModelForCausalLM.from_pretrained(folder, config=config), theirs)


def test_a_missing_body_tensor_is_initialised_reported_and_warned(hf_folders, tmp_path, caplog):
    folder = tmp_path / "holed"
    transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama").save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    _, their_info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    with caplog.at_level(logging.WARNING, logger="mindformers_py"):
        ours, info = mf.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info == their_info and info["missing_keys"] == {"model.layers.1.mlp.down_proj.weight"}
    assert "model.layers.1.mlp.down_proj.weight not in" in caplog.text and "newly initialised" in caplog.text
    new = ours.model.layers[1].mlp.down_proj.weight
    assert torch.isfinite(new).all() and new.std() > 0  # the model's own init
    assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, state["model.layers.1.mlp.up_proj.weight"])


# -- 6. a single file beside a stale index ----------------------------------------------------------------------------


def test_a_single_file_beside_a_stale_index_loads_and_shards_win_over_a_stale_single_file(hf_folders, tmp_path):
    """transformers' save_pretrained leaves both kinds of folder. Single over sharded (the index stays, its shards
    go): both load the single file. Sharded over single (the single file stays): transformers loads the stale single
    file, we load the shards the index lists (docs/hf-habits.md says so)."""
    single_over_sharded, sharded_over_single = tmp_path / "a", tmp_path / "b"
    stale = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama")
    stale.save_pretrained(single_over_sharded, max_shard_size="20KB")
    stale.save_pretrained(sharded_over_single)
    new = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama")
    with torch.no_grad():
        new.lm_head.weight.add_(1.0)
    new.save_pretrained(single_over_sharded)
    new.save_pretrained(sharded_over_single, max_shard_size="20KB")
    for folder in (single_over_sharded, sharded_over_single):
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "model.safetensors.index.json"} <= names
    assert _close(transformers.AutoModelForCausalLM.from_pretrained(single_over_sharded), new)
    assert _close(mf.AutoModelForCausalLM.from_pretrained(single_over_sharded), new)
    assert _close(transformers.AutoModelForCausalLM.from_pretrained(sharded_over_single), stale)  # theirs: stale
    assert _close(mf.AutoModelForCausalLM.from_pretrained(sharded_over_single), new)


# -- 8. AutoConfig's keywords -----------------------------------------------------------------------------------------


def test_auto_config_takes_transformers_keywords(hf_folders, tmp_path):
    repo = tmp_path / "repo"
    transformers.AutoConfig.from_pretrained(hf_folders / "llama").save_pretrained(repo / "sub")
    kw = dict(trust_remote_code=True, revision="main", local_files_only=True, cache_dir=str(tmp_path / "cache"),
              subfolder="sub", return_unused_kwargs=True, not_a_field=1, rms_norm_eps=1e-3)
    theirs, their_unused = transformers.AutoConfig.from_pretrained(repo, **kw)
    ours, unused = mf.AutoConfig.from_pretrained(repo, **kw)
    assert unused == their_unused == {"not_a_field": 1}
    assert ours.rms_norm_eps == ours.norm_eps == theirs.rms_norm_eps == 1e-3
    assert ours.num_hidden_layers == theirs.num_hidden_layers
    with pytest.raises(ConfigError, match=r"'not_a_field' is neither a GPTConfig field .* nor an "
                                          r"AutoConfig.from_pretrained argument \(subfolder, return_unused_kwargs, "):
        mf.AutoConfig.from_pretrained(repo, subfolder="sub", not_a_field=1)


# -- 12. config aliases -------------------------------------------------------------------------------------------------


def test_config_aliases_of_the_checkpoint_architecture(hf_folders):
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", rms_norm_eps=0.5)
    ours = mf.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", rms_norm_eps=0.5)
    assert ours.config.norm_eps == 0.5 and _close(ours, theirs)
    assert not _close(ours, transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama"))  # it counts
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "gpt2", n_inner=None)
    ours = mf.AutoModelForCausalLM.from_pretrained(hf_folders / "gpt2", n_inner=None)
    assert ours.config.intermediate_size == 4 * 32 and _close(ours, theirs)


# -- 14. output_loading_info's mismatched keys ---------------------------------------------------------------------------


def test_mismatched_keys_are_name_and_both_shapes_and_not_missing(hf_folders, tmp_path):
    transformers.AutoModelForSequenceClassification.from_pretrained(hf_folders / "llama", num_labels=3) \
        .save_pretrained(tmp_path / "cls3")
    kw = dict(num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    _, theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls3", **kw)
    _, ours = mf.AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls3", **kw)
    assert ours == theirs
    assert ours["mismatched_keys"] == {("score.weight", (3, 32), (5, 32))} and not ours["missing_keys"]


# -- 15. config= as a folder, max_memory / offload_folder, from_config's trust_remote_code, an adapter folder -----------


def test_config_as_a_folder_and_from_config_trust_remote_code(hf_folders):
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", config=str(hf_folders / "llama"))
    ours = mf.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", config=str(hf_folders / "llama"))
    assert _close(ours, theirs)
    config = transformers.AutoConfig.from_pretrained(hf_folders / "llama")
    assert type(transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)).__name__ == \
        "LlamaForCausalLM"
    assert isinstance(mf.AutoModelForCausalLM.from_config(config, trust_remote_code=True), mf.GPTForCausalLM)


def test_max_memory_and_offload_folder_with_device_map_auto(hf_folders, tmp_path):
    """A budget too small for the model sends its layers to disk in both (transformers reads them from the
    checkpoint's own safetensors files; accelerate writes ours into the offload folder)."""
    for budget in ("10GB", "60KB"):
        kw = dict(device_map="auto", max_memory={"cpu": budget})
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", offload_folder=str(
            tmp_path / f"hf{budget}"), **kw)
        ours = mf.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", offload_folder=str(
            tmp_path / f"ours{budget}"), **kw)
        assert _close(ours, theirs)
        on_disk = "disk" in getattr(theirs, "hf_device_map", {}).values()
        assert on_disk == ("disk" in ours.hf_device_map.values()) == (budget == "60KB")
        assert bool(list((tmp_path / f"ours{budget}").glob("model.layers.*.dat"))) == on_disk
    with pytest.raises(ConfigError, match=r"max_memory plans where modules go and needs device_map='auto'"):
        mf.AutoModelForCausalLM.from_pretrained(hf_folders / "llama", max_memory={"cpu": "1GB"})


def test_an_adapter_folder_loads_its_base_model_with_the_adapter(hf_folders, tmp_path):
    peft = pytest.importorskip("peft")
    tuned = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama"),
                                peft.LoraConfig(r=4, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_()
    tuned.save_pretrained(tmp_path / "adapter")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    ours = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    assert isinstance(ours, mf.GPTForCausalLM) and list(ours.peft_config) == list(theirs.peft_config) == ["default"]
    assert _close(ours, theirs) and _close(ours, tuned)
    assert not _close(ours, transformers.AutoModelForCausalLM.from_pretrained(hf_folders / "llama"))
