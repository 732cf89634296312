"""The Trainer starts its own workers when the layout needs more processes than the program has (no torchrun): the
layouts give stand-alone's per-step losses; state, metrics and trained weights come back to the parent; objects
defined in the caller (lambdas, local classes, a Trainer subclass) reach the workers; failures, kills and interrupts
end the call with one line and leave no worker behind; a script without a ``__main__`` guard works.

All calls of this file share one fork server, so only the first launch pays for importing torch in the workers.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import mindformers_py as mf
from support.dist_utils import process_alive
from mindformers_py.errors import ConfigError
from mindformers_py.parallel import ParallelConfig
from mindformers_py.launcher.launch import LaunchError

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 128, 16, 4, 3
RTOL = 1e-4  # the CLI layout tests' tolerance
MOE = {"expert_num": 4, "num_experts_chosen": 2, "routing_policy": "dropless", "moe_intermediate_size": 32,
       "aux_loss_scope": "sequence"}  # a per-sequence router loss: the same whatever the data-parallel split
ROOT = Path(__file__).resolve().parents[2]


def tiny_model(moe: bool = False) -> mf.GPTForCausalLM:
    extra = {"moe_config": MOE, "output_router_logits": True} if moe else {}
    torch.manual_seed(0)
    return mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          max_position_embeddings=SEQ, **extra))


def rows(n: int = 16, seed: int = 1) -> list[dict[str, list[int]]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def make_trainer(folder, parallel: ParallelConfig, model=None, trainer_class=mf.Trainer, **kwargs) -> mf.Trainer:
    args = mf.TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=GLOBAL_BATCH // max(parallel.dp, 1),
        per_device_eval_batch_size=4, max_steps=kwargs.pop("max_steps", STEPS), logging_steps=1, learning_rate=1e-2,
        report_to=[], save_strategy=kwargs.pop("save_strategy", "no"), save_steps=kwargs.pop("save_steps", 500),
        disable_tqdm=True, plot_loss_curve=False, use_cpu=True, parallel_config=parallel, overwrite_output_dir=True,
        bf16=False)  # fp32: the layouts are compared with the stand-alone run to 1e-4
    collate = lambda batch: {k: torch.tensor([r[k] for r in batch]) for k in batch[0]}  # noqa: E731 - by value
    return trainer_class(model=model if model is not None else tiny_model(), args=args, train_dataset=rows(),
                         eval_dataset=rows(8, seed=2), data_collator=collate, **kwargs)


def losses(trainer: mf.Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values()))


_REFERENCE: dict[bool, mf.Trainer] = {}


def stand_alone(tmp_path_factory, moe: bool = False) -> mf.Trainer:
    """The stand-alone run each layout is compared with (trained once per model)."""
    if moe not in _REFERENCE:
        trainer = make_trainer(tmp_path_factory.mktemp("reference"), ParallelConfig(), tiny_model(moe))
        trainer.train()
        _REFERENCE[moe] = trainer
    return _REFERENCE[moe]


def semi(**sizes) -> ParallelConfig:
    return ParallelConfig(parallel_mode="semi_auto_parallel", **sizes)


def test_two_processes_from_python_give_back_state_metrics_and_weights(tmp_path, tmp_path_factory):
    """dp2 with ZeRO-1 from this process; a callback class, a Trainer subclass and a compute_metrics closure defined
    here reach the workers; what a stand-alone run gives comes back."""

    class CountSteps(TrainerCallback):  # a local class: cloudpickle sends it by value
        def on_step_end(self, args, state, control, **kwargs):
            state.log_history.append({"worker_rank": int(os.environ["RANK"]), "step": state.global_step})

    class TaggedTrainer(mf.Trainer):
        def log(self, logs):
            super().log({**logs, "tagged": 1.0})

    threshold = 0.5
    metrics = lambda p: {"above": float((p.predictions.max(-1) > threshold).mean())}  # noqa: E731
    reference = stand_alone(tmp_path_factory)
    trainer = make_trainer(tmp_path / "dp", ParallelConfig(parallel_mode="data_parallel", data_parallel=2,
                                                           optimizer_shard=1),
                           trainer_class=TaggedTrainer, callbacks=[CountSteps()], compute_metrics=metrics)
    assert not torch.distributed.is_initialized()  # the parent joins no process group
    output = trainer.train()
    assert output.global_step == STEPS and output.training_loss == pytest.approx(
        reference.state.log_history[-1]["train_loss"], rel=RTOL)
    assert losses(trainer) == pytest.approx(losses(reference), rel=RTOL)
    assert all(h.get("tagged") == 1.0 for h in trainer.state.log_history if "loss" in h)
    assert [h["worker_rank"] for h in trainer.state.log_history if "worker_rank" in h] == [0] * STEPS  # rank 0's
    assert max_weight_difference(trainer.model, reference.model) < 1e-4  # the trained weights came back
    evaluated = trainer.evaluate()
    assert evaluated["eval_loss"] == pytest.approx(reference.evaluate()["eval_loss"], rel=RTOL)
    assert 0.0 <= evaluated["eval_above"] <= 1.0
    predicted = trainer.predict(rows(8, seed=3))
    assert predicted.predictions.shape == (8, SEQ, VOCAB) and "test_loss" in predicted.metrics
    trainer.save_model(tmp_path / "saved")
    loaded = mf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert max_weight_difference(loaded, trainer.model) == 0.0
    assert (tmp_path / "dp" / "log.jsonl").is_file()  # rank 0 writes the run's files, as under the CLI


LAYOUTS = {
    "tp2_sp_vocab_recompute": (semi(model_parallel=2, use_seq_parallel=True, vocab_emb_dp=False,
                                    recompute="selective"), False),
    "pp2_1f1b": (semi(pipeline_stage=2, micro_batch_num=2, pipeline_schedule="1f1b"), False),
    "cp2_ring": (semi(context_parallel=2), False),
    "auto_parallel": (ParallelConfig(parallel_mode="auto_parallel", data_parallel=2), False),
    "moe_dp2_ep2_zero2": (semi(data_parallel=2, expert_parallel=2, optimizer_shard=2), True),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_from_python_give_stand_alone_losses(name, tmp_path, tmp_path_factory):
    parallel, moe = LAYOUTS[name]
    reference = stand_alone(tmp_path_factory, moe)
    trainer = make_trainer(tmp_path, parallel, tiny_model(moe))
    trainer.train()
    assert losses(trainer) == pytest.approx(losses(reference), rel=RTOL)
    assert max_weight_difference(trainer.model, reference.model) < 1e-4


def test_zero3_recompute_checkpoint_resumes_as_under_the_cli(tmp_path, tmp_path_factory):
    reference = stand_alone(tmp_path_factory)
    parallel = ParallelConfig(parallel_mode="data_parallel", data_parallel=2, optimizer_shard=3, recompute="full")
    full = make_trainer(tmp_path, parallel, save_strategy="steps", save_steps=2)
    full.train()
    assert losses(full) == pytest.approx(losses(reference), rel=RTOL)
    assert (tmp_path / "checkpoint-2" / "dcp").is_dir()  # the sharded checkpoint the CLI writes
    resumed = make_trainer(tmp_path, parallel)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert losses(resumed)[-1] == pytest.approx(losses(full)[-1], rel=RTOL)
    assert max_weight_difference(resumed.model, full.model) < 1e-5


class FailOnRankOne(TrainerCallback):
    def __init__(self, how: str) -> None:
        self.how = how

    def on_step_end(self, args, state, control, **kwargs):
        if os.environ["RANK"] == "1" and state.global_step == 1:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank one gave up")


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_worker_ends_the_call_with_one_line_naming_its_rank(how, tmp_path):
    trainer = make_trainer(tmp_path, ParallelConfig(parallel_mode="data_parallel", data_parallel=2),
                           callbacks=[FailOnRankOne(how)])
    with pytest.raises(LaunchError) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message and "rank 1" in message and "other ranks were stopped" in message
    if how == "raise":
        assert "RuntimeError: rank one gave up" in message
        traceback_file = tmp_path / "worker_errors" / "rank1.txt"
        assert str(traceback_file) in message and "in on_step_end" in traceback_file.read_text()
    else:
        assert "SIGKILL" in message


def test_what_cannot_reach_the_workers_is_refused_in_one_line(tmp_path):
    def numbers():
        yield 1

    trainer = make_trainer(tmp_path, ParallelConfig(parallel_mode="data_parallel", data_parallel=2))
    trainer.eval_dataset = numbers()
    with pytest.raises(ConfigError, match=r"cannot send its eval_dataset \(generator\) to the 2 worker processes"):
        trainer.evaluate()
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = make_trainer(tmp_path, ParallelConfig(parallel_mode="data_parallel", data_parallel=2), model,
                           optimizers=(optimizer, None))
    with pytest.raises(ConfigError, match="optimizers=.* cannot be used when the Trainer starts its 2 worker"):
        trainer.train()


class WritePid(TrainerCallback):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_step_end(self, args, state, control, **kwargs):
        Path(self.folder, f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(0.2)


def test_an_interrupt_stops_every_worker(tmp_path):
    trainer = make_trainer(tmp_path, ParallelConfig(parallel_mode="data_parallel", data_parallel=2), max_steps=10_000,
                           callbacks=[WritePid(str(tmp_path))])

    def interrupt_once_training():
        while len(glob.glob(str(tmp_path / "pid*"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C or the notebook's stop button sends

    handler = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_once_training, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    pids = [int(Path(p).read_text()) for p in glob.glob(str(tmp_path / "pid*"))]
    assert len(pids) == 2 and not any(process_alive(pid) for pid in pids)
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back


SCRIPT = """
import torch
import mindformers_py as mf
from transformers import TrainerCallback

