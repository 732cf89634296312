"""The first run on a CUDA GPU: correctness against the CPU, bf16 training, a ~1B model's speed and decode speed.

Nothing of this package had run on CUDA before this script: NCCL, bf16 on GPU, FSDP2 mixed precision, SDPA's
flash kernels, inductor's GPU code, grouped GEMMs for MoE. On one (or more) CUDA GPUs it runs, and prints one table:

1. **parity**: every family (GPT-2 and Llama flavours, GPT-MoE, BERT, T5, ViT; tiny shapes) forward and backward on
   the GPU against the CPU fp32 result on the same weights and batch. fp32 on the GPU (TF32 off): loss and outputs
   within ``1e-4`` (absolute, plus ``1e-4`` relative), gradients within a relative norm error of ``1e-3``. bf16
   autocast on the GPU: loss within 2% relative, gradients within a relative norm error of 5%.
2. **bf16 training**: a small Llama-flavour GPT trained by our Trainer in fp32 and in bf16 (autocast) on a learnable
   synthetic sequence task; every logged loss of the bf16 run within 3% of the fp32 run's (relative).
3. **~1B training**: the ``llama_1b`` preset (Llama 3.2 1B's shape, random weights) trained with bf16 +
   ``torch_compile`` by our Trainer, under FSDP2 (``optimizer_shard=3``) across the GPUs when there are two or
   more (FSDP2 has nothing to shard on one), beside transformers' Trainer (``bf16=True``) on the same weights and
   batches on one GPU: steady tokens/s per GPU and MFU against the GPU's datasheet bf16 peak and its measured
   matmul peak.
4. **decode**: greedy decoding of the same model (bf16 weights) at batch 1 and 16, transformers' ``generate``
   against ours (the eager lean loop, and the compiled step of ``cache_implementation="static"``), tokens/s, the
   ratio and how many generated tokens agree.

``--smoke`` runs the same code on the CPU with tiny sizes (two gloo processes for the FSDP2 section, dynamo's
``eager`` backend instead of inductor, a few steps) in well under a minute: the test suite runs it, so the script
cannot rot before a GPU arrives. Its numbers mean nothing.

    python benchmarks/gpu_check.py              # on a CUDA machine
    python benchmarks/gpu_check.py --smoke      # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import CompileConfig, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
from flops import matmul_peak, step_flops  # noqa: E402

import mindformers_py as mf  # noqa: E402
from mindformers_py.models.gpt.convert_gpt import config_to_hf  # noqa: E402
from mindformers_py.trainer import Trainer, TrainingArguments  # noqa: E402

FP32_OUTPUT_TOL = 1e-4
FP32_GRAD_TOL = 1e-3
BF16_LOSS_TOL = 2e-2
BF16_GRAD_TOL = 1e-1
BF16_CURVE_TOL = 3e-2


@dataclass
class Row:
    """One line of the final table."""

    section: str
    check: str
    value: str
    bound: str = ""
    ok: bool | None = None  # None: a measurement without a pass/fail bound


@dataclass
class Sizes:
    """The sizes of a run (full on a GPU, tiny with ``--smoke``)."""

    width: int
    curve_steps: int
    big_preset: dict[str, Any]
    big_batch: int
    big_seq: int
    big_steps: int
    big_warmup: int
    prompt: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)


FULL = Sizes(width=256, curve_steps=60, big_preset={}, big_batch=4, big_seq=2048, big_steps=10, big_warmup=3,
             prompt=128, new_tokens=128, decode_batches=(1, 16))
SMOKE = Sizes(width=32, curve_steps=4, big_batch=2, big_seq=32, big_steps=2, big_warmup=1, prompt=8, new_tokens=6,
              decode_batches=(1, 2),
              big_preset=dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
              extra={"repeats": 1})


# -- 1. parity ------------------------------------------------------------------------------------------------------


def family_cases(width: int) -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[torch.Generator], dict]]]:
    """Each family's tiny model (a builder) and batch (from a generator); dropout off, so both devices agree."""
    vocab, seq, heads = 128, 16, max(2, width // 32)
    small = dict(hidden_size=width, num_hidden_layers=2, num_attention_heads=heads)

    def tokens(g: torch.Generator, rows: int = 2) -> dict:
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    def masked(g: torch.Generator) -> dict:
        batch = tokens(g)
        batch["labels"][:, ::2] = -100
        return batch

    def seq2seq(g: torch.Generator) -> dict:
        return {"input_ids": torch.randint(2, vocab, (2, seq), generator=g),
                "labels": torch.randint(2, vocab, (2, seq // 2), generator=g)}

    def images(g: torch.Generator) -> dict:
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.randint(0, 10, (2,), generator=g)}

    gpt = dict(vocab_size=vocab, max_position_embeddings=64, embedding_dropout=0.0, attention_dropout=0.0,
               hidden_dropout=0.0, **small)
    return {
        "gpt2": (lambda: mf.AutoModelForCausalLM.from_config(mf.GPTConfig(flavour="gpt2", **gpt)), tokens),
        "llama": (lambda: mf.AutoModelForCausalLM.from_config(
            mf.GPTConfig(flavour="llama", num_key_value_heads=max(1, heads // 2), intermediate_size=2 * width, **gpt)),
            tokens),
        "gpt_moe": (lambda: mf.AutoModelForCausalLM.from_config(mf.GPTConfig(
            flavour="llama", intermediate_size=2 * width,
            moe_config=dict(expert_num=4, num_experts_chosen=2, routing_policy="dropless"), **gpt)), tokens),
        "bert": (lambda: mf.AutoModelForMaskedLM.from_config(mf.AutoConfig.from_pretrained(
            "bert_tiny", vocab_size=vocab, hidden_dropout=0.0, attention_dropout=0.0, **small)), masked),
        "t5": (lambda: mf.AutoModelForSeq2SeqLM.from_config(mf.AutoConfig.from_pretrained(
            "t5_tiny", vocab_size=vocab, head_dim=width // heads, intermediate_size=2 * width, dropout_rate=0.0,
            decoder_start_token_id=0, **small)), seq2seq),
        "vit": (lambda: mf.AutoModelForImageClassification.from_config(mf.AutoConfig.from_pretrained(
            "vit_tiny", image_size=16, patch_size=4, num_labels=10, intermediate_size=2 * width, hidden_dropout=0.0,
            attention_dropout=0.0, **small)), images),
    }


def forward_backward(model: torch.nn.Module, batch: dict, device: str, bf16: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, main output, gradients) of one forward + backward on ``device``, all returned on the CPU in fp32."""
    model = model.to(device)
    model.zero_grad(set_to_none=True)
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float().cpu(), out.logits.detach().float().cpu(), grads


def grad_error(grads: dict, reference: dict) -> float:
    """Relative norm error of all gradients together: ||g - g_ref|| / ||g_ref||."""
    diff = torch.sqrt(sum(((grads[n] - g) ** 2).sum() for n, g in reference.items()))
    return float(diff / torch.sqrt(sum((g**2).sum() for g in reference.values())).clamp(min=1e-30))


def check_parity(device: str, sizes: Sizes) -> list[Row]:
    rows = []
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name, (build, make_batch) in family_cases(sizes.width).items():
        torch.manual_seed(0)
        model = build().eval()  # eval: dropout and MoE jitter off on both devices
        batch = make_batch(torch.Generator().manual_seed(0))
        ref_loss, ref_out, ref_grads = forward_backward(model, batch, "cpu", bf16=False)
        loss, out, grads = forward_backward(model, batch, device, bf16=False)
        out_err = float((out - ref_out).abs().max() / (1 + ref_out.abs().max()))
        loss_err = float((loss - ref_loss).abs() / (1 + ref_loss.abs()))
        g_err = grad_error(grads, ref_grads)
        ok = max(out_err, loss_err) <= FP32_OUTPUT_TOL and g_err <= FP32_GRAD_TOL
        rows.append(Row("parity", f"{name} fp32 {device} vs cpu", f"out {out_err:.1e}, loss {loss_err:.1e}, "
                        f"grads {g_err:.1e}", f"<= {FP32_OUTPUT_TOL:g} / {FP32_GRAD_TOL:g}", ok))
        loss, out, grads = forward_backward(model, batch, device, bf16=True)
        loss_rel, g_err = float((loss - ref_loss).abs() / ref_loss.abs()), grad_error(grads, ref_grads)
        rows.append(Row("parity", f"{name} bf16 {device} vs cpu fp32", f"loss {loss_rel:.1e}, grads {g_err:.1e}",
                        f"<= {BF16_LOSS_TOL:g} / {BF16_GRAD_TOL:g}",
                        loss_rel <= BF16_LOSS_TOL and g_err <= BF16_GRAD_TOL))
        model.to("cpu")
    return rows


# -- 2. bf16 training tracks fp32 -----------------------------------------------------------------------------------


def progressions(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows ``a, a+d, a+2d, ...`` (mod ``vocab``) with a random start and step: learnable, so losses fall."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + step * torch.arange(seq)) % vocab
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def train_losses(model: torch.nn.Module, data: list, bf16: bool, steps: int, device: str) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, learning_rate=3e-3,
                                 warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, plot_loss_curve=False, bf16=bf16, use_cpu=device == "cpu", seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
        with quiet_stdout():
            trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def check_bf16_curve(device: str, sizes: Sizes) -> list[Row]:
    config = mf.GPTConfig(flavour="llama", vocab_size=256, hidden_size=sizes.width, num_hidden_layers=2,
                          num_attention_heads=max(2, sizes.width // 64), intermediate_size=2 * sizes.width,
                          max_position_embeddings=128)
    data = progressions(8 * sizes.curve_steps, 64, config.vocab_size)
    curves = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        curves[bf16] = train_losses(mf.AutoModelForCausalLM.from_config(config), data, bf16, sizes.curve_steps, device)
    gap = max(abs(b - a) / a for a, b in zip(curves[False], curves[True]))
    return [Row("bf16 training", f"{sizes.curve_steps} steps, loss {curves[False][0]:.3f} -> fp32 {curves[False][-1]:.3f}"
                f" / bf16 {curves[True][-1]:.3f}", f"largest gap {gap:.2%}", f"<= {BF16_CURVE_TOL:.0%}",
                gap <= BF16_CURVE_TOL)]


# -- 3. ~1B training: ours (bf16 + compile [+ FSDP2]) beside transformers' Trainer ------------------------------------


def big_checkpoint(folder: str, sizes: Sizes) -> str:
    """Save a seeded random transformers Llama of the ``llama_1b`` shape (or the smoke shape); returns the folder."""
    config = mf.AutoConfig.from_pretrained("llama_1b", **sizes.big_preset)
    hf_config = config_to_hf(config)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(folder)
    return folder


def _timed_args(out: str, sizes: Sizes, device: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=sizes.big_batch, max_steps=sizes.big_warmup + sizes.big_steps,
                learning_rate=1e-4, warmup_steps=0, logging_steps=1000, save_strategy="no", report_to="none",
                disable_tqdm=True, bf16=True, use_cpu=device == "cpu", seed=0, dataloader_num_workers=0)


class _Clock(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def _steady_seconds(clock: _Clock, sizes: Sizes) -> float:
    return (clock.ends[-1] - clock.ends[sizes.big_warmup - 1]) / sizes.big_steps


def train_ours(folder: str, sizes: Sizes, device: str, world: int, backend: str) -> float:
    """Steady seconds per step of our Trainer (bf16, compile; FSDP2 over ``world`` ranks when > 1). Runs in each
    launched worker (or in this process for one rank)."""
    data = progressions(sizes.big_batch * world * (sizes.big_warmup + sizes.big_steps), sizes.big_seq, 256, seed=1)
    parallel = mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=world, optimizer_shard=3) if world > 1 \
        else mf.ParallelConfig()
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(**_timed_args(out, sizes, device), plot_loss_curve=False, torch_compile=True,
                                 torch_compile_backend=backend, parallel_config=parallel)
        trainer = Trainer(model=mf.AutoModelForCausalLM.from_pretrained(folder), args=args, train_dataset=data,
                          data_collator=default_data_collator, callbacks=[clock])
        with quiet_stdout():
            trainer.train()
    return _steady_seconds(clock, sizes)


def train_transformers(folder: str, sizes: Sizes, device: str) -> float:
    data = progressions(sizes.big_batch * (sizes.big_warmup + sizes.big_steps), sizes.big_seq, 256, seed=1)
    clock = _Clock()
    with tempfile.TemporaryDirectory() as out:
        trainer = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(folder),
                                       args=transformers.TrainingArguments(**_timed_args(out, sizes, device)),
                                       train_dataset=data, data_collator=default_data_collator, callbacks=[clock])
        with quiet_stdout():
            trainer.train()
    return _steady_seconds(clock, sizes)


def check_big_training(folder: str, device: str, sizes: Sizes, world: int, backend: str) -> list[Row]:
    if world > 1:
        from mindformers_py.parallel.launch import launch

        ours = max(launch(train_ours, world, folder, sizes, device, world, backend).values())
    else:
        ours = train_ours(folder, sizes, device, 1, backend)
    theirs = train_transformers(folder, sizes, device)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).to(device)
    batch = default_data_collator(progressions(sizes.big_batch, sizes.big_seq, 256))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        flops = step_flops(model, {k: v.to(device) for k, v in batch.items()})
    del model
    tokens = sizes.big_batch * sizes.big_seq
    peaks = {"measured bf16 matmul peak": matmul_peak(torch.bfloat16, device)}
    if device.startswith("cuda"):
        from mindformers_py.planner.device_spec import DeviceSpec

        datasheet = DeviceSpec.detect("cuda").peak_flops
        if datasheet:
            peaks = {"datasheet bf16 peak": datasheet, **peaks}
    layout = f"FSDP2 (ZeRO-3) over {world} ranks" if world > 1 else "one GPU: FSDP2 needs >= 2 GPUs, not exercised"
    rows = [Row("1B training", f"ours: bf16 + compile ({backend}), {layout}", f"{tokens / ours:,.0f} tokens/s per rank"),
            Row("1B training", "transformers Trainer, bf16=True, one device", f"{tokens / theirs:,.0f} tokens/s",
                ""),
            Row("1B training", "ours / transformers (per device)", f"{theirs / ours:.2f}x")]
    for name, peak in peaks.items():
        rows.append(Row("1B training", f"MFU vs {name} ({peak / 1e12:.0f} TFLOP/s)",
                        f"ours {flops / ours / peak:.1%}, transformers {flops / theirs / peak:.1%}"))
    return rows


# -- 4. decode ------------------------------------------------------------------------------------------------------


def check_decode(folder: str, device: str, sizes: Sizes, backend: str) -> list[Row]:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    ours = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    static = dict(cache_implementation="static", compile_config=CompileConfig(backend=backend, dynamic=True))
    contenders = {"transformers generate": lambda **kw: hf.generate(**kw),
                  "ours": lambda **kw: ours.generate(**kw),
                  "ours, compiled step": lambda **kw: ours.generate(**kw, **static)}
    rows = []
    vocab = hf.config.vocab_size
    for batch in sizes.decode_batches:
        ids = torch.randint(1, vocab, (batch, sizes.prompt), generator=torch.Generator().manual_seed(batch)).to(device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=sizes.new_tokens,
                  do_sample=False, eos_token_id=None, pad_token_id=0)
        outputs, seconds = {}, {}
        for name, run in contenders.items():
            outputs[name] = run(**kw)  # warm-up (and compilation)
            times = []
            for _ in range(sizes.extra.get("repeats", 3)):
                start = _synced_now(device)
                run(**kw)
                times.append(_synced_now(device) - start)
            seconds[name] = min(times)
        reference = outputs["transformers generate"][:, sizes.prompt:]
        for name in contenders:
            agree = float((outputs[name][:, sizes.prompt:] == reference).float().mean())
            ratio = seconds["transformers generate"] / seconds[name]
            # fp32 decoding must give transformers' tokens exactly; bf16 kernels may legitimately differ
            rows.append(Row("decode", f"batch {batch}: {name}",
                            f"{batch * sizes.new_tokens / seconds[name]:,.0f} tokens/s ({ratio:.2f}x), "
                            f"{agree:.0%} of tokens equal to transformers'",
                            "100% (fp32)" if dtype == torch.float32 else "", agree == 1.0 if dtype == torch.float32 else None))
    return rows


def quiet_stdout() -> contextlib.AbstractContextManager:
    """The trainers' own log lines (printed without a progress bar) stay out of the report."""
    return contextlib.redirect_stdout(io.StringIO())


def _synced_now(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


# -- the run --------------------------------------------------------------------------------------------------------


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    width = max(len(r.check) for r in rows)
    header = f"{'section':14} {'check':{width}} {'result':58} {'bound':18} status"
    print(header)
    print("-" * len(header))
    for r in rows:
        status = "" if r.ok is None else ("ok" if r.ok else "FAILED")
        print(f"{r.section:14} {r.check:{width}} {r.value:58} {r.bound:18} {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (what the test suite runs)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="ranks for the FSDP2 training section (default: every visible GPU; 2 with --smoke)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("parity", "curve", "train", "decode"))
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if opts.smoke:
        device, sizes, backend = "cpu", SMOKE, "eager"
        world = opts.gpus or 2
    elif torch.cuda.is_available():
        device, sizes, backend = "cuda", FULL, "inductor"
        world = opts.gpus or torch.cuda.device_count()
    else:
        print("no CUDA GPU is visible: run with --smoke for the CPU check of this script")
        return 2
    rows: list[Row] = []
    started = time.perf_counter()
    if "parity" not in opts.skip:
        rows += check_parity(device, sizes)
    if "curve" not in opts.skip:
        rows += check_bf16_curve(device, sizes)
    with tempfile.TemporaryDirectory() as folder:
        if not {"train", "decode"} <= set(opts.skip):
            big_checkpoint(folder, sizes)
        if "train" not in opts.skip:
            rows += check_big_training(folder, device, sizes, world, backend)
        if "decode" not in opts.skip:
            rows += check_decode(folder, device, sizes, backend)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke sizes: the numbers mean nothing)"
    print_table(rows, f"gpu_check on {name}, torch {torch.__version__}, transformers {transformers.__version__}, "
                      f"{time.perf_counter() - started:.0f} s")
    failed = [r for r in rows if r.ok is False]
    print(f"{len(failed)} check(s) failed" if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
