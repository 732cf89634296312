"""Data at scale under the layouts, in one 2-process launch:

* packed rows (positions restarting at each document, no attention mask) give, under stand-alone, tp2 (with sequence
  parallelism for the dense model), pp2, cp2 ring with ZeRO-3 (and ep2 for the MoE model) and cp2 Ulysses, the loss
  and gradients of each document run alone (<= 1e-6, fp32) for GPT in GPT-2 flavour and GPT-MoE in Qwen3-MoE's shape (Llama flavour with per-head q/k norms; a
  dense layer, then an MoE one): the block-sparse path on one rank, tensor and pipeline ranks; the boundaries cut
  with the sequence under context parallelism;
* Megatron's samples (pre-shifted targets, restarting positions) under cp2 ring give one process's gradients;
* a run saved at step k under dp2 and resumed under dp1, and one saved under dp1 and resumed under dp2, read exactly
  the global batches of the remaining steps an uninterrupted run reads, for map-style data, a stream and a Megatron
  corpus (read in its own order), across an epoch boundary.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from support.dist_utils import run_workers
from support.task_models import FirstStepGradients, full_gradients, train_first_step
from torch.utils.data import IterableDataset

import mindformers_py as mf
from mindformers_py.data.megatron.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mindformers_py.data.megatron.gpt_dataset import GPTSampleOptions, MegatronGPTDataset, split_indices
from mindformers_py.data.sft_packing import PackedRowsCollator
from mindformers_py.trainer import Trainer, TrainingArguments

SEMI = "semi_auto_parallel"
VOCAB = 64
DOCUMENTS = [[5, 11], [16], [3, 4, 9], [7, 1, 8]]  # four rows of 16 tokens, documents of 1 to 16 tokens
# token-level routing; router losses are normalised per forward, not per document. Layer 0 keeps a dense (SwiGLU) MLP,
# so one Qwen3-shaped model (Llama flavour, per-head q/k norms) covers the dense Llama / Qwen3 layer and GPT-MoE's
# expert layer in every launch.
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "moe_intermediate_size": 16,
       "aux_loss_factor": 0.0, "mlp_only_layers": [0]}
FAMILIES = ["gpt2", "qwen3_moe"]
LAYOUTS = {"tp2_sp": dict(model_parallel=2, use_seq_parallel=True), "pp2": dict(pipeline_stage=2, micro_batch_num=2),
           "cp2_ring_zero3_ep2": dict(context_parallel=2, optimizer_shard=3, expert_parallel=2),
           "cp2_ulysses": dict(context_parallel=2, context_parallel_algo="ulysses")}


def layout_of(name: str, family: str) -> mf.ParallelConfig:
    """The layout ``name`` for ``family``: the MoE model runs tp2 without sequence parallelism (which it refuses), the
    dense one the ring without expert parallelism (it has no experts)."""
    layout = dict(LAYOUTS[name])
    layout.pop("use_seq_parallel" if family == "qwen3_moe" else "expert_parallel", None)
    return mf.ParallelConfig(parallel_mode=SEMI, **layout)


def make_model(family: str) -> mf.GPTForCausalLM:
    torch.manual_seed(0)
    extra = {"moe_config": MOE, "qk_norm": True} if family == "qwen3_moe" else {}
    return mf.GPTForCausalLM(mf.GPTConfig(
        flavour="gpt2" if family == "gpt2" else "llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=None if family == "gpt2" else 2, max_position_embeddings=32,
        pad_token_id=0, embedding_dropout=0.0, attention_dropout=0.0, hidden_dropout=0.0, **extra))


def packed_rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in DOCUMENTS:
        positions = torch.cat([torch.arange(n) for n in lengths])
        ids = torch.randint(1, VOCAB, (len(positions),), generator=g)
        rows.append({"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)})
    return rows


def first_step(family: str, folder: str, parallel: mf.ParallelConfig, dataset=None) -> tuple[dict, float]:
    clock = FirstStepGradients()
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=len(DOCUMENTS) // parallel.dp, max_steps=1,
                             learning_rate=1e-3, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to="none", disable_tqdm=True, plot_loss_curve=False, use_cpu=True, bf16=False,
                             parallel_config=parallel)
    trainer = Trainer(model=make_model(family), args=args, train_dataset=packed_rows() if dataset is None else dataset,
                      callbacks=[clock], data_collator=PackedRowsCollator())
    grads, loss = train_first_step(trainer, clock)
    return full_gradients(grads), loss


def documents_alone(family: str) -> tuple[dict, float]:
    """Gradients and loss of every document of the batch run as a sequence of its own."""
    model = make_model(family)
    rows = packed_rows()
    items = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
    loss = 0.0
    for row, lengths in zip(rows, DOCUMENTS):
        start = 0
        for n in lengths:
            ids, labels = row["input_ids"][start:start + n][None], row["labels"][start:start + n][None]
            loss = loss + model(input_ids=ids, labels=labels, num_items_in_batch=items).loss
            start += n
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, loss.item()


# -- resuming under another data-parallel size ----------------------------------------------------------------------

STEPS, SAVE_AT, PER_DEVICE, GLOBAL = 4, 2, 2, 4  # 12 samples: 3 steps an epoch, so the resumed steps cross epoch 1


class Recorder:
    """A collator that notes the rows it collates (this rank's part of each micro-batch), in order."""

    def __init__(self, collate) -> None:
        self.collate, self.rows = collate, []

    def __call__(self, examples):
        batch = self.collate(examples)
        self.rows += [tuple(r.tolist()) for r in batch["input_ids"]]
        return batch


class Stream(IterableDataset):
    def __init__(self, rows) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def corpus(root: str) -> str:
    prefix = f"{root}/corpus"
    if not Path(prefix + ".idx").exists():
        rng = np.random.default_rng(0)
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for _ in range(20):  # 100 tokens: 12 samples of 8 + 1
                writer.add_document(np.append(rng.integers(2, VOCAB, 4), 1))
    return prefix


def source(kind: str, root: str):
    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": torch.randint(1, VOCAB, (8,), generator=g)} for _ in range(12)]
    if kind == "map":
        return rows, None
    if kind == "stream":
        return Stream(rows), None
    indexed = IndexedDataset(corpus(root))
    options = GPTSampleOptions(8, seed=7, eod_token_id=1, reset_position_ids=True, reset_attention_mask=True)
    dataset = MegatronGPTDataset(indexed, split_indices(len(indexed), (0.0, 1.0)), None, "train", options,
                                 cache_dir=f"{root}/cache")
    return dataset, PackedRowsCollator()


def train(kind: str, dp: int, folder: str, root: str, resume: str | None = None) -> list[tuple]:
    """This rank's rows, micro-batch after micro-batch, of a run under ``dp`` data-parallel ranks (the global batch
    of every step is 4 samples: 2 per rank under dp2, 2 micro-batches of 2 under dp1)."""
    dataset, collate = source(kind, root)
    recorder = Recorder(collate or mf.data.StackingCausalLMCollator())
    parallel = mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=2) if dp == 2 else mf.ParallelConfig()
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=PER_DEVICE,
                             gradient_accumulation_steps=GLOBAL // (PER_DEVICE * dp), max_steps=STEPS,
                             learning_rate=1e-3, save_strategy="steps", save_steps=SAVE_AT, logging_steps=1,
                             report_to="none", disable_tqdm=True, plot_loss_curve=False, use_cpu=True, bf16=False,
                             seed=11, parallel_config=parallel)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           max_position_embeddings=16))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=recorder)
    trainer.train(resume_from_checkpoint=resume)
    trainer.engine.teardown()
    return recorder.rows


