"""A Trainer made without a train_dataset under a multi-process layout prepares its model for evaluation only, as
transformers wraps a model for training only: data parallelism's replicate manages none of its weights (it would hold
a second whole copy of each: a Qwen3-MoE slice's evaluation under ep2 peaked at 10.5 GiB a rank, 3.5 GiB without);
the evaluation equals stand-alone's; the weights keep their ``requires_grad``; and ``train()`` is refused in one line
if a train_dataset is set afterwards. On 2 gloo processes, under dp2, ep2 (an MoE) and ZeRO-3."""

from __future__ import annotations

import pytest

import mindformers_py as mf
from mindformers_py.errors import MindFormersError
from support.dist_utils import run_workers
from support.task_models import make_data, make_model

LAYOUTS = {
    "dp2": ("causal_lm", dict(parallel_mode="data_parallel", data_parallel=2)),
    "ep2": ("moe_causal_lm", dict(parallel_mode="semi_auto_parallel", data_parallel=2, expert_parallel=2)),
    "zero3": ("causal_lm", dict(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=3)),
}


def _evaluate(head: str, folder: str, parallel: dict | None) -> tuple[mf.Trainer, float]:
    args = mf.TrainingArguments(output_dir=folder, use_cpu=True, report_to="none", bf16=False,
                                per_device_eval_batch_size=2,
                                **({"parallel_config": mf.ParallelConfig(**parallel)} if parallel else {}))
    trainer = mf.Trainer(model=make_model(head), args=args, eval_dataset=make_data(head))
    return trainer, trainer.evaluate()["eval_loss"]


def _job(rank: int, world: int, folder: str) -> dict:
    out = {}
    for name, (head, parallel) in LAYOUTS.items():
        trainer, loss = _evaluate(head, f"{folder}/{name}", parallel)
        params = list(trainer.model.named_parameters())
        trainer.train_dataset = make_data(head)
        try:
            trainer.train()
            refusal = None
        except MindFormersError as err:
            refusal = str(err)
        out[name] = {"loss": loss, "managed": _fsdp_managed(trainer.model),
                     "trainable": all(p.requires_grad for _, p in params), "refusal": refusal}
    return out


def _fsdp_managed(model) -> int:
    """How many parameters FSDP2 (its replicate, or ZeRO-3's fully_shard) manages in ``model``'s units."""
    count = 0
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        count += len(group.fsdp_params) if group is not None else 0
    return count


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(_job, 2, str(tmp_path_factory.mktemp("evaluation-only")))[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_evaluation_only_trainer_keeps_weights_out_of_replicate_and_refuses_training(results, tmp_path, name):
    head = LAYOUTS[name][0]
    got = results[name]
    assert got["loss"] == pytest.approx(_evaluate(head, str(tmp_path), None)[1], rel=1e-5)
    # replicate (dp2; ep2's dense part and experts) manages none (it held 21 and 23 before); ZeRO-3 keeps its shards
    assert (got["managed"] > 0) == (name == "zero3")
    assert got["trainable"]  # frozen only while the layout wrapped them
    assert got["refusal"] is not None and "made without a train_dataset" in got["refusal"] \
        and "make a Trainer with train_dataset=" in got["refusal"]
