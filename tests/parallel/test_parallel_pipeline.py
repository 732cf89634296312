"""Pipeline parallelism: the cut by the declared plan, and pp2 (every schedule), tp2×pp2 and dp2×pp2 losses equal
stand-alone over several AdamW steps (fp32, CPU, gloo)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig
from mindformers_py.parallel.pipelining.stages import layer_ranges, split_model, stage_ids_for_rank, stage_view
from mindformers_py.task_registry import get_task
from support.tolerances import BF16_LAYOUT

VOCAB, SEQ, BATCH, STEPS, LR = 96, 16, 4, 3, 1e-2
RTOL = 1e-4


def tiny_config(flavour="gpt2", layers=4):
    return mf.GPTConfig(flavour=flavour, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=32)


def tiny_model(flavour="gpt2", layers=4):
    torch.manual_seed(0)
    return mf.GPTForCausalLM(tiny_config(flavour, layers)).train()


def batches(padded=True):
    """STEPS batches of (BATCH, SEQ) token ids, a left-padded row in each when ``padded`` (labels -100 there)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :5] = 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def eval_batch():
    """An evaluation batch of another shape than training's: 3 rows (not a multiple of the micro-batches), 12 long."""
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    return ids, ids.clone()


def autocast(bf16: bool):
    """bf16 autocast on the CPU (as the engine's), or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def stand_alone_run(flavour, layers, padded=True, bf16=False):
    """Per-step training losses, then the evaluation loss and logits of :func:`eval_batch`."""
    model = tiny_model(flavour, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, mask, labels in batches(padded):
        with autocast(bf16):
            loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(*eval_batch()[:1], labels=eval_batch()[1])
    return losses, out.loss.item(), out.logits


def stand_alone_losses(flavour, layers, padded=True, bf16=False):
    return stand_alone_run(flavour, layers, padded, bf16)[0]


def train_pipeline(pipe, padded=True, rank_batch=None, dp_group=None, bf16=False):
    """STEPS AdamW steps of a PipelineParallel (under bf16 autocast with ``bf16``); ``rank_batch(ids)`` picks this
    rank's rows and the losses are averaged over ``dp_group`` (data parallel)."""
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR)
    losses = []
    for ids, mask, labels in batches(padded):
        if rank_batch is not None:
            ids, mask, labels = rank_batch(ids), rank_batch(mask), rank_batch(labels)
        with autocast(bf16):
            loss = pipe.step({"input_ids": ids, "labels": labels, "attention_mask": mask})
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(dp_group)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


# -- the cut, in one process -----------------------------------------------------------------------------------


def test_layer_ranges_are_contiguous_and_favour_early_stages():
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    with pytest.raises(ConfigError, match="chunks=5.*num_hidden_layers=4"):
        layer_ranges(4, 5)


def test_interleaved_stages_are_assigned_round_robin():
    assert stage_ids_for_rank(0, 2, 2) == [0, 2] and stage_ids_for_rank(1, 2, 2) == [1, 3]
    assert stage_ids_for_rank(2, 4) == [2]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_stages_keep_full_model_names_and_chain_to_the_same_logits(flavour):
    model = tiny_model(flavour, layers=5).eval()
    full_keys = set(model.state_dict())
    parts = split_model(model, 3, [0, 1, 2], pp_size=3)
    assert [list(p.layer_ids) for p in parts] == [[0, 1], [2, 3], [4]]
    keys = [set(p.state_dict()) for p in parts]
    assert set().union(*keys) == full_keys  # nothing lost, names unchanged
    assert "model.embed_tokens.weight" in keys[0] and "lm_head.weight" in keys[2]
    assert not any(k.startswith("model.layers.4.") for k in keys[0] | keys[1])
    assert all(not (a & b) or a & b <= {"lm_head.weight", "model.embed_tokens.weight"}
               for i, a in enumerate(keys) for b in keys[i + 1:])
    ids, mask, _ = batches()[0]
    with torch.no_grad():
        expected = tiny_model(flavour, layers=5).eval()(ids, attention_mask=mask).logits
        hidden = ids
        for part in parts:
            hidden = part(hidden, attention_mask=mask)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def test_models_without_a_pipeline_plan_are_refused():
    class Plain(nn.Module):
        base_model_prefix = "model"
        config = tiny_config()

    with pytest.raises(ConfigError, match="pipeline_stage > 1 is not supported for Plain"):
        stage_view(Plain(), range(0, 1), True, True, get_task("causal_lm"))


def test_loss_tokens_skip_the_first_position_and_ignored_labels():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, 1, 2]])
    assert get_task("causal_lm").count_items({"labels": labels}) == 2 + 2


# -- pp2 with each schedule, against stand-alone ---------------------------------------------------------------

# (schedule, flavour, layers, micro-batches, virtual stages): tied (gpt2) and untied (llama) embeddings, an uneven
# split (5 layers on 2 stages), and interleaved 1F1B with 2 ranks x 2 virtual stages over 4 layers.
PP_CASES = [
    ("gpipe", "gpt2", 4, 2, 1),
    ("1f1b", "llama", 5, 4, 1),
    ("interleaved_1f1b", "gpt2", 4, 4, 2),
]


