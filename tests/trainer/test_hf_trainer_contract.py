"""transformers' Trainer habits, part three (issue 37): each checked by running transformers' Trainer and ours side by
side on the same tiny Llama (same weights, same rows, fp32): a second ``train()``, several label names, evaluation
without an eval_dataset, ``prediction_loss_only``, the substep and prediction-step callbacks, ``save_total_limit``
with the best model, ``gradient_checkpointing`` and transformers' fields we do not have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import mindformers_py as mf
from support.hf_models import tiny_hf_model
from mindformers_py.auto import auto_class_for
from mindformers_py.errors import ConfigError
from mindformers_py.models.gpt import convert_gpt

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, report_to=[], disable_tqdm=True,
              logging_steps=1, save_strategy="no", learning_rate=1e-2, seed=3)


def _pair(head: str = "causal_lm"):
    """transformers' tiny Llama with ``head`` and our model holding the same weights."""
    hf = tiny_hf_model("llama", head)
    ours = auto_class_for(head).from_config(hf.config)
    ours.load_state_dict(convert_gpt.state_dict_from_hf(hf.state_dict(), ours.config))
    return hf.train(), ours.train()


def _trainers(tmp_path: Path, head: str = "causal_lm", **kwargs):
    """(transformers' Trainer, ours) over the same weights; ``kwargs`` go to both TrainingArguments, except
    ``trainer`` ones (datasets, callbacks, compute_metrics), which go to both Trainers."""
    trainer_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in ("train_dataset", "eval_dataset", "compute_metrics")}
    make_callbacks = kwargs.pop("callbacks", lambda: [])
    hf, ours = _pair(head)
    theirs = transformers.Trainer(model=hf, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, **{**COMMON, **kwargs}), callbacks=make_callbacks(), **trainer_kw)
    mine = mf.Trainer(model=ours, args=mf.TrainingArguments(
        output_dir=str(tmp_path / "ours"), bf16=False, **{**COMMON, **kwargs}), callbacks=make_callbacks(), **trainer_kw)
    return theirs, mine


def _rows(n: int = 8, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 128, (8,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def _logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


# -- 1. a second train() -------------------------------------------------------------------------------------------


def test_a_second_train_trains_again_with_a_fresh_schedule(tmp_path):
    """Re-running a notebook cell: transformers drops the schedule it made and makes a new one; ours reused the
    finished one (learning rate 0, nothing changed)."""
    results = []
    for trainer in _trainers(tmp_path, train_dataset=_rows(), max_steps=2):
        trainer.train()
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train()
        changed = sum(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        results.append((_logged(trainer, "learning_rate"), changed))
    (hf_lr, hf_changed), (our_lr, our_changed) = results
    assert our_lr == pytest.approx(hf_lr) and our_lr == pytest.approx([0.01, 0.005])
    assert our_changed == hf_changed == len(list(_pair()[1].parameters()))


# -- 9. several label names ----------------------------------------------------------------------------------------


def test_predict_and_evaluate_give_every_label_array_with_several_label_names(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 128, (8,), generator=g).tolist(), "start_positions": i % 8,
             "end_positions": (i + 2) % 8} for i in range(6)]
    seen = []

    def metrics(prediction):
        starts, ends = prediction.label_ids  # a tuple, as question answering needs
        seen.append((starts.tolist(), ends.tolist()))
        return {"exact": float(((prediction.predictions[0].argmax(-1) == starts)
                                & (prediction.predictions[1].argmax(-1) == ends)).mean())}

    outputs = []
    for trainer in _trainers(tmp_path, "question_answering", label_names=["start_positions", "end_positions"],
                             compute_metrics=metrics):
        out = trainer.predict(rows)
        assert isinstance(out.label_ids, tuple) and len(out.label_ids) == 2
        outputs.append((out, trainer.evaluate(rows)))
    (hf_out, hf_eval), (our_out, our_eval) = outputs
    assert seen[0] == seen[1] == seen[2] == seen[3]
    for theirs, mine in zip(hf_out.label_ids, our_out.label_ids):
        assert (theirs == mine).all()
    for theirs, mine in zip(hf_out.predictions, our_out.predictions):
        assert abs(theirs - mine).max() <= 1e-4
    assert our_eval["eval_exact"] == hf_eval["eval_exact"]
    assert our_eval["eval_loss"] == pytest.approx(hf_eval["eval_loss"], abs=1e-5)


# -- 10. eval_strategy without an eval_dataset ---------------------------------------------------------------------


def test_eval_strategy_without_an_eval_dataset_is_refused_when_the_trainer_is_built(tmp_path):
    hf, ours = _pair()
    with pytest.raises(ValueError, match="eval_dataset"):
        transformers.Trainer(model=hf, args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), use_cpu=True, eval_strategy="steps", **COMMON), train_dataset=_rows())
    with pytest.raises(ConfigError, match=r"^eval_strategy='steps' evaluates during training, but the Trainer got no "
                                          r"eval_dataset; pass an eval_dataset or set eval_strategy='no'$"):
        mf.Trainer(model=ours, args=mf.TrainingArguments(output_dir=str(tmp_path / "ours"), eval_strategy="steps",
                                                         bf16=False, **COMMON), train_dataset=_rows())
    assert not (tmp_path / "ours").exists()


