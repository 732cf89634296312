"""Greedy decoding speed: HF ``generate`` vs ours on the same weights, measured in one run: GPT-2 (the default),
Qwen3 or Qwen3-MoE (``--arch``).

The HF model (``transformers.GPT2LMHeadModel``, ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``, random weights,
built locally) is saved to a temporary folder and loaded into ours with
``mindformers_py.AutoModelForCausalLM.from_pretrained``. Each configuration is timed with
the runs of the contenders interleaved (so a slow spell of a shared machine hits all of them alike); the table
shows the median tokens/s over the repeats and the ratio to HF. Generated tokens must be identical, or the
benchmark fails.

    python benchmarks/bench_generate.py                 # 4 layers, width 256, 4 heads, vocab 8192, fp32, CPU
    python benchmarks/bench_generate.py --vocab 50257   # GPT-2's vocabulary (the LM head then dominates)
    python benchmarks/bench_generate.py --arch qwen3_moe --new 32 --repeats 5   # 8 experts of 384, top-2

For Qwen3-MoE the compiled step is left out (``--no-compiled`` is implied): the experts' rows per expert change at
every step, and dynamo recompiles the MoE part until its limit (minutes for a few tokens).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
import warnings

import torch
import transformers

import mindformers_py as mf


def build_models(args: argparse.Namespace, folder: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded random HF model of ``args.arch`` and the same weights loaded into our GPTForCausalLM."""
    torch.manual_seed(0)
    tokens = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    qwen = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads, vocab_size=args.vocab,
                max_position_embeddings=args.context, intermediate_size=3 * args.hidden, **tokens)
    if args.arch == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**qwen)).eval()
    elif args.arch == "deepseek_v3":  # latent attention (an 8x smaller latent), a dense first layer, 8 experts
        heads, rope = args.heads, args.hidden // args.heads // 2
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
            num_key_value_heads=heads, vocab_size=args.vocab, max_position_embeddings=args.context,
            intermediate_size=3 * args.hidden, moe_intermediate_size=3 * args.hidden // 2, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            q_lora_rank=args.hidden // 2, kv_lora_rank=args.kv_lora_rank or args.hidden // 8, qk_nope_head_dim=args.hidden // heads,
            qk_rope_head_dim=rope, v_head_dim=args.hidden // heads, **tokens)).eval()
    elif args.arch == "qwen3_moe":
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **qwen, moe_intermediate_size=3 * args.hidden // 2, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True)).eval()
    else:
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                         vocab_size=args.vocab, n_positions=args.context, **tokens)
        hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(folder)
    ours = mf.AutoModelForCausalLM.from_pretrained(folder)
    return hf, ours


def make_prompts(batch: int, length: int, vocab: int, left_pad: bool) -> dict[str, torch.Tensor]:
    """Random prompts (ids >= 1, so never the eos/pad id 0); with ``left_pad`` rows get 0..3 leading pads."""
    ids = torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    if left_pad:
        for row in range(batch):
            pads = row % 4
            ids[row, :pads] = 0
            mask[row, :pads] = 0
    return {"input_ids": ids, "attention_mask": mask}


def measure(contenders: dict, inputs: dict, kwargs: dict, warmup: int, repeats: int) -> dict[str, tuple]:
    """For each contender: (median seconds per ``generate`` call, its output, the seconds of its first call, which
    for the compiled step includes compiling it). Runs interleaved, order rotated."""
    names = list(contenders)
    outputs, times, first = {}, {name: [] for name in names}, {}
    for _ in range(max(1, warmup)):
        for name in names:
            start = time.perf_counter()
            outputs[name] = contenders[name](**inputs, **kwargs)
            first.setdefault(name, time.perf_counter() - start)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            contenders[name](**inputs, **kwargs)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), outputs[name], first[name]) for name in names}


