"""A checkpoint the Trainer saved under dp2 + ZeRO-3 resumes through the Trainer under other layouts (tensor and
pipeline parallel, dp4, stand-alone), optimizer state included, on stand-alone's loss curve: GPT, GPT-MoE in
Qwen3-MoE's shape (per-head q/k norms, no shared expert; saved with expert parallelism) and BERT (masked LM). The pipeline pairs failed before: the last stage's copy of the tied
embedding found no optimizer state of its own in a checkpoint without stages, and an MoE model without router loss
sent router statistics no loss used (so no gradient came back).

Every family resumes under every layout. One 2-process job saves all three and resumes the tensor/pipeline pairs,
one 4-process job the dp4 ones; the stand-alone references and resumes run in the test process."""

from __future__ import annotations

import pytest
import torch
from transformers import default_data_collator

import mindformers_py as mf
from dist_utils import run_workers
from mindformers_py.parallel import ParallelConfig
from mindformers_py.trainer import Trainer, TrainingArguments

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 64, 16, 4, 3, 2
RTOL = 1e-4
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "moe_intermediate_size": 32}
FAMILIES = ("gpt", "moe", "bert")
RESUMED_2 = [(family, name) for family in FAMILIES for name in ("tp2", "pp2")]
RESUMED_4 = [(family, "dp4") for family in FAMILIES]
RESUMED_1 = [(family, "stand_alone") for family in FAMILIES]


def model(family: str):
    torch.manual_seed(0)
    if family == "bert":
        return mf.BertForMaskedLM(mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))  # dropout masks differ by layout
    moe = {"flavour": "llama", "num_key_value_heads": 2, "qk_norm": True, "moe_config": MOE} if family == "moe" else {}
    return mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=SEQ, **moe))


def data(family: str) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (4 * GLOBAL_BATCH, SEQ), generator=gen)
    if family != "bert":
        return [{"input_ids": row.tolist()} for row in ids]
    masked = torch.rand(ids.shape, generator=gen) < 0.3  # fixed masks: the same labels under every layout
    return [{"input_ids": i.tolist(), "labels": l.tolist()}
            for i, l in zip(ids.masked_fill(masked, 3), ids.masked_fill(~masked, -100))]


def layout(family: str, name: str) -> ParallelConfig:
    ep = {"expert_parallel": 2} if family == "moe" and name in ("saved", "dp4") else {}
    sizes = {"saved": dict(data_parallel=2, optimizer_shard=3), "tp2": dict(model_parallel=2),
             "pp2": dict(pipeline_stage=2, micro_batch_num=2), "dp4": dict(data_parallel=4),
             "stand_alone": {}}[name]
    mode = "stand_alone" if name == "stand_alone" else "semi_auto_parallel"
    return ParallelConfig(parallel_mode=mode, **sizes, **ep)


def train(family: str, name: str, root: str, resume: bool = False) -> list[float]:
    """The Trainer's logged losses under layout ``name`` (resuming from the dp2 + ZeRO-3 run's checkpoint)."""
    parallel = layout(family, name)
    saving = {"save_strategy": "steps", "save_steps": SAVE_AT} if name == "saved" else {"save_strategy": "no"}
    args = TrainingArguments(output_dir=f"{root}/{family}/{name}", per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                             learning_rate=1e-2, weight_decay=0.1, max_steps=STEPS, logging_steps=1, use_cpu=True,
                             parallel_config=parallel, report_to=[], disable_tqdm=True, seed=3, bf16=False, **saving)
    trainer = Trainer(model=model(family), args=args, train_dataset=data(family),
                      data_collator=default_data_collator if family == "bert" else None)
    trainer.train(resume_from_checkpoint=f"{root}/{family}/saved/checkpoint-{SAVE_AT}" if resume else None)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _worker(rank, world_size, root):
    if world_size == 4:
        return {case: train(*case, root, resume=True) for case in RESUMED_4}
    out = {(family, "saved"): train(family, "saved", root) for family in FAMILIES}
    out.update({case: train(*case, root, resume=True) for case in RESUMED_2})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layouts"))
    results = {(family, "reference"): train(family, "stand_alone", f"{root}/ref") for family in FAMILIES}
    results.update(run_workers(_worker, 2, root)[0])
    results.update(run_workers(_worker, 4, root)[0])
    results.update({case: train(*case, root, resume=True) for case in RESUMED_1})
    return results


@pytest.mark.parametrize("case", [(f, "saved") for f in FAMILIES] + RESUMED_2 + RESUMED_4 + RESUMED_1,
                         ids=lambda case: "-".join(case))
def test_checkpoint_of_dp2_zero3_resumes_on_the_stand_alone_curve(runs, case):
    family, _ = case
    reference = runs[(family, "reference")]
    assert len(reference) == STEPS and len(runs[case]) == STEPS
    assert runs[case] == pytest.approx(reference, rel=RTOL), case
