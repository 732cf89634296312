"""A user's loss goes through the same loss path under every layout: a ``compute_loss_func`` (transformers' Trainer
argument) under pp2 and dp2, and an overridden ``compute_loss`` under pp2, give stand-alone's gradients; a user's
loss a layout cannot run is refused in one line before training.

Gradients of the first step are compared with clipping off; the rows hold different numbers of label tokens, so a
loss normalised per micro-batch or per rank instead of over the step would show.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mindformers_py as mf
from support.dist_utils import run_workers
from mindformers_py.errors import ConfigError
from mindformers_py.trainer import Trainer
from support.task_models import N, assert_same, first_step, make_data, make_model

PP2 = dict(parallel_mode="semi_auto_parallel", pipeline_stage=2, micro_batch_num=2)
DP2 = dict(parallel_mode="data_parallel", data_parallel=2)


def smoothed_causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """Next-token cross-entropy with label smoothing, summed and divided by the step's items (HF's contract)."""
    logits = outputs.logits[:, :-1].float()
    summed = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, label_smoothing=0.2,
                             reduction="sum")
    return summed / num_items_in_batch


class ZLossTrainer(Trainer):
    """The model's own loss plus a z-loss on its logits (over the label tokens), as a subclass writes it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        counted = (inputs["labels"][:, 1:] != -100).float()
        z = torch.logsumexp(outputs.logits[:, :-1].float(), dim=-1) ** 2
        loss = outputs.loss + 0.1 * (z * counted).sum() / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


def _job(rank: int, world: int, folder: str) -> dict:
    out = {}
    pp2, dp2 = mf.ParallelConfig(**PP2), mf.ParallelConfig(**DP2)
    out["pp2_func"] = first_step("causal_lm", N, 2, f"{folder}/pp2-func", pp2, compute_loss_func=smoothed_causal_lm_loss)
    out["pp2_subclass"] = first_step("causal_lm", N, 2, f"{folder}/pp2-sub", pp2, trainer_class=ZLossTrainer)
    grads, loss = first_step("causal_lm", N // 2, 1, f"{folder}/dp2-func", dp2, compute_loss_func=smoothed_causal_lm_loss)
    out["dp2_func"] = ({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in grads.items()}, loss)
    try:  # an MoE model's stages carry its router statistics: a user's loss cannot see the whole model's outputs
        Trainer(model=make_model("moe_causal_lm"), train_dataset=make_data("moe_causal_lm"),
                args=mf.TrainingArguments(output_dir=f"{folder}/moe", use_cpu=True, report_to="none",
                                          parallel_config=mf.ParallelConfig(**PP2)),
                compute_loss_func=smoothed_causal_lm_loss)
        out["refusal"] = None
    except ConfigError as err:
        out["refusal"] = str(err)
    return out


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    return run_workers(_job, 2, str(tmp_path_factory.mktemp("custom-loss")))


def test_compute_loss_func_under_pp2_and_dp2_gives_stand_alone_gradients(layout_results, tmp_path):
    ref_grads, ref_loss = first_step("causal_lm", N, 1, str(tmp_path / "ref"), compute_loss_func=smoothed_causal_lm_loss)
    own_grads, _ = first_step("causal_lm", N, 1, str(tmp_path / "own"))
    assert not torch.allclose(ref_grads["lm_head.weight"], own_grads["lm_head.weight"])  # the function is used
    for rank in range(2):
        assert_same(*layout_results[rank]["dp2_func"], ref_grads, ref_loss)
        grads, loss = layout_results[rank]["pp2_func"]
        assert grads and len(grads) < len(ref_grads)  # each stage holds its half
        assert_same(grads, loss, {k: ref_grads[k] for k in grads}, ref_loss)


def test_overridden_compute_loss_runs_under_pp2_with_stand_alone_gradients(layout_results, tmp_path):
    ref_grads, ref_loss = first_step("causal_lm", N, 1, str(tmp_path / "ref"), trainer_class=ZLossTrainer)
    for rank in range(2):
        grads, loss = layout_results[rank]["pp2_subclass"]
        assert_same(grads, loss, {k: ref_grads[k] for k in grads}, ref_loss)


def test_a_user_loss_a_layout_cannot_run_is_refused_in_one_line(layout_results):
    for rank in range(2):
        message = layout_results[rank]["refusal"]
        assert message is not None and "\n" not in message
        assert "compute_loss_func" in message and "pipeline_stage=2" in message
