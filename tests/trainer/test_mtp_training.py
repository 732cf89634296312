"""Multi-token prediction in the Trainer (``GPTConfig.use_mtp``, DeepSeek-V3's MTP): the MTP loss is logged apart
(``mtp_loss``) beside the loss that includes it, the MTP block's selection bias moves with the main layers', and the
saved checkpoint holds the module (a reload builds it)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import mindformers_py as mf
from mindformers_py.trainer import Trainer

from test_expert_balancing import tiny_deepseek_moe
from test_trainer import args, token_data


def test_mtp_loss_is_logged_apart_and_the_module_trains_and_saves(tmp_path):
    model = tiny_deepseek_moe()
    config = model.config
    config.use_mtp, config.num_nextn_predict_layers, config.mtp_loss_weight = True, 1, 0.3
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(config)
    before = model.mtp.layers[0].eh_proj.weight.detach().clone()
    trainer = Trainer(model=model, train_dataset=token_data(8),
                      args=args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(entry["mtp_loss"] > 0 and entry["loss"] > entry["mtp_loss"] for entry in logged)
    layer = trainer.model.mtp.layers[0]
    assert not torch.equal(layer.eh_proj.weight, before)  # trained
    assert layer.block.mlp.gate.e_score_correction_bias.abs().max() > 0  # balanced with the others
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert torch.equal(saved["mtp.layers.0.eh_proj.weight"], layer.eh_proj.weight)
    assert mf.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2").mtp is not None
