"""Worker functions for the fault tests (tests/launcher/test_faults.py): a tiny GPT trained by the Trainer under a
2-process layout, with a fault injected from a callback (the rank kills or stops itself, or blocks in a collective
its peer never joins). Workers are started by ``launch`` (forkserver, preloaded), so they import this module."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

VOCAB, SEQ, GLOBAL_BATCH, STEPS, SAVE_STEPS = 64, 16, 4, 4, 2


class Fault(TrainerCallback):
    """On the first attempt (before any restart), ``rank`` injects ``how`` at the end of optimizer step ``step``:
    ``kill`` (SIGKILL), ``stop`` (SIGSTOP: frozen, heartbeat included) or ``deadlock`` (enters a collective on a
    group its peer never joins, heartbeat alive)."""

    def __init__(self, how: str, rank: int, step: int) -> None:
        self.how, self.rank, self.step = how, rank, step
        self.side_group = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.how == "deadlock":  # every rank takes part in making the group; only one will use it
            self.side_group = dist.new_group(backend="gloo")

    def on_step_end(self, args, state, control, **kwargs):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if not first_attempt or state.global_step != self.step or dist.get_rank() != self.rank:
            return
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            dist.all_reduce(torch.zeros(1), group=self.side_group)  # the peer is in the next step's collectives


def layout(name: str):
    from mindformers_py.parallel import ParallelConfig

    sizes = {"dp2": dict(data_parallel=2), "tp2": dict(model_parallel=2),
             "pp2": dict(pipeline_stage=2, micro_batch_num=2)}[name]
    return ParallelConfig(parallel_mode="semi_auto_parallel", **sizes)


def tiny_gpt():
    import mindformers_py as mf

    torch.manual_seed(0)
    return mf.GPTForCausalLM(mf.GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=SEQ, embedding_dropout=0.1,
                                          hidden_dropout=0.1))


def token_data():
    ids = torch.randint(0, VOCAB, (3 * GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row.tolist()} for row in ids]


def train(layout_name: str, output_dir: str, fault: Fault | None = None, **extra):
    """Train the tiny GPT under the layout; returns the run's ``log_history``."""
    from mindformers_py.trainer import Trainer, TrainingArguments

    parallel = layout(layout_name)
    extra = {"save_strategy": "steps", "save_steps": SAVE_STEPS, **extra}
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // parallel.dp,
                             learning_rate=1e-2, max_steps=STEPS, logging_steps=1, use_cpu=True,
                             parallel_config=parallel, report_to=[], disable_tqdm=True, seed=5, bf16=False, **extra)
    trainer = Trainer(model=tiny_gpt(), args=args, train_dataset=token_data(), callbacks=[fault] if fault else [])
    trainer.train()
    return trainer.state.log_history


def killed_and_restarted(layout_name: str, root: str, rank: int, step: int):
    """The run whose ``rank`` is SIGKILLed after ``step`` on the first attempt (with asynchronous checkpoints), then,
    after the launcher restarted the group, the same run uninterrupted and saving nothing; both runs' logs, and this
    rank's attempt."""
    faulty = train(layout_name, f"{root}/faulty", Fault("kill", rank, step), save_async=True)
    reference = train(layout_name, f"{root}/reference", save_strategy="no")
    return {"faulty": faulty, "reference": reference, "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}


def hangs(how: str, root: str, timeout: int):
    """Rank 1 stops (``stop``) or deadlocks (``deadlock``) after step 2 of a dp2 run with ``ddp_timeout=timeout``."""
    train("dp2", f"{root}/{how}", Fault(how, rank=1, step=2), ddp_timeout=timeout, save_strategy="no")


def read_log(output_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(output_dir, "log.jsonl").read_text().splitlines() if line.strip()]