"""Loss normalisation for every task head: the same 8 samples give the same gradients and the same logged loss
whether they are one batch of 8, 2 × 4 or 8 × 1 accumulated micro-batches, or split over 2 data-parallel ranks.
The MoE causal LM's loss includes its router losses (sequence-wise load balancing and z-loss), whose micro-batch
shares must add up the same way, also over expert-parallel ranks.

Gradients are compared (not AdamW losses, which are nearly blind to a constant factor), with clipping off. The
micro-batches hold different numbers of items (padding, ignored labels), so a per-micro-batch mean would show.
"""

from __future__ import annotations

import pytest

import mindformers_py as mf
from support.dist_utils import run_workers
from support.task_models import HEADS, N, assert_bf16_close, assert_same, first_step

@pytest.mark.parametrize("head", HEADS)
def test_gradient_accumulation_splits_give_one_batch_gradients(head, tmp_path):
    ref_grads, ref_loss = first_step(head, N, 1, str(tmp_path / "8x1"))
    # transformers' classifier averages over its micro-batch: one holding only the ignored row would be 0/0.
    splits = ((4, 2), (2, 4)) if head == "hf_sequence_classifier" else ((4, 2), (1, 8))
    for batch, accumulation in splits:
        grads, loss = first_step(head, batch, accumulation, str(tmp_path / f"{batch}x{accumulation}"))
        assert_same(grads, loss, ref_grads, ref_loss)


def _dp2_job(rank: int, world: int, folder: str) -> dict:
    out = {}
    for head in HEADS:
        grads, loss = first_step(head, N // 2, 1, f"{folder}/{head}",
                                 mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=2))
        out[head] = ({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in grads.items()}, loss)
    return out


def test_data_parallel_gives_stand_alone_gradients_for_every_head(tmp_path):
    results = run_workers(_dp2_job, 2, str(tmp_path))
    for head in HEADS:
        ref_grads, ref_loss = first_step(head, N, 1, str(tmp_path / f"ref-{head}"))
        for rank in range(2):
            assert_same(*results[rank][head], ref_grads, ref_loss)


TIED = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
OUR_HEADS = [h for h in HEADS if h != "hf_sequence_classifier"]  # transformers' models are not cut into stages
LAYOUTS = {
    "pp2": dict(pipeline_stage=2, micro_batch_num=2),
    "tp2_sequence_parallel": dict(model_parallel=2, use_seq_parallel=True),
    "dp2_ep2": dict(data_parallel=2, expert_parallel=2),
}
# Sequence parallelism does not split encoder-decoders (refused); tp2 alone is tested in test_t5_parallel.py.
UNSUPPORTED = {("tp2_sequence_parallel", "seq2seq_lm")}


def _heads_for(layout: dict) -> list[str]:
    """Expert parallelism needs experts; sequence parallelism is refused with them and for encoder-decoders (tp2
    alone is tested for T5 in test_t5_parallel.py)."""
    if layout.get("expert_parallel", 1) > 1:
        return ["moe_causal_lm"]
    return [h for h in OUR_HEADS if not (layout.get("use_seq_parallel") and h in ("moe_causal_lm", "seq2seq_lm"))]


# Each family once more under bf16 autocast, in the same launch (issue 37: layouts ran in fp32 only): GPT, ViT and T5
# cut into pipeline stages, BERT with tensor and sequence parallelism, GPT-MoE with its experts split.
BF16_CASES = [("pp2", "causal_lm"), ("tp2_sequence_parallel", "bert_masked_lm"), ("pp2", "image_classification"),
              ("pp2", "seq2seq_lm"), ("dp2_ep2", "moe_causal_lm")]


def _layout_job(rank: int, world: int, folder: str) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        for head in _heads_for(layout):
            batch = N // layout.get("data_parallel", 1)
            grads, loss = first_step(head, batch, 2, f"{folder}/{name}-{head}",
                                     mf.ParallelConfig(parallel_mode="semi_auto_parallel", **layout))
            out[name, head] = ({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in grads.items()}, loss)
    for name, head in BF16_CASES:
        layout = LAYOUTS[name]
        out[name, head, "bf16"] = first_step(head, N // layout.get("data_parallel", 1), 2, f"{folder}/{name}-{head}-bf16",
                                             mf.ParallelConfig(parallel_mode="semi_auto_parallel", **layout),
                                             bf16=True)[1]
    return out


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    return run_workers(_layout_job, 2, str(tmp_path_factory.mktemp("layouts")))


def test_pipeline_and_tensor_parallel_layouts_give_stand_alone_gradients_for_every_head(layout_results, tmp_path):
    """pp2 (each rank holds half the parameters), tp2 with sequence parallelism and, for the MoE head, dp2 with its
    experts split over the 2 ranks, with accumulation 2."""
    results = layout_results
    for head in OUR_HEADS:
        ref_grads, ref_loss = first_step(head, N, 1, str(tmp_path / f"ref-{head}"))
        for rank in range(2):
            for name in (n for n, layout in LAYOUTS.items() if head in _heads_for(layout)):
                grads, loss = results[rank][name, head]
                # a stage holding only the tied copy of an embedding (BERT's MLM decoder) names it as the copy
                held = {k: ref_grads[k if k in ref_grads else TIED[k]] for k in grads}
                assert held and (name != "pp2" or len(held) < len(ref_grads)), (name, head)
                assert_same(grads, loss, held, ref_loss)


@pytest.mark.parametrize("case", BF16_CASES, ids=[f"{name}-{head}" for name, head in BF16_CASES])
def test_each_family_runs_its_layout_under_bf16_within_tolerance(layout_results, tmp_path, case):
    name, head = case
    ref_loss = first_step(head, N, 1, str(tmp_path / "bf16"), bf16=True)[1]
    fp32_loss = first_step(head, N, 1, str(tmp_path / "fp32"))[1]
    for rank in range(2):
        assert_bf16_close(layout_results[rank][name, head, "bf16"], ref_loss, fp32_loss)