# Under bf16 autocast, in the same launch: (schedule, flavour, layers, micro-batches, virtual stages).
BF16_PP_CASE = ("1f1b", "llama", 5, 4, 1)


def _pp2_worker(rank, world_size, cases):
    from mindformers_py.parallel.mesh import build_mesh
    from mindformers_py.parallel.pipelining.schedule import build_pipeline

    results = {}
    schedule, flavour, layers, micro, _ = BF16_PP_CASE
    config = ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=micro,
                            pipeline_schedule=schedule).resolve(world_size)
    results["bf16"] = train_pipeline(build_pipeline(tiny_model(flavour, layers), config, build_mesh(config)), bf16=True)
    for schedule, flavour, layers, micro, virtual in cases:
        config = ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=micro,
                                pipeline_schedule=schedule, virtual_pipeline_stages=virtual).resolve(world_size)
        model = tiny_model(flavour, layers)
        pipe = build_pipeline(model, config, build_mesh(config))
        held = [list(part.layer_ids) for part in pipe.model_parts]
        losses = train_pipeline(pipe)
        ids, labels = eval_batch()
        out = pipe.eval()(input_ids=ids, labels=labels, use_cache=False)
        local = {name: p for name, p in model.named_parameters()}
        same = local == {name: p for name, p in pipe.named_parameters()}
        results[schedule] = (losses, held, out.loss.item(), out.logits, sorted(local), same)
    return results


@pytest.fixture(scope="module")
def pp2_results():
    return run_workers(_pp2_worker, 2, PP_CASES)


@pytest.mark.parametrize("case", PP_CASES, ids=[c[0] for c in PP_CASES])
def test_pp2_losses_match_stand_alone(pp2_results, case):
    schedule, flavour, layers, _, virtual = case
    expected, eval_loss, eval_logits = stand_alone_run(flavour, layers)
    for rank, results in enumerate(pp2_results):
        losses, held, rank_eval_loss, rank_logits, _, _ = results[schedule]
        assert losses == pytest.approx(expected, rel=RTOL), (rank, losses, expected)
        assert len(held) == virtual
        # Forward-only evaluation on a batch of another shape: same loss and logits on every pipeline rank.
        assert rank_eval_loss == pytest.approx(eval_loss, rel=RTOL)
        torch.testing.assert_close(rank_logits, eval_logits, rtol=1e-4, atol=1e-4)
    chunks = layer_ranges(layers, 2 * virtual)
    assert pp2_results[0][schedule][1] == [list(chunks[i]) for i in stage_ids_for_rank(0, 2, virtual)]
    assert expected[0] != expected[-1]  # the steps really changed the weights


def test_pp2_under_bf16_autocast_stays_within_bf16_tolerance_of_stand_alone(pp2_results):
    _, flavour, layers, _, _ = BF16_PP_CASE
    expected = stand_alone_losses(flavour, layers, bf16=True)
    assert expected != pytest.approx(stand_alone_losses(flavour, layers), rel=1e-6)  # bf16 changed the numerics
    for results in pp2_results:
        assert results["bf16"] == pytest.approx(expected, **BF16_LAYOUT), (results["bf16"], expected)


def test_the_model_cut_to_a_ranks_stages_holds_exactly_its_parameters(pp2_results):
    first, last = (results["1f1b"] for results in pp2_results)
    assert first[5] and last[5]  # the cut model's parameters are the pipeline parts' parameters
    assert "model.embed_tokens.weight" in first[4] and "lm_head.weight" not in first[4]
    assert "lm_head.weight" in last[4] and "model.norm.weight" in last[4] and "model.embed_tokens.weight" not in last[4]
    assert any(n.startswith("model.layers.2.") for n in first[4]) and any(n.startswith("model.layers.3.") for n in last[4])
    assert not set(first[4]) & set(last[4])


# -- composed with tensor and data parallelism (4 processes) ----------------------------------------------------


def _composed_layout(dp, tp, extra, bf16=False):
    from mindformers_py.parallel.data import apply_data_parallel
    from mindformers_py.parallel.mesh import build_mesh
    from mindformers_py.parallel.pipelining.schedule import build_pipeline
    from mindformers_py.parallel.tensor import apply_tensor_parallel

    config = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=dp, model_parallel=tp,
                            pipeline_stage=2, micro_batch_num=2, pipeline_schedule="1f1b", **extra).resolve(dp * tp * 2)
    mesh = build_mesh(config)

    def parallelize(part):
        if tp > 1:
            apply_tensor_parallel(part, mesh.tp_mesh, sequence_parallel=config.sequence_parallel,
                                  vocab_parallel=config.vocab_parallel)
        # under bf16, ZeRO-3 takes FSDP2's bf16 mixed-precision policy (the engine's), here inside autocast too
        return apply_data_parallel(part, mesh, config, param_dtype=torch.bfloat16 if bf16 else None)

    pipe = build_pipeline(tiny_model("llama"), config, mesh, parallelize=parallelize)
    rows = BATCH // dp

    def rank_batch(t):
        return t[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows]

    # Equal token counts per data-parallel rank, so the mean of rank means is the batch mean.
    return train_pipeline(pipe, padded=False, rank_batch=rank_batch, dp_group=mesh.dp_mesh.get_group(), bf16=bf16)


