"""DeepSeek-V3's multi-token-prediction layer on GPTForCausalLM: a tiny transformers DeepSeek-V3 (MoE, the first
layer dense) saved, then an MTP layer added to its file under the checkpoint's names (``model.layers.4.*``: enorm,
hnorm, eh_proj, an MoE block with per-expert tensors and a selection bias, shared_head.norm, and the copies of the
main embedding and head), random values of the right shapes. Ours builds the module from the file (transformers
ignores it), keeps transformers' logits and greedy tokens, writes every tensor of the file back bitwise; with
labels the loss is the main loss plus the module's weighted loss (by hand from the module on the same hidden
states), whose gradients reach the MTP weights and the shared embedding and head."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

import mindformers_py as mf
from support.hf_models import VOCAB, tiny_deepseek_v3_config
from mindformers_py.errors import ConfigError
from mindformers_py.layers.loss import causal_lm_loss
from mindformers_py.layers.masks import build_attention_mask
from mindformers_py.layers.multi_token_prediction import mtp_loss
from mindformers_py.parallel import ParallelConfig

TOL = 1e-5
LAYERS = 4  # tiny_deepseek_v3_config(moe=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model, the folder whose file holds the MTP layer, the folder without it)."""
    torch.manual_seed(1234)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_deepseek_v3_config(True)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    plain, with_mtp = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("with_mtp")
    hf.save_pretrained(plain)
    hf.save_pretrained(with_mtp)
    file = with_mtp / "model.safetensors"
    state = safetensors.torch.load_file(file)
    last = f"model.layers.{LAYERS - 1}."
    generator = torch.Generator().manual_seed(7)
    for key in [k for k in state if k.startswith(last)]:  # the block: the last (MoE) layer's tensors and shapes
        state[f"model.layers.{LAYERS}." + key[len(last):]] = torch.randn(state[key].shape, generator=generator) * 0.2
    hidden = hf.config.hidden_size
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
             "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
             "eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden, generator=generator),
             "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),  # DeepSeek's copies of the main ones
             "shared_head.head.weight": state["lm_head.weight"].clone()}
    state.update({f"model.layers.{LAYERS}.{k}": v for k, v in extra.items()})
    safetensors.torch.save_file(state, file, metadata={"format": "pt"})
    return hf, with_mtp, plain


def _batch(length: int = 12):
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 6] = -100
    return ids, mask, labels


def test_the_mtp_layer_loads_and_the_main_model_stays_transformers(saved):
    hf, with_mtp, plain = saved
    ours = mf.AutoModelForCausalLM.from_pretrained(with_mtp)
    assert ours.config.use_mtp is True and ours.mtp is not None and len(ours.mtp.layers) == 1
    file = safetensors.torch.load_file(with_mtp / "model.safetensors")
    assert torch.equal(ours.mtp.layers[0].eh_proj.weight, file[f"model.layers.{LAYERS}.eh_proj.weight"])
    assert torch.equal(ours.mtp.layers[0].block.mlp.gate.e_score_correction_bias,
                       file[f"model.layers.{LAYERS}.mlp.gate.e_score_correction_bias"])
    ids, mask, _ = _batch()
    with torch.no_grad():
        delta = (ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits)[mask.bool()]
    assert delta.abs().max().item() <= TOL
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    prompt = ids[:, :6].masked_fill(mask[:, :6] == 0, 0)
    assert torch.equal(ours.generate(prompt, **kw | {"attention_mask": mask[:, :6]}),
                       hf.generate(prompt, **kw | {"attention_mask": mask[:, :6]}))
    # without the tensors in the file: transformers' model, no module (use_mtp=True asks for one anyway)
    assert mf.AutoModelForCausalLM.from_pretrained(plain).mtp is None
    assert mf.AutoModelForCausalLM.from_pretrained(plain, use_mtp=True).mtp is not None
    assert mf.AutoModelForCausalLM.from_pretrained(with_mtp, use_mtp=False).mtp is None


