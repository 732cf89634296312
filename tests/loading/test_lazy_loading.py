"""``from_pretrained`` at real size, shown at toy size: the model is built on ``meta`` and each tensor is read lazily
from the memory-mapped shards, converted and placed once; nothing is randomly initialised and then overwritten; a
checkpoint already in the requested dtype is not even copied (its parameters are views of the files, as
transformers loads); the default dtype is transformers 5's (the checkpoint's); saving streams into size-bounded
shards with an index that transformers loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import mindformers_py as mf
from mindformers_py.loading.conversion_trace import ConversionTrace, Derived, Renamed
from mindformers_py.checkpoint.reader import CheckpointReader
from mindformers_py.models.gpt import convert_gpt
from mindformers_py.models.gpt.modeling_gpt import GPTPreTrainedModel


def _llama(tmp_path: Path, dtype: torch.dtype = torch.float32, shard: str = "40KB", tie: bool = False) -> tuple[Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tie)
    hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    folder = tmp_path / f"llama-{str(dtype).split('.')[-1]}"
    hf.save_pretrained(folder, max_shard_size=shard)
    return folder, hf


@pytest.fixture
def init_calls(monkeypatch):
    """The modules whose weights the GPT family's init drew (module names, in call order)."""
    calls = []
    original = GPTPreTrainedModel._init_weights

    def counted(self, module):
        if any(not p.is_meta for p in module.parameters(recurse=False)):
            calls.append(type(module).__name__)
        return original(self, module)

    monkeypatch.setattr(GPTPreTrainedModel, "_init_weights", counted)
    return calls


def test_a_sharded_checkpoint_loads_without_initialising_what_it_then_overwrites(tmp_path, init_calls):
    folder, hf = _llama(tmp_path)
    assert len(list(folder.glob("*.safetensors"))) > 2  # several shards with an index
    ours = mf.AutoModelForCausalLM.from_pretrained(folder)
    assert init_calls == []  # every weight came from the checkpoint: no init drew a value
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() <= 1e-5
    # a head the checkpoint lacks is the only thing initialised, by the model's own init
    classifier = mf.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3)
    assert init_calls == ["Linear"]
    assert 0.01 < classifier.score.weight.std().item() < 0.03  # initializer_range 0.02


def test_weights_already_in_the_requested_dtype_are_views_of_the_files(tmp_path):
    folder, _ = _llama(tmp_path, torch.bfloat16)
    model = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    shards = [str(p) for p in folder.glob("*.safetensors")]
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] in shards:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            mapped.append((start, end))
    in_files = [any(a <= p.data_ptr() < b for a, b in mapped) for p in model.parameters()]
    assert mapped and all(in_files)
    # written in place (training), the model's copy changes and the file does not
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    again = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert torch.equal(again.model.norm.weight + 1.0, model.model.norm.weight)
    # another dtype is converted one tensor at a time into memory of the process's own
    converted = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not any(any(a <= p.data_ptr() < b for a, b in mapped) for p in converted.parameters())


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_the_default_dtype_is_transformers_5s(tmp_path, saved):
    folder, _ = _llama(tmp_path, saved)
    for dtype in (None, "auto"):
        kwargs = {} if dtype is None else {"dtype": dtype}
        ours = mf.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        assert {p.dtype for p in ours.parameters()} == {p.dtype for p in theirs.parameters()} == {saved}
        assert ours.config.dtype == theirs.config.dtype == saved
    assert {p.dtype for p in mf.AutoModelForCausalLM.from_pretrained(folder, dtype="float16").parameters()} == {torch.float16}
    assert {p.dtype for p in mf.AutoModelForCausalLM.from_pretrained("llama_tiny").parameters()} == {torch.float32}


def test_converters_are_traced_once_and_replayed_tensor_by_tensor(tmp_path):
    """GPT-2's fused, transposed q/k/v is split (derived tensors); the rest is renamed and read as stored."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                                              n_positions=16))
    hf.save_pretrained(tmp_path)
    config = mf.AutoConfig.from_pretrained(tmp_path)
    with CheckpointReader(tmp_path) as reader:
        trace = ConversionTrace(reader, lambda state: convert_gpt.state_dict_from_hf(state, config))
        whole = convert_gpt.state_dict_from_hf(dict(reader.items()), config)
        assert set(trace.sources) == set(whole)
        assert isinstance(trace.sources["model.layers.0.self_attn.q_proj.weight"], Derived)
        assert isinstance(trace.sources["model.embed_tokens.weight"], Renamed)
        for key, value in whole.items():
            assert torch.equal(trace.value(key), value), key


def test_a_missing_or_damaged_shard_is_one_line_naming_the_file(tmp_path):
    folder, _ = _llama(tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(mf.CheckpointError, match=rf"{shard.name} is cut short"):
        mf.AutoModelForCausalLM.from_pretrained(folder)
    shard.unlink()
    with pytest.raises(mf.CheckpointError, match=rf"{shard.name} is listed in model.safetensors.index.json but missing"):
        mf.AutoModelForCausalLM.from_pretrained(folder)


def test_consolidation_streams_into_bounded_shards_that_transformers_loads(tmp_path):
    """A sharded (DCP) checkpoint consolidated into shards of at most max_shard_size, with transformers' index; the
    folder loads in transformers (its own loader, our class through the registration) and exports to HF Llama."""
    from mindformers_py.checkpoint.sharded import consolidate_checkpoint, save_checkpoint

    folder, hf = _llama(tmp_path)
    ours = mf.AutoModelForCausalLM.from_pretrained(folder)
    save_checkpoint(tmp_path / "dcp", ours)
    out = consolidate_checkpoint(tmp_path / "dcp", tmp_path / "whole", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(out / f) <= 40_000 + 2**16 for f in files)  # a file may hold one larger tensor
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "GPTForCausalLM"
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours(ids).logits)
    mf.convert_checkpoint(out, tmp_path / "hf", to="hf")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() <= 1e-5
