"""Auxiliary-loss-free balancing in the Trainer (``MoEConfig.bias_update_rate``, DeepSeek-V3's router): the
selection biases move after every optimizer step by the loads of the whole step (gradient-accumulated micro-batches
count as one batch), and a resumed run continues with the saved biases."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from mindformers_py.models.gpt import GPTConfig, GPTForCausalLM
from mindformers_py.trainer import Trainer

from test_trainer import StopAt, args, token_data, train_losses

RATE = 0.01


def tiny_deepseek_moe(seed: int = 0) -> GPTForCausalLM:
    torch.manual_seed(seed)
    config = GPTConfig(flavour="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=32,
                       moe_config={"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless",
                                   "router_type": "deepseek_v3", "n_group": 2, "topk_group": 2,
                                   "moe_intermediate_size": 16, "shared_expert_num": 1, "bias_update_rate": RATE})
    return GPTForCausalLM(config)


def biases(model: GPTForCausalLM) -> list[torch.Tensor]:
    return [layer.mlp.gate.e_score_correction_bias.clone() for layer in model.model.layers]


def test_biases_move_by_the_loads_of_the_whole_step(tmp_path):
    """One batch of 4 and two accumulated micro-batches of 2 give the same loads, hence the same biases; each step
    moves every bias entry by at most the rate."""
    data = token_data(8)
    runs = {}
    for batch, accum in [(4, 1), (2, 2)]:
        trainer = Trainer(model=tiny_deepseek_moe(), train_dataset=data,
                          args=args(tmp_path, f"b{batch}", per_device_train_batch_size=batch,
                                    gradient_accumulation_steps=accum, max_steps=2))
        trainer.train()
        runs[batch] = biases(trainer.model)
    for one, accumulated in zip(runs[4], runs[2]):
        assert torch.equal(one, accumulated)
        assert one.abs().max() > 0 and one.abs().max() <= 2 * RATE + 1e-7
        assert torch.equal(one, one.float())  # kept in float32


def test_resumed_run_continues_with_the_saved_biases(tmp_path):
    data = token_data(16)
    common = dict(max_steps=3, save_strategy="steps", save_steps=1)
    full = Trainer(model=tiny_deepseek_moe(), args=args(tmp_path, "full", **common), train_dataset=data)
    full.train()
    stopped = Trainer(model=tiny_deepseek_moe(), args=args(tmp_path, "split", **common), train_dataset=data,
                      callbacks=[StopAt(1)])
    stopped.train()
    saved = load_file(tmp_path / "split" / "checkpoint-1" / "model.safetensors")
    for i, bias in enumerate(biases(stopped.model)):  # the checkpoint holds the biases after step 1
        assert torch.equal(saved[f"model.layers.{i}.mlp.gate.e_score_correction_bias"], bias)
        assert bias.abs().max() > 0
    resumed = Trainer(model=tiny_deepseek_moe(seed=123), args=args(tmp_path, "split", **common), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    for a, b in zip(biases(full.model), biases(resumed.model)):
        assert torch.equal(a, b)
    assert train_losses(resumed.state)[3] == train_losses(full.state)[3]
