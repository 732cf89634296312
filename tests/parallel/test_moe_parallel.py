"""Expert parallelism on CPU with gloo: a tiny GPT-MoE (dropless top-2 of 4 experts, a shared expert, the
sequence-wise load-balancing loss and the z-loss on) trains with stand-alone's per-step losses (AdamW, clipping,
gradient accumulation) when its experts are split over expert-parallel ranks borrowed from data parallelism, with
tensor parallelism, ZeRO 1/2/3, recompute and pipeline stages (where the router statistics travel from stage to
stage), and the same gradient norms (which AdamW's updates would not show a constant factor in); its checkpoints
consolidate to whole weights; the router metrics are the stand-alone ones. The layouts named ``qwen3_moe_*`` run a
Qwen3-MoE-shaped model instead (per-head q/k norms, renormalised top-2, no shared expert); those named
``deepseek_v3_*`` DeepSeek-V3's router (sigmoid, group-limited) with auxiliary-loss-free balancing, whose selection
biases after every step are bitwise stand-alone's on every rank (dp, ep, ZeRO-3, recompute, pp, cp, tp); the one
named ``deepseek_v3_mtp_*`` adds a DeepSeek-V3 multi-token-prediction module (``use_mtp``, its loss weighted 0.3 and
logged apart, its block's router balanced with the others). Those named ``deepseek_v3_model_*`` run the whole
DeepSeek-V3 shape (latent attention with a query latent, a dense first layer, then the router above with a shared
expert; multi-token prediction where the name says ``mtp``) and compare every parameter's whole gradient of the first
and the last step with stand-alone's under dp, ZeRO-1/2/3, recompute, ep, pp (the MTP module and a copy of the
embedding on the last stage), cp x ep (the MTP module's tokens and targets ahead made from the whole sequence before
it is cut, its block's attention on the main stack's ring), tp with a vocabulary-parallel head and dp x tp x ep (the
MTP module split as the main stack's layers, ``eh_proj`` by its output features), and tp x cp.
"""

from __future__ import annotations

import pytest
import torch

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.engine import build_engine
from mindformers_py.parallel import ParallelConfig
from mindformers_py.task_registry import get_task
from mindformers_py.trainer.arguments import TrainingArguments
from mindformers_py.trainer.scheduler import create_scheduler
from test_parallel_layouts import MICRO_BATCHES, RTOL, SEQ, STEPS, VOCAB
from support.tolerances import BF16_LAYOUT, BF16_LAYOUT_GRAD_NORM

GLOBAL_BATCH = 8  # two rows per rank and micro-batch at dp4

MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "aux_loss_scope": "sequence",
       "aux_loss_factor": 0.1, "z_loss_factor": 0.01, "moe_intermediate_size": 32, "shared_expert_num": 1,
       "use_shared_expert_gating": True}


QWEN3_MOE = {**MOE, "shared_expert_num": 0, "use_shared_expert_gating": False, "norm_topk_prob": True}
# DeepSeek-V3's router with auxiliary-loss-free balancing: 2 groups of 2 experts, one allowed per token, and a rate
# large enough for the bias to move the choices within the few steps.
DEEPSEEK_MOE = {**MOE, "use_shared_expert_gating": False, "router_type": "deepseek_v3", "n_group": 2, "topk_group": 1,
                "routed_scaling_factor": 2.5, "bias_update_rate": 0.05}


# The rest of DeepSeek-V3's shape: latent attention with a query latent (heads of 8 + 4 rotary / 8 value dims) and
# a dense first layer.
DEEPSEEK_ATTENTION = dict(attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=8, num_key_value_heads=None)
# Its selection biases start where a trained checkpoint's are (non-zero), so that they choose experts from the
# first step, whose gradients are compared.
DEEPSEEK_INITIAL_BIAS = (0.02, 0.01, -0.02, 0.0)


def tiny_moe(qwen3: bool = False, deepseek: bool = False, mtp: bool = False, whole: bool = False,
             **moe) -> mf.GPTForCausalLM:
    """The same tiny GPT-MoE on every rank (same seed): 2 MoE layers, hidden 64, 4 heads (2 KV heads); ``qwen3``:
    Qwen3-MoE's shape; ``deepseek``: DeepSeek-V3's router with its selection bias updated every step; ``whole``:
    and DeepSeek-V3's latent attention, its first layer dense; ``mtp``: a multi-token-prediction module (an MoE
    block) whose loss is weighted 0.3."""
    base = QWEN3_MOE if qwen3 else DEEPSEEK_MOE if deepseek else MOE
    extra = DEEPSEEK_ATTENTION if whole else {}
    if whole:
        moe = {"mlp_only_layers": [0], **moe}
    config = mf.GPTConfig(**{**dict(flavour="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    output_router_logits=True, qk_norm=qwen3, moe_config={**base, **moe}, use_mtp=mtp,
                                    num_nextn_predict_layers=int(mtp), mtp_loss_weight=0.3), **extra})
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(config).train()
    if whole:
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.copy_(torch.tensor(DEEPSEEK_INITIAL_BIAS))
    return model


