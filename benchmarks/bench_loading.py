"""A real-size checkpoint, from disk to a parallel run: load time and memory against transformers, then the GPT LoRA
recipe started from it under each layout, with every process's peak memory.

The checkpoint has Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads, 8 key/value heads, MLP 8192, a 128256-token
vocabulary, rope scaling "llama3") with an untied head: 1.50 B parameters, random bf16 values, written by
transformers' ``save_pretrained`` in 4 shards (3.0 GB). It is made once into ``--folder`` (default
``runs/bench_loading/llama_1b``) and reused.

1. ``from_pretrained(folder, dtype=torch.bfloat16)`` then one forward of 8 tokens (which touches every weight), ours
   and transformers' ``AutoModelForCausalLM``, each in a fresh process with torch already imported, sides alternating
   over ``--rounds``: wall time from importing the library (``import transformers`` costs 0.7 s of it, which our
   package's lazy import pays on first use instead) and peak RSS (``VmHWM``) after loading and after the forward;
   ratios ours / transformers from the best round of each.
2. ``tasks/gpt/finetune_lora.yaml --model.name_or_path <folder> --max_steps 1 --per_device_train_batch_size 1
   --data.block_size 32 --data.max_eval_samples 4 --per_device_eval_batch_size 4`` stand-alone and under dp2 + ZeRO-3, tp2 (vocabulary
   sharded too) and pp2 (two micro-batches of one sequence) (``--layouts``): the peak RSS of every process over the
   whole run (loading, training, the final evaluation, saving, the samples), sampled from ``/proc`` every 50 ms, and
   its ratio to stand-alone's. The final evaluation is cut to 4 sequences in one batch: at the recipe's 256 in
   batches of 32, its (32 x 32 x 128K) fp32 logits and their loss would be the largest thing any process holds, in
   every layout alike, and take minutes.
3. The planner's memory estimate of each layout's rank (``mindformers_py.planner``'s cost model for the same model,
   batch and sequence on a CPU "device") beside the measured peaks.

    python benchmarks/bench_loading.py                     # all of it (about 10 minutes on 2 cores)
    python benchmarks/bench_loading.py --skip-recipe       # the load comparison only
    python benchmarks/bench_loading.py --layouts dp2_zero3 # one layout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "stand_alone": [],
    "dp2_zero3": ["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--optimizer_shard", "3"],
    # the vocabulary sharded too (MindFormers' vocab_emb_dp=False): replicated, a 128K-token embedding and head are
    # a third of this model on every rank
    "tp2": ["--parallel_mode", "semi_auto_parallel", "--model_parallel", "2", "--vocab_emb_dp", "false"],
    # two micro-batches of one sequence (a pipeline needs at least as many micro-batches as stages)
    "pp2": ["--parallel_mode", "semi_auto_parallel", "--pipeline_stage", "2", "--micro_batch_num", "2",
            "--per_device_train_batch_size", "2"],
}
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})

# One side of the load comparison, run in a fresh interpreter: prints one JSON line.
_LOAD = r"""
import json, sys, time
import torch
side, folder = sys.argv[1], sys.argv[2]
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
start = time.perf_counter()  # torch is imported; each side's own library is imported inside the window
lib = __import__("transformers" if side == "transformers" else "mindformers_py")
model = lib.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
loaded, loaded_peak = time.perf_counter() - start, peak()
with torch.no_grad():
    model(torch.arange(1, 9).unsqueeze(0))
print(json.dumps({"load_s": loaded, "load_peak": loaded_peak, "forward_s": time.perf_counter() - start,
                  "forward_peak": peak()}))
