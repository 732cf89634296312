"""Wrapping our model in a peft adapter raises no deprecation warning: peft asks the model
``is_gradient_checkpointing``, which transformers 5 keeps only as a deprecated alias (FutureWarning) of
``is_activation_checkpointing``; every process of a LoRA run printed it, twice."""

from __future__ import annotations

import warnings

import mindformers_py as mf
from mindformers_py.adapters import apply_peft


def _tiny():
    return mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                          max_position_embeddings=16))


def test_applying_lora_warns_nothing():
    model = _tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_peft(model, {"type": "lora", "r": 2, "target_modules": ["q_proj", "v_proj"]}, task="causal_lm")
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []


def test_the_alias_peft_reads_answers_as_transformers_new_name():
    model = _tiny()
    assert model.is_gradient_checkpointing is False is model.is_activation_checkpointing
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing is True is model.is_activation_checkpointing
