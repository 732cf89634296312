"""Context parallelism: each sequence split over 2 or 4 ranks gives a stand-alone step's gradients (<= 1e-4 relative)
for every algorithm (ring, Ulysses, hybrid) and family (GPT with GQA, padding, packed rows and a sliding window;
Qwen3 mixing full and sliding layers, with per-head q/k norms; GPT-MoE and Qwen3-MoE; BERT; ViT; T5), alone and with data, tensor + sequence, pipeline, ZeRO-3 and expert parallelism, recompute
and gradient accumulation; what cannot be split is refused in one line before anything starts.

The rows of tests/support/task_models.py are right-padded to different lengths, and 12 tokens do not divide into the 2 x 4
chunks of a balanced ring over 4 ranks: batches are padded to the layout's multiple on the fly, which must not show
in the gradients either. Multi-process checks are packed into one job per world size.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_utils import run_workers
from support.task_models import N, assert_bf16_close, assert_same, first_step, full_gradients, make_data, make_model

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.layers.loss import IGNORE_INDEX
from mindformers_py.layers.document_mask import DocumentMask
from mindformers_py.layers.masks import build_attention_mask
from mindformers_py.parallel.context.attention import (
    DIAGONAL,
    FULL,
    SKIP,
    AttentionView,
    classify,
)
from mindformers_py.parallel.context.data import BatchSharding, StreamSpec, shard_batch
from mindformers_py.parallel.context.layout import ContextLayout

SEMI = "semi_auto_parallel"


# -- layouts, masks and the data side (one process) ----------------------------------------------------------------


def test_balanced_layout_pairs_head_and_tail_chunks():
    layout = ContextLayout(16, ring=4, balanced=True)  # 8 chunks of 2: rank i holds chunks i and 7 - i
    assert [layout.indices(r).tolist() for r in range(4)] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                              [6, 7, 8, 9]]
    hybrid = ContextLayout(16, ring=2, ulysses=2, balanced=True)  # ring shares [0-3, 12-15] and [4-11], halved
    assert [hybrid.indices(r).tolist() for r in range(4)] == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7],
                                                              [8, 9, 10, 11]]
    assert hybrid.ring_segments(0) == [(0, 0, 4), (4, 12, 16)]
    assert torch.equal(torch.cat([layout.indices(r) for r in range(4)])[layout.restore()], torch.arange(16))
    with pytest.raises(ValueError, match="multiple of 8"):
        ContextLayout(12, ring=4, balanced=True)


@pytest.mark.parametrize("causal,padded,packed,window", [(True, False, False, None), (True, True, False, None),
                                                          (True, False, True, None), (True, False, False, 3),
                                                          (False, True, False, None)])
def test_block_masks_assemble_the_single_device_mask(causal, padded, packed, window):
    """Every (query chunk, key chunk) block of a balanced 4-rank layout masks exactly as build_attention_mask does
    for the whole sequence, and the causal classification never skips a visible key nor needs a mask it omits."""
    length = 16
    attention_mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        attention_mask[0, 10:] = 0
        attention_mask[1, :] = 0  # a row without any real token sees only itself
    positions = torch.arange(length).expand(2, -1).clone()
    if packed:
        positions[0] = torch.tensor([*range(5), *range(11)])
    view = AttentionView(ContextLayout(length, ring=4, balanced=causal), attention_mask if padded else None,
                         positions, causal, window)
    full = build_attention_mask(view.attention_mask, query_length=length, kv_length=length, causal=causal,
                                sliding_window=window, position_ids=positions)
    full = (torch.ones(length, length, dtype=torch.bool).tril() if causal else torch.ones(length, length,
            dtype=torch.bool))[None, None] if full is None else full
    full = full.dense() if isinstance(full, DocumentMask) else full  # packed rows: the documents' dense reference
    for q in range(4):
        for k in range(4):
            for _, q0, q1 in view.layout.ring_segments(q):
                for _, k0, k1 in view.layout.ring_segments(k):
                    block, expected = torch.broadcast_tensors(
                        view.block_mask(torch.arange(q0, q1), torch.arange(k0, k1)), full[..., q0:q1, k0:k1])
                    assert torch.equal(block, expected)
                    kind = classify((q0, q1), (k0, k1), causal, window)
                    if kind == SKIP:
                        assert not expected.any()
                    elif view.plain and kind in (FULL, DIAGONAL):  # computed without a mask
                        shape = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
                        assert torch.equal(expected[0, 0], shape if kind == FULL else shape.tril())


def _sharding(rank: int, **kw) -> BatchSharding:
    return BatchSharding(cp_rank=rank, ring=2, ulysses=1, source=StreamSpec(causal=True, pad_token_id=0), **kw)


def test_labels_are_shifted_positions_numbered_and_padding_added_before_cutting():
    ids = torch.arange(1, 11)[None]  # 10 tokens: padded to 12, the multiple of a balanced ring over 2 ranks
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    parts = [shard_batch(batch, _sharding(r, shift_labels=True)) for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[1, 2, 3, 10, 0, 0]] and parts[1]["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9]]
    assert parts[0]["position_ids"].tolist() == [[0, 1, 2, 9, 10, 11]]
    assert parts[0]["shift_labels"].tolist() == [[2, 3, 4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert parts[1]["shift_labels"].tolist() == [[5, 6, 7, 8, 9, 10]]  # the label of token 7 lives on rank 0's chunk
    assert parts[0]["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])}
    assert shard_batch(packed, _sharding(0))["position_ids"].tolist() == [[0, 1, 2, 6, 7, 8]]  # the last document goes on
    roberta = BatchSharding(cp_rank=1, ring=2, ulysses=1, source=StreamSpec(causal=False, pad_token_id=1,
                                                                           positions="padding_aware"))
    row = {"input_ids": torch.tensor([[0, 5, 6, 7, 8, 2, 1, 1]])}  # RoBERTa numbers real tokens from padding_idx + 1
    assert shard_batch(row, roberta)["position_ids"].tolist() == [[6, 7, 1, 1]]
    with pytest.raises(ConfigError, match="cannot split the batch key 'scores'"):
        shard_batch({"input_ids": ids, "scores": torch.ones(1, 10)}, _sharding(0))


def test_multi_token_prediction_inputs_and_targets_are_made_before_cutting():
    """Module k embeds token t + k and scores against token t + k + 1 at position t: both made on the whole row, then
    cut with it, so a chunk's edge takes them from the other rank's chunk (DeepSeek-V3's MTP, two modules)."""
    ids = torch.arange(1, 11)[None]
    batch = {"input_ids": ids, "labels": ids.clone()}
    parts = [shard_batch(batch, _sharding(r, shift_labels=True, tokens_ahead=2)) for r in range(2)]
    # rank 0 holds positions 0, 1, 2, 9 and two of padding; rank 1 positions 3..8
    assert parts[0]["mtp_input_ids"][..., 0].tolist() == [[2, 3, 4, 1, 0, 0]]  # past the end: the row's first tokens
    assert parts[0]["mtp_input_ids"][..., 1].tolist() == [[3, 4, 5, 2, 0, 0]]
    assert parts[1]["mtp_input_ids"][..., 0].tolist() == [[5, 6, 7, 8, 9, 10]]  # token 10 lives on rank 0's chunk
    assert parts[0]["mtp_shift_labels"][..., 0].tolist() == [[3, 4, 5] + [IGNORE_INDEX] * 3]
    assert parts[1]["mtp_shift_labels"][..., 0].tolist() == [[6, 7, 8, 9, 10, IGNORE_INDEX]]
    assert parts[1]["mtp_shift_labels"][..., 1].tolist() == [[7, 8, 9, 10, IGNORE_INDEX, IGNORE_INDEX]]
    assert "mtp_input_ids" not in shard_batch({"input_ids": ids}, _sharding(0, tokens_ahead=2))  # nothing to score


@pytest.mark.parametrize("layout,model,kwargs,fragments", [
    (dict(context_parallel=2, context_parallel_algo="ulysses"), dict(num_attention_heads=3, hidden_size=48), {},
     ["num_attention_heads=3", "Ulysses group of 2"]),
    (dict(context_parallel=2, model_parallel=2, context_parallel_algo="ulysses"), dict(num_attention_heads=2), {},
     ["model_parallel*ulysses = 2*2"]),
    (dict(context_parallel=2), {}, dict(sequence_length=130), ["sequence length 130", "2*context_parallel = 2*2 = 4",
                                                               "e.g. 132"]),
    (dict(context_parallel=2), dict(attention_dropout=0.1), {}, ["attention_dropout=0.1", "'ulysses'"]),
    (dict(context_parallel=2), {}, dict(task="text-classification"), ["GPT sequence classifier", "input_ids"]),
])
def test_what_context_parallelism_cannot_split_is_refused_in_one_line(layout, model, kwargs, fragments):
    config = mf.ParallelConfig(parallel_mode=SEMI, **layout)
    with pytest.raises(ConfigError) as info:
        config.validate_for(config.required_world_size(), mf.GPTConfig(**model), **kwargs)
    assert "\n" not in str(info.value) and all(f in str(info.value) for f in fragments), str(info.value)


def test_layout_and_family_refusals():
    for fields, fragment in ((dict(context_parallel=2, context_parallel_algo="hybrid"), "hybrid"),
                             (dict(context_parallel=8, context_parallel_algo="hybrid", ulysses_degree_in_cp=8),
                              "choose one of: 2, 4"),
                             (dict(context_parallel=2, context_parallel_algo="bogus"), "'ring', 'ulysses', 'hybrid'")):
        with pytest.raises(ConfigError, match=fragment):
            mf.ParallelConfig(parallel_mode=SEMI, **fields)
    with pytest.raises(ConfigError, match="context_parallel=2 is not valid with parallel_mode='data_parallel'"):
        mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=2, context_parallel=2)
    cp2 = mf.ParallelConfig(parallel_mode=SEMI, context_parallel=2)
    with pytest.raises(ConfigError, match=r"data_parallel\*context_parallel\*model_parallel\*pipeline_stage = 1\*2"):
        cp2.validate_for(4)
    with pytest.raises(ConfigError, match="197 tokens per sample"):
        cp2.validate_for(2, mf.ViTConfig())
    with pytest.raises(ConfigError, match="encoder-decoder"):
        mf.ParallelConfig(parallel_mode=SEMI, context_parallel=2, pipeline_stage=2, micro_batch_num=2).validate_for(
            4, mf.T5Config(dropout_rate=0.0))
    hybrid = mf.ParallelConfig(parallel_mode=SEMI, context_parallel=8, context_parallel_algo="hybrid_cp")
    assert (hybrid.cp_ulysses, hybrid.cp_ring, hybrid.required_world_size()) == (4, 2, 8)
    assert mf.ParallelConfig(parallel_mode=SEMI, context_parallel=2, data_parallel=2, expert_parallel=4).ep == 4
    # From Python, the Trainer refuses them before it starts its worker processes.
    config = mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_labels=2,
                          pad_token_id=0)
    for model, extra, fragment in ((mf.GPTForSequenceClassification(config), {}, "GPT sequence classifier"),
                                   (mf.GPTForCausalLM(config), {"torch_compile": True}, "torch_compile=True")):
        args = mf.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], parallel_config=cp2, **extra)
        with pytest.raises(ConfigError, match=fragment):
            mf.Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3, 4], "labels": 1}])


