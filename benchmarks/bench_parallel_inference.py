"""Parallel generation against one process: tokens/s, and memory per rank of the weights and the KV cache.

For the default GPT (``gpt_tiny``) and T5 (``t5_tiny``), random weights, greedy decoding of ``--new`` tokens after a
``--prompt``-token prompt (T5: a source of that length), each batch size of ``--batch``:

* stand-alone: ``model.generate`` in this process, with all of this machine's cores (torch's default threads);
* each layout of ``--layouts`` (default ``tp2``): the same call through a parallel pipeline's pool of workers
  (:mod:`mindformers_py.pipelines.parallel_pool`), whose workers share the same cores (``OMP_NUM_THREADS``, else the
  cores divided among them), request and answer included.

Printed: tokens/s of each side (best of ``--repeats``) and their ratio (layout / stand-alone; above 1 is faster), and
per rank the bytes of weights held and of KV cache per token (measured in each worker on a short forward), as a
ratio to stand-alone's. Both sides generate the same tokens (checked).

    python benchmarks/bench_parallel_inference.py
    python benchmarks/bench_parallel_inference.py --layouts tp2 pp2 tp2pp2 --batch 1 8
"""

from __future__ import annotations

import argparse
import time

import torch

import mindformers_py as mf
from mindformers_py.errors import ConfigError
from mindformers_py.parallel.inference import cache_bytes, inference_layout, local_bytes
from mindformers_py.pipelines.parallel_pool import InferencePool

LAYOUTS = {"tp2": {"model_parallel": 2}, "pp2": {"pipeline_stage": 2}, "tp2pp2": {"model_parallel": 2, "pipeline_stage": 2}}
MODELS = {"gpt_tiny": ("causal_lm", mf.AutoModelForCausalLM), "t5_tiny": ("seq2seq_lm", mf.AutoModelForSeq2SeqLM)}
MIB = 2**20


def _inputs(model, batch: int, prompt: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(4, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _timed(generate, inputs, new: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Best tokens/s of ``repeats`` runs (after one warm-up) and the generated ids."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    out = generate(**inputs, **kwargs)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(**inputs, **kwargs)
        best = min(best, time.perf_counter() - start)
    return inputs["input_ids"].shape[0] * new / best, out


def _stand_alone_memory(model) -> tuple[int, int]:
    probe = torch.zeros(1, 8, dtype=torch.long)
    extra = {"decoder_input_ids": probe} if model.config.is_encoder_decoder else {}
    with torch.inference_mode():
        out = model(input_ids=probe, use_cache=True, **extra)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    return local_bytes(model), cache_bytes(cache) // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=["tp2"], choices=list(LAYOUTS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"greedy, prompt {args.prompt} tokens, {args.new} new tokens, {torch.get_num_threads()} threads stand-alone")
    for name in args.models:
        task, auto = MODELS[name]
        torch.manual_seed(0)
        model = auto.from_pretrained(name, eos_token_id=None).eval()  # no early stop: every run makes --new tokens
        weights, kv = _stand_alone_memory(model)
        alone = {b: _timed(model.generate, _inputs(model, b, args.prompt), args.new, args.repeats) for b in args.batch}
        for layout_name in args.layouts:
            try:
                layout = inference_layout(LAYOUTS[layout_name], model.config)
            except ConfigError as refused:  # e.g. pipeline stages for an encoder-decoder: said, then the next layout
                print(f"{name:9} {layout_name:7} refused: {refused}")
                continue
            pool = InferencePool(model, task, layout)
            try:
                pool.start()
                for batch in args.batch:
                    speed, out = _timed(pool.generate, _inputs(model, batch, args.prompt), args.new, args.repeats)
                    base, expected = alone[batch]
                    same = "same tokens" if torch.equal(out, expected) else "TOKENS DIFFER"
                    print(f"{name:9} {layout_name:7} batch {batch:2}: stand-alone {base:8.1f} tok/s, {layout_name} "
                          f"{speed:8.1f} tok/s, ratio {speed / base:5.2f}x ({same})")
                for rank, memory in enumerate(pool.memory()):
                    print(f"{name:9} {layout_name:7} rank {rank}: weights {memory['weights_bytes'] / MIB:7.2f} MiB "
                          f"({memory['weights_bytes'] / weights:4.2f}x stand-alone's {weights / MIB:.2f}), KV cache "
                          f"{memory['kv_cache_bytes_per_token']} B/token ({memory['kv_cache_bytes_per_token'] / kv:4.2f}x "
                          f"stand-alone's {kv})")
            finally:
                pool.close()


if __name__ == "__main__":
    main()
