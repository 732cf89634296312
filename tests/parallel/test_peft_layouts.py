"""peft adapters under every layout, against stand-alone, on CPU with gloo.

One 2-process job runs everything multi-process: the adapter gradients of one optimizer step (two accumulated
micro-batches) under dp2, ZeRO-1, ZeRO-3, tp2 with sequence parallelism, pp2 and recompute through the engines,
compared with stand-alone's (fp32; the LoRA matrices start random so both A and B get gradients); the same for a
Qwen3-MoE whose experts' projections ``target_modules`` names (peft's LoRA on the stacked expert weights) under dp2,
ZeRO-3, ep2, ep2 with ZeRO-3, tp2 and pp2 (dp2 x tp2 x ep2 runs in test_moe_parallel.py's 4-process job); the same
for the whole DeepSeek-V3 shape with multi-token prediction, LoRA on its latent attention's projections, the MTP
module's ``eh_proj`` and the experts', under dp2 x ep2 and tp2; the output head fused with the loss
(``fused_loss``) under ep2, dp2, ZeRO-2/3 and tp2 over the vocabulary, or declined, with the unfused stand-alone
gradients; then the LoRA
recipe (``tasks/gpt/finetune_lora.yaml`` at test size, by the recipe runner the CLI calls) under dp2 with ZeRO-3,
tp2 and pp2 (GPT-2 flavour, biases and a tied head), whose per-step losses must be stand-alone's (run through the CLI); and a ZeRO-3 run's adapter and
checkpoint, which a stand-alone run loads and resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mindformers_py as mf
from support.dist_utils import run_workers
from support.fused_loss import fused_loss
from mindformers_py.adapters import apply_peft
from mindformers_py.cli import main
from mindformers_py.layers.loss.fused_head import ROWS_OVER_BATCH
from mindformers_py.parallel import ParallelConfig
from mindformers_py.task_registry import get_task
from mindformers_py.trainer.arguments import TrainingArguments
from support.tolerances import BF16_LAYOUT_GRAD_NORM

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tasks" / "gpt" / "finetune_lora.yaml"
VOCAB, SEQ, BATCH = 64, 16, 4
# Every projection: q/k/v/gate/up are column-parallel, o/down row-parallel under tensor parallelism.
LORA = {"type": "lora", "r": 4, "lora_alpha": 8, "init_lora_weights": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def peft_model() -> torch.nn.Module:
    """A tiny Llama-flavour GPT with random LoRA matrices (the same on every rank)."""
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                          max_position_embeddings=SEQ)
    model = mf.GPTForCausalLM(config)
    torch.manual_seed(1)
    return apply_peft(model, LORA, task="causal_lm").train()


def moe_peft_model() -> torch.nn.Module:
    """A tiny Qwen3-MoE (4 experts of 16, top-2) with random LoRA matrices on its attention and, through the names
    gate_proj / up_proj / down_proj, on its experts' stacked projections (the same on every rank)."""
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, qk_norm=True,
                          output_router_logits=True, moe_config={
                              "expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless",
                              "moe_intermediate_size": 16, "aux_loss_scope": "sequence"})
    model = mf.GPTForCausalLM(config)
    torch.manual_seed(1)
    return apply_peft(model, LORA, task="causal_lm").train()


# DeepSeek-V3's projections: the latent attention's (query latent, joint key/value latent with the rotary key, their
# up-projections, the output), multi-token prediction's eh_proj, and the dense, shared and routed experts'.
DEEPSEEK_LORA = {**LORA, "target_modules": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                            "eh_proj", "gate_proj", "up_proj", "down_proj"]}


def deepseek_peft_model() -> torch.nn.Module:
    """The whole tiny DeepSeek-V3 shape (latent attention with a query latent, a dense first layer, then 4 routed
    experts behind the group-limited sigmoid router and a shared expert, a multi-token-prediction module) with random
    LoRA matrices on every projection :data:`DEEPSEEK_LORA` names (the same on every rank)."""
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=SEQ, attention_type="mla", q_lora_rank=16,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                          output_router_logits=True, use_mtp=True, num_nextn_predict_layers=1, mtp_loss_weight=0.3,
                          moe_config={"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless",
                                      "moe_intermediate_size": 16, "aux_loss_scope": "sequence",
                                      "shared_expert_num": 1, "router_type": "deepseek_v3", "n_group": 2,
                                      "topk_group": 1, "routed_scaling_factor": 2.5, "mlp_only_layers": [0]})
    model = mf.GPTForCausalLM(config)
    torch.manual_seed(1)
    return apply_peft(model, DEEPSEEK_LORA, task="causal_lm").train()


