"""The fused linear cross-entropy's chunk size against its speed: the kernel alone (forward and backward of
:func:`mindformers_py.layers.loss.linear_cross_entropy`) at several ``CHUNK_ELEMENTS`` (logits elements per chunk),
against the unfused ``hidden @ weight.T`` + ``F.cross_entropy`` on the same tensors, at Qwen3's 151,936-token
vocabulary. Every chunk reads the whole head weight again, so the chunk size is a trade of memory (one chunk of fp32
logits) against those reads. Best of ``--rounds`` per cell, seconds.

    python benchmarks/bench_loss_chunks.py
    python benchmarks/bench_loss_chunks.py --exponents 23 26 --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

from mindformers_py.engine.cpu_memory import keep_freed_cpu_memory

kernel = importlib.import_module("mindformers_py.layers.loss.linear_cross_entropy")
VOCAB = 151_936
# (tokens, width, dtype, head trains): a full fine-tune's fp32 head, a LoRA run's frozen one, and bf16 at real widths
CASES = [(1024, 256, torch.float32, True), (1024, 256, torch.float32, False), (1024, 2048, torch.bfloat16, False),
         (2048, 1024, torch.bfloat16, True)]


def best_seconds(step, rounds: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exponents", type=int, nargs="+", default=[23, 25, 26, 27],
                        help="CHUNK_ELEMENTS = 2**exponent for each column")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    keep_freed_cpu_memory()  # as the Trainer runs on CPU
    print(f"{torch.get_num_threads()} threads, vocabulary {VOCAB}; seconds per forward + backward, best of "
          f"{opts.rounds}; each chunk column: its logits chunk in fp32")
    chunks = [f"2**{e} ({2 ** e * 4 >> 20} MiB)" for e in opts.exponents]
    header = ["tokens x width, dtype, head", *chunks, "unfused"]
    print(" | ".join(header))
    for tokens, width, dtype, trains in CASES:
        torch.manual_seed(0)
        hidden = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
        weight = (torch.randn(VOCAB, width) * 0.02).to(dtype).requires_grad_(trains)
        labels = torch.randint(0, VOCAB, (1, tokens))

        def fused() -> None:
            kernel.linear_cross_entropy(hidden.unsqueeze(0), weight, labels).backward()
            hidden.grad = weight.grad = None

        def unfused() -> None:
            logits = (hidden @ weight.t()).float()
            F.cross_entropy(logits[:-1], labels[0, 1:]).backward()
            hidden.grad = weight.grad = None

        row = []
        default = kernel.CHUNK_ELEMENTS
        try:
            for exponent in opts.exponents:
                kernel.CHUNK_ELEMENTS = 2 ** exponent
                row.append(best_seconds(fused, opts.rounds))
        finally:
            kernel.CHUNK_ELEMENTS = default
        row.append(best_seconds(unfused, opts.rounds))
        name = f"{tokens} x {width}, {str(dtype).removeprefix('torch.')}, {'trained' if trains else 'frozen'}"
        print(" | ".join([name] + [f"{t:.2f}" for t in row]), flush=True)


if __name__ == "__main__":
    main()
