"""A checkpoint the Trainer saved under dp2 + ZeRO-3 resumes through the Trainer under other layouts (tensor and
pipeline parallel, dp4, stand-alone), optimizer state included, on stand-alone's loss curve: GPT, GPT-MoE in
Qwen3-MoE's shape (per-head q/k norms, no shared expert; saved with expert parallelism) and BERT (masked LM); the
same GPT-MoE with DeepSeek-V3's router and auxiliary-loss-free balancing under pp2 and stand-alone (its selection
biases, moved every step, come back from the checkpoint and go on bitwise as uninterrupted). The pipeline pairs
failed before: the last stage's copy of the tied embedding found no optimizer state of its own in a checkpoint
without stages, and an MoE model without router loss sent router statistics no loss used (so no gradient came
back).

Every family resumes under every layout (DeepSeek-V3's routing under pp2 and stand-alone). One 2-process job saves
all four and resumes the tensor/pipeline pairs, one 4-process job the dp4 ones; the stand-alone references and
resumes run in the test process."""

from __future__ import annotations

import pytest
import torch
from transformers import default_data_collator

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.parallel import ParallelConfig
from mindformers_py.trainer import Trainer, TrainingArguments

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 64, 16, 4, 3, 2
RTOL = 1e-4
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "moe_intermediate_size": 32}
# a rate small enough that the biases do not swing back to 0 within the steps (the check needs them non-zero)
DEEPSEEK = {**MOE, "router_type": "deepseek_v3", "n_group": 2, "topk_group": 1, "bias_update_rate": 0.001}
FAMILIES = ("gpt", "moe", "bert", "deepseek")
RESUMED_2 = [(family, name) for family in FAMILIES[:3] for name in ("tp2", "pp2")] + [("deepseek", "pp2")]
RESUMED_4 = [(family, "dp4") for family in FAMILIES[:3]]
RESUMED_1 = [(family, "stand_alone") for family in FAMILIES]


def model(family: str):
    torch.manual_seed(0)
    if family == "bert":
        return mf.BertForMaskedLM(mf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))  # dropout masks differ by layout
    moe = {"flavour": "llama", "num_key_value_heads": 2, "qk_norm": True,
           "moe_config": MOE if family == "moe" else DEEPSEEK} if family in ("moe", "deepseek") else {}
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
    ep = {"expert_parallel": 2} if family in ("moe", "deepseek") and name in ("saved", "dp4") else {}
    sizes = {"saved": dict(data_parallel=2, optimizer_shard=3), "tp2": dict(model_parallel=2),
             "pp2": dict(pipeline_stage=2, micro_batch_num=2), "dp4": dict(data_parallel=4),
             "stand_alone": {}}[name]
    mode = "stand_alone" if name == "stand_alone" else "semi_auto_parallel"
    return ParallelConfig(parallel_mode=mode, **sizes, **ep)


def train(family: str, name: str, root: str, resume: bool = False) -> dict:
    """The Trainer's logged losses under layout ``name`` (resuming from the dp2 + ZeRO-3 run's checkpoint) and the
    MoE selection biases at the end (this rank's layers')."""
    parallel = layout(family, name)
    saving = {"save_strategy": "steps", "save_steps": SAVE_AT} if name == "saved" else {"save_strategy": "no"}
    args = TrainingArguments(output_dir=f"{root}/{family}/{name}", per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                             learning_rate=1e-2, weight_decay=0.1, max_steps=STEPS, logging_steps=1, use_cpu=True,
                             parallel_config=parallel, report_to=[], disable_tqdm=True, seed=3, bf16=False, **saving)
    trainer = Trainer(model=model(family), args=args, train_dataset=data(family),
                      data_collator=default_data_collator if family == "bert" else None)
    trainer.train(resume_from_checkpoint=f"{root}/{family}/saved/checkpoint-{SAVE_AT}" if resume else None)
    biases = {name: b.detach().cpu().clone() for name, b in trainer.model.named_buffers()
              if name.endswith("e_score_correction_bias")}
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "biases": biases}


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
    results.update(_merged(run_workers(_worker, 2, root)))
    results.update(_merged(run_workers(_worker, 4, root)))
    results.update({case: train(*case, root, resume=True) for case in RESUMED_1})
    return results


def _merged(per_rank: list[dict]) -> dict:
    """Rank 0's results, with the biases of every rank's layers (a pipeline rank holds its stage's)."""
    return {case: {**result, "biases": {k: v for rank in per_rank for k, v in rank[case]["biases"].items()}}
            for case, result in per_rank[0].items()}


@pytest.mark.parametrize("case", [(f, "saved") for f in FAMILIES] + RESUMED_2 + RESUMED_4 + RESUMED_1,
                         ids=lambda case: "-".join(case))
def test_checkpoint_of_dp2_zero3_resumes_on_the_stand_alone_curve(runs, case):
    family, _ = case
    reference = runs[(family, "reference")]
    assert len(reference["losses"]) == STEPS and len(runs[case]["losses"]) == STEPS
    assert runs[case]["losses"] == pytest.approx(reference["losses"], rel=RTOL), case
    if family == "deepseek":  # the biases went on from the saved ones: bitwise the uninterrupted run's
        assert set(runs[case]["biases"]) == set(reference["biases"]) and len(reference["biases"]) == 2
        assert all(bias.abs().min() > 0 for bias in reference["biases"].values())
        for name, bias in runs[case]["biases"].items():
            assert torch.equal(bias, reference["biases"][name]), (case, name, bias, reference["biases"][name])