"""


def make_checkpoint(folder: Path) -> None:
    """The 1.50 B bf16 Llama checkpoint in 4 shards, written by transformers (once)."""
    if (folder / "model.safetensors.index.json").is_file():
        return
    import torch
    import transformers

    print(f"making the checkpoint in {folder} (once) ...", flush=True)
    config = transformers.LlamaConfig(**LLAMA_1B, dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama_1b-", dir=folder.parent))
    model.save_pretrained(tmp, max_shard_size="800MB")
    os.replace(tmp, folder)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def compare_loading(folder: Path, rounds: int) -> None:
    """Part 1: ours against transformers, fresh processes, sides alternating; the best round of each."""
    runs: dict[str, list[dict]] = {"transformers": [], "ours": []}
    for i in range(rounds):
        for side in (("transformers", "ours") if i % 2 == 0 else ("ours", "transformers")):
            out = subprocess.run([sys.executable, "-c", _LOAD, side, str(folder)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  round {i + 1} {side}: {runs[side][-1]}", flush=True)
    best = {side: {k: min(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    print("\n| from_pretrained(dtype=bf16) | load | peak RSS after load | + forward touching every weight | peak RSS |")
    print("|---|---|---|---|---|")
    for side in ("transformers", "ours"):
        b = best[side]
        print(f"| {side} | {b['load_s']:.2f} s | {_gib(b['load_peak'])} | {b['forward_s']:.2f} s | "
              f"{_gib(b['forward_peak'])} |")
    t, o = best["transformers"], best["ours"]
    print(f"| ours / transformers | {o['load_s'] / t['load_s']:.2f}x | {o['load_peak'] / t['load_peak']:.2f}x | "
          f"{o['forward_s'] / t['forward_s']:.2f}x | {o['forward_peak'] / t['forward_peak']:.2f}x |", flush=True)


class PeakWatcher:
    """Every descendant process's peak RSS (``VmHWM``), sampled every ``interval`` seconds until stopped."""

    def __init__(self, root_pid: int, interval: float = 0.05) -> None:
        self.root, self.interval = root_pid, interval
        self.peaks: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _children(self, pid: int) -> list[int]:
        out = []
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            todo, seen = [self.root], set()
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                todo += self._children(pid)
                try:  # (a process may end between two reads)
                    status = Path(f"/proc/{pid}/status").read_text()
                    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="ignore").split("\0")
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text()
                except OSError:
                    continue
                hwm = next((int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("VmHWM")), 0)
                rank = next((kv.split("=", 1)[1] for kv in environ if kv.startswith("RANK=")), None)
                if pid == self.root:
                    label = "launcher"
                elif rank is not None and "forkserver" not in cmdline:
                    label = f"rank {rank}"
                else:
                    label = "helper"
                if hwm > self.peaks.get(pid, ("", 0))[1]:
                    self.peaks[pid] = (label, hwm)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_recipe(folder: Path, layout: str, out_root: Path) -> tuple[float, dict[str, int], int]:
    """(wall seconds, peak RSS per rank, the launcher's peak) of the LoRA recipe under ``layout``."""
    output = out_root / layout
    cmd = [sys.executable, "-m", "mindformers_py", "run", str(ROOT / "tasks/gpt/finetune_lora.yaml"),
           "--model.name_or_path", str(folder), "--max_steps", "1", "--per_device_train_batch_size", "1",
           "--data.block_size", "32", "--data.max_eval_samples", "4", "--per_device_eval_batch_size", "4",
           "--output_dir", str(output),
           "--overwrite_output_dir", "true", "--eval_strategy", "no", "--save_strategy", "no", *LAYOUTS[layout]]
    start = time.perf_counter()
    log = open(out_root / f"{layout}.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    with PeakWatcher(process.pid) as watcher:
        code = process.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{layout} failed (exit {code}); see {out_root / f'{layout}.log'}")
    ranks = {label: hwm for label, hwm in watcher.peaks.values() if label.startswith("rank")}
    launcher = max((hwm for label, hwm in watcher.peaks.values() if label == "launcher"), default=0)
    if not ranks:  # stand-alone: the launcher is the one process that trains
        ranks = {"rank 0": launcher}
    return wall, ranks, launcher


def planner_estimate(folder: Path, layout: str) -> float:
    """The planner's estimate (bytes, :func:`mindformers_py.planner.cost_model.estimate_memory`) of the busiest rank
    of ``layout`` for this recipe: the bf16 base, the recipe's LoRA adapter, batch 1 x 32 tokens, the activation
    dtype the run uses (bf16 where the CPU has it natively)."""
    import yaml

    from mindformers_py.adapters.config import recipe_peft_config
    from mindformers_py.adapters.counting import adapter_parameter_count
    from mindformers_py.auto import resolve_config
    from mindformers_py.engine.precision import native_bf16
    from mindformers_py.parallel import ParallelConfig
    from mindformers_py.planner.cost_model import estimate_memory

    config = resolve_config(str(folder))[0]
    recipe = yaml.safe_load((ROOT / "tasks/gpt/finetune_lora.yaml").read_text())
    trainable = adapter_parameter_count(recipe_peft_config(recipe, "causal_lm"), config)
    flags = LAYOUTS[layout]
    fields = {flags[i].lstrip("-"): flags[i + 1] for i in range(0, len(flags), 2)}
    batch = int(fields.pop("per_device_train_batch_size", 1))
    fields = {k: (v if k == "parallel_mode" else v == "true" if v in ("true", "false") else int(v))
              for k, v in fields.items()}
    parallel = ParallelConfig(**fields) if fields else ParallelConfig()
    estimate = estimate_memory(config, parallel, per_device_batch=batch, seq_length=32,
                               act_bytes=2 if native_bf16("cpu") else 4, trainable_params=trainable, param_bytes=2)
    return float(estimate.total)


def compare_recipe(folder: Path, layouts: list[str]) -> None:
    """Part 2: the LoRA recipe from the checkpoint under each layout."""
    out_root = ROOT / "runs" / "bench_loading" / "lora"
    out_root.mkdir(parents=True, exist_ok=True)
    results = {}
    for layout in layouts:
        print(f"  LoRA recipe, {layout} ...", flush=True)
        results[layout] = run_recipe(folder, layout, out_root)
        wall, ranks, launcher = results[layout]
        print(f"  {layout}: {wall:.0f} s, " + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(ranks.items()))
              + (f", launcher {_gib(launcher)}" if layout != "stand_alone" else ""), flush=True)
    base = max(results["stand_alone"][1].values()) if "stand_alone" in results else None
    print("\n| layout | wall | peak RSS per process | largest / stand-alone | planner's estimate (model state + "
          "activations, no runtime) |")
    print("|---|---|---|---|---|")
    for layout, (wall, ranks, launcher) in results.items():
        peaks = ", ".join(f"{k}: {_gib(v)}" for k, v in sorted(ranks.items()))
        ratio = f"{max(ranks.values()) / base:.2f}x" if base else "-"
        estimate = planner_estimate(folder, layout)
        print(f"| {layout} | {wall:.0f} s | {peaks} | {ratio} | {_gib(estimate)} "
              f"({max(ranks.values()) / estimate:.2f}x of it measured) |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=ROOT / "runs" / "bench_loading" / "llama_1b")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-recipe", action="store_true")
    opts = parser.parse_args(argv)
    make_checkpoint(opts.folder)
    if not opts.skip_load:
        compare_loading(opts.folder, opts.rounds)
    if not opts.skip_recipe:
        compare_recipe(opts.folder, opts.layouts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