def contenders_of(hf: torch.nn.Module, ours: torch.nn.Module, compiled: bool = True) -> dict:
    """transformers' ``generate``, ours through ``GenerationMixin``'s loop, ours (the lean loop), and (``compiled``)
    ours with the compiled step (``cache_implementation="static"``, transformers' switch; compiled on CPU too)."""
    contenders = {
        "hf": hf.generate,
        "ours, GenerationMixin loop": lambda **kw: ours.generate(fast_generate=False, **kw),
        "ours": ours.generate,
    }
    if compiled:
        contenders["ours, compiled step"] = lambda **kw: ours.generate(cache_implementation="static", **kw)
    return contenders


class DecodeTable:
    """Prints the tokens/s of every contender per case with the ratios to transformers, checks that every one
    generated transformers' tokens, and ends with the issue's target (>= 2x) per case."""

    def __init__(self, names: list[str], target: float | None = 2.0) -> None:
        self.names = names
        self.target = target  # GPT-2's (issue 12); the other architectures report the ratio only
        self.best: dict[str, tuple[str, float]] = {}
        self.compiled = "ours, compiled step" in names
        self.header = f"{'batch':>12} | {'HF tok/s':>9} | " + " | ".join(f"{n:>26}" for n in names[1:]) + \
            (f" | {'1st call, compiled':>18}" if self.compiled else "")
        print(self.header)
        print("-" * len(self.header))

    def add(self, label: str, results: dict, generated: int) -> None:
        reference = results["hf"][1]
        for name, (_, out, _) in results.items():
            if not torch.equal(out, reference):
                raise SystemExit(f"{name} generated different tokens from transformers at batch {label}")
        tps = {name: generated / seconds for name, (seconds, _, _) in results.items()}
        cells = [f"{tps[n]:>9.0f} ({tps[n] / tps['hf']:4.2f}x)".rjust(26) for n in self.names[1:]]
        first = f" | {results['ours, compiled step'][2]:>17.1f}s" if self.compiled else ""
        print(f"{label:>12} | {tps['hf']:>9.0f} | " + " | ".join(cells) + first)
        self.best[label] = max(((n, tps[n] / tps["hf"]) for n in ("ours", "ours, compiled step") if n in tps),
                               key=lambda x: x[1])

    def close(self) -> None:
        print("tokens identical to transformers' in every case (asserted)")
        for label, (name, ratio) in self.best.items():
            verdict = "" if self.target is None else \
                f", target >= {self.target:g}x: {'met' if ratio >= self.target else 'MISSED'}"
            print(f"batch {label}: best {name} / transformers {ratio:.2f}x{verdict}")


def cpu_name() -> str:
    """The CPU model as the OS reports it (for the table header)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("gpt2", "qwen3", "qwen3_moe", "deepseek_v3"), default="gpt2")
    parser.add_argument("--no-compiled", action="store_true", help="leave out the compiled decode step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192, help="8192 is the gpt_tiny preset's; 50257 is GPT-2's")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--kv-lora-rank", type=int, default=None,
                        help="deepseek_v3: the latent's width (default hidden/8; DeepSeek-V3 has 512 = hidden/14)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 keeps a shared machine's noise low)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as folder:
        hf, ours = build_models(args, folder)
    contenders = contenders_of(hf, ours, compiled=not args.no_compiled and args.arch not in ("qwen3_moe", "deepseek_v3"))
    print(f"greedy decoding, fp32, CPU ({cpu_name()}), {args.threads} thread(s): {type(hf).__name__} {args.layers} layers x {args.hidden} wide, "
          f"{args.heads} heads, vocab {args.vocab}; prompt {args.prompt} tokens, {args.new} new tokens; "
          f"median of {args.repeats} runs (torch {torch.__version__}, transformers {transformers.__version__})")
    table = DecodeTable(list(contenders), target=2.0 if args.arch == "gpt2" else None)
    cases = [(b, False) for b in args.batches] + [(max(args.batches), True)]
    for batch, left_pad in cases:
        prompts = make_prompts(batch, args.prompt, args.vocab, left_pad)
        results = measure(contenders, prompts, dict(max_new_tokens=args.new, do_sample=False), args.warmup, args.repeats)
        table.add(f"{batch}{' left-pad' if left_pad else ''}", results, batch * args.new)
    table.close()


if __name__ == "__main__":
    main()