class Note(TrainerCallback):  # defined in the script: travels by value
    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print("ran", state.global_step, "steps", flush=True)

def run(parallel):
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           max_position_embeddings=8))
    data = [{"input_ids": [i % 64] * 8, "labels": [i % 64] * 8} for i in range(8)]
    args = mf.TrainingArguments(output_dir=f"out{parallel.dp}", max_steps=2, logging_steps=1, per_device_train_batch_size=4 // parallel.dp,
                                report_to=[], disable_tqdm=True, save_strategy="no", parallel_config=parallel, bf16=False)
    trainer = mf.Trainer(model=model, args=args, train_dataset=data, callbacks=[Note()])
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]

print("script started", flush=True)  # no __main__ guard: the workers must not run this again
one, two = run(mf.ParallelConfig()), run(mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=2))
print("losses agree", all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(one, two)) and len(one) == len(two) == 2)
pipe = mf.pipeline("summarization", model=T5_FOLDER, parallel_config={"model_parallel": 2})
pipe("read the lines of a file", max_new_tokens=2, num_beams=1)
print("pool", *pipe.model.pool.pids, flush=True)  # not closed: the pool stops when the interpreter exits
"""


def test_a_plain_script_without_main_guard_starts_its_workers(tmp_path):
    """... and a parallel pipeline it leaves open stops with the interpreter."""
    script = tmp_path / "train.py"
    t5_folder = ROOT / "tests" / "fixtures" / "t5_pipelines"
    script.write_text(f"T5_FOLDER = {str(t5_folder)!r}\n" + textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("script started") == 1
    assert "losses agree True" in done.stdout and done.stdout.count("ran 2 steps") == 2
    pool = [int(pid) for pid in done.stdout.split("pool ")[1].split()]
    assert len(pool) == 2 and not any(process_alive(pid) for pid in pool)