def global_batches(per_rank: list[list[tuple]]) -> list[Counter]:
    """Each step's global batch (a multiset of rows) from every rank's rows in order."""
    share = GLOBAL // len(per_rank)
    steps = len(per_rank[0]) // share
    return [Counter(row for rows in per_rank for row in rows[s * share:(s + 1) * share]) for s in range(steps)]


KINDS = ["map", "stream", "megatron"]
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _job(rank: int, world: int, root: str) -> dict:
    out = {}
    for name in LAYOUTS:
        for family in FAMILIES:
            out[name, family] = first_step(family, f"{root}/{name}-{family}", layout_of(name, family))
    # Megatron's samples (all targets pre-shifted, documents as restarting positions) cut over the ring
    out["megatron_cp2"] = first_step("llama", f"{root}/megatron-cp2", mf.ParallelConfig(
        parallel_mode=SEMI, context_parallel=2), dataset=source("megatron", root)[0])
    for kind in KINDS:
        out["dp2", kind] = train(kind, 2, f"{root}/dp2-{kind}", root)
        out["dp2_resumed", kind] = train(kind, 2, f"{root}/dp2-resumed-{kind}", root,
                                         resume=f"{root}/dp1-{kind}/checkpoint-{SAVE_AT}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("packed"))
    results = {("dp1", kind): train(kind, 1, f"{root}/dp1-{kind}", root) for kind in KINDS}
    results["megatron_alone"] = first_step("llama", f"{root}/megatron-alone", mf.ParallelConfig(),
                                           dataset=source("megatron", root)[0])
    ranks = run_workers(_job, 2, root)
    results.update({key: [r[key] for r in ranks] for key in ranks[0]})
    for kind in KINDS:
        results["dp1_resumed", kind] = train(kind, 1, f"{root}/dp1-resumed-{kind}", root,
                                             resume=f"{root}/dp2-{kind}/checkpoint-{SAVE_AT}")
    return results


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["stand_alone", *LAYOUTS])
def test_packed_rows_give_each_documents_loss_and_gradients(runs, layout, family, tmp_path):
    reference, reference_loss = documents_alone(family)
    if layout == "stand_alone":
        grads, loss = first_step(family, str(tmp_path), mf.ParallelConfig())
        ranks = [(grads, loss)]
    else:
        ranks = runs[layout, family]
    for grads, loss in ranks:
        assert math.isclose(loss, reference_loss, rel_tol=1e-6), (loss, reference_loss)
        assert grads
        for name, grad in grads.items():  # (a pipeline rank holds its stage's; the last one its copy of a tied table)
            expected = reference[name if name in reference else TIED.get(name, name)]
            torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_under_another_data_parallel_size_reads_the_remaining_global_batches(runs, kind):
    uninterrupted = global_batches([runs["dp1", kind]])
    assert len(uninterrupted) == STEPS and global_batches(runs["dp2", kind]) == uninterrupted
    assert global_batches([runs["dp1_resumed", kind]]) == uninterrupted[SAVE_AT:]
    assert global_batches(runs["dp2_resumed", kind]) == uninterrupted[SAVE_AT:]


def test_megatron_samples_under_context_parallelism_give_one_processs_gradients(runs):
    reference, reference_loss = runs["megatron_alone"]
    for grads, loss in runs["megatron_cp2"]:
        assert math.isclose(loss, reference_loss, rel_tol=1e-6), (loss, reference_loss)
        assert grads.keys() == reference.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-6, msg=name)
