"""BERT throughput against transformers: MLM training (our Trainer + our BertForMaskedLM vs transformers' Trainer +
BertForMaskedLM) and inference (feature extraction: our BertModel vs transformers' BertModel).

Training: both sides start from the same BERT checkpoint (default: 4 layers x 256, 4 heads, BERT's 30522-token
vocabulary, its default dropout 0.1) and train on the same pre-masked blocks (sequence 128, batch 16, 15% of the
tokens labelled) with the same AdamW settings, collator, logging and no checkpoints, fp32 on CPU. Each run is a
fresh process and the trainers alternate (``--rounds``), as in ``bench_train.py``, whose step clock and process
handling this reuses. transformers' Trainer runs with the allocator setting our Trainer makes on CPU
(``keep_freed_cpu_memory``, applied before it trains: the same setting on both sides) and, with ``--plain-hf``,
also as shipped. The steady-state seconds per step (after the warmup steps) are reported as wall and process CPU
time; the best run of each side and the ratio are printed.

Inference: the last hidden states of batches of sentences (all-MiniLM-L6-v2's weights when its package is
installed, else a random BERT of its shape), ``torch.no_grad``, the two models called alternately in one process
(same allocator, same threads), median of ``--repeats`` timed calls each.

    python benchmarks/bench_bert.py                        # both, defaults above
    python benchmarks/bench_bert.py --only inference --repeats 20
    python benchmarks/bench_bert.py --only training --steps 6 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import BertConfig, BertForMaskedLM, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import StepClock, steady_seconds_per_step  # noqa: E402
from family_models import masked_rows  # noqa: E402

import mindformers_py  # noqa: E402
from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory  # noqa: E402
from mindformers_py.trainer import Trainer, TrainingArguments  # noqa: E402

SIDES = ("hf_kept", "ours")
NAMES = {"hf": "transformers.Trainer (as shipped)", "hf_kept": "transformers.Trainer + kept heap",
         "ours": "mindformers_py.Trainer"}


def make_data(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Pre-masked MLM rows (:func:`family_models.masked_rows`)."""
    return masked_rows(vocab, seq)(n, seed)


def common_args(output_dir: str, opts: argparse.Namespace) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=opts.batch, max_steps=opts.warmup + opts.steps,
                learning_rate=5e-4, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=0,
                optim="adamw_torch_fused", logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
                seed=42, dataloader_num_workers=0, use_cpu=True)


def train_once(side: str, checkpoint: str, opts: argparse.Namespace) -> tuple[float, float]:
    data = make_data((opts.warmup + opts.steps) * opts.batch, opts.seq, opts.vocab)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        if side == "ours":
            model = mindformers_py.AutoModelForMaskedLM.from_pretrained(checkpoint)
            args = TrainingArguments(**common_args(out, opts), plot_loss_curve=False)
            trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                              callbacks=[clock])
        else:
            if side == "hf_kept":
                keep_freed_cpu_memory()  # the setting our Trainer makes, process-wide: before anything trains
            model = BertForMaskedLM.from_pretrained(checkpoint)
            trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common_args(out, opts)),
                                           train_dataset=data, data_collator=default_data_collator, callbacks=[clock])
        trainer.train()
    return steady_seconds_per_step(clock, opts)


