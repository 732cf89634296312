"""The Trainer's own workers get the parent's model without its weights: a model unchanged since ``from_pretrained``
points at its checkpoint (nothing written), any other model writes its weights once; the pickle each worker reads is
a small fraction of the weights, and filling it gives exactly the parent's values."""

from __future__ import annotations

import pickle

import torch

import mindformers_py as mf
from mindformers_py.adapters.apply import apply_peft
from mindformers_py.loading import materialize
from mindformers_py.loading.handover import dumps, weights_by_reference


def _weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _tiny(tmp_path):
    torch.manual_seed(0)
    model = mf.AutoModelForCausalLM.from_pretrained("llama_tiny", num_hidden_layers=2)
    model.save_pretrained(tmp_path / "ckpt")
    return mf.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")


def _sent(model, spill):
    with weights_by_reference(model, spill) as by_reference:
        data = dumps(model, by_reference)
    received = pickle.loads(data)
    assert all(p.is_meta for p in received.parameters())
    return data, materialize(received, "cpu")


def test_an_unchanged_loaded_model_points_at_its_checkpoint(tmp_path):
    model = _tiny(tmp_path)
    data, received = _sent(model, tmp_path / "spill")
    assert not (tmp_path / "spill").exists()  # nothing written: the checkpoint holds the weights
    assert len(data) < 0.05 * _weights_bytes(model)
    for (name, a), (_, b) in zip(model.named_parameters(), received.named_parameters()):
        assert torch.equal(a, b), name


def test_a_changed_model_writes_its_weights_once(tmp_path):
    model = _tiny(tmp_path)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)  # training in place
    data, received = _sent(model, tmp_path / "spill")
    assert (tmp_path / "spill" / "model.safetensors").is_file()
    assert len(data) < 0.05 * _weights_bytes(model)
    assert torch.equal(received.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    assert received.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_an_adapter_added_after_loading_travels_by_value(tmp_path):
    model = apply_peft(_tiny(tmp_path), {"type": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]},
                       task="causal_lm")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # as trained
    with weights_by_reference(model, tmp_path / "spill") as by_reference:
        received = pickle.loads(dumps(model, by_reference))
    assert not (tmp_path / "spill").exists()
    adapters = {n: p for n, p in received.named_parameters() if "lora_" in n}
    assert adapters and not any(p.is_meta for p in adapters.values())
    assert all(p.is_meta for n, p in received.named_parameters() if "lora_" not in n)
    materialize(received, "cpu")
    for (name, a), (_, b) in zip(model.named_parameters(), received.named_parameters()):
        assert torch.equal(a, b), name