def test_round_trip_keeps_every_tensor_of_the_mtp_layer(saved, tmp_path):
    _, with_mtp, _ = saved
    mf.convert_checkpoint(with_mtp, tmp_path / "ours", to="mindformers")
    assert mf.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").mtp is not None  # our format keeps use_mtp
    mf.convert_checkpoint(tmp_path / "ours", tmp_path / "back", to="hf")
    before = safetensors.torch.load_file(with_mtp / "model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "back" / "model.safetensors")
    assert sum(k.startswith(f"model.layers.{LAYERS}.") for k in before) > 20  # experts one by one
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_loss_is_the_main_loss_plus_the_modules_and_gradients_reach_the_shared_weights(saved):
    """The wired loss against mtp_loss computed by hand from the module on the main model's pre-norm hidden states
    (captured at the final norm's input), the causal padding mask and the rotary positions built here."""
    _, with_mtp, _ = saved
    model = mf.AutoModelForCausalLM.from_pretrained(with_mtp, mtp_loss_weight=0.3)
    ids, mask, labels = _batch()
    items = int((labels[:, 1:] != -100).sum())
    out = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: captured.update(h=args[0]))
    main = model(ids, attention_mask=mask)
    hook.remove()
    length = ids.shape[1]
    positions = torch.arange(length)[None]
    block_mask = build_attention_mask(mask, query_length=length, kv_length=length, position_ids=positions)
    logits, _ = model.mtp(captured["h"], ids, model.model.embed_tokens, model.lm_head, attention_mask=block_mask,
                          position_embeddings=model.model.rotary_emb(positions, torch.float32), token_mask=mask)
    by_hand = mtp_loss(logits, labels, 0.3, items)
    reference = causal_lm_loss(main.logits, labels, num_items_in_batch=items) + by_hand
    assert abs(out.mtp_loss.item() - by_hand.item()) <= 1e-6 and abs(out.loss.item() - reference.item()) <= 1e-6
    layer = model.mtp.layers[0]
    params = [layer.eh_proj.weight, layer.enorm.weight, layer.block.self_attn.kv_b_proj.weight,
              layer.block.mlp.experts.down_proj, model.model.embed_tokens.weight, model.lm_head.weight]
    ours = torch.autograd.grad(out.loss, params)
    expected = torch.autograd.grad(reference, params)
    for g, e in zip(ours, expected):
        assert g.abs().sum() > 0 and (g - e).abs().max().item() <= 1e-6
    # the shared embedding and head get the module's share on top of the main loss's
    main_only = model(ids, attention_mask=mask)  # no labels: no MTP
    shared = torch.autograd.grad(causal_lm_loss(main_only.logits, labels, num_items_in_batch=items), params[-2:])
    for g, s in zip(ours[-2:], shared):
        assert (g - s).abs().max().item() > 1e-4


def test_training_logs_the_mtp_loss_apart(saved):
    _, with_mtp, _ = saved
    model = mf.AutoModelForCausalLM.from_pretrained(with_mtp).train()
    ids, mask, labels = _batch()
    losses = [model(ids, attention_mask=mask, labels=labels).mtp_loss.item() for _ in range(2)]
    logs = model.training_metrics.summarize(model.training_metrics.pop("cpu"), steps=2)
    assert logs["mtp_loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert "load_imbalance" in logs and "mtp_loss" in model.training_metrics.postfix_keys


def test_layouts_that_cut_what_the_module_reads_are_refused(saved):
    """Sequence parallelism (the module reads whole sequences) and context x pipeline parallelism (the last stage's
    MTP loss needs labels aligned with the inputs) are refused with multi-token prediction; data, tensor, context
    and pipeline parallelism run it (tests/parallel/test_moe_parallel.py)."""
    _, with_mtp, _ = saved
    config = mf.AutoModelForCausalLM.from_pretrained(with_mtp).config
    layouts = {"use_seq_parallel=True": (2, dict(model_parallel=2, use_seq_parallel=True)),
               "context_parallel=2 with pipeline_stage=2": (4, dict(context_parallel=2, pipeline_stage=2,
                                                                     micro_batch_num=2))}
    for what, (world, layout) in layouts.items():
        with pytest.raises(ConfigError, match=f"{what} .*num_nextn_predict_layers=1"):
            ParallelConfig(parallel_mode="semi_auto_parallel", **layout).validate_for(world, config)
    config.use_mtp = False  # (sequence parallelism stays refused for this model's experts)
    ParallelConfig(parallel_mode="semi_auto_parallel", **layouts["context_parallel=2 with pipeline_stage=2"][1]
                   ).validate_for(4, config)
    config.use_mtp = True
    ParallelConfig(parallel_mode="data_parallel", data_parallel=2).validate_for(2, config)
    ParallelConfig(parallel_mode="semi_auto_parallel", model_parallel=2).validate_for(2, config)
    ParallelConfig(parallel_mode="semi_auto_parallel", context_parallel=2).validate_for(2, config)
    ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=2).validate_for(2, config)