# -- gradients against stand-alone (gloo) --------------------------------------------------------------------------

FAMILIES = ["causal_lm", "packed_causal_lm", "window_causal_lm", "qwen3_causal_lm", "moe_causal_lm", "qwen3_moe_causal_lm",
            "bert_masked_lm", "bert_single_label", "question_answering", "image_classification", "seq2seq_lm"]
# (name, layout, heads, per-rank batch, accumulation)
TWO_RANKS = [
    *((algo, dict(context_parallel=2, context_parallel_algo=algo), FAMILIES, N, 1) for algo in ("ring", "ulysses")),
    ("ring_accumulation_full_recompute", dict(context_parallel=2, recompute="full"), ["causal_lm"], N // 2, 2),
    ("ring_selective_recompute", dict(context_parallel=2, recompute="selective"), ["seq2seq_lm"], N, 1),
    ("ulysses_selective_recompute", dict(context_parallel=2, context_parallel_algo="ulysses", recompute="selective"),
     ["causal_lm"], N, 1),
    ("ring_zero1", dict(context_parallel=2, optimizer_shard=1), ["causal_lm"], N, 1),
    ("ulysses_zero2", dict(context_parallel=2, context_parallel_algo="ulysses", optimizer_shard=2), ["causal_lm"], N, 1),
    ("ring_zero3", dict(context_parallel=2, optimizer_shard=3), ["causal_lm", "bert_single_label"], N, 1),
    ("ring_ep2", dict(context_parallel=2, expert_parallel=2), ["moe_causal_lm"], N, 1),
]
FOUR_RANKS = [
    ("cp4_ring", dict(context_parallel=4), ["causal_lm", "moe_causal_lm"], N, 1),
    ("cp4_ulysses", dict(context_parallel=4, context_parallel_algo="ulysses"), ["bert_masked_lm"], N, 1),
    ("cp4_hybrid", dict(context_parallel=4, context_parallel_algo="hybrid"),
     ["causal_lm", "packed_causal_lm", "qwen3_causal_lm", "seq2seq_lm"], N, 1),
    ("dp2_cp2", dict(data_parallel=2, context_parallel=2), ["causal_lm", "image_classification"], N // 2, 1),
    ("cp2_tp2_sequence_parallel", dict(context_parallel=2, model_parallel=2, use_seq_parallel=True),
     ["causal_lm", "qwen3_causal_lm"], N, 1),
    ("cp2_tp2_ulysses", dict(context_parallel=2, model_parallel=2, context_parallel_algo="ulysses"), ["causal_lm"], N, 1),
    ("cp2_pp2", dict(context_parallel=2, pipeline_stage=2, micro_batch_num=2),
     ["causal_lm", "qwen3_causal_lm", "moe_causal_lm"], N, 1),
    ("dp2_cp2_ep4", dict(data_parallel=2, context_parallel=2, expert_parallel=4), ["moe_causal_lm", "qwen3_moe_causal_lm"],
     N // 2, 1),
]
# Once more under bf16 autocast, in the same launches (issue 37): the blocks' attention in bf16 with a T5 bias, and
# an MoE model's router statistics handed between the stages of a context-parallel pipeline.
BF16_CASES = {2: [("ring_bf16", dict(context_parallel=2), ["causal_lm", "seq2seq_lm"], N, 1)],
              4: [("cp2_pp2_bf16", dict(context_parallel=2, pipeline_stage=2, micro_batch_num=2), ["moe_causal_lm"], N, 1)]}


def _gradient_job(rank: int, world: int, folder: str, cases: list) -> dict:
    out = {}
    for name, layout, heads, batch, accumulation in cases:
        for head in heads:
            grads, loss = first_step(head, batch, accumulation, f"{folder}/{name}-{head}",
                                     mf.ParallelConfig(parallel_mode=SEMI, **layout))
            out[name, head] = (full_gradients(grads), loss)
    for name, layout, heads, batch, accumulation in BF16_CASES[world]:
        for head in heads:
            out[name, head] = first_step(head, batch, accumulation, f"{folder}/{name}-{head}",
                                         mf.ParallelConfig(parallel_mode=SEMI, **layout), bf16=True)[1]
    if world == 2:  # evaluation runs whole sequences on every rank: the stand-alone loss
        out["eval"] = _eval_loss(folder, mf.ParallelConfig(parallel_mode=SEMI, context_parallel=2))
    return out


def _eval_loss(folder: str, parallel: mf.ParallelConfig) -> float:
    args = mf.TrainingArguments(output_dir=f"{folder}/eval", per_device_eval_batch_size=4, report_to="none",
                                disable_tqdm=True, use_cpu=True, parallel_config=parallel, bf16=False)
    trainer = mf.Trainer(model=make_model("causal_lm"), args=args, eval_dataset=make_data("causal_lm"))
    loss = trainer.evaluate()["eval_loss"]
    trainer.engine.teardown()
    return loss


def _check(results: list[dict], cases: list, folder) -> None:
    references: dict[str, tuple] = {}
    for name, _, heads, _, _ in cases:
        for head in heads:
            if head not in references:
                references[head] = first_step(head, N, 1, str(folder / f"ref-{head}"))
            ref_grads, ref_loss = references[head]
            for result in results:
                grads, loss = result[name, head]
                held = {k: ref_grads[k] for k in grads}  # a pipeline stage holds some of them
                assert held, (name, head)
                assert_same(grads, loss, held, ref_loss)
    for name, _, heads, _, _ in BF16_CASES[len(results)]:
        for head in heads:
            bf16_loss = first_step(head, N, 1, str(folder / f"ref-{head}-bf16"), bf16=True)[1]
            fp32_loss = references[head][1] if head in references else first_step(head, N, 1, str(folder / head))[1]
            for result in results:
                assert_bf16_close(result[name, head], bf16_loss, fp32_loss)


def test_two_ranks_give_stand_alone_gradients_for_every_algorithm_and_family(tmp_path):
    results = run_workers(_gradient_job, 2, str(tmp_path), TWO_RANKS)
    _check(results, TWO_RANKS, tmp_path)
    reference = _eval_loss(str(tmp_path / "sa"), mf.ParallelConfig())
    assert all(abs(r["eval"] - reference) <= 1e-5 * reference for r in results)


def test_four_ranks_and_combined_layouts_give_stand_alone_gradients(tmp_path):
    _check(run_workers(_gradient_job, 4, str(tmp_path), FOUR_RANKS), FOUR_RANKS, tmp_path)
