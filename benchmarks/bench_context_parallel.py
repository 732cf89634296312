"""Context parallelism on this machine: activations and peak memory per rank, and step time, of cp1/cp2/cp4 for a
small GPT at long sequences, beside the planner's estimate.

For each sequence length and context-parallel size, every rank runs training steps of the same Llama-flavour GPT
(batch 1) on its chunks of the sequence (the load-balanced ring by default) and reports:

* ``saved``: the peak bytes of the tensors autograd keeps for backward (counted exactly with
  ``saved_tensors_hooks``, as ``bench_parallel.py`` does): the activation memory, which should fall close to 1/cp;
* ``rss+``: how far the process's peak resident memory rose during the measured steps above its footprint
  before them (after a warm-up step, freed memory returned to the system, the peak reset through
  ``/proc/self/clear_refs``): the real high-water mark of a training step, i.e. the activations, the attention's
  transient blocks, the logits and gradients; approximate (resident pages, Linux only);
* ``step``: the median wall time of the measured steps (forward, backward, AdamW);
* ``planner``: the planner's activation estimate for that rank (:func:`~mindformers_py.planner.cost_model.
  estimate_memory`'s activations plus the key/value blocks in flight), and its ratio to ``saved``.

    python benchmarks/bench_context_parallel.py                       # seq 2048..16384, cp 1, 2, 4
    python benchmarks/bench_context_parallel.py --seqs 2048 4096 --cps 1 2 --algo ulysses

Step times on a shared or small machine are noisy, and cp4 on fewer than 4 cores time-slices its ranks: compare
the memory columns there, the times on an idle machine with a core per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import time

import torch
from bench_parallel import MIB, SavedActivations

import mindformers_py as mf
from mindformers_py.parallel import ParallelConfig, build_mesh, parallelize
from mindformers_py.planner.cost_model import estimate_memory


def model_config(args: argparse.Namespace, seq: int) -> mf.GPTConfig:
    return mf.GPTConfig(flavour="llama", vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.heads // 2, max_position_embeddings=seq,
                        attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0)


def parallel_config(cp: int, algo: str) -> ParallelConfig:
    if cp == 1:
        return ParallelConfig()
    return ParallelConfig(parallel_mode="semi_auto_parallel", context_parallel=cp, context_parallel_algo=algo)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (VmHWM) to the current one


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def _current_rss() -> int:
    """Resident bytes now, after returning freed memory to the system (glibc's malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(seq: int, cp: int, args: argparse.Namespace) -> dict[str, float]:
    """Training steps of one (sequence, cp) on this rank: saved activations, peak RSS growth, median step time."""
    config = parallel_config(cp, args.algo)
    torch.manual_seed(0)
    model = mf.GPTForCausalLM(model_config(args, seq)).train()
    context = None
    if cp > 1:
        layout = config.resolve(cp)  # one context-parallel group: the world
        parallelize(model, layout, build_mesh(layout))
        context = model.context_parallel
        context.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if context is not None:
        batch = context.shard_batch(batch)

    def step(counter: SavedActivations | None = None) -> float:
        start = time.perf_counter()
        with (context.sharded() if context is not None else contextlib.nullcontext()):
            if counter is not None:
                with counter.hooks():
                    loss = model(**batch).loss
            else:
                loss = model(**batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # a warm-up step: AdamW's state and the collectives' buffers exist from here on
    before = _current_rss()
    _reset_peak_rss()
    counter = SavedActivations([model])
    times = [step(counter)] + [step() for _ in range(args.steps - 1)]
    return {"saved": counter.bytes, "rss": max(_peak_rss() - before, 0), "step": statistics.median(times)}


def _job(cases: list[tuple[int, int]], args: argparse.Namespace) -> dict[tuple[int, int], dict[str, float]]:
    torch.set_num_threads(args.threads)
    return {case: measure(*case, args) for case in cases}


def planner_activations(seq: int, cp: int, args: argparse.Namespace) -> int:
    estimate = estimate_memory(model_config(args, seq), parallel_config(cp, args.algo), 1, seq)
    return estimate.activations + estimate.context


def run(args: argparse.Namespace) -> dict[tuple[int, int], list[dict[str, float]]]:
    from mindformers_py.launcher.launch import launch

    results: dict[tuple[int, int], list[dict[str, float]]] = {}
    for cp in args.cps:
        cases = [(seq, cp) for seq in args.seqs]
        per_rank = {0: _job(cases, args)} if cp == 1 else launch(_job, cp, cases, args)
        for case in cases:
            results[case] = [per_rank[rank][case] for rank in sorted(per_rank)]
    return results


def table(results: dict[tuple[int, int], list[dict[str, float]]], args: argparse.Namespace) -> str:
    head = (f"{'seq':>7}{'cp':>4}{'saved (MiB)':>13}{'vs cp1':>8}{'rss+ (MiB)':>12}{'vs cp1':>8}{'step (s)':>10}"
            f"{'planner (MiB)':>15}{'plan/saved':>12}")
    title = (f"GPT llama flavour: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}; "
             f"batch 1; context_parallel_algo={args.algo}; busiest rank shown")
    lines = [title, head, "-" * len(head)]
    for (seq, cp), ranks in sorted(results.items()):
        saved = max(r["saved"] for r in ranks)
        rss = max(r["rss"] for r in ranks)
        step = max(r["step"] for r in ranks)
        base = results.get((seq, 1))
        saved1 = max(r["saved"] for r in base) if base else None
        rss1 = max(r["rss"] for r in base) if base else None
        planned = planner_activations(seq, cp, args)
        lines.append(f"{seq:>7}{cp:>4}{saved / MIB:>13.1f}{(saved / saved1 if saved1 else float('nan')):>8.2f}"
                     f"{rss / MIB:>12.1f}{(rss / rss1 if rss1 else float('nan')):>8.2f}{step:>10.2f}"
                     f"{planned / MIB:>15.1f}{planned / saved:>12.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--algo", default="ring", choices=["ring", "ulysses", "hybrid"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(table(run(args), args))


if __name__ == "__main__":
    main()