def bench_training(opts: argparse.Namespace, argv: list[str]) -> None:
    sides = ("hf", *SIDES) if opts.plain_hf else SIDES
    results: dict[str, list[dict]] = {side: [] for side in sides}
    tokens = opts.batch * opts.seq
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        BertForMaskedLM(BertConfig(vocab_size=opts.vocab, hidden_size=opts.hidden, num_hidden_layers=opts.layers,
                                   num_attention_heads=opts.heads, intermediate_size=4 * opts.hidden,
                                   max_position_embeddings=max(512, opts.seq))).save_pretrained(ckpt)
        for r in range(opts.rounds):
            for side in sides:
                proc = subprocess.run([sys.executable, __file__, *argv, "--worker", side, "--checkpoint", ckpt],
                                      capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not lines:
                    raise SystemExit(f"{side} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                res = json.loads(lines[-1][len("RESULT "):])
                results[side].append(res)
                print(f"  round {r + 1}: {NAMES[side]:34s} wall {res['wall']:.3f} s/step ({tokens / res['wall']:5.0f} "
                      f"tokens/s), cpu {res['cpu']:.3f} s/step", flush=True)
    print(f"MLM training: BERT {opts.layers} layers x {opts.hidden}, {opts.heads} heads, vocab {opts.vocab}, seq "
          f"{opts.seq}, batch {opts.batch}, fp32 CPU, torch threads {results['ours'][0]['threads']}")
    for kind in ("wall", "cpu"):
        best = {side: min(r[kind] for r in runs) for side, runs in results.items()}
        print(f"{kind:4s} tokens/s (best of {opts.rounds}): " +
              ", ".join(f"{NAMES[s]} {tokens / best[s]:.0f}" for s in results))
        for side in (s for s in results if s != "ours"):
            print(f"     mindformers_py / {NAMES[side]}: {best[side] / best['ours']:.2f}x")


def bench_inference(opts: argparse.Namespace) -> None:
    from mindformers_py.models.packaged import packaged_checkpoint_path

    try:
        folder = packaged_checkpoint_path("sentence-transformers/all-MiniLM-L6-v2")
    except mindformers_py.CheckpointError:
        folder = None
    with tempfile.TemporaryDirectory() as tmp:
        if folder is None:  # a random BERT of MiniLM's shape
            torch.manual_seed(0)
            transformers.BertModel(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                              intermediate_size=1536)).save_pretrained(tmp)
            folder = tmp
        hf = transformers.BertModel.from_pretrained(folder).eval()
        ours = mindformers_py.AutoModel.from_pretrained(folder).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 30000, (opts.infer_batch, opts.infer_seq), generator=g)
        lengths = torch.randint(opts.infer_seq // 4, opts.infer_seq + 1, (opts.infer_batch,), generator=g)
        mask = (torch.arange(opts.infer_seq)[None] < lengths[:, None]).long()  # padded batches, as a pipeline's
        batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
        times: dict[str, list[float]] = {"hf": [], "ours": []}
        with torch.no_grad():
            assert (hf(**batch).last_hidden_state - ours(**batch).last_hidden_state).abs().max() <= 1e-4
            for _ in range(opts.repeats):
                for side, model in (("hf", hf), ("ours", ours)):
                    start = time.perf_counter()
                    model(**batch)
                    times[side].append(time.perf_counter() - start)
    tokens = int(mask.sum())
    med = {side: statistics.median(t) for side, t in times.items()}
    print(f"feature extraction: {'MiniLM-L6 weights' if folder != tmp else 'random MiniLM-shaped BERT'}, batch "
          f"{opts.infer_batch} x {opts.infer_seq} (padded, {tokens} real tokens), fp32 CPU, torch threads "
          f"{torch.get_num_threads()}, median of {opts.repeats}")
    print(f"     transformers {tokens / med['hf']:.0f} tokens/s, mindformers_py {tokens / med['ours']:.0f} tokens/s: "
          f"mindformers_py / transformers {med['hf'] / med['ours']:.2f}x")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("training", "inference"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="measured training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="training steps per run before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="alternating training runs of each trainer")
    parser.add_argument("--plain-hf", action="store_true", help="also run transformers' Trainer as shipped")
    parser.add_argument("--infer-batch", type=int, default=32)
    parser.add_argument("--infer-seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed inference calls per model")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--worker", choices=("hf", *SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    argv = sys.argv[1:]
    opts = parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.worker:
        wall, cpu = train_once(opts.worker, opts.checkpoint, opts)
        print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}))
        return
    if opts.only in (None, "inference"):
        bench_inference(opts)
    if opts.only in (None, "training"):
        bench_training(opts, argv)


if __name__ == "__main__":
    main()