def global_batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches; a left-padded row per batch makes the ranks' label-token counts unequal."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, :7] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def training_args(parallel: ParallelConfig, bf16: bool = False) -> TrainingArguments:
    return TrainingArguments(output_dir="unused", per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                             learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, optim="adamw_torch",
                             use_cpu=True, parallel_config=parallel, report_to=[], bf16=bf16)


def _loss_fn(model, batch, num_items):
    return model(**batch, num_items_in_batch=num_items).loss


def run_moe_layout(parallel: ParallelConfig, moe: dict | None = None, save_to: str | None = None,
                   qwen3: bool = False, bf16: bool = False, deepseek: bool = False, mtp: bool = False,
                   whole: bool = False) -> dict:
    """Per-step losses and gradient norms (before clipping: a constant factor on some gradients, which AdamW would
    hide from the losses, shows there) under ``parallel``, driven as the Trainer drives an engine (under bf16
    autocast with ``bf16``); the router metrics of the run reduced over the ranks; the MoE layers' selection biases
    (``deepseek``: moved after every step); optionally a consolidated checkpoint. ``whole`` (the whole DeepSeek-V3
    shape): also every parameter's whole gradient of the first and the last step, and the layers each rank holds."""
    engine = build_engine(parallel, training_args(parallel, bf16))
    engine.setup()
    model = tiny_moe(qwen3, deepseek, mtp, whole, **(moe or {}))
    wrapped = engine.prepare_model(model)
    optimizer = engine.build_optimizer(model)
    scheduler = create_scheduler(optimizer, engine.args, STEPS)
    losses, norms, biases, loads, gradients = [], [], [], [], []
    for step, batch in enumerate(global_batches()):
        rows = engine.shard_indices(range(GLOBAL_BATCH))
        local = {k: v[rows] for k, v in batch.items()}
        # each rank's chunks of every sequence under context parallelism (the Trainer's read_step)
        micro = [engine.shard_batch({k: v[i::MICRO_BATCHES] for k, v in local.items()}) for i in range(MICRO_BATCHES)]
        items = engine.all_reduce_sum(torch.tensor(sum(get_task("causal_lm").count_items(mb) for mb in micro)))
        loss = engine.forward_backward(wrapped, micro, items, _loss_fn)
        if whole and step in (0, STEPS - 1):
            gradients.append(_whole_gradients(model))
        norms.append(float(engine.clip_grad_norm(model, optimizer, engine.args.max_grad_norm)))
        engine.optimizer_step(optimizer)
        loads.append(_buffers(model, "expert_load"))  # this rank's counts of the step, before the update
        engine.balance_experts(model)
        biases.append(_buffers(model, "e_score_correction_bias"))
        scheduler.step()
        engine.zero_grad(optimizer)
        losses.append(engine.all_reduce_mean(loss).item())
    tracker = model.training_metrics
    metrics = tracker.summarize(engine.reduce_metrics(tracker.pop(engine.device)), STEPS)
    if save_to is not None:
        engine.save_pretrained(model, save_to)
    eval_loss = None
    if whole:  # the trained model's evaluation loss (the MTP loss included, on every pipeline rank)
        wrapped.eval()
        with torch.no_grad():
            eval_loss = float(engine.forward(wrapped, global_batches()[0]).loss)
    modules = [name.replace("_checkpoint_wrapped_module.", "") for name, _ in model.named_modules()]
    held = [name for name in modules if name.startswith("model.layers.") and name.count(".") == 2]
    held += [name for name in ("model.embed_tokens", "mtp") if name in modules]
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731 (this rank's part of a DTensor)
    shapes = {name.replace("_checkpoint_wrapped_module.", ""): tuple(local(p).shape)
              for name, p in model.named_parameters()}
    engine.teardown()
    return {"losses": losses, "grad_norms": norms, "metrics": metrics, "biases": biases, "loads": loads,
            "gradients": gradients, "layers": held, "eval_loss": eval_loss, "local_shapes": shapes}


def _whole_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (DTensors gathered) by its name in the plain model; a pipeline rank has its
    stage's."""
    return {name.replace("_checkpoint_wrapped_module.", ""): (
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in model.named_parameters() if p.grad is not None}


def _buffers(model: torch.nn.Module, suffix: str) -> dict[str, torch.Tensor]:
    """Copies of the model's buffers named ``*suffix`` by their names in the plain model."""
    return {name.replace("_checkpoint_wrapped_module.", ""): buffer.detach().cpu().clone()
            for name, buffer in model.named_buffers() if name.endswith(suffix)}


_REFERENCE: dict = {}


def reference(qwen3: bool = False, bf16: bool = False, deepseek: bool = False, mtp: bool = False,
              whole: bool = False) -> dict:
    """Stand-alone's run (fp32, or under bf16 autocast) of the model (Qwen3-MoE with ``qwen3``, DeepSeek-V3's
    router with ``deepseek``, its whole shape with ``whole``, a multi-token-prediction module with ``mtp``),
    computed once each."""
    key = (qwen3, bf16, deepseek, mtp, whole)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_moe_layout(ParallelConfig(), qwen3=qwen3, bf16=bf16, deepseek=deepseek, mtp=mtp,
                                         whole=whole)
    return _REFERENCE[key]


def model_of(name: str) -> dict[str, bool]:
    """The model a layout's name runs (see the module docstring)."""
    return {"qwen3": name.startswith("qwen3_moe"), "deepseek": name.startswith("deepseek_v3"),
            "mtp": "_mtp_" in name, "whole": name.startswith("deepseek_v3_model_")}


def semi(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", **fields)


LAYOUTS_2 = {
    "dp2_ep2": semi(data_parallel=2, expert_parallel=2),
    "dp2_ep2_zero1": semi(data_parallel=2, expert_parallel=2, optimizer_shard=1),
    "dp2_ep2_zero3_recompute": semi(data_parallel=2, expert_parallel=2, optimizer_shard=3, recompute="full"),
    "tp2": semi(model_parallel=2),
    "pp2_gpipe": semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="gpipe"),
    "qwen3_moe_dp2_ep2_zero3_recompute": semi(data_parallel=2, expert_parallel=2, optimizer_shard=3, recompute="full"),
    "qwen3_moe_tp2": semi(model_parallel=2),
    "qwen3_moe_pp2_1f1b": semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="1f1b"),
    "deepseek_v3_dp2": semi(data_parallel=2),
    "deepseek_v3_dp2_ep2_zero3_recompute": semi(data_parallel=2, expert_parallel=2, optimizer_shard=3,
                                                recompute="full"),
    "deepseek_v3_pp2_1f1b": semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="1f1b"),
    "deepseek_v3_cp2_ep2": semi(context_parallel=2, expert_parallel=2),
    "deepseek_v3_tp2": semi(model_parallel=2),
    "deepseek_v3_mtp_dp2_ep2_zero3_recompute": semi(data_parallel=2, expert_parallel=2, optimizer_shard=3,
                                                    recompute="full"),
    # the whole DeepSeek-V3 shape with multi-token prediction
    "deepseek_v3_model_mtp_dp2_ep2": semi(data_parallel=2, expert_parallel=2),
    "deepseek_v3_model_mtp_zero1": semi(data_parallel=2, optimizer_shard=1),
    "deepseek_v3_model_mtp_dp2_ep2_zero2": semi(data_parallel=2, expert_parallel=2, optimizer_shard=2),
    "deepseek_v3_model_mtp_zero3_recompute": semi(data_parallel=2, optimizer_shard=3, recompute="full"),
    "deepseek_v3_model_mtp_pp2_1f1b": semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="1f1b"),
    # the MTP module's tokens and targets ahead made before the sequence is cut, its block on the ring
    "deepseek_v3_model_mtp_cp2_ep2": semi(context_parallel=2, expert_parallel=2),
    # the MTP module split as the main stack (its shared head the vocabulary-parallel one)
    "deepseek_v3_model_mtp_tp2": semi(model_parallel=2, vocab_emb_dp=False),
}
# dp2 x tp2 x ep2 and dp2 x pp2 x ep2 also run through the recipe and the CLI (test_moe_recipe.py), plain ep2 in the
# recipe x layout matrix (test_recipe_layouts.py); dp4 x ep4 with ZeRO-3 is the "saved" run below.
LAYOUTS_4 = {
    "dp4_ep2": semi(data_parallel=4, expert_parallel=2),  # experts replicated over pairs of ranks
    "dp4_ep2_zero2": semi(data_parallel=4, expert_parallel=2, optimizer_shard=2),  # ... and sharded over them
    "qwen3_moe_dp2_tp2_ep2_zero1": semi(data_parallel=2, model_parallel=2, expert_parallel=2, optimizer_shard=1),
    "deepseek_v3_model_mtp_dp2_tp2_ep2": semi(data_parallel=2, model_parallel=2, expert_parallel=2),
    # latent attention's heads split over tp, each head's sequence over the ring (the MTP block's too)
    "deepseek_v3_model_mtp_tp2_cp2": semi(model_parallel=2, context_parallel=2),
}
# Under bf16 autocast (the default where the hardware has it), in the same launches: the router statistics travel
# between pipeline stages beside bf16 hidden states (dp2 x pp2 x ep2 crashed there, issue 37).
BF16_LAYOUTS_2 = {"pp2_1f1b_bf16": semi(pipeline_stage=2, micro_batch_num=2)}
BF16_LAYOUTS_4 = {"dp2_pp2_ep2_bf16": semi(data_parallel=2, pipeline_stage=2, micro_batch_num=2, expert_parallel=2)}


