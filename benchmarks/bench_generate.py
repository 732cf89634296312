"""Greedy decoding speed: HF ``generate`` on a GPT-2 model vs ours on the same weights, measured in one run.

The HF model (``transformers.GPT2LMHeadModel``, random weights, built locally) is saved to a temporary folder and
loaded into ours with ``mindformers_py.AutoModelForCausalLM.from_pretrained``. Each configuration is timed with
the runs of the contenders interleaved (so a slow spell of a shared machine hits all of them alike); the table
shows the median tokens/s over the repeats and the ratio to HF. Generated tokens must be identical, or the
benchmark fails.

    python benchmarks/bench_generate.py                 # 4 layers, width 256, 4 heads, vocab 8192, fp32, CPU
    python benchmarks/bench_generate.py --vocab 50257   # GPT-2's vocabulary (the LM head then dominates)
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
    """A seeded random HF GPT-2 and the same weights loaded into our GPTForCausalLM."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab, n_positions=args.context,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
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


def measure(contenders: dict, prompts: dict, new_tokens: int, warmup: int, repeats: int) -> dict[str, tuple[float, torch.Tensor]]:
    """Median seconds per ``generate`` call and the output of each contender (runs interleaved, order rotated)."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    names = list(contenders)
    outputs, times = {}, {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            outputs[name] = contenders[name](**prompts, **kwargs)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            contenders[name](**prompts, **kwargs)
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), outputs[name]) for name in names}


def cpu_name() -> str:
    """The CPU model as the OS reports it (for the table header)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192, help="8192 is the gpt_tiny preset's; 50257 is GPT-2's")
    parser.add_argument("--context", type=int, default=256)
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
    contenders = {
        "hf": hf.generate,
        "ours (GenerationMixin loop)": lambda **kw: ours.generate(fast_generate=False, **kw),
        "ours": ours.generate,
    }
    print(f"greedy decoding, fp32, CPU ({cpu_name()}), {args.threads} thread(s): GPT-2 {args.layers} layers x {args.hidden} wide, "
          f"{args.heads} heads, vocab {args.vocab}; prompt {args.prompt} tokens, {args.new} new tokens; "
          f"median of {args.repeats} runs (torch {torch.__version__}, transformers {transformers.__version__})")
    header = f"{'batch':>12} | {'HF tok/s':>9} | {'ours, GenerationMixin loop':>26} | {'ours tok/s':>10} | {'ours / HF':>9}"
    print(header)
    print("-" * len(header))
    ratios = {}
    cases = [(b, False) for b in args.batches] + [(max(args.batches), True)]
    for batch, left_pad in cases:
        prompts = make_prompts(batch, args.prompt, args.vocab, left_pad)
        results = measure(contenders, prompts, args.new, args.warmup, args.repeats)
        reference = results["hf"][1]
        for name, (_, out) in results.items():
            if not torch.equal(out, reference):
                raise SystemExit(f"{name} generated different tokens from HF at batch {batch}")
        generated = batch * (reference.shape[1] - args.prompt)
        tps = {name: generated / seconds for name, (seconds, _) in results.items()}
        label = f"{batch}{' left-pad' if left_pad else ''}"
        ratios[label] = tps["ours"] / tps["hf"]
        print(f"{label:>12} | {tps['hf']:>9.0f} | {tps['ours (GenerationMixin loop)']:>26.0f} | {tps['ours']:>10.0f} | "
              f"{ratios[label]:>8.2f}x")
    print("tokens identical to HF in every case; ratios: " + ", ".join(f"batch {k}: {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