def batch() -> dict[str, torch.Tensor]:
    """One global batch; a left-padded row makes the ranks' label counts unequal."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss(model, inputs, num_items):
    return model(**inputs, num_items_in_batch=num_items).loss


def _declined_fused_loss(model, inputs, num_items):
    return fused_loss(model, inputs, num_items, taken=False)


def _fused_loss_of_a_sharded_head(model, inputs, num_items):
    """:func:`fused_loss` under ZeRO-2/3, whose frozen head, gathered for the loss alone, is sharded again once the
    loss returns (the unfused head stays whole from its forward to its backward)."""
    loss = fused_loss(model, inputs, num_items)
    from torch.distributed.tensor import DTensor

    heads = [m.lm_head for m in model.modules() if hasattr(m, "fused_loss_taken")]
    assert heads and all(isinstance(h.weight, DTensor) and h.weight.to_local().shape[0] < h.weight.shape[0]
                         for h in heads)
    return loss


def _fused_loss_of_a_row_split_head(model, inputs, num_items):
    """:func:`fused_loss` with the frozen head split by rows over the data-parallel ranks (``shard_frozen_head``): each
    rank holds half the rows, and the loss scores both ranks' tokens against them."""
    _assert_rows_split(model)
    return fused_loss(model, inputs, num_items)


def _unfused_loss_of_a_row_split_head(model, inputs, num_items):
    """The model's own loss (logits made) with the head split by rows: its forward gathers the weight for the call."""
    _assert_rows_split(model)
    output = model(**inputs, num_items_in_batch=num_items)
    assert output.logits is not None and output.logits.shape[-1] == VOCAB
    return output.loss


def _assert_rows_split(model) -> None:
    from torch.distributed.tensor import DTensor

    heads = [m.lm_head for m in model.modules() if hasattr(m, "fused_loss_taken")]
    assert heads and all(getattr(h, ROWS_OVER_BATCH) and isinstance(h.weight, DTensor)
                         and h.weight.to_local().shape[0] == VOCAB // 2 for h in heads)


def token_gathering_case(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s tokens for the token-gathering loss: (hidden states, labels, the head, num_items_in_batch),
    with unequal token counts (10 and 7) and ignored labels on rank 0."""
    generator = torch.Generator().manual_seed(3)
    head = torch.randn(VOCAB + 1, 8, generator=generator)  # an odd vocabulary: the ranks hold 33 and 32 rows
    cases = []
    for rows, length in ((2, 5), (1, 7)):
        labels = torch.randint(0, VOCAB + 1, (rows, length), generator=generator)
        cases.append((torch.randn(rows, length, 8, generator=generator), labels))
    cases[0][1][0, :3] = -100
    hidden, labels = cases[rank]
    return hidden, labels, head, (None if rank == 0 else torch.tensor(11))


def token_gathering_loss(rank: int, grad_enabled: bool = True, chunk_elements: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, hidden states' gradient of 3x the loss) of rank ``rank``'s tokens through the token-gathering loss over
    the two ranks, each holding half the head's rows; ``chunk_elements``: the kernel's logits per chunk instead of
    its own (64: one row of 33 columns a chunk, where a rank of 32 rows alone would take two)."""
    import importlib
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # (the module: the package exports a function of the same name)
    kernel = importlib.import_module("mindformers_py.layers.loss.linear_cross_entropy")

    hidden, labels, head, num_items = token_gathering_case(rank)
    rows = distribute_tensor(head, init_device_mesh("cpu", (2,)), [Shard(0)])
    hidden.requires_grad_(grad_enabled)
    chunks = mock.patch.object(kernel, "CHUNK_ELEMENTS", chunk_elements or kernel.CHUNK_ELEMENTS)
    with torch.set_grad_enabled(grad_enabled), chunks:
        loss = kernel.vocab_parallel_linear_cross_entropy(hidden, rows, labels, num_items, gather_tokens=True)
    if grad_enabled:
        (3 * loss).backward()
    return loss.detach(), hidden.grad


def full_model() -> torch.nn.Module:
    """:func:`peft_model`'s base, every weight trained (its untied head too)."""
    torch.manual_seed(0)
    return mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                          max_position_embeddings=SEQ)).train()


