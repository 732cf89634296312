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
   batch and sequence on a CPU "device", the process's runtime included) beside the measured peaks.

``--checkpoint qwen3_moe_slice``: the same three parts for an expert-heavy checkpoint, a slice of Qwen3-30B-A3B at its
real widths (hidden 2048, 32 heads, 4 key/value heads of 128, 128 experts of 768, top-8, its 151936-token vocabulary,
untied) with 4 layers instead of 48: 3.00 B parameters, 2.42 B of them in experts, random bf16 values written by
transformers' ``save_pretrained`` (one tensor per expert and projection, as transformers writes Qwen3-MoE) in 1 GB
shards (6.0 GB), made once into ``runs/bench_loading/qwen3_moe_slice``. Its recipe is
``tasks/gpt/finetune_lora_qwen3.yaml`` with the same flags and its LoRA on the attention only
(``--peft.target_modules [q_proj,k_proj,v_proj,o_proj]``: LoRA on the experts, peft's ``ParamWrapper``, makes every
expert's updated weight anew in each forward and its gradient in backward, 0.4 GB per projection and layer here in
bf16: one step of this slice took 20 minutes at 15 GiB on the development machine, which has no native bf16; with the
attention alone it peaked at 8.88 GiB, its step still 20 minutes on 2 shared cores) and 8 new tokens per sample,
stand-alone and under ep2 (``--data_parallel 2 --expert_parallel 2``: each rank holds, and reads, 64 of the 128
experts of every layer); on request (``--layouts tp2``) under tp2 with the vocabulary sharded, the two-process layout
that also shards the dense part (attention heads, embedding and head) besides each expert's intermediate width.

``--checkpoint deepseek_v3_slice``: the same for DeepSeek-V3's architecture (transformers' ``deepseek_v3``) at a
released model's real widths, Moonlight-16B-A3B's (hidden 2048; multi-head latent attention with 16 heads, no query
latent, a key/value latent of 512, 128 + 64 query/key and 128 value dimensions per head; a dense first layer of 11264;
then 64 routed experts of 1408 with 6 per token, sigmoid scores, plus 2 shared; a 163840-token vocabulary, untied)
with 4 of its 27 layers (1 dense + 3 MoE): 2.51 B parameters, 1.66 B in routed experts, a non-zero
``e_score_correction_bias``, bf16, 1 GB shards (5.0 GB), made once into ``runs/bench_loading/deepseek_v3_slice``.
DeepSeek-V3's own widths would not fit the development machine (one of its MoE layers is 11 B parameters). The same
recipe and flags, its LoRA on latent attention's projections (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
``o_proj``), stand-alone and under ep2 (32 of the 64 experts a rank).

    python benchmarks/bench_loading.py                     # all of it (about 10 minutes on 2 cores)
    python benchmarks/bench_loading.py --skip-recipe       # the load comparison only
    python benchmarks/bench_loading.py --layouts dp2_zero3 # one layout
    python benchmarks/bench_loading.py --checkpoint qwen3_moe_slice   # the expert-heavy checkpoint
    python benchmarks/bench_loading.py --checkpoint deepseek_v3_slice # DeepSeek-V3's architecture

``--layers N`` makes and measures the checkpoint with N layers instead of its own (in
``runs/bench_loading/<checkpoint>_<N>layers``): how a ratio changes with depth, e.g. ``--checkpoint qwen3_moe_slice
--layers 8 --skip-load --layouts stand_alone ep2`` (12 GB on disk; the load comparison at 8 layers would need about
18 GiB for transformers' side).
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
MOE_LAYOUTS = {
    "stand_alone": [],
    "ep2": ["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--expert_parallel", "2"],
    # the frozen head split by rows over the two ranks too (each reads half of it; the fused loss gathers the tokens)
    "ep2_head_rows": ["--parallel_mode", "semi_auto_parallel", "--data_parallel", "2", "--expert_parallel", "2",
                      "--shard_frozen_head", "true"],
    # on request only (--layouts tp2): two processes that shard the dense part too (attention heads, the vocabulary)
    # besides every expert's intermediate width, where ep2 replicates the dense part on both
    "tp2": LAYOUTS["tp2"],
}
ON_REQUEST = {"tp2"}
"""The MoE checkpoints' layouts a run measures only when ``--layouts`` names them (each takes many minutes)."""
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})

# Qwen3-30B-A3B's widths (its config.json), 4 of its 48 layers
QWEN3_MOE_SLICE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                       bos_token_id=151643, eos_token_id=151645)
# Moonlight-16B-A3B's widths (its config.json: Moonshot's DeepSeek-V3-architecture model), 4 of its 27 layers: the
# dense first layer and 3 MoE layers. DeepSeek-V3's own do not fit a 24 GiB machine (one MoE layer is 11 B parameters).
DEEPSEEK_V3_SLICE = dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                         num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
                         q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
                         topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, num_nextn_predict_layers=0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, tie_word_embeddings=False,
                         bos_token_id=163584, eos_token_id=163586)