def _worker(rank, world_size, layouts, bf16_layouts, folder=None):
    out = {name: run_moe_layout(layout, **model_of(name)) for name, layout in layouts.items()}
    out.update({name: run_moe_layout(layout, bf16=True) for name, layout in bf16_layouts.items()})
    if folder is not None:
        out["saved"] = run_moe_layout(semi(data_parallel=4, expert_parallel=4, optimizer_shard=3), save_to=folder)
        from test_peft_layouts import adapter_gradients, moe_peft_model  # LoRA on the experts, on these 4 ranks

        out["expert_lora_dp2_tp2_ep2"] = adapter_gradients(
            semi(data_parallel=2, model_parallel=2, expert_parallel=2), moe_peft_model)
    return out


@pytest.fixture(scope="module")
def two_process_results():
    return run_workers(_worker, 2, LAYOUTS_2, BF16_LAYOUTS_2)


@pytest.fixture(scope="module")
def four_process_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe_ep_checkpoint")
    return run_workers(_worker, 4, LAYOUTS_4, BF16_LAYOUTS_4, str(folder)), folder


def _check(results, name):
    expected = reference(**model_of(name))
    if "_mtp_" in name:  # the MTP loss is logged apart, and its block's router is balanced with the others
        assert expected["metrics"]["mtp_loss"] > 0
        assert any(key.startswith("mtp.") for key in expected["biases"][0])
    for rank, result in enumerate(results):
        assert result[name]["losses"] == pytest.approx(expected["losses"], rel=RTOL), (name, rank, result[name], expected)
        assert result[name]["grad_norms"] == pytest.approx(expected["grad_norms"], rel=RTOL), (name, rank, result[name])
        metrics = result[name]["metrics"]
        for key, value in expected["metrics"].items():
            assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (name, key, metrics[key], value)
    assert abs(expected["losses"][0] - expected["losses"][-1]) > 1e-3  # the steps really changed the weights
    # The selection biases after every step: bitwise stand-alone's on every rank (a pipeline rank has its stage's).
    for step, expected_biases in enumerate(expected["biases"]):
        for rank, result in enumerate(results):
            for key, bias in result[name]["biases"][step].items():
                assert torch.equal(bias, expected_biases[key]), (name, step, rank, key, bias, expected_biases[key])
        assert {key for result in results for key in result[name]["biases"][step]} == set(expected_biases)
    if model_of(name)["whole"]:
        _check_gradients(results, name, expected)
    if name.startswith("deepseek_v3"):  # and they moved (stand-alone's first step has a sign for every expert)
        initial = torch.tensor(DEEPSEEK_INITIAL_BIAS) if model_of(name)["whole"] else torch.zeros(4)
        for bias in expected["biases"][0].values():
            torch.testing.assert_close((bias - initial).abs(), torch.full((4,), DEEPSEEK_MOE["bias_update_rate"]))
        # The ranks' counts add up to stand-alone's: each token once (twice where recompute runs the forward again,
        # which sign(mean - load) does not see), none from pipeline shape inference, none from padding.
        factor = (2 if "recompute" in name else 1) * (2 if "tp2" in name else 1)  # tp ranks see the same tokens
        for step, expected_loads in enumerate(expected["loads"]):
            for key, load in expected_loads.items():
                total = sum(result[name]["loads"][step][key] for result in results
                            if key in result[name]["loads"][step])
                assert torch.equal(total, factor * load), (name, step, key, total, load)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_process_moe_layout_matches_stand_alone(two_process_results, name):
    _check(two_process_results, name)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_process_moe_layout_matches_stand_alone(four_process_results, name):
    _check(four_process_results[0], name)