def adapter_gradients(parallel: ParallelConfig, build=peft_model, bf16: bool = False, loss=_loss
                      ) -> dict[str, torch.Tensor]:
    """Whole gradients of every trainable tensor of ``build()`` after one step of two micro-batches under
    ``parallel`` (fp32, or under bf16 autocast), the loss taken by ``loss``."""
    import torch.distributed as dist

    from mindformers_py.engine import build_engine

    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=BATCH // parallel.dp, use_cpu=True,
                             parallel_config=parallel, report_to=[], bf16=bf16)
    engine = build_engine(parallel, args)
    engine.setup()
    model = build()
    wrapped = engine.prepare_model(model)
    if engine.layout.data_parallel_engine == "replicate" and engine.layout.ep == 1:
        # the frozen base stays out of FSDP2's replicate, which would copy it whole into every step (a head split
        # over the ranks is a DTensor of its own)
        managed = [f"{owner}.{name}" for owner, module in model.named_modules()
                   if not getattr(module, ROWS_OVER_BATCH, 0) for name, p in module.named_parameters(recurse=False)
                   if not p.requires_grad and hasattr(p, "placements")]
        assert managed == [], f"frozen weights managed by replicate: {managed[:3]}"
    local = {k: v[engine.shard_indices(range(BATCH))] for k, v in batch().items()}
    micro = [{k: v[i::2] for k, v in local.items()} for i in range(2)]
    items = engine.all_reduce_sum(torch.tensor(sum(get_task("causal_lm").count_items(m) for m in micro)))
    engine.forward_backward(wrapped, micro, items, loss)
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = grad.detach().clone()
    if dist.is_initialized():  # pipeline ranks hold different stages
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, grads)
        grads = {k: v for part in parts for k, v in part.items()}
    return grads


def _dp(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="data_parallel", data_parallel=2, **fields)