def _composed_worker(rank, world_size, cases):
    return {name: _composed_layout(*case) for name, case in cases.items()}


# name: (data_parallel, model_parallel, other ParallelConfig fields[, bf16]), all with pipeline_stage=2 and 1F1B.
COMPOSED_CASES = {
    "tp2xpp2": (1, 2, {}),
    "tp2xpp2_seq_vocab_parallel": (1, 2, {"use_seq_parallel": True, "vocab_emb_dp": False}),
    "dp2xpp2": (2, 1, {}),
    "dp2xpp2_zero3": (2, 1, {"optimizer_shard": 3}),
}
BF16_COMPOSED_CASES = {"dp2xpp2_zero3_bf16": (2, 1, {"optimizer_shard": 3}, True)}  # FSDP2's bf16 policy on stages


@pytest.fixture(scope="module")
def composed_results():
    return run_workers(_composed_worker, 4, {**COMPOSED_CASES, **BF16_COMPOSED_CASES})


@pytest.mark.parametrize("case", list(COMPOSED_CASES))
def test_composed_layouts_match_stand_alone(composed_results, case):
    expected = stand_alone_losses("llama", 4, padded=False)
    for rank, results in enumerate(composed_results):
        assert results[case] == pytest.approx(expected, rel=RTOL), (rank, results[case], expected)


@pytest.mark.parametrize("case", list(BF16_COMPOSED_CASES))
def test_composed_layout_under_bf16_stays_within_bf16_tolerance_of_stand_alone(composed_results, case):
    expected = stand_alone_losses("llama", 4, padded=False, bf16=True)
    for rank, results in enumerate(composed_results):
        assert results[case] == pytest.approx(expected, **BF16_LAYOUT), (rank, results[case], expected)


# -- through the Trainer: one flag apart from stand-alone -----------------------------------------------------------

TRAINER_STEPS, TRAINER_SAVE_AT, TRAINER_BATCH = 4, 2, 4


def _trainer_run(parallel, output_dir, resume=None):
    """Train the tiny tied-embedding GPT for TRAINER_STEPS steps (gradient accumulation 2, clipping on, checkpoint at
    TRAINER_SAVE_AT), then evaluate and save; returns (logged losses, eval loss)."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2 * TRAINER_STEPS * TRAINER_BATCH, SEQ), generator=gen).tolist()
    eval_ids = torch.randint(0, VOCAB, (6, SEQ), generator=gen).tolist()
    args = mf.TrainingArguments(
        output_dir=output_dir, overwrite_output_dir=resume is None, per_device_train_batch_size=TRAINER_BATCH // parallel.dp,
        per_device_eval_batch_size=3, gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1,
        max_grad_norm=0.5, max_steps=TRAINER_STEPS, logging_steps=1, save_strategy="steps", save_steps=TRAINER_SAVE_AT,
        use_cpu=True, parallel_config=parallel, report_to=[], disable_tqdm=True, bf16=False,
    )
    trainer = mf.Trainer(model=tiny_model("gpt2"), args=args, train_dataset=Dataset.from_dict({"input_ids": ids}),
                         eval_dataset=Dataset.from_dict({"input_ids": eval_ids}))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model()
    return losses, eval_loss


def _pp_trainer_worker(rank, world_size, folder):
    pp2 = ParallelConfig(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=2)
    trained = _trainer_run(pp2, f"{folder}/pp2")
    dp2 = ParallelConfig(parallel_mode="semi_auto_parallel", data_parallel=2)
    resumed = _trainer_run(dp2, f"{folder}/pp2", resume=f"{folder}/pp2/checkpoint-{TRAINER_SAVE_AT}")
    return trained, resumed


def test_trainer_pp2_matches_stand_alone_evaluates_saves_and_resumes_under_dp2(tmp_path):
    expected, expected_eval = _trainer_run(ParallelConfig(), str(tmp_path / "stand_alone"))
    results = run_workers(_pp_trainer_worker, 2, str(tmp_path))
    for (losses, eval_loss), (resumed, resumed_eval) in results:
        assert losses == pytest.approx(expected, rel=RTOL) and len(losses) == TRAINER_STEPS
        assert eval_loss == pytest.approx(expected_eval, rel=RTOL)
        # The pipeline checkpoint resumes under dp2 on the same curve.
        assert resumed[TRAINER_SAVE_AT:] == pytest.approx(expected[TRAINER_SAVE_AT:], rel=RTOL)
    # The pipeline run's saved model holds every stage's weights.
    saved = mf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "stand_alone"))
    consolidated = mf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pp2"))
    ids = eval_batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(consolidated(ids).logits, saved(ids).logits, rtol=1e-4, atol=1e-4)