# name -> (transformers config and model classes, config, shard size, the LoRA recipe, its layouts, its LoRA's
# target modules (None: the recipe's), the recipe's other flags)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# multi-head latent attention's projections (no query latent at Moonlight's widths: q_proj is the whole query)
LATENT_ATTENTION = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
CHECKPOINTS = {
    "llama_1b": ("LlamaConfig", "LlamaForCausalLM", LLAMA_1B, "800MB", "tasks/gpt/finetune_lora.yaml", LAYOUTS,
                 None, []),
    "qwen3_moe_slice": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE_SLICE, "1GB",
                        "tasks/gpt/finetune_lora_qwen3.yaml", MOE_LAYOUTS, ATTENTION,
                        ["--generate.max_new_tokens", "8"]),
    "deepseek_v3_slice": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3_SLICE, "1GB",
                          "tasks/gpt/finetune_lora_qwen3.yaml", MOE_LAYOUTS, LATENT_ATTENTION,
                          ["--generate.max_new_tokens", "8"]),
}

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


def make_checkpoint(folder: Path, name: str = "llama_1b", layers: int | None = None) -> None:
    """The checkpoint ``name`` (:data:`CHECKPOINTS`) in bf16 shards, written by transformers (once); ``layers``
    instead of its own number of layers when given."""
    if (folder / "model.safetensors.index.json").is_file():
        return
    import torch
    import transformers

    config_class, model_class, fields, shard_size = CHECKPOINTS[name][:4]
    fields = {**fields, "num_hidden_layers": layers} if layers else fields
    print(f"making the checkpoint in {folder} (once) ...", flush=True)
    config = getattr(transformers, config_class)(**fields, dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the parameters made in bf16 directly (no fp32 copy of the model)
    try:
        with torch.device("meta"):
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for bname, buffer in model.named_buffers():  # DeepSeek-V3's expert bias (selection only): non-zero, as trained
            if bname.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.01)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    model.save_pretrained(tmp, max_shard_size=shard_size)
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
            todo, seen = [(self.root, "")], set()
            while todo:
                pid, parent_cmdline = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                try:  # (a process may end between two reads)
                    status = Path(f"/proc/{pid}/status").read_text()
                    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="ignore").split("\0")
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text()
                except OSError:
                    continue
                todo += [(child, cmdline) for child in self._children(pid)]
                hwm = next((int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("VmHWM")), 0)
                # /proc's environ is the one the process was started with: a rank forked from the fork server has
                # the server's (no RANK) and its command line; it is the server's child
                rank = next((kv.split("=", 1)[1] for kv in environ if kv.startswith("RANK=")), None)
                if pid == self.root:
                    label = "launcher"
                elif "forkserver" in cmdline and "forkserver" in parent_cmdline:
                    label = "rank"  # numbered by process id when read (:meth:`rank_peaks`)
                elif rank is not None and "forkserver" not in cmdline:
                    label = f"rank {rank}"
                else:
                    label = "helper"
                if hwm > self.peaks.get(pid, ("", 0))[1]:
                    self.peaks[pid] = (label, hwm)
            time.sleep(self.interval)

    def rank_peaks(self) -> dict[str, int]:
        """Peak RSS by rank label; ranks forked from the fork server, whose rank their starting environment does
        not hold, are numbered in the order they were started (process ids)."""
        out, forked = {}, sorted(pid for pid, (label, _) in self.peaks.items() if label == "rank")
        for pid, (label, hwm) in self.peaks.items():
            if label == "rank":
                out[f"rank {forked.index(pid)}"] = hwm
            elif label.startswith("rank "):
                out[label] = hwm
        return out

    def __enter__(self) -> "PeakWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_recipe(folder: Path, layout: str, out_root: Path, checkpoint: str = "llama_1b") -> tuple[float, dict[str, int], int]:
    """(wall seconds, peak RSS per rank, the launcher's peak) of the checkpoint's LoRA recipe under ``layout``."""
    output = out_root / layout
    recipe, layouts, targets, extra = CHECKPOINTS[checkpoint][4:]
    if targets is not None:
        extra = [*extra, "--peft.target_modules", "[" + ",".join(targets) + "]"]
    cmd = [sys.executable, "-m", "mindformers_py", "run", str(ROOT / recipe),
           "--model.name_or_path", str(folder), "--max_steps", "1", "--per_device_train_batch_size", "1",
           "--data.block_size", "32", "--data.max_eval_samples", "4", "--per_device_eval_batch_size", "4",
           "--output_dir", str(output),
           "--overwrite_output_dir", "true", "--eval_strategy", "no", "--save_strategy", "no",
           "--gradient_accumulation_steps", "1", *extra, *layouts[layout]]
    start = time.perf_counter()
    log = open(out_root / f"{layout}.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    with PeakWatcher(process.pid) as watcher:
        code = process.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{layout} failed (exit {code}); see {out_root / f'{layout}.log'}")
    ranks = watcher.rank_peaks()
    launcher = max((hwm for label, hwm in watcher.peaks.values() if label == "launcher"), default=0)
    if not ranks:  # stand-alone: the launcher is the one process that trains
        ranks = {"rank 0": launcher}
    return wall, ranks, launcher


def planner_estimate(folder: Path, layout: str, checkpoint: str = "llama_1b") -> float:
    """The planner's estimate (bytes, :func:`mindformers_py.planner.cost_model.estimate_memory`) of the busiest rank
    of ``layout`` for this recipe: the bf16 base, the recipe's LoRA adapter, batch 1 x 32 tokens, the activation
    dtype the run uses (bf16 where the CPU has it natively), the recipe's ``fused_loss`` and the process's runtime
    (the CPU's, as ``DeviceSpec.detect`` gives it)."""
    import yaml

    from mindformers_py.adapters.config import recipe_peft_config
    from mindformers_py.adapters.counting import adapter_parameter_count
    from mindformers_py.auto import resolve_config
    from mindformers_py.engine.precision import native_bf16
    from mindformers_py.parallel import ParallelConfig
    from mindformers_py.planner.cost_model import estimate_memory
    from mindformers_py.planner.device_spec import DeviceSpec

    config = resolve_config(str(folder))[0]
    recipe_path, layouts, targets = CHECKPOINTS[checkpoint][4:7]
    recipe = yaml.safe_load((ROOT / recipe_path).read_text())
    if targets is not None:
        recipe["peft"]["target_modules"] = targets
    trainable = adapter_parameter_count(recipe_peft_config(recipe, "causal_lm"), config)
    flags = layouts[layout]
    fields = {flags[i].lstrip("-"): flags[i + 1] for i in range(0, len(flags), 2)}
    batch = int(fields.pop("per_device_train_batch_size", 1))
    fields = {k: (v if k == "parallel_mode" else v == "true" if v in ("true", "false") else int(v))
              for k, v in fields.items()}
    parallel = ParallelConfig(**fields) if fields else ParallelConfig()
    device = DeviceSpec.detect("cpu")
    estimate = estimate_memory(config, parallel, per_device_batch=batch, seq_length=32,
                               act_bytes=2 if native_bf16("cpu") else 4, trainable_params=trainable, param_bytes=2,
                               runtime_bytes=device.runtime_bytes, mapped_embedding=device.maps_frozen_weights,
                               fused_loss=bool((recipe.get("training") or {}).get("fused_loss", False)))
    return float(estimate.total)


def compare_recipe(folder: Path, layouts: list[str], checkpoint: str = "llama_1b") -> None:
    """Part 2: the LoRA recipe from the checkpoint under each layout."""
    out_root = ROOT / "runs" / "bench_loading" / f"lora_{checkpoint}"
    out_root.mkdir(parents=True, exist_ok=True)
    results = {}
    for layout in layouts:
        print(f"  LoRA recipe, {layout} ...", flush=True)
        results[layout] = run_recipe(folder, layout, out_root, checkpoint)
        wall, ranks, launcher = results[layout]
        print(f"  {layout}: {wall:.0f} s, " + ", ".join(f"{k} {_gib(v)}" for k, v in sorted(ranks.items()))
              + (f", launcher {_gib(launcher)}" if layout != "stand_alone" else ""), flush=True)
    base = max(results["stand_alone"][1].values()) if "stand_alone" in results else None
    print("\n| layout | wall | peak RSS per process | largest / stand-alone | planner's estimate (runtime "
          "included) |")
    print("|---|---|---|---|---|")
    for layout, (wall, ranks, launcher) in results.items():
        peaks = ", ".join(f"{k}: {_gib(v)}" for k, v in sorted(ranks.items()))
        ratio = f"{max(ranks.values()) / base:.2f}x" if base else "-"
        estimate = planner_estimate(folder, layout, checkpoint)
        print(f"| {layout} | {wall:.0f} s | {peaks} | {ratio} | {_gib(estimate)} "
              f"({max(ranks.values()) / estimate:.2f}x of it measured) |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", choices=list(CHECKPOINTS), default="llama_1b")
    parser.add_argument("--folder", type=Path, default=None, help="default: runs/bench_loading/<checkpoint>")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=None, choices=sorted({*LAYOUTS, *MOE_LAYOUTS}),
                        help="default: every layout of the checkpoint's recipe")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-recipe", action="store_true")
    parser.add_argument("--layers", type=int, default=None,
                        help="the checkpoint with this many layers instead of its own (default folder: "
                             "runs/bench_loading/<checkpoint>_<N>layers)")
    opts = parser.parse_args(argv)
    if opts.layers is not None and opts.layers < 1:
        parser.error(f"--layers must be at least 1, got {opts.layers}")
    default_name = opts.checkpoint + (f"_{opts.layers}layers" if opts.layers else "")
    folder = opts.folder or ROOT / "runs" / "bench_loading" / default_name
    own = CHECKPOINTS[opts.checkpoint][5]
    layouts = opts.layouts or [name for name in own if own is LAYOUTS or name not in ON_REQUEST]
    make_checkpoint(folder, opts.checkpoint, opts.layers)
    if not opts.skip_load:
        compare_loading(folder, opts.rounds)
    if not opts.skip_recipe:
        compare_recipe(folder, layouts, opts.checkpoint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