def _semi(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", **fields)


GRADIENT_LAYOUTS = {
    "dp2": _dp(),
    "zero1": _dp(optimizer_shard=1),
    "zero3": _dp(optimizer_shard=3),
    "tp2_sequence_parallel": _semi(model_parallel=2, use_seq_parallel=True),
    "pp2": _semi(pipeline_stage=2, micro_batch_num=2),
    "zero2_recompute": _dp(optimizer_shard=2, recompute="full"),
}
# Qwen3-MoE with LoRA on its experts (the dense layers' losses are not split-invariant with the batch-wide router
# loss, so its router loss is per sequence)
EXPERT_GRADIENT_LAYOUTS = {
    "dp2": _dp(),
    "zero3": _dp(optimizer_shard=3),
    "ep2": _semi(data_parallel=2, expert_parallel=2),
    "ep2_zero3_recompute": _semi(data_parallel=2, expert_parallel=2, optimizer_shard=3, recompute="full"),
    "tp2": _semi(model_parallel=2),
    "pp2": _semi(pipeline_stage=2, micro_batch_num=2),
}
# The whole DeepSeek-V3 shape with LoRA on its latent attention, multi-token prediction and experts: experts split
# over ep, and every projection split as tensor parallelism splits its base layer (the latent down-projections
# whole, eh_proj column-parallel with its output gathered)
DEEPSEEK_GRADIENT_LAYOUTS = {
    "dp2_ep2": _semi(data_parallel=2, expert_parallel=2),
    "tp2": _semi(model_parallel=2),
}
# The output head fused with the loss in the model's forward, called whole under FSDP2 / replicate: a frozen head
# (LoRA) under ep2 and under dp2, and under ZeRO-2/3 (its own FSDP2 unit, gathered for the loss alone; ZeRO-3 also
# with ep2 and recompute); a head tp2 shards over the vocabulary, frozen (LoRA) or trained and with sequence parallelism
# (vocabulary-parallel: softmax statistics and the hidden states' gradient summed over the ranks); a trained head
# ZeRO-3 shards declines (its hooks that reduce the gradient would not run) and the model's own loss is taken; a frozen
# head split by rows over the data-parallel ranks (shard_frozen_head) under ep2 and dp2, fused (every rank's tokens
# against each rank's rows) and unfused (its forward gathers the weight)
FUSED_GRADIENT_LAYOUTS = {
    "ep2_lora_moe": (EXPERT_GRADIENT_LAYOUTS["ep2"], moe_peft_model, fused_loss),
    "dp2_lora": (GRADIENT_LAYOUTS["dp2"], peft_model, fused_loss),
    "zero2_lora": (_dp(optimizer_shard=2), peft_model, _fused_loss_of_a_sharded_head),
    "zero3_lora": (_dp(optimizer_shard=3), peft_model, _fused_loss_of_a_sharded_head),
    "ep2_zero3_recompute_lora_moe": (EXPERT_GRADIENT_LAYOUTS["ep2_zero3_recompute"], moe_peft_model,
                                     _fused_loss_of_a_sharded_head),
    "tp2_vocab_lora": (_semi(model_parallel=2, vocab_emb_dp=False), peft_model, fused_loss),
    "tp2_sp_vocab_full": (_semi(model_parallel=2, vocab_emb_dp=False, use_seq_parallel=True), full_model,
                          fused_loss),
    "zero3_full_declines": (_dp(optimizer_shard=3), full_model, _declined_fused_loss),
    "ep2_head_rows_lora_moe": (_semi(data_parallel=2, expert_parallel=2, shard_frozen_head=True), moe_peft_model,
                               _fused_loss_of_a_row_split_head),
    "dp2_head_rows_lora": (_dp(shard_frozen_head=True), peft_model, _fused_loss_of_a_row_split_head),
    "dp2_head_rows_lora_unfused": (_dp(shard_frozen_head=True), peft_model, _unfused_loss_of_a_row_split_head),
}
RECIPE_LAYOUTS = {
    "zero3": ["--parallel_mode", "data_parallel", "--data_parallel", "2", "--optimizer_shard", "3"],
    # Sequence parallelism is left to the gradient check: it needs a sequence length divisible by the tensor-parallel
    # size, and the recipe pads each batch to its longest row.
    "tp2": ["--parallel_mode", "semi_auto_parallel", "--model_parallel", "2"],
    "pp2": ["--parallel_mode", "semi_auto_parallel", "--pipeline_stage", "2", "--micro_batch_num", "2"],
}


# -- the LoRA recipe at test size -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory) -> Path:
    """A tiny pretrained-model folder (GPT-2 flavour, its BPE tokenizer) and instruction pairs in json files."""
    from mindformers_py.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("lora_recipe")
    pairs = [{"prompt": f"# Write the function number {i}:\n", "response": f"def function_{i}(x):\n    return x * {i}\n"}
             for i in range(64)]
    for name, rows in (("train.jsonl", pairs[:48]), ("val.jsonl", pairs[48:])):
        (folder / name).write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = train_bpe_tokenizer([p["prompt"] + p["response"] for p in pairs] * 4, 300)
    torch.manual_seed(0)
    config = mf.GPTConfig(flavour="gpt2", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=64, embedding_dropout=0.0,
                          attention_dropout=0.0, hidden_dropout=0.0, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    mf.GPTForCausalLM(config).save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    return folder


PROMPT = "# Write the function number 3:\n"


def recipe_flags(inputs: Path, out: Path, *extra: str) -> list[str]:
    """The recipe at test size: the tiny base, 32-token pairs, 4 steps of 8, LoRA without dropout."""
    return [str(RECIPE), "--model.name_or_path", str(inputs / "base"), "--data.source", "files",
            "--data.train_files", str(inputs / "train.jsonl"), "--data.validation_files", str(inputs / "val.jsonl"),
            "--data.text_column", "prompt", "--data.target_column", "response", "--data.block_size", "32",
            "--peft.r", "4", "--peft.lora_dropout", "0.0", "--max_steps", "4", "--per_device_train_batch_size", "8",
            "--warmup_steps", "0", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "steps",
            "--save_steps", "2", "--save_total_limit", "null", "--report_to", "[]", "--disable_tqdm", "true",
            "--generate.prompts", json.dumps([PROMPT]), "--generate.max_new_tokens", "8", "--generate.do_sample", "false",
            "--bf16", "false", "--output_dir", str(out), *extra]


def losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]


def _job(rank: int, world_size: int, inputs: str, work: str) -> dict:
    from mindformers_py.recipes import load_recipe, run_recipe

    out: dict = {"gradients": {name: adapter_gradients(layout) for name, layout in GRADIENT_LAYOUTS.items()},
                 "expert_gradients": {name: adapter_gradients(layout, moe_peft_model)
                                      for name, layout in EXPERT_GRADIENT_LAYOUTS.items()},
                 "deepseek_gradients": {name: adapter_gradients(layout, deepseek_peft_model)
                                        for name, layout in DEEPSEEK_GRADIENT_LAYOUTS.items()},
                 "fused_gradients": {name: adapter_gradients(layout, build, loss=loss)
                                     for name, (layout, build, loss) in FUSED_GRADIENT_LAYOUTS.items()}}
    out["bf16_norm"] = gradient_norm(adapter_gradients(GRADIENT_LAYOUTS[BF16_LAYOUT_NAME], bf16=True))
    import torch.distributed as dist

    out["token_gathering"] = [None, None]  # every rank's (loss, gradient), no-grad loss, (loss, gradient) in small chunks
    dist.all_gather_object(out["token_gathering"], (token_gathering_loss(rank),
                                                    token_gathering_loss(rank, grad_enabled=False)[0],
                                                    token_gathering_loss(rank, chunk_elements=64)))
    for name, flags in RECIPE_LAYOUTS.items():
        args = recipe_flags(Path(inputs), Path(work) / name, *flags)
        per_rank = ["--per_device_train_batch_size", "4"] if "--data_parallel" in flags else []
        run_recipe(load_recipe(args[0]), args[1:] + per_rank)
    return out


@pytest.fixture(scope="module")
def job(recipe_inputs, tmp_path_factory):
    work = tmp_path_factory.mktemp("lora_layouts")
    return work, run_workers(_job, 2, str(recipe_inputs), str(work))[0]


@pytest.fixture(scope="module")
def stand_alone_recipe(recipe_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_stand_alone") / "run"
    assert main(["run", *recipe_flags(recipe_inputs, out)]) == 0
    return out


@pytest.mark.parametrize("name", list(GRADIENT_LAYOUTS))
def test_adapter_gradients_equal_stand_alone(job, name):
    expected = adapter_gradients(ParallelConfig())
    got = job[1]["gradients"][name]
    assert set(got) == set(expected) and len(expected) == 28  # 14 adapted projections, A and B each
    for key, grad in expected.items():
        assert grad.abs().max() > 0, key
        torch.testing.assert_close(got[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


def assert_expert_gradients(got: dict[str, torch.Tensor], name: str) -> None:
    """``got`` equals stand-alone's gradients of :func:`moe_peft_model`: 8 attention projections and 6 stacked
    expert projections (3 per MoE layer), A and B each."""
    expected = adapter_gradients(ParallelConfig(), moe_peft_model)
    assert set(got) == set(expected) and len(expected) == 28
    assert sum(".experts." in key for key in expected) == 12
    for key, grad in expected.items():
        assert grad.abs().max() > 0, key
        torch.testing.assert_close(got[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", list(EXPERT_GRADIENT_LAYOUTS))
def test_expert_adapter_gradients_equal_stand_alone(job, name):
    assert_expert_gradients(job[1]["expert_gradients"][name], name)


@pytest.mark.parametrize("name", list(DEEPSEEK_GRADIENT_LAYOUTS))
def test_deepseek_v3_adapter_gradients_equal_stand_alone(job, name):
    """LoRA on MLA's projections (query and key/value latents, their up-projections, the output), on the MTP
    module's eh_proj and block, and on the dense, shared and routed experts: 31 adapted projections, A and B each."""
    expected, got = adapter_gradients(ParallelConfig(), deepseek_peft_model), job[1]["deepseek_gradients"][name]
    assert set(got) == set(expected) and len(expected) == 62
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mtp.layers.0.eh_proj",
                 "mtp.layers.0.block.mlp.experts", "shared_expert.down_proj"):
        assert any(part in key for key in expected), part
    for key, grad in expected.items():
        assert grad.abs().max() > 0, key
        torch.testing.assert_close(got[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", list(FUSED_GRADIENT_LAYOUTS))
def test_fused_head_loss_gives_stand_alones_gradients(job, name):
    """``fused_loss``'s head folded into the loss (no logits) under a layout, or declined, gives the unfused
    stand-alone gradients."""
    build = FUSED_GRADIENT_LAYOUTS[name][1]
    expected, got = adapter_gradients(ParallelConfig(), build), job[1]["fused_gradients"][name]
    assert set(got) == set(expected)
    if build is full_model:
        assert "lm_head.weight" in expected
    for key, grad in expected.items():
        torch.testing.assert_close(got[key], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("rank", [0, 1])
def test_token_gathering_loss_is_each_ranks_own_with_unequal_tokens(job, rank):
    """A head split by rows over two ranks holding different numbers of tokens (10 and 7), different denominators
    and different upstream gradients: each rank's loss and hidden-state gradient are those of its tokens against the
    whole head, with and without grad mode, and in chunks smaller than a rank's rows (the ranks hold 33 and 32: both
    walk chunks of the larger rank's size, or their reductions would not pair up)."""
    from mindformers_py.layers.loss.linear_cross_entropy import linear_cross_entropy

    hidden, labels, head, num_items = token_gathering_case(rank)
    hidden.requires_grad_(True)
    expected = linear_cross_entropy(hidden, head, labels, num_items)
    (3 * expected).backward()
    (loss, grad), no_grad_loss, (chunked_loss, chunked_grad) = job[1]["token_gathering"][rank]
    for got in (loss, no_grad_loss, chunked_loss):
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)
    for got in (grad, chunked_grad):
        torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=1e-6)


BF16_LAYOUT_NAME = "zero3"  # once more under bf16 (FSDP2's mixed precision over LoRA layers), in the same launch


def gradient_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads.values()])))


def test_adapter_gradients_under_bf16_stay_within_bf16_tolerance_of_stand_alone(job):
    expected = gradient_norm(adapter_gradients(ParallelConfig(), bf16=True))
    assert expected != gradient_norm(adapter_gradients(ParallelConfig()))  # bf16 changed the numerics
    assert job[1]["bf16_norm"] == pytest.approx(expected, **BF16_LAYOUT_GRAD_NORM)


@pytest.mark.parametrize("name", list(RECIPE_LAYOUTS))
def test_samples_after_a_layout_are_stand_alones(job, stand_alone_recipe, name):
    """After training under a layout the ranks load the saved adapter on its base sharded for generation (tensor
    parallel over both ranks, each reading only its shards) and generate together: the same greedy samples as the
    stand-alone run."""
    work, _ = job
    assert (work / name / "samples.txt").read_text() == (stand_alone_recipe / "samples.txt").read_text()


def test_recipe_trains_only_the_adapter_and_saves_it_in_peft_format(stand_alone_recipe, recipe_inputs):
    out = stand_alone_recipe
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # the frozen base is not written again
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["base_model_name_or_path"] == str(recipe_inputs / "base")
    first, *_, last = losses(out)
    assert last < first
    # The saved run reloads (its base, then the adapter) and evaluates as it ended.
    from mindformers_py.recipes import load_recipe, run_recipe

    final = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    again = run_recipe(load_recipe(out / "run_config.yaml"), ["--run_mode", "eval", "--model.name_or_path", str(out),
                                                              "--output_dir", str(out.parent / "eval")])
    assert again["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("name", list(RECIPE_LAYOUTS))
def test_recipe_layouts_give_stand_alone_losses(job, stand_alone_recipe, name):
    expected, got = losses(stand_alone_recipe), losses(job[0] / name)
    assert len(got) == len(expected) == 4
    assert got == pytest.approx(expected, rel=1e-4)
    assert (job[0] / name / "adapter_model.safetensors").is_file()


def test_zero3_checkpoint_resumes_stand_alone_exactly(job, stand_alone_recipe, recipe_inputs, tmp_path):
    """The ZeRO-3 run's checkpoint (adapter, whole optimizer state) resumes in one process on stand-alone's curve."""
    out = tmp_path / "resumed"
    checkpoint = job[0] / "zero3" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert main(["run", *recipe_flags(recipe_inputs, out, "--resume_from_checkpoint", str(checkpoint))]) == 0
    assert losses(out)[2:] == pytest.approx(losses(stand_alone_recipe)[2:], rel=1e-4)


def test_recipe_starts_from_a_transformers_checkpoint(stand_alone_recipe, recipe_inputs, tmp_path):
    """The same base model exported to transformers' GPT-2 (its tokenizer without a pad token, as GPT-2's) trains to
    the same losses, and its adapter names the transformers folder as its base."""
    import transformers

    hf = tmp_path / "hf_gpt2"
    mf.convert_checkpoint(recipe_inputs / "base", hf, to="hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(hf)
    out = tmp_path / "run"
    assert main(["run", *recipe_flags(recipe_inputs, out, "--model.name_or_path", str(hf))]) == 0
    assert losses(out) == pytest.approx(losses(stand_alone_recipe), rel=1e-5)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf)