# -- 11. prediction_loss_only and the substep / prediction-step callbacks ------------------------------------------


class Counter(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def _count(self, name: str, control):
        self.counts[name] = self.counts.get(name, 0) + 1
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        return self._count("on_substep_end", control)

    def on_step_end(self, args, state, control, **kwargs):
        return self._count("on_step_end", control)

    def on_prediction_step(self, args, state, control, **kwargs):
        return self._count("on_prediction_step", control)


def test_prediction_loss_only_and_the_substep_and_prediction_step_callbacks(tmp_path):
    called = []
    results = []
    for trainer in _trainers(tmp_path, train_dataset=_rows(16), max_steps=2, gradient_accumulation_steps=2,
                             prediction_loss_only=True, compute_metrics=lambda p: called.append(1) or {"x": 1.0},
                             callbacks=lambda: [Counter()]):
        trainer.train()
        out = trainer.predict(_rows(6, seed=1))
        counter = next(c for c in trainer.callback_handler.callbacks if isinstance(c, Counter))
        results.append((out, dict(counter.counts)))
    (hf_out, hf_counts), (our_out, our_counts) = results
    assert hf_counts == our_counts == {"on_substep_end": 2, "on_step_end": 2, "on_prediction_step": 2}
    assert our_out.predictions is None and our_out.label_ids is None and hf_out.predictions is None
    assert not called  # compute_metrics needs predictions: not run by either
    assert our_out.metrics["test_loss"] == pytest.approx(hf_out.metrics["test_loss"], abs=1e-5)


# -- 14. save_total_limit=1 with the best model ----------------------------------------------------------------------


def test_save_total_limit_one_with_the_best_model_keeps_only_the_best_checkpoint(tmp_path):
    scores = {"hf": iter([3.0, 1.0, 2.0]), "ours": iter([3.0, 1.0, 2.0])}  # best at step 2 of 3
    remaining = {}
    for name, trainer in zip(("hf", "ours"), _trainers(
            tmp_path, train_dataset=_rows(), eval_dataset=_rows(4, seed=2), max_steps=3, eval_strategy="steps",
            eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=1, load_best_model_at_end=True,
            metric_for_best_model="score", greater_is_better=False)):
        trainer.compute_metrics = lambda p, it=scores[name]: {"score": next(it)}
        trainer.train()
        remaining[name] = sorted(p.name for p in (tmp_path / name).glob("checkpoint-*"))
        assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-2"
    assert remaining["ours"] == remaining["hf"] == ["checkpoint-2"]


# -- 12. gradient_checkpointing, and transformers' fields we lack ----------------------------------------------------


def test_gradient_checkpointing_recomputes_the_layers_as_transformers_does(tmp_path):
    """``gradient_checkpointing=True`` (transformers 5's older name of ``activation_checkpointing``) is recompute:
    each layer's MLP runs twice per step (forward, and again in backward) in both Trainers, and the weights after
    training agree."""
    calls = {}
    weights = []
    for name, trainer in zip(("hf", "ours"), _trainers(tmp_path, train_dataset=_rows(4), max_steps=1,
                                                       gradient_checkpointing=True)):
        calls[name] = 0

        def count(*_, name=name):
            calls[name] += 1

        layer = trainer.model.model.layers[0]
        getattr(layer, "_checkpoint_wrapped_module", layer).mlp.register_forward_pre_hook(count)  # ours: wrapped
        trainer.train()
        weights.append(layer.state_dict()["mlp.down_proj.weight"].detach().clone())
    assert mf.TrainingArguments(gradient_checkpointing=True).parallel_config.recompute.recompute == "full"
    assert calls["ours"] == calls["hf"] == 2
    assert (weights[0] - weights[1]).abs().max() <= 1e-5


def test_a_transformers_field_we_lack_is_a_one_line_error():
    transformers.TrainingArguments(output_dir="unused", fp16_full_eval=True, use_cpu=True)  # theirs takes it
    with pytest.raises(ConfigError, match=r"^fp16_full_eval is a transformers TrainingArguments field that "
                                          r"TrainingArguments does not have; remove it \(valid fields: output_dir, "):
        mf.TrainingArguments(fp16_full_eval=True)
    with pytest.raises(ConfigError, match=r"^gradient_accumulation_step is not a TrainingArguments field; did you mean "
                                          r"gradient_accumulation_steps\?"):
        mf.TrainingArguments(gradient_accumulation_step=2)
    with pytest.raises(ConfigError, match=r"^generation_config is a transformers Seq2SeqTrainingArguments field"):
        mf.Seq2SeqTrainingArguments(generation_config="x")
