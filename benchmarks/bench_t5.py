"""Greedy decoding speed of an encoder-decoder: HF ``generate`` on a T5 model vs ours on the same weights.

The HF model (``transformers.T5ForConditionalGeneration``, random weights, built locally) is saved to a temporary
folder and loaded into ours with ``mindformers_py.AutoModelForSeq2SeqLM.from_pretrained``. Each configuration is
timed with the contenders' runs interleaved (a slow spell of a shared machine hits all of them alike); the table
shows the median decoder tokens/s and the ratio to HF. Generated tokens must be identical, or the benchmark fails.
Sources are padded (rows of different lengths) at batch > 1, as a pipeline's batches are.

    python benchmarks/bench_t5.py                   # t5_tiny's shape: 4+4 layers, width 256, 4 heads, vocab 8192
    python benchmarks/bench_t5.py --preset t5_small # T5-small's shape (6+6 layers, 512 wide, vocab 32128)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

import mindformers_py as mf

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import DecodeTable, contenders_of, cpu_name, measure  # noqa: E402


def build_models(preset: str, folder: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded random HF T5 of the preset's shape and the same weights loaded into our T5ForConditionalGeneration
    (generation runs with ``eos_token_id=None``, so every run decodes the full length)."""
    torch.manual_seed(0)
    ours_config = mf.AutoConfig.from_pretrained(preset)
    hf_config = mf.models.t5.convert_t5.config_to_hf(ours_config)
    hf_config.decoder_start_token_id = 0
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    hf.save_pretrained(folder)
    ours = mf.AutoModelForSeq2SeqLM.from_pretrained(folder)
    return hf, ours


def make_sources(batch: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    """Random sources (ids >= 2); at batch > 1 row r is padded at the end by 3·(r mod 4) tokens."""
    ids = torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    for row in range(batch if batch > 1 else 0):
        pads = 3 * (row % 4)
        if pads:
            ids[row, -pads:] = 0
            mask[row, -pads:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="t5_tiny", help="a T5 preset giving the shape (random weights)")
    parser.add_argument("--source", type=int, default=64, help="source tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per source")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 keeps a shared machine's noise low)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as folder:
        hf, ours = build_models(args.preset, folder)
    c = ours.config
    contenders = contenders_of(hf, ours)
    print(f"greedy decoding, fp32, CPU ({cpu_name()}), {args.threads} thread(s): {args.preset} shape, "
          f"{c.num_hidden_layers}+{c.num_decoder_layers} layers x {c.hidden_size} wide, {c.num_attention_heads} heads, "
          f"vocab {c.vocab_size}; source {args.source} tokens, {args.new} new tokens; median of {args.repeats} runs "
          f"(torch {torch.__version__}, transformers {transformers.__version__})")
    table = DecodeTable(list(contenders))
    for batch in args.batches:
        inputs = make_sources(batch, args.source, c.vocab_size)
        kwargs = dict(max_new_tokens=args.new, do_sample=False, eos_token_id=None)
        table.add(str(batch), measure(contenders, inputs, kwargs, args.warmup, args.repeats), batch * args.new)
    table.close()


if __name__ == "__main__":
    main()
