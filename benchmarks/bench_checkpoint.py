"""How long a checkpoint save stalls training: our Trainer saving synchronously and asynchronously (``save_async``),
and transformers' Trainer (synchronous; it has no asynchronous save) on the same model and data.

The model is the default GPT of ``tasks/gpt/pretrain_tiny.yaml`` (4 layers, 256 wide, 4 heads, a 4096-token
vocabulary, 128-token blocks, batch 16: 4.3M parameters, a ~52 MB checkpoint with its AdamW state), trained fp32 on
the CPU for ``--steps`` steps with a full checkpoint every ``--save-every`` steps into a temporary folder.

The stall of a save is the time the training loop spends in it: for a synchronous save the whole write; for an
asynchronous one copying the state to host memory plus any wait for the previous save still being written (at most
one is in flight) and, after the last step, the wait for the last one. The background write itself is timed too,
and the steps that ran while a save was being written, against those that did not (on a machine with few cores the
writer competes with training for them). Sides alternate over ``--rounds``; the best round of each is reported.

    python benchmarks/bench_checkpoint.py                  # the default GPT, 3 rounds
    python benchmarks/bench_checkpoint.py --preset gpt_small --steps 6 --save-every 3   # 124M parameters, ~1.5 GB
    python benchmarks/bench_checkpoint.py --restart        # also: restart-to-resume time of a killed dp2 rank
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import warnings

import torch
import transformers
from transformers import TrainerCallback, default_data_collator

import mindformers_py as mf
from mindformers_py.trainer import Trainer, TrainingArguments

RECIPE_MODEL = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    max_position_embeddings=256, embedding_dropout=0.0, attention_dropout=0.0, hidden_dropout=0.0)


class StepClock(TrainerCallback):
    """(begin, end) of every optimizer step (a save's stall falls between a step's end and the next one's begin)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self._begin = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((self._begin, time.perf_counter()))

    @property
    def durations(self) -> list[float]:
        return [end - begin for begin, end in self.steps]


def timed(obj, name: str, log: list[tuple[float, float]]) -> None:
    """Wrap ``obj.name`` to append (start, end) of every call to ``log``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            log.append((start, time.perf_counter()))

    setattr(obj, name, wrapper)


def model(opts):
    torch.manual_seed(0)
    config = mf.GPTConfig(**RECIPE_MODEL) if opts.preset is None else mf.AutoConfig.for_model(opts.preset)
    return mf.GPTForCausalLM(config)


def data(opts, vocab: int):
    ids = torch.randint(0, vocab, (opts.batch * (opts.steps + 1), opts.seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def arguments(out: str, opts) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=opts.batch, max_steps=opts.steps, learning_rate=2e-3,
                logging_steps=opts.steps, save_strategy="steps", save_steps=opts.save_every, report_to="none",
                disable_tqdm=True, use_cpu=True, seed=42)


def run_ours(opts, save_async: bool) -> dict:
    net = model(opts)
    clock, saves, waits, writes = StepClock(), [], [], []
    with tempfile.TemporaryDirectory(dir=opts.dir) as out:
        trainer = Trainer(model=net, args=TrainingArguments(**arguments(out, opts), save_async=save_async,
                                                             plot_loss_curve=False),
                          train_dataset=data(opts, net.config.vocab_size), data_collator=default_data_collator,
                          callbacks=[clock])
        timed(trainer, "_save_checkpoint", saves)
        timed(trainer.engine, "wait_for_checkpoint", waits)
        timed(trainer.engine, "_write_checkpoint", writes)
        trainer.train()
        size = sum(p.stat().st_size for p in os.scandir(os.path.join(out, f"checkpoint-{opts.steps}")) if p.is_file())
    # Waits inside _save_checkpoint are part of its time already; the others are the end of training's.
    final_wait = sum(e - s for s, e in waits if not any(a <= s and e <= b for a, b in saves))
    stall = sum(e - s for s, e in saves) + final_wait
    overlapped = [end - begin for begin, end in clock.steps if any(begin < e and s < end for s, e in writes)]
    return {"stall_per_save": stall / len(saves), "final_wait": final_wait,
            "in_loop_per_save": statistics.mean(e - s for s, e in saves),
            "write_per_save": statistics.mean(e - s for s, e in writes),
            "step": statistics.median(clock.durations), "step_during_write": statistics.median(overlapped) if overlapped
            else None, "checkpoint_mb": size / 2**20, "saves": len(saves)}


def run_hf(opts) -> dict:
    net = model(opts)
    clock, saves = StepClock(), []
    with tempfile.TemporaryDirectory(dir=opts.dir) as out:
        trainer = transformers.Trainer(model=net, args=transformers.TrainingArguments(**arguments(out, opts)),
                                       train_dataset=data(opts, net.config.vocab_size),
                                       data_collator=default_data_collator, callbacks=[clock])
        timed(trainer, "_save_checkpoint", saves)
        trainer.train()
    return {"stall_per_save": statistics.mean(e - s for s, e in saves), "step": statistics.median(clock.durations),
            "saves": len(saves)}


# -- restart-to-resume time ----------------------------------------------------------------------------------------


def _restart_run(out: str, max_restarts: int = 0) -> float | None:
    """dp2 training of a tiny GPT whose rank 1 is SIGKILLed after step 3 on the first attempt; returns the restart's
    logged ``restart_seconds`` (failure seen by the launcher -> training resumed from checkpoint-2). In a launched
    worker it is one rank; in this process the Trainer starts its own two workers (with ``max_restarts``)."""
    from mindformers_py.parallel import ParallelConfig

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    net = mf.GPTForCausalLM(mf.GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=16))
    ids = torch.randint(0, 64, (24, 16), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=5, save_steps=2, logging_steps=1,
                             use_cpu=True, report_to="none", disable_tqdm=True, max_restarts=max_restarts,
                             parallel_config=ParallelConfig(parallel_mode="data_parallel", data_parallel=2))
    trainer = Trainer(model=net, args=args, train_dataset=[{"input_ids": r.tolist()} for r in ids], callbacks=[Kill()])
    trainer.train()
    return next((e.get("restart_seconds") for e in trainer.state.log_history if "restart" in e), None)


def measure_restart() -> dict[str, float | None]:
    """Restart-to-resume seconds of workers started as fresh interpreters (``spawn``: as the CLI's command-line
    workers, which import torch and the package again after a restart) and of the Trainer's own workers started
    from Python (forked from a fork server that imported them once)."""
    from mindformers_py.launcher.launch import launch

    with tempfile.TemporaryDirectory() as out:
        spawned = launch(_restart_run, 2, out, max_restarts=1)[0]
    with tempfile.TemporaryDirectory() as out:
        forked = _restart_run(out, max_restarts=1)
    return {"spawn": spawned, "trainer_workers": forked}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None, help="a GPT preset instead of the recipe's model (e.g. gpt_small)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the system temp folder)")
    parser.add_argument("--restart", action="store_true", help="also measure the restart-to-resume time (a kill under "
                        "dp2: the launcher's restart, new workers, loading checkpoint-2)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results: dict[str, list[dict]] = {"ours_sync": [], "ours_async": [], "hf_sync": []}
    for _ in range(opts.rounds):
        results["ours_sync"].append(run_ours(opts, save_async=False))
        results["ours_async"].append(run_ours(opts, save_async=True))
        results["hf_sync"].append(run_hf(opts))
    best = {side: min(runs, key=lambda r: r["stall_per_save"]) for side, runs in results.items()}
    report = {"best": best, "async_stall_over_sync": best["ours_async"]["stall_per_save"] / best["ours_sync"]["stall_per_save"],
              "ours_sync_over_hf": best["ours_sync"]["stall_per_save"] / best["hf_sync"]["stall_per_save"]}
    if opts.restart:
        report["restart_to_resume_s"] = measure_restart()
    if opts.json:
        print(json.dumps(report, indent=1))
        return
    size = best["ours_sync"]["checkpoint_mb"]
    print(f"checkpoint {size:.1f} MB, {best['ours_sync']['saves']} saves per run, best of {opts.rounds} rounds")
    for side, row in best.items():
        extra = (f" ({row['in_loop_per_save']:.3f} s in the loop, {row['final_wait']:.3f} s waiting for the last save "
                 f"at the end), written in the background in {row['write_per_save']:.3f} s") if side == "ours_async" else ""
        print(f"{side:10s} stall per save {row['stall_per_save']:.3f} s{extra}; median step {row['step']:.3f} s")
    during = best["ours_async"].get("step_during_write")
    if during:
        print(f"ours_async  median step while a save was written: {during:.3f} s")
    print(f"async stall / sync stall: {report['async_stall_over_sync']:.2f}; ours sync / transformers sync: "
          f"{report['ours_sync_over_hf']:.2f}")
    if opts.restart:
        times = report["restart_to_resume_s"]
        print(f"restart to resume (dp2, a rank SIGKILLed, launcher restart, checkpoint loaded): "
              f"{times['spawn']} s with spawned workers (the CLI's), {times['trainer_workers']} s with the Trainer's "
              "own workers (fork server)")


if __name__ == "__main__":
    main()
