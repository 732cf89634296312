"""Memory and time of one training step's loss at a large vocabulary: transformers' Qwen3 against ours, with the
model's own loss and with ``fused_loss`` (the head folded into the loss, no logits:
:mod:`mindformers_py.layers.loss.fused_head`).

A small Qwen3 (2 layers of 256, untied head) with Qwen3's 151,936-token vocabulary, the same weights on every side,
trains one step (forward and backward) of ``--batch`` x ``--seq`` tokens, in fp32, with the head and input embedding
frozen as a LoRA run has them (``--train-head`` trains them too). Each side runs in a fresh process, ``--rounds``
times, alternating: the rise of the process's peak RSS over the step (what the step adds to the model's weights)
and the step's wall time, best of the rounds. The sides:

* ``hf``: transformers' ``Qwen3ForCausalLM(input_ids, labels).loss``;
* ``ours``: our ``GPTForCausalLM`` loaded from the same folder, its own loss;
* ``ours_fused``: the same inside ``loss_without_logits`` (what the Trainer does with ``fused_loss=True``).

``--layout zero3`` / ``--layout tp2``: ours and ours_fused only, on 2 gloo processes. ``zero3``
(``data_parallel=2, optimizer_shard=3``): each rank takes half the batch; the head, frozen, is a sharded FSDP2 unit
of its own, gathered for the fused loss alone. ``tp2`` (``model_parallel=2, vocab_emb_dp=False``): both ranks take
the whole batch, the head's vocabulary split between them (the fused loss runs vocabulary-parallel). The rise is the
larger of the two ranks'.

    python benchmarks/bench_fused_loss.py
    python benchmarks/bench_fused_loss.py --batch 8 --seq 512 --rounds 3
    python benchmarks/bench_fused_loss.py --layout zero3
    python benchmarks/bench_fused_loss.py --layout tp2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SIDES = ("hf", "ours", "ours_fused")
# --layout: the ParallelConfig of each 2-process comparison
LAYOUTS = {"zero3": {"parallel_mode": "data_parallel", "data_parallel": 2, "optimizer_shard": 3},
           "tp2": {"parallel_mode": "semi_auto_parallel", "model_parallel": 2, "vocab_emb_dp": False}}

# One side of the comparison, in a fresh interpreter (two under torchrun with a layout, the ParallelConfig's fields
# as a 6th argument): prints one JSON line (rank 0: the loss of both ranks' batches, the larger rank's rise).
_STEP = r"""
import contextlib, ctypes, json, sys, time
import torch
side, folder, batch, seq, train_head = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
layout = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
if layout:
    import torch.distributed as dist
    import mindformers_py as mf
    from mindformers_py.engine import build_engine
    parallel = mf.ParallelConfig(**layout)
    engine = build_engine(parallel, mf.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], bf16=False,
                                                         parallel_config=parallel))
    engine.setup()
torch.manual_seed(0)
if side == "hf":
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
else:
    import mindformers_py as mf
    model = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
model.train()
if not train_head:
    model.get_output_embeddings().weight.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(False)
ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
wrapped, loss_context = model, contextlib.nullcontext()
if layout:  # this rank's rows; tp2's sharded logits take loss_parallel, as the Trainer runs them
    wrapped, loss_context = engine.prepare_model(model), engine.loss_context()
    ids = ids[engine.shard_indices(range(batch))]
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
ctypes.CDLL("libc.so.6").malloc_trim(0)
if layout:
    dist.barrier()
before = status("VmRSS")
start = time.perf_counter()
with loss_context:
    if side == "ours_fused":
        from mindformers_py.layers.loss.fused_head import loss_without_logits
        with loss_without_logits(wrapped):
            loss = wrapped(input_ids=ids, labels=ids).loss
    else:
        loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
result = {"side": side, "loss": loss.item(), "seconds": time.perf_counter() - start, "rise": status("VmHWM") - before}
if layout:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, result)
    result = {**result, "loss": sum(f["loss"] for f in found) / len(found), "rise": max(f["rise"] for f in found)}
if not layout or dist.get_rank() == 0:
    print(json.dumps(result))
"""


def _run_side(side: str, folder: Path, opts: argparse.Namespace) -> dict:
    """One side's step in a fresh interpreter (two under torchrun with ``--layout``): its JSON line."""
    step_args = [side, str(folder), str(opts.batch), str(opts.seq), "1" if opts.train_head else "0"]
    if opts.layout:
        script = folder.parent / "step.py"
        script.write_text(_STEP)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(script), *step_args, json.dumps(LAYOUTS[opts.layout])]
    else:
        command = [sys.executable, "-c", _STEP, *step_args]
    out = subprocess.run(command, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"} if opts.layout else None)
    return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))


def make_checkpoint(folder: Path) -> None:
    """A small Qwen3 with the real vocabulary, saved by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train-head", action="store_true", help="train the head and input embedding too")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=None)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help="ours and ours_fused on 2 processes")
    opts = parser.parse_args(argv)
    if opts.sides is None:
        opts.sides = ["ours", "ours_fused"] if opts.layout else list(SIDES)
    if opts.layout and "hf" in opts.sides:
        parser.error("--layout runs our sides only (ours, ours_fused)")
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3_vocab"
        make_checkpoint(folder)
        for round_ in range(opts.rounds):
            for side in opts.sides:
                result = _run_side(side, folder, opts)
                print(f"round {round_ + 1} {side:10s} loss {result['loss']:.5f}  step {result['seconds']:.2f} s  "
                      f"peak RSS rise {result['rise'] / 2**30:.3f} GiB", flush=True)
                kept = best.setdefault(side, result)
                kept["seconds"] = min(kept["seconds"], result["seconds"])
                kept["rise"] = min(kept["rise"], result["rise"])
    base_name = "ours" if opts.layout else "hf"
    base = best.get(base_name)
    where = f"{opts.layout} on 2 processes, the larger rank's rise" if opts.layout else "one process"
    print(f"\n{opts.batch} x {opts.seq} tokens, vocabulary 151,936, fp32, head {'trained' if opts.train_head else 'frozen'}"
          f", {where} (best of {opts.rounds})")
    against = "ours unfused" if opts.layout else "transformers'"
    print(f"| side | step time | peak RSS rise | rise / {against} | time / {against} |")
    print("| --- | --- | --- | --- | --- |")
    for side, r in best.items():
        ratios = (f"{r['rise'] / base['rise']:.2f}x | {r['seconds'] / base['seconds']:.2f}x" if base else "- | -")
        print(f"| {side} | {r['seconds']:.2f} s | {r['rise'] / 2**30:.3f} GiB | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
