"""Distributed layouts against stand-alone on CPU with gloo: per-step losses of several AdamW steps (fp32) through
the distributed engine match stand-alone for dp2, ZeRO 1/2/3, tp2 (both flavours), sequence and vocabulary
parallel, recompute, dp2×tp2 and HSDP; checkpoints resume across layouts and consolidate to ``from_pretrained``.
Multi-head latent attention's gradients under tp2 (with and without sequence parallelism) and context parallelism
(ring and Ulysses over 2 ranks, hybrid over 4: its values narrower than its keys) equal stand-alone's (its
replicated latent projections: a gradient summed once too often is a constant factor AdamW's losses would hide).
``fused_loss``'s vocabulary-parallel head under dp2 x tp2, trained, gives stand-alone's unfused gradients.

Each spawned job runs several layouts one after the other, so the whole file starts only three process groups.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import mindformers_py as mf
from support.dist_utils import run_workers
from support.fused_loss import fused_loss
from mindformers_py.parallel import ParallelConfig, RecomputeConfig
from mindformers_py.engine import Engine
from mindformers_py.trainer.arguments import TrainingArguments
from mindformers_py.task_registry import get_task
from mindformers_py.trainer.scheduler import create_scheduler

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 128, 32, 4, 4, 2
RTOL = 1e-4
MICRO_BATCHES = 2  # gradient accumulation inside each step: exercises the no-sync micro-steps


def tiny_model(flavour: str) -> mf.GPTForCausalLM:
    """The same tiny GPT on every rank (same seed): 2 layers, hidden 64, 4 heads (2 KV heads for llama; "qwen3" is
    llama with Qwen3's per-head q/k norms)."""
    extra = {"num_key_value_heads": 2} if flavour in ("llama", "qwen3") else {}
    if flavour == "qwen3":
        flavour, extra["qk_norm"] = "llama", True
    if flavour == "mla":  # DeepSeek-V3's latent attention: a query latent, heads of 8 + 4 rotary / 8 value dims
        flavour, extra = "llama", dict(attention_type="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                       qk_rope_head_dim=4, v_head_dim=8)
    config = mf.GPTConfig(flavour=flavour, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=SEQ, **extra)
    torch.manual_seed(0)
    return mf.GPTForCausalLM(config).train()


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


def training_args(parallel: ParallelConfig, folder: str = "unused", bf16: bool = False) -> TrainingArguments:
    return TrainingArguments(output_dir=folder, per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                             learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, optim="adamw_torch",
                             use_cpu=True, parallel_config=parallel, report_to=[], bf16=bf16)


def _loss_fn(model, batch, num_items):
    return model(**batch, num_items_in_batch=num_items).loss


class Run:
    """A model, optimizer and scheduler driven by an engine the way the Trainer drives them."""

    def __init__(self, engine: Engine, flavour: str) -> None:
        self.engine = engine
        self.model = engine.prepare_model(tiny_model(flavour))
        self.optimizer = engine.build_optimizer(self.model)
        self.scheduler = create_scheduler(self.optimizer, engine.args, STEPS)

    def train(self, start: int, stop: int, save_to: str | None = None) -> list[float]:
        losses = []
        batches = global_batches()
        for step in range(start, stop):
            rows = self.engine.shard_indices(range(GLOBAL_BATCH))
            local = {k: v[rows] for k, v in batches[step].items()}
            micro = [{k: v[i::MICRO_BATCHES] for k, v in local.items()} for i in range(MICRO_BATCHES)]
            local_items = sum(get_task("causal_lm").count_items(mb) for mb in micro)
            n_items = self.engine.all_reduce_sum(torch.tensor(local_items))  # as the Trainer does
            loss = self.engine.forward_backward(self.model, micro, n_items, _loss_fn)
            self.engine.clip_grad_norm(self.model, self.optimizer, self.engine.args.max_grad_norm)
            self.engine.optimizer_step(self.optimizer)
            self.scheduler.step()
            self.engine.zero_grad(self.optimizer)
            losses.append(self.engine.all_reduce_mean(loss).item())
            if save_to is not None and step + 1 == SAVE_AT:
                self.engine.save_checkpoint(save_to, self.model, self.optimizer, self.scheduler,
                                            {"step.txt": str(step + 1)})
        return losses


def run_layout(parallel: ParallelConfig, flavour: str, start: int = 0, save_to: str | None = None,
               resume_from: str | None = None, bf16: bool = False) -> list[float]:
    """Losses of steps ``start``.. under ``parallel`` (the engine its mode registers), optionally saving after
    step SAVE_AT or resuming from a checkpoint first."""
    from mindformers_py.engine import build_engine

    args = training_args(parallel, bf16=bf16)
    engine = build_engine(parallel, args)
    engine.setup()
    run = Run(engine, flavour)
    if resume_from is not None:
        engine.load_checkpoint(resume_from, run.model, run.optimizer, run.scheduler)
        engine.load_rng_state(resume_from)
    losses = run.train(start, STEPS, save_to)
    engine.teardown()
    return losses


_REFERENCE: dict[str, list[float]] = {}


def reference(flavour: str) -> list[float]:
    """Stand-alone losses (computed once per flavour)."""
    if flavour not in _REFERENCE:
        _REFERENCE[flavour] = run_layout(ParallelConfig(), flavour)
    return _REFERENCE[flavour]


def semi(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", **fields)


def dp(**fields) -> ParallelConfig:
    return ParallelConfig(parallel_mode="data_parallel", data_parallel=2, **fields)


# name -> (flavour, layout) for the 2-process job
LAYOUTS_2 = {
    "dp2": ("llama", dp()),
    "zero1": ("llama", dp(optimizer_shard=1)),
    "zero2": ("gpt2", dp(optimizer_shard=2)),
    "zero3": ("llama", dp(optimizer_shard=3)),
    "tp2_gpt2": ("gpt2", semi(model_parallel=2)),
    "tp2_llama": ("llama", semi(model_parallel=2)),
    "tp2_seq_parallel": ("llama", semi(model_parallel=2, use_seq_parallel=True)),
    "tp2_vocab_parallel_tied": ("gpt2", semi(model_parallel=2, vocab_emb_dp=False)),
    "tp2_seq_vocab_parallel": ("llama", semi(model_parallel=2, use_seq_parallel=True, vocab_emb_dp=False)),
    # Qwen3's q/k norms stay per head, their weights whole with gradients summed over the tensor-parallel ranks
    "tp2_qwen3": ("qwen3", semi(model_parallel=2)),
    "tp2_seq_parallel_qwen3": ("qwen3", semi(model_parallel=2, use_seq_parallel=True)),
    "zero2_qwen3": ("qwen3", dp(optimizer_shard=2)),
    "dp2_recompute_full": ("gpt2", dp(recompute="full")),
    "dp2_recompute_selective": ("llama", dp(recompute="selective")),
    "zero3_recompute_first_layer": ("llama", dp(optimizer_shard=3, recompute=RecomputeConfig(recompute=1))),
}
# bf16 runs (FSDP2's MixedPrecisionPolicy, or autocast without FSDP) against stand-alone bf16 autocast
BF16_LAYOUTS_2 = {
    "zero3_bf16": ("llama", dp(optimizer_shard=3)),
    "tp2_seq_vocab_parallel_bf16": ("llama", semi(model_parallel=2, use_seq_parallel=True, vocab_emb_dp=False)),
}
BF16_RTOL = 2e-3  # bf16 products rounded in a different order
# name -> (flavour, layout) for the 4-process job
LAYOUTS_4 = {
    "dp2xtp2": ("llama", semi(data_parallel=2, model_parallel=2)),
    "dp2xtp2_zero3_seq_vocab": ("gpt2", semi(data_parallel=2, model_parallel=2, optimizer_shard=3,
                                             use_seq_parallel=True, vocab_emb_dp=False)),
    "dp2xtp2_zero1_recompute": ("llama", semi(data_parallel=2, model_parallel=2, optimizer_shard=1,
                                              recompute="full")),
    "dp2xtp2_zero3_seq_qwen3_selective": ("qwen3", semi(data_parallel=2, model_parallel=2, optimizer_shard=3,
                                                        use_seq_parallel=True, recompute="selective")),
}
BF16_LAYOUTS_4 = {"dp2xtp2_bf16": ("llama", semi(data_parallel=2, model_parallel=2))}  # in the 4-process launch


# name -> (flavour, layout) whose whole gradients of one step are compared with stand-alone's (2-process job)
GRADIENT_LAYOUTS_2 = {
    "tp2_mla": ("mla", semi(model_parallel=2)),
    "tp2_seq_parallel_mla": ("mla", semi(model_parallel=2, use_seq_parallel=True)),
    "cp2_ring_mla": ("mla", semi(context_parallel=2)),
    "cp2_ulysses_mla": ("mla", semi(context_parallel=2, context_parallel_algo="ulysses")),
}
GRADIENT_LAYOUTS_4 = {"cp4_hybrid_mla": ("mla", semi(context_parallel=4, context_parallel_algo="hybrid"))}
# The output head fused with the loss (``fused_loss``), sharded over the vocabulary by tp and trained, under dp2
FUSED_GRADIENT_LAYOUTS_4 = {"dp2_tp2_vocab_fused": ("llama", semi(data_parallel=2, model_parallel=2,
                                                                  vocab_emb_dp=False))}


def layout_gradients(parallel: ParallelConfig, flavour: str, fused: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient after one forward/backward of the first global batch under ``parallel``;
    with ``fused``, the model's head folded into the loss (which must be taken: no logits)."""
    from mindformers_py.engine import build_engine

    engine = build_engine(parallel, training_args(parallel)) if parallel.parallel_mode != "stand_alone" else None
    if engine is not None:
        engine.setup()
        model = engine.prepare_model(tiny_model(flavour))
    else:
        model = tiny_model(flavour)
    batch = global_batches()[0]
    rows = engine.shard_indices(range(GLOBAL_BATCH)) if engine is not None else list(range(GLOBAL_BATCH))
    local = {k: v[rows] for k, v in batch.items()}
    if parallel.context_parallel > 1 or fused:  # (cp: each rank its chunks) the loss over the whole step's tokens
        local = engine.shard_batch(local) if parallel.context_parallel > 1 else local
        items = engine.all_reduce_sum(torch.tensor(get_task("causal_lm").count_items(local)))
        engine.forward_backward(model, [local], items, fused_loss if fused else _loss_fn)
    else:
        model(**local).loss.backward()
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for name, p in model.named_parameters()}
    if engine is not None:
        engine.teardown()
    return grads


def _layouts_worker(rank, world_size, layouts, bf16_layouts=None, gradient_layouts=None):
    out = {name: run_layout(layout, flavour) for name, (flavour, layout) in layouts.items()}
    for name, (flavour, layout) in (bf16_layouts or {}).items():
        out[name] = run_layout(layout, flavour, bf16=True)
    for name, (flavour, layout) in (gradient_layouts or {}).items():
        out[name] = layout_gradients(layout, flavour)
    return out


@pytest.fixture(scope="module")
def two_process_losses():
    return run_workers(_layouts_worker, 2, LAYOUTS_2, BF16_LAYOUTS_2, GRADIENT_LAYOUTS_2)


@pytest.fixture(scope="module")
def four_process_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hsdp")
    return run_workers(_four_worker, 4, LAYOUTS_4, str(folder), BF16_LAYOUTS_4, GRADIENT_LAYOUTS_4)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_process_layout_matches_stand_alone(two_process_losses, name):
    flavour = LAYOUTS_2[name][0]
    expected = reference(flavour)
    for rank, results in enumerate(two_process_losses):
        assert results[name] == pytest.approx(expected, rel=RTOL), (name, rank, results[name], expected)
    assert abs(expected[0] - expected[-1]) > 1e-3  # the steps really changed the weights


@pytest.mark.parametrize("name", list(GRADIENT_LAYOUTS_2))
def test_two_process_layout_gradients_match_stand_alone(two_process_losses, name):
    _check_gradients(two_process_losses, name, GRADIENT_LAYOUTS_2[name][0])


@pytest.mark.parametrize("name", list(GRADIENT_LAYOUTS_4))
def test_four_process_layout_gradients_match_stand_alone(four_process_results, name):
    _check_gradients(four_process_results, name, GRADIENT_LAYOUTS_4[name][0])


@pytest.mark.parametrize("name", list(FUSED_GRADIENT_LAYOUTS_4))
def test_four_process_fused_head_gradients_match_stand_alone(four_process_results, name):
    _check_gradients(four_process_results, name, FUSED_GRADIENT_LAYOUTS_4[name][0])


def _check_gradients(launch, name, flavour):
    expected = layout_gradients(ParallelConfig(), flavour)
    for rank, results in enumerate(launch):
        grads = results[name]
        assert grads.keys() == expected.keys()
        for key, ref in expected.items():
            scale = ref.abs().max().item()
            assert scale > 0 and (grads[key] - ref).abs().max().item() <= RTOL * scale, (name, rank, key)


@pytest.mark.parametrize("name", list(BF16_LAYOUTS_2))
def test_bf16_layout_matches_stand_alone_bf16(two_process_losses, name):
    _check_bf16(two_process_losses, name, BF16_LAYOUTS_2[name][0])


@pytest.mark.parametrize("name", list(BF16_LAYOUTS_4))
def test_four_process_bf16_layout_matches_stand_alone_bf16(four_process_results, name):
    _check_bf16(four_process_results, name, BF16_LAYOUTS_4[name][0])


def _check_bf16(all_results, name, flavour):
    expected = run_layout(ParallelConfig(), flavour, bf16=True)
    assert expected != pytest.approx(reference(flavour), rel=1e-6)  # bf16 really changed the numerics
    for results in all_results:
        assert results[name] == pytest.approx(expected, rel=BF16_RTOL), (name, results[name], expected)
        assert results[name] != pytest.approx(reference(flavour), rel=1e-5)  # computed in bf16, not fp32


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_process_layout_matches_stand_alone(four_process_results, name):
    expected = reference(LAYOUTS_4[name][0])
    for rank, results in enumerate(four_process_results):
        assert results[name] == pytest.approx(expected, rel=RTOL), (name, rank, results[name], expected)


def test_recompute_stand_alone_matches_and_keeps_state_dict_names():
    for mode in ("full", "selective"):
        layout = ParallelConfig(recompute=mode)
        assert run_layout(layout, "llama") == pytest.approx(reference("llama"), rel=RTOL), mode
    engine = Engine(ParallelConfig(recompute="full").resolve(1), training_args(ParallelConfig()))
    engine.setup()
    model = engine.prepare_model(tiny_model("llama"))
    assert set(model.state_dict()) == set(tiny_model("llama").state_dict())
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())


# -- HSDP and what a layout does to the parameters (4 processes) ---------------------------------------------------


def _four_worker(rank, world_size, layouts, folder, bf16_layouts, gradient_layouts):
    from mindformers_py.parallel import build_mesh, parallelize

    results = _layouts_worker(rank, world_size, layouts, bf16_layouts, gradient_layouts)
    for name, (flavour, layout) in FUSED_GRADIENT_LAYOUTS_4.items():
        results[name] = layout_gradients(layout, flavour, fused=True)
    # HSDP: ZeRO-3 sharded within pairs of ranks, replicated across the pairs.
    hsdp = ParallelConfig(parallel_mode="data_parallel", data_parallel=4, optimizer_shard=3,
                          optimizer_weight_shard_size=2).resolve(world_size)
    mesh = build_mesh(hsdp, shard_size=hsdp.shard_size)
    model = parallelize(tiny_model("llama"), hsdp, mesh)
    weight = model.model.layers[0].self_attn.q_proj.weight
    results["hsdp_placements"] = (tuple(weight.device_mesh.mesh_dim_names),
                                  [weight.placements[0].is_replicate(), weight.placements[1].is_shard(0)],
                                  tuple(weight.to_local().shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in global_batches():  # one sample per rank; the loss is normalised by the global token count
        local = {k: v[mesh.dp_rank:mesh.dp_rank + 1] for k, v in batch.items()}
        share = model(**local, num_items_in_batch=torch.tensor(get_task("causal_lm").count_items(batch))).loss
        (share * world_size).backward()  # FSDP averages gradients over the 4 ranks
        optimizer.step()
        optimizer.zero_grad()
        total = share.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
    results["hsdp_losses"] = losses
    return results


def test_hsdp_shards_within_groups_and_matches_plain_adamw(four_process_results):
    names, placements, local_shape = four_process_results[0]["hsdp_placements"]
    assert names == ("dp_replicate", "dp_shard")
    assert placements == [True, True] and local_shape == (32, 64)  # q_proj (64, 64) halved within a pair
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = []
    for batch in global_batches():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for results in four_process_results:
        assert results["hsdp_losses"] == pytest.approx(expected, rel=RTOL)


# -- checkpoints across layouts (2 processes) ----------------------------------------------------------------------

RESUME_CASES = [  # (saved under, resumed under); stand-alone resumes run in the test process
    ("zero3", "tp2_llama"),
    ("tp2_llama", "zero1"),
    ("dp2", "tp2_seq_vocab_parallel"),
]


def _checkpoint_worker(rank, world_size, folder):
    out = {}
    for saved, resumed in RESUME_CASES:
        ckpt = str(Path(folder) / f"{saved}-to-{resumed}")
        first = run_layout(LAYOUTS_2[saved][1], "llama", save_to=ckpt)
        out[(saved, resumed)] = first[:SAVE_AT] + run_layout(LAYOUTS_2[resumed][1], "llama", start=SAVE_AT,
                                                             resume_from=ckpt)
    # A stand-alone (single-process) checkpoint resumed under ZeRO-3 (whole files -> shards).
    out["from_stand_alone"] = run_layout(LAYOUTS_2["zero3"][1], "llama", start=SAVE_AT,
                                         resume_from=str(Path(folder) / "stand_alone"))
    # Logits of the distributed model saved under tp2 with a sharded vocabulary, for consolidation.
    from mindformers_py.engine import build_engine

    layout = LAYOUTS_2["tp2_seq_vocab_parallel"][1]
    engine = build_engine(layout, training_args(layout))
    engine.setup()
    run = Run(engine, "llama")
    run.train(0, 1)
    engine.save_pretrained(run.model, str(Path(folder) / "consolidated"))
    engine.save_checkpoint(str(Path(folder) / "tp2-sharded"), run.model, run.optimizer, run.scheduler, {})
    run.model.eval()  # eval mode: the vocabulary-parallel head gathers whole logits, the loss needs no loss_parallel
    with torch.no_grad():
        ids = global_batches()[0]["input_ids"]
        output = run.model(ids, labels=ids)
    out["logits"], out["eval_loss"] = output.logits, output.loss.item()
    return out


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    run_layout(ParallelConfig(), "llama", save_to=str(folder / "stand_alone"))
    return folder, run_workers(_checkpoint_worker, 2, str(folder))


@pytest.mark.parametrize("case", RESUME_CASES, ids=[f"{a}-to-{b}" for a, b in RESUME_CASES])
def test_resume_across_layouts_continues_the_loss_curve(checkpoint_results, case):
    _, results = checkpoint_results
    for rank_results in results:
        assert rank_results[case] == pytest.approx(reference("llama"), rel=RTOL), case


def test_stand_alone_checkpoint_resumes_under_zero3(checkpoint_results):
    _, results = checkpoint_results
    assert results[0]["from_stand_alone"] == pytest.approx(reference("llama")[SAVE_AT:], rel=RTOL)


def test_distributed_checkpoint_resumes_stand_alone(checkpoint_results):
    """The plain stand-alone engine resumes a checkpoint written by dp2, and the sharded part loads alone too."""
    from mindformers_py.checkpoint.sharded import load_checkpoint

    folder, _ = checkpoint_results
    ckpt = str(folder / "zero3-to-tp2_llama")
    assert run_layout(ParallelConfig(), "llama", start=SAVE_AT, resume_from=ckpt) == \
        pytest.approx(reference("llama")[SAVE_AT:], rel=RTOL)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters())
    load_checkpoint(Path(ckpt) / "dcp", model, optimizer)
    whole = mf.AutoModelForCausalLM.from_pretrained(ckpt)
    for (name, a), b in zip(model.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(a, b), name
    assert len(optimizer.state) == len(list(model.parameters()))


def test_consolidated_checkpoint_gives_the_same_logits(checkpoint_results, tmp_path):
    from mindformers_py.checkpoint.sharded import consolidate_checkpoint

    folder, results = checkpoint_results
    ids = global_batches()[0]["input_ids"]
    expected = results[0]["logits"]
    assert type(expected) is torch.Tensor and expected.shape == (GLOBAL_BATCH, SEQ, VOCAB)
    assert torch.equal(results[0]["logits"], results[1]["logits"])
    consolidate_checkpoint(folder / "tp2-sharded" / "dcp", tmp_path / "offline")
    for path in (folder / "consolidated", tmp_path / "offline", folder / "tp2-sharded"):
        model = mf.AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            output = model(ids, labels=ids)
        assert (output.logits - expected).abs().max().item() < 1e-4, path
        assert output.loss.item() == pytest.approx(results[0]["eval_loss"], rel=1e-5)
    hf_dir = mf.convert_checkpoint(folder / "consolidated", tmp_path / "hf", to="hf")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        assert (hf(ids).logits - expected).abs().max().item() < 1e-4
    assert math.isfinite(expected.sum().item())


# -- the Trainer, one flag apart ------------------------------------------------------------------------------------


def _trainer_run(parallel: ParallelConfig, output_dir: str, resume: str | None = None) -> list[float]:
    """Train the tiny GPT with the Trainer for STEPS steps (checkpoint every SAVE_AT); the logged losses."""
    from datasets import Dataset

    ids = torch.randint(0, VOCAB, (4 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(
        output_dir=output_dir, overwrite_output_dir=resume is None,
        per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
        learning_rate=1e-2, weight_decay=0.1, max_steps=STEPS, logging_steps=1, save_strategy="steps",
        save_steps=SAVE_AT, use_cpu=True, parallel_config=parallel, report_to=[], disable_tqdm=True, bf16=False,
    )
    trainer = mf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=Dataset.from_dict({"input_ids": ids}))
    trainer.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _counting(counts: dict[str, int], key: str, original):
    """``original`` counting its outermost calls in ``counts[key]`` (a call it makes to another counted function
    under the same key is not counted again)."""
    def counted(*args, **kwargs):
        outermost = not counts.get("_in_" + key)
        counts[key] += outermost
        counts["_in_" + key] = True
        try:
            return original(*args, **kwargs)
        finally:
            counts["_in_" + key] = not outermost
    return counted


def _resolutions_worker(output_dir: str) -> dict:
    """A tp2 Trainer (2 steps), counting in this process how often its layout is checked against the run
    (``ParallelConfig.resolve`` and ``validate_for``, outermost calls) and how often the user's sizes are read into
    degrees (``Layout.of``); then a Trainer given the layout already resolved (as a launched worker is), counted
    the same way. What the run built from the layout comes back too: the engine's layout, the mesh, a placement."""
    from unittest import mock

    from datasets import Dataset

    from mindformers_py.parallel.layout import Layout

    parallel = semi(model_parallel=2)
    ids = torch.randint(0, VOCAB, (4 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    args = TrainingArguments(output_dir=output_dir, overwrite_output_dir=True, per_device_train_batch_size=GLOBAL_BATCH,
                             max_steps=2, logging_steps=1, save_strategy="no", use_cpu=True, parallel_config=parallel,
                             report_to=[], disable_tqdm=True, bf16=False)
    data = Dataset.from_dict({"input_ids": ids})
    derive = Layout.of.__func__

    def counted_run(run_args) -> tuple[dict[str, int], object]:
        counts = {"checks": 0, "derived": 0}
        with mock.patch.object(ParallelConfig, "resolve", _counting(counts, "checks", ParallelConfig.resolve)), \
                mock.patch.object(ParallelConfig, "validate_for", _counting(counts, "checks", ParallelConfig.validate_for)), \
                mock.patch.object(Layout, "of", classmethod(_counting(counts, "derived", derive))):
            trainer = mf.Trainer(model=tiny_model("llama"), args=run_args, train_dataset=data)
            if run_args is args:
                trainer.train()
        trainer.engine.teardown()
        return {k: v for k, v in counts.items() if not k.startswith("_")}, trainer

    counts, trainer = counted_run(args)
    weight = trainer.model.model.layers[0].self_attn.q_proj.weight
    out = {"counts": counts, "layout": trainer.engine.layout, "mesh_tp": trainer.engine.mesh.tp,
           "placement": (tuple(weight.device_mesh.mesh_dim_names),
                         [(type(p).__name__, getattr(p, "dim", None)) for p in weight.placements],
                         tuple(weight.to_local().shape))}
    sent = trainer.engine.layout  # what a launching process sends its workers
    out["received_counts"], received = counted_run(args.with_resolved_layout(sent))
    out["received_layout"] = received.engine.layout
    return out


def _trainer_worker(rank, world_size, output_dir):
    return {"zero3": _trainer_run(semi(data_parallel=2, optimizer_shard=3), output_dir),
            "resolutions": _resolutions_worker(output_dir + "_tp2")}


@pytest.fixture(scope="module")
def trainer_launch(tmp_path_factory):
    """One 2-process launch for the Trainer tests: ZeRO-3 with its checkpoint, then the counted tp2 runs."""
    folder = tmp_path_factory.mktemp("trainer")
    return folder, run_workers(_trainer_worker, 2, str(folder / "zero3"))


def test_layout_is_resolved_once_per_process_and_read_from_layout_after(trainer_launch):
    from mindformers_py.parallel.layout import Layout

    for rank, result in enumerate(trainer_launch[1]):
        result = result["resolutions"]
        # checked once against the run (the old code checked 3 times: engine setup, build_mesh, prepare_model),
        # and model_parallel read into the tp degree once: the engine, mesh and parallelize read the Layout
        assert result["counts"] == {"checks": 1, "derived": 1}, (rank, result["counts"])
        layout = result["layout"]
        assert isinstance(layout, Layout) and (layout.tp, layout.dp, layout.world_size) == (2, 1, 2)
        assert result["mesh_tp"] == 2
        # q_proj is column-parallel: its rows split over the mesh's "tp" dimension (32 query dims of 64 per rank)
        assert result["placement"] == (("tp",), [("Shard", 0)], (32, 64)), result["placement"]
        # a Trainer given the layout resolved elsewhere (a launched worker) checks and derives nothing
        assert result["received_counts"] == {"checks": 0, "derived": 0}
        assert result["received_layout"] == layout


def test_trainer_zero3_matches_stand_alone_and_its_checkpoint_resumes_stand_alone(tmp_path, trainer_launch):
    expected = _trainer_run(ParallelConfig(), str(tmp_path / "stand_alone"))
    folder, launched = trainer_launch
    distributed = [result["zero3"] for result in launched]
    assert distributed[0] == pytest.approx(expected, rel=RTOL) and len(expected) == STEPS
    records = [json.loads(line) for line in (folder / "zero3" / "log.jsonl").read_text().splitlines()]
    assert [r["layout"] for r in records if "layout" in r] == [  # what the run started, recorded once (rank 0)
        "2 processes (semi_auto_parallel): dp=2 tp=1 pp=1 ep=1, ZeRO-3, recompute=off"]
    checkpoint = folder / "zero3" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "dcp" / ".metadata").is_file() and (checkpoint / "model.safetensors").is_file()
    resumed = _trainer_run(ParallelConfig(), str(folder / "zero3"), resume=str(checkpoint))
    assert len(resumed) == STEPS  # the checkpoint's logged steps, then the ones run after resuming
    assert resumed[SAVE_AT:] == pytest.approx(expected[SAVE_AT:], rel=RTOL)


def test_checkpoint_errors_name_the_folder(tmp_path):
    from mindformers_py.errors import CheckpointError
    from mindformers_py.checkpoint.sharded import consolidate_checkpoint, load_checkpoint, save_checkpoint

    model = tiny_model("llama")
    with pytest.raises(CheckpointError, match="missing.*does not exist"):
        load_checkpoint(tmp_path / "missing", model)
    save_checkpoint(tmp_path / "llama", model)
    other = mf.GPTForCausalLM(mf.GPTConfig(flavour="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=SEQ))
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(tmp_path / "llama", other)
    with pytest.raises(CheckpointError, match="not a DCP checkpoint"):
        consolidate_checkpoint(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
