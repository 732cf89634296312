"""Data at scale: document masks as metadata, packed fine-tuning, preprocessing into Megatron's format, and the demo's
speed, each compared in the same run.

* ``mask``: the attention mask of 4 rows of 8,192 packed tokens (16 documents a row): the dense boolean matrix
  transformers' rule builds (what ``build_attention_mask`` returned before document masks became metadata) against
  :class:`~mindformers_py.layers.document_mask.DocumentMask` (document ids + FlexAttention's block tables); then the
  time of attention forward + backward over 4 x 2,048 packed tokens: the block-sparse path, SDPA with the dense mask,
  and SDPA's plain causal kernel over the whole rows (which ignores the documents: a lower bound of the work).
* ``sft``: one epoch of instruction fine-tuning of a GPT-2-flavoured model (2 x 128 by default; the standard
  library's docstring -> function pairs, 512-token context, a length-skewed set) with padded batches (8 samples, padded to the longest) and with packed rows (first
  fit decreasing into 512 tokens, 4 rows a step), the same model and optimizer: real (non-padding) tokens per
  second of each, and the per-token loss of the same samples at the same weights by both paths.
* ``preprocess``: ``mindformers-py preprocess`` (tokenise + write ``.bin``/``.idx``) against ``datasets.map``
  tokenisation saved as Arrow (``save_to_disk``), on the same JSONL of standard-library files, same tokenizer and
  processes.
* ``demo``: ``tasks/gpt/pretrain_tiny.yaml`` for ``--steps`` steps (no evaluation, no checkpoints) with this tree and
  with ``--baseline`` (another checkout, e.g. the commit before), alternating, each in a fresh process: the training
  tokens per second of each.

    python benchmarks/bench_data.py mask
    python benchmarks/bench_data.py sft --samples 256
    python benchmarks/bench_data.py preprocess --files 400 --workers 2
    python benchmarks/bench_data.py demo --baseline /path/to/base/checkout --steps 120 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _row(total: int, documents: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), documents - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def bench_mask(args: argparse.Namespace) -> None:
    from mindformers_py.layers.document_mask import DocumentMask

    rng = random.Random(0)
    tokens, rows = 8192, 4
    pos = torch.stack([_positions(_row(tokens, 16, rng)) for _ in range(rows)])
    mask = DocumentMask.from_position_ids(pos)
    dense = mask.dense()
    tables = mask.nbytes
    print(f"| attention mask, {rows} x {tokens} tokens, 16 documents a row | bytes |")
    print("| --- | --- |")
    print(f"| dense boolean (B, 1, T, T), transformers' rule | {dense.nbytes / 2**20:,.1f} MiB |")
    print(f"| DocumentMask: document ids + block tables (128-token tiles) | {tables / 2**20:.3f} MiB "
          f"({tables:,} B) |")
    del dense
    t, heads, dim = args.time_tokens, 8, 64
    pos = torch.stack([_positions(_row(t, max(2, t // 512), rng)) for _ in range(rows)])
    mask = DocumentMask.from_position_ids(pos)
    q, k, v = (torch.randn(rows, heads, t, dim, requires_grad=True) for _ in range(3))

    def block():
        return mask.attend(q, k, v)

    def dense_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())

    def causal():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    times = {name: [] for name in ("block", "dense", "causal")}
    for _ in range(args.rounds):
        for name, fn in (("block", block), ("dense", dense_sdpa), ("causal", causal)):
            start = time.perf_counter()
            fn().sum().backward()
            times[name].append(time.perf_counter() - start)
    best = {name: min(v) for name, v in times.items()}
    print(f"\n| attention forward + backward, {rows} x {t} tokens, {heads} heads x {dim} | best of {args.rounds} | "
          "vs dense |")
    print("| --- | --- | --- |")
    for name, label in (("block", "block-sparse (DocumentMask)"), ("dense", "SDPA + dense mask"),
                        ("causal", "SDPA causal, documents ignored")):
        print(f"| {label} | {best[name] * 1e3:,.0f} ms | {best['dense'] / best[name]:.2f}x |")


def _sft_samples(count: int, block: int):
    from mindformers_py.data import default_tokenizer
    from mindformers_py.data.stdlib.instructions import docstring_instructions, tokenize_instructions

    tokenizer = default_tokenizer(vocab_size=4096)
    pairs = docstring_instructions("train")
    samples = tokenize_instructions(pairs, tokenizer, block).shuffle(seed=0).select(range(count))
    return tokenizer, samples.remove_columns("attention_mask")


def bench_sft(args: argparse.Namespace) -> None:
    import mindformers_py as mf
    from mindformers_py.data.collators import DataCollatorForCausalLM
    from mindformers_py.data.sft_packing import PackedRowsCollator, pack_samples

    torch.manual_seed(0)
    tokenizer, samples = _sft_samples(args.samples, args.block)
    lengths = sorted(len(x) for x in samples["input_ids"])
    real = sum(lengths)
    print(f"{len(samples)} samples, {real:,} tokens; length median {statistics.median(lengths):.0f}, "
          f"90th percentile {lengths[int(0.9 * len(lengths))]}, longest {lengths[-1]}")
    padded_collate = DataCollatorForCausalLM(tokenizer)
    rows = list(samples)
    padded = [padded_collate(rows[i:i + args.batch]) for i in range(0, len(rows), args.batch)]
    packed_rows = list(pack_samples(samples, args.block))
    packed_collate = PackedRowsCollator(pad_token_id=tokenizer.pad_token_id)
    packed = [packed_collate(packed_rows[i:i + args.rows]) for i in range(0, len(packed_rows), args.rows)]
    config = mf.GPTConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=4,
                          max_position_embeddings=args.block, embedding_dropout=0.0, attention_dropout=0.0,
                          hidden_dropout=0.0, pad_token_id=tokenizer.pad_token_id)
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in padded)

    def per_token_loss(model, batches):
        with torch.no_grad():
            return sum(float(model(**b, num_items_in_batch=items).loss) for b in batches)

    torch.manual_seed(0)
    model = mf.GPTForCausalLM(config)
    loss_padded, loss_packed = per_token_loss(model, padded), per_token_loss(model, packed)
    print(f"per-token loss at init: padded {loss_padded:.6f}, packed {loss_packed:.6f}", flush=True)
    slots = {"padded": sum(b["input_ids"].numel() for b in padded),
             "packed": sum(b["input_ids"].numel() for b in packed)}
    results = {"padded": [], "packed": []}
    for _ in range(args.rounds):
        for name, batches in (("padded", padded), ("packed", packed)):
            torch.manual_seed(0)
            model = mf.GPTForCausalLM(config).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            start = time.perf_counter()
            for batch in batches:
                n = int((batch["labels"][:, 1:] != -100).sum())
                model(**batch, num_items_in_batch=n).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            results[name].append(time.perf_counter() - start)
            print(f"{name}: epoch in {results[name][-1]:.1f} s", flush=True)
    best = {name: min(v) for name, v in results.items()}
    print(f"\n| one epoch, {len(samples)} samples, fp32 | steps | token slots | real tokens/s | per-token loss "
          "at init |")
    print("| --- | --- | --- | --- | --- |")
    for name, batches, loss in (("padded", padded, loss_padded), ("packed", packed, loss_packed)):
        print(f"| {name} ({args.batch} samples a step)" if name == "padded" else
              f"| {name} ({args.rows} rows of {args.block} a step)", end="")
        print(f" | {len(batches)} | {slots[name]:,} | {real / best[name]:,.0f} | {loss:.6f} |")
    print(f"\npacked / padded real tokens per second: {best['padded'] / best['packed']:.2f}x "
          f"(best of {args.rounds} epochs each, alternating); per-token loss difference "
          f"{abs(loss_packed - loss_padded):.1e}")


def _jsonl(folder: Path, files: int) -> Path:
    from mindformers_py.data.corpus import stdlib_files

    path = folder / "stdlib.jsonl"
    with open(path, "w") as f:
        for file in stdlib_files("train")[:files]:
            f.write(json.dumps({"text": file.read_text(errors="replace")}) + "\n")
    return path


def bench_preprocess(args: argparse.Namespace) -> None:
    import datasets

    from mindformers_py.data import default_tokenizer
    from mindformers_py.data.megatron.preprocess import preprocess

    datasets.disable_progress_bars()
    tokenizer = default_tokenizer(vocab_size=4096)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = _jsonl(folder, args.files)
        size = source.stat().st_size
        results: dict[str, list[float]] = {"preprocess": [], "datasets": []}
        tokens = 0
        for r in range(args.rounds):
            datasets.disable_caching()  # every round tokenises afresh: no Arrow cache to reuse
            start = time.perf_counter()
            result = preprocess(source, folder / f"out{r}", tokenizer, workers=args.workers, append_eod=True)
            results["preprocess"].append(time.perf_counter() - start)
            tokens = result.tokens

            def encode(batch):
                ids = tokenizer(batch["text"], return_attention_mask=False, verbose=False)["input_ids"]
                return {"input_ids": [x + [tokenizer.eos_token_id] for x in ids]}

            start = time.perf_counter()
            table = datasets.load_dataset("json", data_files=str(source), split="train",
                                          cache_dir=str(folder / f"hf{r}"))
            table.map(encode, batched=True, num_proc=args.workers if args.workers > 1 else None,
                      remove_columns=table.column_names).save_to_disk(str(folder / f"arrow{r}"))
            results["datasets"].append(time.perf_counter() - start)
    best = {name: min(v) for name, v in results.items()}
    print(f"{args.files} standard-library files, {size / 2**20:.1f} MiB of JSONL, {tokens:,} tokens, "
          f"{args.workers} worker(s), best of {args.rounds}")
    print("\n| tokenise into | time | tokens/s |")
    print("| --- | --- | --- |")
    print(f"| Megatron .bin/.idx (`mindformers-py preprocess`) | {best['preprocess']:.2f} s | "
          f"{tokens / best['preprocess']:,.0f} |")
    print(f"| Arrow (`datasets.map` + `save_to_disk`) | {best['datasets']:.2f} s | {tokens / best['datasets']:,.0f} |")
    print(f"\npreprocess / datasets.map tokens per second: {best['datasets'] / best['preprocess']:.2f}x")


def _demo_run(tree: Path, steps: int, folder: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-m", "mindformers_py", "run", str(ROOT / "tasks/gpt/pretrain_tiny.yaml"),
               "--max_steps", str(steps), "--output_dir", folder, "--overwrite_output_dir", "true",
               "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--generate.prompts", "[]",
               "--disable_tqdm", "true"]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=folder, check=True)
    found = re.findall(r"train_tokens_per_second=([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"no train_tokens_per_second in the output of {tree}:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return float(found[-1])


def bench_demo(args: argparse.Namespace) -> None:
    trees = {"baseline": Path(args.baseline).resolve(), "this tree": ROOT}
    rates: dict[str, list[float]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                rates[name].append(_demo_run(tree, args.steps, tmp))
                print(f"round {r + 1}: {name}: {rates[name][-1]:,.0f} tokens/s", flush=True)
    print(f"\n| demo, {args.steps} steps of 16 x 128 tokens | tokens/s (median of {args.rounds}) | runs |")
    print("| --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} ({trees[name]}) | {statistics.median(values):,.0f} | "
              f"{', '.join(f'{v:,.0f}' for v in values)} |")
    ratio = statistics.median(rates["this tree"]) / statistics.median(rates["baseline"])
    print(f"\nthis tree / baseline: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mask = sub.add_parser("mask")
    mask.add_argument("--time-tokens", type=int, default=2048)
    mask.add_argument("--rounds", type=int, default=3)
    sft = sub.add_parser("sft")
    sft.add_argument("--samples", type=int, default=256)
    sft.add_argument("--block", type=int, default=512)
    sft.add_argument("--batch", type=int, default=8)
    sft.add_argument("--rows", type=int, default=4)
    sft.add_argument("--rounds", type=int, default=2)
    sft.add_argument("--hidden", type=int, default=128)
    sft.add_argument("--layers", type=int, default=2)
    pre = sub.add_parser("preprocess")
    pre.add_argument("--files", type=int, default=400)
    pre.add_argument("--workers", type=int, default=2)
    pre.add_argument("--rounds", type=int, default=2)
    demo = sub.add_parser("demo")
    demo.add_argument("--baseline", required=True, help="another checkout of the project (e.g. the previous commit)")
    demo.add_argument("--steps", type=int, default=120)
    demo.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    {"mask": bench_mask, "sft": bench_sft, "preprocess": bench_preprocess, "demo": bench_demo}[args.what](args)


if __name__ == "__main__":
    main()
