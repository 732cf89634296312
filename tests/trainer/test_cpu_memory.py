"""What loading a checkpoint freed goes back to the OS once the Trainer has placed the model: the engine keeps freed
CPU memory in the heap for the training steps' reuse (``cpu_keep_freed_memory``), so the loader's temporaries
(per-expert tensors stacked, shards sliced) would otherwise stay resident all run."""

from __future__ import annotations

import mindformers_py.trainer.trainer as trainer_module
from mindformers_py import GPTConfig, GPTForCausalLM, Trainer, TrainingArguments
from mindformers_py.engine.base import Engine


def test_the_trainer_returns_loadings_freed_memory_after_placing_the_model(monkeypatch, tmp_path):
    events = []
    prepare = Engine.prepare_model

    def recording_prepare(self, model, task=None):
        events.append("prepared")
        return prepare(self, model, task)

    monkeypatch.setattr(Engine, "prepare_model", recording_prepare)
    monkeypatch.setattr(trainer_module, "return_freed_cpu_memory", lambda: events.append("returned") or True)
    model = GPTForCausalLM(GPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     max_position_embeddings=16))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, use_cpu=True, bf16=False)
    Trainer(model=model, args=args)
    assert events == ["prepared", "returned"]
