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

    python benchmarks/bench_fused_loss.py
    python benchmarks/bench_fused_loss.py --batch 8 --seq 512 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SIDES = ("hf", "ours", "ours_fused")

# One side of the comparison, in a fresh interpreter: prints one JSON line.
_STEP = r"""
import ctypes, json, sys, time
import torch
side, folder, batch, seq, train_head = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
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
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS")
start = time.perf_counter()
if side == "ours_fused":
    from mindformers_py.layers.loss.fused_head import loss_without_logits
    with loss_without_logits(model):
        loss = model(input_ids=ids, labels=ids).loss
else:
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print(json.dumps({"side": side, "loss": loss.item(), "seconds": time.perf_counter() - start,
                  "rise": status("VmHWM") - before}))
"""


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
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    opts = parser.parse_args(argv)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3_vocab"
        make_checkpoint(folder)
        for round_ in range(opts.rounds):
            for side in opts.sides:
                out = subprocess.run([sys.executable, "-c", _STEP, side, str(folder), str(opts.batch), str(opts.seq),
                                      "1" if opts.train_head else "0"], capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"round {round_ + 1} {side:10s} loss {result['loss']:.5f}  step {result['seconds']:.2f} s  "
                      f"peak RSS rise {result['rise'] / 2**30:.3f} GiB", flush=True)
                kept = best.setdefault(side, result)
                kept["seconds"] = min(kept["seconds"], result["seconds"])
                kept["rise"] = min(kept["rise"], result["rise"])
    hf = best.get("hf")
    print(f"\n{opts.batch} x {opts.seq} tokens, vocabulary 151,936, fp32, head {'trained' if opts.train_head else 'frozen'}"
          f" (best of {opts.rounds})")
    print("| side | step time | peak RSS rise | rise / transformers' | time / transformers' |")
    print("| --- | --- | --- | --- | --- |")
    for side, r in best.items():
        ratios = (f"{r['rise'] / hf['rise']:.2f}x | {r['seconds'] / hf['seconds']:.2f}x" if hf else "- | -")
        print(f"| {side} | {r['seconds']:.2f} s | {r['rise'] / 2**30:.3f} GiB | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
