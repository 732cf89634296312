"""Trainer behaviour on tiny models (CPU, fp32): exact resume, gradient accumulation, callbacks, state files,
logs and clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainerState

from mindformers_py.errors import CheckpointError, ConfigError, MindFormersError
from mindformers_py.models.gpt import GPTConfig, GPTForCausalLM
from mindformers_py.engine import Engine, register_engine
from mindformers_py.trainer import Trainer, TrainingArguments

VOCAB = 64
SEQ = 12


def tiny_gpt(dropout: float = 0.1, seed: int = 0) -> GPTForCausalLM:
    """Our GPT, 2 layers x 32 wide; dropout on so that resuming must restore the RNG."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=32, embedding_dropout=dropout,
                       attention_dropout=dropout, hidden_dropout=dropout)
    return GPTForCausalLM(config)


def tiny_hf_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM"))


def token_data(n: int, seed: int = 1, ragged_labels: bool = False) -> list[dict]:
    """``n`` examples of SEQ tokens (lists); with ``ragged_labels`` each masks a different number of label
    positions with -100, so micro-batches hold unequal label-token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g).tolist()
        example = {"input_ids": ids}
        if ragged_labels:
            hidden = (3 * i) % (SEQ - 2)
            example["labels"] = [-100] * hidden + ids[hidden:]
        out.append(example)
    return out


def args(tmp_path: Path, name: str = "run", **kw) -> TrainingArguments:
    # fp32 pinned (bf16="auto" is the default): these tests compare losses and weights exactly
    defaults = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, learning_rate=1e-3,
                    logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none", seed=7, bf16=False)
    defaults.update(kw)
    return TrainingArguments(**defaults)


def train_losses(state: TrainerState) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in state.log_history if "loss" in e}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.logs: list[dict] = []
        self.evals: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("train_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(f"step_end_{state.global_step}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evals.append(dict(metrics))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(f"save_{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("train_end")


# -- exact resume -------------------------------------------------------------------------------------------------


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path):
    # 20 samples, batch 4 -> 5 micro-batches per epoch, accumulation 2 -> steps of 2, 2, 1 micro-batches:
    # checkpoint-4 lies inside the second epoch, after a short last step; dropout and shuffling are on.
    data = token_data(20)
    common = dict(gradient_accumulation_steps=2, max_steps=8, save_strategy="steps", save_steps=4)
    full = Trainer(model=tiny_gpt(), args=args(tmp_path, "full", **common), train_dataset=data)
    full.train()
    reference = train_losses(full.state)
    assert sorted(reference) == list(range(1, 9))

    # The same run stopped by a callback right after checkpoint-4, then resumed with resume_from_checkpoint=True.
    stopped = Trainer(model=tiny_gpt(), args=args(tmp_path, "split", **common), train_dataset=data,
                      callbacks=[StopAt(4)])
    stopped.train()
    assert stopped.state.global_step == 4
    assert [p.name for p in (tmp_path / "split").glob("checkpoint-*")] == ["checkpoint-4"]

    resumed = Trainer(model=tiny_gpt(seed=123), args=args(tmp_path, "split", **common), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    after = train_losses(resumed.state)
    for step in range(5, 9):
        assert after[step] == reference[step], f"step {step}: {after[step]!r} != {reference[step]!r}"
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    # log.jsonl reads as one run: steps 1..8 once each (plus the final summary at step 8)
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 9))


# -- gradient accumulation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_loss", [True, False])
def test_gradient_accumulation_matches_one_big_batch(tmp_path, fused_loss):
    data = token_data(8, ragged_labels=True)  # unequal label-token counts in every micro-batch
    weights = []
    for batch, accum in [(4, 1), (2, 2), (1, 4)]:
        model = tiny_gpt(dropout=0.0)
        trainer = Trainer(model=model, train_dataset=data, args=args(
            tmp_path, f"b{batch}", per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
            max_steps=2, fused_loss=fused_loss, weight_decay=0.1))
        trainer.train()
        assert (trainer._fused_loss is not None) == fused_loss
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    # AdamW turns float-rounding differences of near-zero gradients into update differences of ~1e-6 (a step is
    # lr = 1e-3); a wrong normalisation moves weights by a whole step. The gradients themselves are compared in
    # test_task_losses.py.
    for other in weights[1:]:
        for name, value in weights[0].items():
            assert torch.allclose(value, other[name], atol=1e-5, rtol=0), name


def test_fused_loss_matches_the_models_own_loss(tmp_path):
    data = token_data(16)
    runs = []
    for fused in (True, False):
        trainer = Trainer(model=tiny_hf_gpt2(), args=args(tmp_path, f"f{fused}", max_steps=4, fused_loss=fused),
                          train_dataset=data)
        trainer.train()
        runs.append(train_losses(trainer.state))
    for step in runs[0]:
        assert math.isclose(runs[0][step], runs[1][step], rel_tol=1e-5), step


def test_fused_loss_in_our_model_matches_its_own_loss_in_training_and_evaluation(tmp_path, caplog):
    """Our causal LM folds its head into the loss in its own forward (no logits): the same training losses and
    evaluation loss as without, and the log says which loss ran."""
    runs = []
    for fused in (True, False):
        trainer = Trainer(model=tiny_gpt(dropout=0.0), train_dataset=token_data(16), eval_dataset=token_data(4, seed=3),
                          args=args(tmp_path, f"f{fused}", max_steps=3, fused_loss=fused))
        with caplog.at_level("INFO", logger="mindformers_py.trainer.loss_mixin"):
            trainer.train()
            runs.append((train_losses(trainer.state), trainer.evaluate()["eval_loss"]))
    assert "causal-LM loss: fused linear cross-entropy (in the model's forward)" in caplog.text
    for step, loss in runs[0][0].items():
        assert math.isclose(loss, runs[1][0][step], rel_tol=1e-5), step
    assert math.isclose(runs[0][1], runs[1][1], rel_tol=1e-5)


# -- callbacks ----------------------------------------------------------------------------------------------------


def test_callback_stops_training_and_sees_logs_and_evaluations(tmp_path):
    recorder = Recorder()
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(40), eval_dataset=token_data(6, seed=2),
                      args=args(tmp_path, max_steps=10, eval_strategy="steps", eval_steps=2),
                      callbacks=[StopAt(3), recorder])
    output = trainer.train()
    assert output.global_step == trainer.state.global_step == 3
    assert recorder.events[0] == "train_begin" and recorder.events[-1] == "train_end"
    assert [e for e in recorder.events if e.startswith("step_end")] == ["step_end_1", "step_end_2", "step_end_3"]
    assert len(recorder.evals) == 1 and recorder.evals[0]["eval_loss"] > 0
    assert math.isclose(recorder.evals[0]["eval_perplexity"], math.exp(recorder.evals[0]["eval_loss"]))
    step_logs = [log for log in recorder.logs if "loss" in log]
    assert len(step_logs) == 3
    assert {"loss", "grad_norm", "learning_rate", "epoch"} <= set(step_logs[0])
    assert "train_loss" in recorder.logs[-1]


def test_early_stopping_callback_and_load_best_model_at_end(tmp_path):
    from transformers import EarlyStoppingCallback

    scores = iter([1.0, 5.0, 2.0, 3.0, 4.0, 6.0])
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}

    trainer = Trainer(
        model=tiny_gpt(), train_dataset=token_data(40), eval_dataset=token_data(2, seed=5),
        compute_metrics=lambda pred: {"score": next(scores)},
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2), Snapshot()],
        args=args(tmp_path, max_steps=12, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                  save_steps=1, save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="score"))
    trainer.train()
    assert trainer.state.global_step == 4  # best at step 2, then two evaluations without improvement
    assert trainer.state.best_metric == 5.0
    assert trainer.state.best_model_checkpoint == str(tmp_path / "run" / "checkpoint-2")
    names = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    # the best survives rotation beside the newest while training; at its end save_total_limit=1 leaves the best alone
    # (transformers' rule, compared in tests/trainer/test_hf_trainer_contract.py)
    assert names == ["checkpoint-2"]
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, snapshots[2][name]), name


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(16),
                      args=args(tmp_path, max_steps=7, save_strategy="steps", save_steps=2, save_total_limit=2))
    trainer.train()
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-6", "checkpoint-7"]  # the last one is the end-of-training save
    assert not list((tmp_path / "run").glob(".checkpoint-*"))  # no temporary folders left behind


def test_state_files_logs_curve_and_tensorboard(tmp_path):
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(16), eval_dataset=token_data(4, seed=3),
                      args=args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, report_to="tensorboard",
                                save_strategy="steps", save_steps=4))
    trainer.train()
    out = tmp_path / "run"
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 4 and state.max_steps == 4
    step_log = next(e for e in state.log_history if "loss" in e)
    assert {"step", "loss", "learning_rate", "grad_norm", "epoch"} <= set(step_log)
    assert any("eval_loss" in e for e in state.log_history)
    assert TrainerState.load_from_json(str(out / "checkpoint-4" / "trainer_state.json")).global_step == 4
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = list((out / "runs").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    assert {"train/loss", "eval/loss"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]


# -- evaluation / prediction / datasets -----------------------------------------------------------------------------


def test_evaluate_is_the_token_weighted_mean_and_predict_returns_logits(tmp_path):
    model = tiny_gpt(dropout=0.0)
    data = token_data(5, seed=4, ragged_labels=True)
    seen = {}

    def metrics(pred):
        seen["shapes"] = (pred.predictions.shape, pred.label_ids.shape)
        return {"accuracy": float((pred.predictions[:, :-1] == pred.label_ids[:, 1:]).mean())}

    trainer = Trainer(model=model, args=args(tmp_path, per_device_eval_batch_size=2), compute_metrics=metrics,
                      preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    result = trainer.evaluate(data)
    with torch.no_grad():
        total, count = 0.0, 0
        for ex in data:
            ids = torch.tensor([ex["input_ids"]])
            labels = torch.tensor([ex["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += model(ids, labels=labels).loss.item() * n
            count += n
    assert math.isclose(result["eval_loss"], total / count, rel_tol=1e-5)
    assert 0.0 <= result["eval_accuracy"] <= 1.0
    assert seen["shapes"] == ((5, SEQ), (5, SEQ))
    trainer.preprocess_logits_for_metrics = trainer.compute_metrics = None
    prediction = trainer.predict(data[:3])
    assert prediction.predictions.shape == (3, SEQ, VOCAB)
    assert np.array_equal(prediction.label_ids, np.array([ex["labels"] for ex in data[:3]]))
    assert "test_loss" in prediction.metrics


def test_datasets_dataset_with_extra_columns_and_a_tokenizer_free_collator(tmp_path):
    from datasets import Dataset

    rows = token_data(12)
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "text": ["x"] * 12})
    trainer = Trainer(model=tiny_hf_gpt2(), train_dataset=ds, args=args(tmp_path, max_steps=3))
    output = trainer.train()
    assert output.global_step == 3 and math.isfinite(output.training_loss)


def test_finetune_loads_pretrained_weights_before_training(tmp_path):
    source = tiny_gpt(dropout=0.0, seed=5)
    Trainer(model=source, args=args(tmp_path, "src")).save_model(tmp_path / "pretrained")
    target = tiny_gpt(dropout=0.0, seed=6)
    trainer = Trainer(model=target, train_dataset=token_data(8),
                      args=args(tmp_path, "ft", max_steps=1, learning_rate=0.0))
    trainer.finetune(finetune_checkpoint=tmp_path / "pretrained")
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name


def test_finetune_from_an_hf_gpt2_folder_converts_it(tmp_path):
    from mindformers_py import AutoModelForCausalLM

    tiny_hf_gpt2(seed=9).save_pretrained(tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ours = GPTForCausalLM(reference.config)
    trainer = Trainer(model=ours, train_dataset=token_data(8), args=args(tmp_path, max_steps=1, learning_rate=0.0))
    trainer.finetune(finetune_checkpoint=str(tmp_path / "hf"))
    for (name, a), (_, b) in zip(reference.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_autocast_trains_on_cpu(tmp_path):
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, max_steps=2, bf16=True))
    output = trainer.train()
    assert math.isfinite(output.training_loss)
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_a_registered_engine_is_what_the_trainer_uses(tmp_path):
    calls = []

    class CountingEngine(Engine):
        def forward_backward(self, model, micro_batches, num_items_in_batch, loss_fn):
            calls.append(len(micro_batches))
            return super().forward_backward(model, micro_batches, num_items_in_batch, loss_fn)

    register_engine("stand_alone", CountingEngine)
    try:
        Trainer(model=tiny_gpt(), train_dataset=token_data(8),
                args=args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2)).train()
    finally:
        register_engine("stand_alone", Engine)
    assert calls == [2, 2]


# -- clear errors -------------------------------------------------------------------------------------------------


def test_dataset_smaller_than_one_batch_is_refused(tmp_path):
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(3), args=args(tmp_path, max_steps=1))
    with pytest.raises(MindFormersError, match=r"train_dataset has 3 samples, fewer than one batch of 4"):
        trainer.train()


def test_output_dir_of_another_run_is_refused_unless_overwritten(tmp_path):
    run = dict(max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, **run)).train()
    with pytest.raises(MindFormersError, match=r"holds another run \(checkpoint-2, trainer_state.json\)"):
        Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, overwrite_output_dir=False, **run)).train()
    (tmp_path / "run" / "checkpoint-2" / "marker").write_text("old")
    Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, overwrite_output_dir=True, **run)).train()
    assert not (tmp_path / "run" / "checkpoint-2" / "marker").exists()


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, max_steps=1))
    with pytest.raises(CheckpointError, match="holds no checkpoint-<step> folder"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))


def test_non_finite_loss_names_the_step(tmp_path):
    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    model.lm_head.weight.fill_(float("nan"))

    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(16), callbacks=[Poison()],
                      args=args(tmp_path, max_steps=5, logging_steps=10))
    with pytest.raises(MindFormersError, match="not finite .* at step 3"):
        trainer.train()


def test_fp16_on_cpu_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fp16=True needs a CUDA device"):
        Trainer(model=tiny_gpt(), args=args(tmp_path, fp16=True, use_cpu=True))


@pytest.mark.parametrize("kwargs, pattern", [
    ({"lr_scheduler_type": "wavy"}, r"lr_scheduler_type='wavy' is not valid; choose one of: 'linear', 'cosine'"),
    ({"eval_strategy": "often"}, r"eval_strategy='often' is not valid; choose one of: 'no', 'steps', 'epoch'"),
    ({"bf16": True, "fp16": True}, "bf16=True and fp16=True are both set"),
    ({"learning_rate": -0.1}, r"learning_rate=-0.1 is not valid; expected a number >= 0"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps=0 is not valid; expected an integer >= 1"),
    ({"max_steps": "ten"}, r"max_steps='ten' is not valid; expected an integer"),
    ({"report_to": "comet_ml"}, r"report_to='comet_ml' is not valid; choose one of: 'tensorboard', 'mlflow', 'wandb', "
                                r"'all', 'none'"),
    ({"parallel_config": {"parallel_mode": "sideways"}}, r"parallel_mode='sideways' is not valid"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "epoch"},
     r"load_best_model_at_end=True needs save_strategy equal to eval_strategy"),
])
def test_training_arguments_refuse_bad_values(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        TrainingArguments(**kwargs)


def test_training_arguments_accept_strings_and_round_trip():
    a = TrainingArguments(output_dir="x", learning_rate="3e-4", max_steps="5", bf16="true", report_to="all",
                          warmup_steps="0.1", parallel_config={"parallel_mode": "stand_alone"})
    from mindformers_py.trainer.arguments import REPORT_TARGETS, tracker_installed

    installed = [t for t in REPORT_TARGETS if tracker_installed(t)]  # "all": every tracker installed, as transformers
    assert (a.learning_rate, a.max_steps, a.bf16, a.report_to) == (3e-4, 5, True, installed)
    assert a.warmup_steps_for(50) == 5
    assert TrainingArguments.from_dict(a.to_dict()) == a
    with pytest.raises(ConfigError, match="not_a_field is not a TrainingArguments field"):
        TrainingArguments.from_dict({"not_a_field": 1})


def test_training_again_into_the_same_output_dir_works_as_in_transformers_5(tmp_path):
    """A notebook cell run twice: the second run trains over the first (default overwrite_output_dir=None), with its
    own state and log."""
    run = dict(max_steps=2, save_strategy="steps", save_steps=2, logging_steps=1)
    first = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, **run))
    first.train()
    trainer = Trainer(model=tiny_gpt(), train_dataset=token_data(8), args=args(tmp_path, **run))
    trainer.train()
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 2  # this run's two steps, not four
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["global_step"] == 2
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
