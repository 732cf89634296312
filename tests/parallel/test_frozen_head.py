"""``ParallelConfig.shard_frozen_head``: the heads it refuses to split, in one line each (what it does under ep2 and
dp2, fused and unfused, is checked against stand-alone's gradients in test_peft_layouts.py's 2-process job)."""

from __future__ import annotations

import pytest
import torch

import mindformers_py as mf
from mindformers_py.adapters import apply_peft
from mindformers_py.errors import ConfigError
from mindformers_py.parallel.frozen_head import shard_frozen_head


def tiny(**fields) -> mf.GPTForCausalLM:
    torch.manual_seed(0)
    config = mf.GPTConfig(**{"flavour": "llama", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 32, **fields})
    return mf.GPTForCausalLM(config)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    return model.requires_grad_(False)


@pytest.mark.parametrize(("build", "fragments"), [
    (lambda: tiny(), ["this head trains", "freeze it"]),
    (lambda: frozen(tiny(tie_word_embeddings=True)), ["untied output head", "tie_word_embeddings=False"]),
    (lambda: apply_peft(tiny(), {"type": "lora", "r": 2, "target_modules": ["q_proj", "lm_head"]}, task="causal_lm"),
     ["its output head is a peft.tuners.lora", "target_modules names it"]),
])
def test_refused_heads_name_the_reason_in_one_line(build, fragments):
    with pytest.raises(ConfigError) as info:
        shard_frozen_head(build(), mesh=None)  # refused before any process group is needed
    message = str(info.value)
    assert "\n" not in message and "shard_frozen_head" in message
    for fragment in fragments:
        assert fragment in message, message