def test_expert_adapter_gradients_under_dp2_tp2_ep2(four_process_results):
    from test_peft_layouts import assert_expert_gradients

    assert_expert_gradients(four_process_results[0][0]["expert_lora_dp2_tp2_ep2"], "dp2 x tp2 x ep2")


@pytest.mark.parametrize("name", [*BF16_LAYOUTS_2, *BF16_LAYOUTS_4])
def test_bf16_moe_layout_runs_within_bf16_tolerance_of_stand_alone(two_process_results, four_process_results, name):
    results = two_process_results if name in BF16_LAYOUTS_2 else four_process_results[0]
    expected = reference(bf16=True)
    assert expected["losses"] != pytest.approx(reference()["losses"], rel=1e-6)  # bf16 really changed the numerics
    for rank, result in enumerate(results):
        for key, tolerance in (("losses", BF16_LAYOUT), ("grad_norms", BF16_LAYOUT_GRAD_NORM)):
            assert result[name][key] == pytest.approx(expected[key], **tolerance), (name, rank, key, result[name])


def test_expert_parallel_checkpoint_consolidates(four_process_results):
    """ZeRO-3 over dp4 x ep4: the saved whole weights load into a plain model with the trained model's losses."""
    results, folder = four_process_results
    model = mf.AutoModelForCausalLM.from_pretrained(folder)
    assert model.model.layers[0].mlp.experts.gate_proj.shape == (4, 32, 64)
    assert results[0]["saved"]["losses"] == pytest.approx(reference()["losses"], rel=RTOL)
    batch = global_batches()[0]
    with torch.no_grad():
        trained = model(**batch).loss.item()
    assert trained < reference()["losses"][0]  # the consolidated weights are the trained ones


# After STEPS - 1 AdamW steps the weights differ by rounding (the sums run in other orders), which AdamW's nearly
# sign-like updates of near-zero gradients amplify: the last step's gradients agree to 2e-3 of each tensor's largest
# entry (measured: 5.5e-4 under dp2 x ep2, ZeRO 1/2/3 and pp2 with multi-token prediction; with it, 2.8e-4 under
# cp2 x ep2, 2.4e-4 under tp2, 5.5e-4 under dp2 x tp2 x ep2, 4.9e-4 under tp2 x cp2), the first step's to RTOL
# (measured: at most 8.0e-7). A gradient reduced once too often or too few is off by
# 50% or more.
LAST_STEP_GRAD_RTOL = 2e-3


def _check_gradients(results, name, expected):
    """Every parameter's whole gradient of the first step (the initial selection biases choosing) and of the last
    (after the biases moved) is stand-alone's, each held by some rank, and so is the trained model's evaluation loss;
    a pipeline's first stage holds the dense first layer (no selection bias), the last the routed one."""
    for rank, result in enumerate(results):
        assert result[name]["eval_loss"] == pytest.approx(expected["eval_loss"], rel=RTOL), (name, rank)
    for step, expected_grads in zip((0, STEPS - 1), expected["gradients"]):
        tolerance = RTOL if step == 0 else LAST_STEP_GRAD_RTOL
        for rank, result in enumerate(results):
            for key, grad in result[name]["gradients"][step > 0].items():
                scale = expected_grads[key].abs().max().item()
                diff = (grad - expected_grads[key]).abs().max().item()
                assert scale > 0 and diff <= tolerance * scale, (name, step, rank, key, diff, scale)
        assert {key for result in results for key in result[name]["gradients"][step > 0]} == set(expected_grads)
    if "pp2" in name:  # the MTP module and a copy of the embedding (its gradient summed with the first's) on the last
        mtp = ["model.embed_tokens", "mtp"] if model_of(name)["mtp"] else []
        assert [result[name]["layers"] for result in results] == [["model.layers.0", "model.embed_tokens"],
                                                                  ["model.layers.1", *mtp]]
        assert not results[0][name]["biases"][0] and set(results[1][name]["biases"][0]) == set(expected["biases"][0])
    if "tp2" in name and model_of(name)["mtp"]:  # the MTP module split as the main stack's routed layer is
        for result in results:
            shapes, block = result[name]["local_shapes"], "mtp.layers.0.block."
            split = {key for key in shapes if key.startswith(block) and shapes[key] != expected["local_shapes"][key]}
            assert {key[len(block):] for key in split} >= {"self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight",
                                                            "self_attn.o_proj.weight", "mlp.experts.gate_proj"}
            for key in shapes:
                if key.startswith(block):
                    assert shapes[key] == shapes["model.layers.1." + key[len(block):]], (name, key)
            assert shapes["mtp.layers.0.eh_proj.weight"] == (32, 128), (name, shapes["mtp.layers.0.eh_proj.weight"])
