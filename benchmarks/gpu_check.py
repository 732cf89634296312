"""The GPU check: correctness against the CPU, bf16 training, a ~1B model's training and decoding speed against
transformers, and the parallel layouts against one GPU, in sections that each print their rows as they are measured.

Sections (``--sections`` picks some; each has a time budget, ``--budget SECTION=SECONDS`` changes one):

* ``peak``: the datasheet's dense bf16 peak of the GPU and the bf16 peak measured on 8192² products
  (:func:`flops.matmul_peak`); on the CPU only the dtypes it computes natively are measured.
* ``parity``: every family (GPT-2 and Llama flavours, Llama on packed rows, GPT-MoE, BERT, T5, ViT; tiny shapes) forward and backward on
  the device against the CPU fp32 result on the same weights and batch. fp32 (TF32 off): loss and outputs within
  ``1e-4`` (absolute, plus ``1e-4`` relative), gradients within a relative norm error of ``1e-3``. bf16 autocast:
  loss within 2% relative, gradients within a relative norm error of 10%.
* ``curve``: a small Llama-flavour GPT trained by our Trainer on a learnable synthetic task in fp32 with two or
  more seeds and in bf16 with the first seed. The bf16 run's largest relative gap to the fp32 run of its seed must
  not exceed the largest gap between the fp32 runs of different seeds, measured in the same run: a bound with a
  measured basis (a fixed 3% failed on the first GPU run while the CPU's seed-to-seed spread reached 31%).
* ``train``: the ``llama_1b`` preset's shape (Llama 3.2 1B, random weights), batch 4 x 2048, one device:
  transformers' Trainer (``bf16=True``), ours in bf16 eager, ours with ``torch_compile=True`` (what
  ``torch_compile="auto"`` resolves to on CUDA) and ours eager with ``fused_loss=True``: seconds per step, tokens/s,
  MFU against the datasheet and the measured peak (FLOPs counted from the shape: :func:`flops.llama_step_flops`),
  first-step time, peak memory; then the bytes each side saves for backward per token on the device
  (``benchmarks/saved_activations.py``'s count), which says where the eager step's memory goes.
* ``layouts``: with two or more GPUs, FSDP2 (ZeRO-3), tensor parallel and pipeline stages over them against one
  GPU's losses (fp32, TF32 off), each with its peak memory per rank; with one GPU a row says they were not run.
* ``decode``: correctness first, in fp32 on a model trained for a few steps (random weights give near-flat logits,
  where rounding legitimately flips the argmax): every decoder of ours must give transformers' greedy tokens. Then
  speed on the 1B model in bf16 at batch 1 and 16: transformers' ``generate`` (eager; and its compiled static cache
  on CUDA), ours eager (the lean loop) and ours with the compiled step (on CUDA captured in a CUDA graph); the share
  of tokens equal to transformers' is only reported there.

Every row is printed (and flushed) when it is measured, with the peak device memory of its measurement, so a run
that is stopped still shows what it measured; the table is printed again at the end. A section that overruns its
budget is stopped (its remaining rows say so) and the next one starts; one that crashes leaves a FAILED row with the
error and the run goes on. The default budgets hold the whole default run on one H100 within 8 minutes,
compilation included (``BUDGETS``).

``--smoke`` runs the same code on the CPU with tiny sizes (two gloo processes for the layouts, dynamo's ``eager``
backend instead of inductor), so the script cannot rot before a GPU arrives; it finishes within a minute or two on
2 cores, with or without native bf16 (a peak is measured only in a dtype the CPU computes natively). Its numbers
mean nothing.

    python benchmarks/gpu_check.py                               # on a CUDA machine
    python benchmarks/gpu_check.py --sections train decode       # some sections
    python benchmarks/gpu_check.py --smoke                       # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import io
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, TextIO

import torch
import transformers
from transformers import CompileConfig, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
from flops import llama_step_flops, matmul_peak, peak_is_meaningful  # noqa: E402

import mindformers_py as mf  # noqa: E402
from mindformers_py.models.gpt.convert_gpt import config_to_hf  # noqa: E402
from mindformers_py.trainer import Trainer, TrainingArguments  # noqa: E402

FP32_OUTPUT_TOL = 1e-4
FP32_GRAD_TOL = 1e-3
BF16_LOSS_TOL = 2e-2
BF16_GRAD_TOL = 1e-1
LAYOUT_LOSS_RTOL = 1e-3  # fp32 with TF32 off: only the order of the reductions differs

SECTIONS = ("peak", "parity", "curve", "train", "layouts", "decode")
# Seconds per section. On one H100 (layouts not run) they add up to 7.6 minutes; the checkpoint of the 1B model,
# made once, is paid in the first section that needs it. Decoding's compilations (ours ~40 s per batch size,
# transformers' ~95 s on the first H100 run) may not all fit: `--sections decode --budget decode=480` measures
# every decode row in a second run.
BUDGETS = {"peak": 15, "parity": 30, "curve": 40, "train": 130, "layouts": 150, "decode": 240}
# The smoke's sections take 1-20 s each on a busy 2-core CPU; their budgets add up to the 3 minutes it must hold.
SMOKE_BUDGETS = {"peak": 5, "parity": 25, "curve": 20, "train": 40, "layouts": 45, "decode": 45}


# -- rows, sections and their budgets ---------------------------------------------------------------------------


@dataclass
class Row:
    """One measured line of the report."""

    section: str
    check: str
    value: str
    bound: str = ""
    ok: bool | None = None  # None: a measurement without a pass/fail bound
    memory: int | None = None  # peak device bytes of the measurement (None on the CPU)

    def line(self) -> str:
        status = "" if self.ok is None else ("ok" if self.ok else "FAILED")
        memory = "-" if self.memory is None else f"{self.memory / 2**30:.1f} GiB"
        return f"{self.section:8} {self.check:52} {self.value:70} {memory:>9} {self.bound:24} {status}"


HEADER = f"{'section':8} {'check':52} {'result':70} {'peak mem':>9} {'bound':24} status"


class Report:
    """The rows so far; each is printed and flushed as it is added."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out
        self.rows: list[Row] = []

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stdout, flush=True)

    def start(self, title: str) -> None:
        self._print(title)
        self._print(HEADER)
        self._print("-" * len(HEADER))

    def note(self, text: str) -> None:
        """A line that is not a row (a section's time)."""
        self._print(text)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self._print(row.line())

    def summary(self, title: str) -> int:
        """Print the whole table again with a verdict; the exit status (1 when a check failed)."""
        self._print(f"\n{title}\n{HEADER}\n{'-' * len(HEADER)}")
        for row in self.rows:
            self._print(row.line())
        failed = [r for r in self.rows if r.ok is False]
        unmeasured = [r for r in self.rows if r.check.startswith(STOPPED)]
        verdict = f"{len(failed)} check(s) failed" if failed else "every check passed"
        if unmeasured:
            verdict += f"; {len(unmeasured)} section(s) stopped at their budget"
        self._print(verdict)
        return 1 if failed else 0


STOPPED = "(stopped)"
CRASHED = "(crashed)"


class BudgetSpent(BaseException):
    """Raised in the main thread when a section's budget runs out (a BaseException, so that the ``except
    Exception`` of the code it interrupts does not swallow it)."""


@contextlib.contextmanager
def hard_deadline(seconds: float):
    """Raise :class:`BudgetSpent` in the main thread after ``seconds`` (SIGALRM; no-op off the main thread or
    where the signal does not exist). Interrupts Python code, including a compilation, between bytecodes.

    An alarm already set (pytest-timeout's, in the test suite) is kept: if it is due first its handler runs, and it
    is set again, for the time it had left, when the block ends."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return
    now = time.monotonic()
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_at = now + outer_left if outer_left > 0 else None
    previous = signal.getsignal(signal.SIGALRM)
    outer_fired = []

    def on_alarm(signum, frame):
        if outer_at is not None and time.monotonic() >= outer_at - 1e-3 and callable(previous):
            outer_fired.append(True)
            previous(signum, frame)  # the outer alarm was due first
            return
        raise BudgetSpent()

    signal.signal(signal.SIGALRM, on_alarm)
    due = now + seconds if outer_at is None else min(now + seconds, outer_at)
    signal.setitimer(signal.ITIMER_REAL, max(due - now, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_at is not None and not outer_fired:
            signal.setitimer(signal.ITIMER_REAL, max(outer_at - time.monotonic(), 1e-3), outer_interval)


class Section:
    """A section's rows and clock: rows it adds are printed at once; :meth:`spent` tells a loop to stop starting
    new measurements, and the hard deadline (:func:`run_section`) stops one that overruns."""

    def __init__(self, name: str, budget_s: float, report: Report) -> None:
        self.name, self.budget_s, self.report = name, budget_s, report
        self.started = time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def spent(self) -> bool:
        return self.left() <= 0

    def row(self, check: str, value: str, bound: str = "", ok: bool | None = None, memory: int | None = None) -> Row:
        row = Row(self.name, check, value, bound, ok, memory)
        self.report.add(row)
        return row

    def out_of_time(self, what: str) -> bool:
        """True (after a row saying so) when the budget is spent before ``what`` could start."""
        if not self.spent():
            return False
        self.row(STOPPED, f"{what} and what follows not measured: the budget of {self.budget_s:.0f} s is spent")
        return True


def run_section(name: str, body: Callable[[Section], None], budget_s: float, report: Report) -> None:
    """Run one section under its budget: an overrun or a crash becomes a row, and the run goes on."""
    section = Section(name, budget_s, report)
    try:
        with hard_deadline(budget_s + 1.0):  # the cooperative checks come first; this stops a measurement that hangs
            body(section)
    except BudgetSpent:
        section.row(STOPPED, f"stopped during a measurement: the budget of {budget_s:.0f} s is spent")
    except Exception as exc:  # noqa: BLE001 - a crash is reported as a row and the next section runs
        traceback.print_exc(file=sys.stderr)
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        section.row(CRASHED, f"{type(exc).__name__}: {first}", ok=False)
    finally:
        release_memory()
        report.note(f"  [{name}: {time.perf_counter() - section.started:.0f} s of its {budget_s:.0f} s]")


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def peak_memory(device: str):
    """Yields a one-element list that holds, after the block, the peak CUDA memory allocated in it (None on CPU)."""
    holder: list[int | None] = [None]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    yield holder
    if cuda:
        torch.cuda.synchronize()
        holder[0] = torch.cuda.max_memory_allocated()


# -- sizes and the shared state of a run --------------------------------------------------------------------------


@dataclass
class Sizes:
    """The sizes of a run (full on a GPU, tiny with ``--smoke``)."""

    width: int
    curve_steps: int
    curve_seeds: tuple[int, ...]
    big_preset: dict[str, Any]
    big_batch: int
    big_seq: int
    big_steps: int
    big_warmup: int
    prompt: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    repeats: int
    layout_model: dict[str, Any]
    layout_steps: int
    layout_seq: int
    correct_steps: int
    peak_sizes: tuple[int, ...] | None = None  # None: flops.matmul_peak's default for the device
    peak_budget_s: float = 3.0
    extra: dict[str, Any] = field(default_factory=dict)


FULL = Sizes(width=256, curve_steps=60, curve_seeds=(0, 1, 2), big_preset={}, big_batch=4, big_seq=2048,
             big_steps=10, big_warmup=3, prompt=128, new_tokens=128, decode_batches=(1, 16), repeats=2,
             layout_model=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1024),
             layout_steps=10, layout_seq=256, correct_steps=150)
SMOKE = Sizes(width=32, curve_steps=4, curve_seeds=(0, 1), big_batch=2, big_seq=32, big_steps=2, big_warmup=1,
              prompt=8, new_tokens=6, decode_batches=(1, 2), repeats=1,
              big_preset=dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
              layout_model=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
              layout_steps=3, layout_seq=16, correct_steps=8, peak_sizes=(128, 256), peak_budget_s=0.5)


@dataclass
class Context:
    """What the sections share: the device, sizes, compile backend, ranks for the layouts, the peaks measured
    and the ~1B checkpoint (made once, by the first section that needs it)."""

    device: str
    sizes: Sizes
    backend: str
    world: int
    workdir: str
    peaks: dict[str, float] = field(default_factory=dict)
    _big: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def big_checkpoint(self) -> str:
        """A seeded random transformers Llama of the ``llama_1b`` shape (or the smoke shape), saved in fp32."""
        if self._big is None:
            folder = str(Path(self.workdir) / "llama_1b")
            hf_config = config_to_hf(mf.AutoConfig.from_pretrained("llama_1b", **self.sizes.big_preset))
            torch.manual_seed(0)
            with torch.device(self.device):  # random init of 1.2B weights is seconds on a GPU, a minute on a CPU
                model = transformers.LlamaForCausalLM(hf_config)
            model.save_pretrained(folder)
            del model
            release_memory()
            self._big = folder
        return self._big


def quiet_stdout() -> contextlib.AbstractContextManager:
    """The trainers' own log lines (printed without a progress bar) stay out of the report."""
    return contextlib.redirect_stdout(io.StringIO())


def synced_now(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


# -- peak ---------------------------------------------------------------------------------------------------------


def measured_peak(ctx: Context, dtype: torch.dtype) -> float | None:
    """The ``dtype`` matmul peak of the device (measured once), or None where the device only emulates ``dtype``."""
    key = f"measured {str(dtype).removeprefix('torch.')}"
    if key not in ctx.peaks:
        if not peak_is_meaningful(dtype, ctx.device):
            return None
        ctx.peaks[key] = matmul_peak(dtype, ctx.device, ctx.sizes.peak_sizes, ctx.sizes.peak_budget_s)
    return ctx.peaks[key]


def datasheet_peak(ctx: Context) -> float | None:
    if not ctx.cuda:
        return None
    if "datasheet" not in ctx.peaks:
        from mindformers_py.planner.device_spec import DeviceSpec

        ctx.peaks["datasheet"] = DeviceSpec.detect("cuda").peak_flops or 0.0
    return ctx.peaks["datasheet"] or None


def check_peak(ctx: Context, sec: Section) -> None:
    if ctx.cuda:
        sheet = datasheet_peak(ctx)
        sec.row("datasheet dense bf16 peak", f"{sheet / 1e12:.0f} TFLOP/s" if sheet else "not in the device catalog")
    dtypes = (torch.bfloat16,) if ctx.cuda else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        shape = "8192²" if ctx.cuda else "x".join(str(n) for n in ctx.sizes.peak_sizes or ()) + " squares"
        if not peak_is_meaningful(dtype, ctx.device):
            sec.row(f"measured {name} matmul peak", f"not measured: {ctx.device} only emulates {name} (no native "
                    "bf16 products: no peak worth a share)")
            continue
        with peak_memory(ctx.device) as mem:
            peak = measured_peak(ctx, dtype)
        sec.row(f"measured {name} matmul peak ({shape})", f"{peak / 1e12:.3g} TFLOP/s", memory=mem[0])


# -- parity -------------------------------------------------------------------------------------------------------


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

    def packed(g: torch.Generator) -> dict:  # two documents a row: the block-sparse document path (FlexAttention on CUDA)
        batch = tokens(g)
        batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(seq - 5)]).expand(2, -1).clone()
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
        "llama_packed": (lambda: mf.AutoModelForCausalLM.from_config(
            mf.GPTConfig(flavour="llama", num_key_value_heads=max(1, heads // 2), intermediate_size=2 * width, **gpt)),
            packed),
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


def check_parity(ctx: Context, sec: Section) -> None:
    device = ctx.device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name, (build, make_batch) in family_cases(ctx.sizes.width).items():
        if sec.out_of_time(f"{name} parity"):
            return
        torch.manual_seed(0)
        model = build().eval()  # eval: dropout and MoE jitter off on both devices
        batch = make_batch(torch.Generator().manual_seed(0))
        ref_loss, ref_out, ref_grads = forward_backward(model, batch, "cpu", bf16=False)
        with peak_memory(device) as mem:
            loss, out, grads = forward_backward(model, batch, device, bf16=False)
        out_err = float((out - ref_out).abs().max() / (1 + ref_out.abs().max()))
        loss_err = float((loss - ref_loss).abs() / (1 + ref_loss.abs()))
        g_err = grad_error(grads, ref_grads)
        sec.row(f"{name} fp32 {device} vs cpu", f"out {out_err:.1e}, loss {loss_err:.1e}, grads {g_err:.1e}",
                f"<= {FP32_OUTPUT_TOL:g} / {FP32_GRAD_TOL:g}",
                max(out_err, loss_err) <= FP32_OUTPUT_TOL and g_err <= FP32_GRAD_TOL, mem[0])
        with peak_memory(device) as mem:
            loss, out, grads = forward_backward(model, batch, device, bf16=True)
        loss_rel, g_err = float((loss - ref_loss).abs() / ref_loss.abs()), grad_error(grads, ref_grads)
        sec.row(f"{name} bf16 {device} vs cpu fp32", f"loss {loss_rel:.1e}, grads {g_err:.1e}",
                f"<= {BF16_LOSS_TOL:g} / {BF16_GRAD_TOL:g}", loss_rel <= BF16_LOSS_TOL and g_err <= BF16_GRAD_TOL,
                mem[0])
        model.to("cpu")


# -- curve: bf16 training against fp32's own seed-to-seed spread --------------------------------------------------


def progressions(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows ``a, a+d, a+2d, ...`` (mod ``vocab``) with a random start and step: learnable, so losses fall."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + step * torch.arange(seq)) % vocab
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def small_llama(width: int, vocab: int = 256, layers: int = 2, positions: int = 128) -> mf.GPTConfig:
    return mf.GPTConfig(flavour="llama", vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                        num_attention_heads=max(2, width // 64), num_key_value_heads=max(1, width // 128),
                        intermediate_size=2 * width, max_position_embeddings=positions)


def train_small(config: mf.GPTConfig, data: list, bf16: bool, steps: int, device: str, seed: int = 0,
                save_to: str | None = None) -> list[float]:
    """Our Trainer's logged losses of ``steps`` steps from a model initialised with ``seed`` (AdamW, lr 3e-3,
    batch 8); the model is saved to ``save_to`` when given."""
    torch.manual_seed(seed)
    model = mf.AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, learning_rate=3e-3,
                                 warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, plot_loss_curve=False, bf16=bf16, use_cpu=device == "cpu",
                                 seed=seed, torch_compile=False)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
        with quiet_stdout():
            trainer.train()
    if save_to is not None:
        model.save_pretrained(save_to)
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def largest_gap(curve: list[float], reference: list[float]) -> float:
    """Largest relative difference between two loss curves, step by step."""
    return max(abs(b - a) / abs(a) for a, b in zip(reference, curve))


def check_bf16_curve(ctx: Context, sec: Section) -> None:
    sizes = ctx.sizes
    config = small_llama(sizes.width)
    data = progressions(8 * sizes.curve_steps, 64, config.vocab_size)
    first = sizes.curve_seeds[0]
    runs: dict[tuple[int, bool], list[float]] = {}
    # bf16 right after its fp32 twin, so a cut run still compares them; the other seeds give the spread
    for seed, bf16 in [(first, False), (first, True), *((s, False) for s in sizes.curve_seeds[1:])]:
        label = f"{'bf16' if bf16 else 'fp32'} seed {seed}"
        if sec.out_of_time(f"the {label} curve"):
            break
        with peak_memory(ctx.device) as mem:
            runs[seed, bf16] = curve = train_small(config, data, bf16, sizes.curve_steps, ctx.device, seed)
        sec.row(f"{label}: {sizes.curve_steps} steps", f"loss {curve[0]:.3f} -> {curve[-1]:.3f}", memory=mem[0])
    others = [runs[s, False] for s in sizes.curve_seeds[1:] if (s, False) in runs]
    if (first, True) not in runs or not others:
        return
    spread = max(largest_gap(curve, runs[first, False]) for curve in others)
    gap = largest_gap(runs[first, True], runs[first, False])
    sec.row("bf16 vs fp32 of the same seed: largest gap", f"{gap:.2%} (fp32 seed-to-seed: {spread:.2%})",
            f"<= fp32 seed spread", gap <= spread)


# -- train: the ~1B step ------------------------------------------------------------------------------------------


class StepClock(transformers.TrainerCallback):
    """The wall time at the end of every step (after the device finished it)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def timed_args(out: str, sizes: Sizes, device: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=sizes.big_batch, max_steps=sizes.big_warmup + sizes.big_steps,
                learning_rate=1e-4, warmup_steps=0, logging_steps=1000, save_strategy="no", report_to="none",
                disable_tqdm=True, bf16=True, use_cpu=device == "cpu", seed=0, dataloader_num_workers=0)


def train_timed(folder: str, sizes: Sizes, device: str, ours: bool, compile_backend: str | None,
                fused_loss: bool = False) -> tuple[float, float]:
    """(steady seconds per step, seconds from the Trainer's creation to the end of its first step) of one side:
    ours (compiled with ``compile_backend``, eager when None; with the fused linear cross-entropy when
    ``fused_loss``) or transformers' Trainer."""
    data = progressions(sizes.big_batch * (sizes.big_warmup + sizes.big_steps), sizes.big_seq, 256, seed=1)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        if ours:
            model = mf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            start = time.perf_counter()
            compile_args = dict(torch_compile=True, torch_compile_backend=compile_backend) if compile_backend \
                else dict(torch_compile=False)
            args = TrainingArguments(**timed_args(out, sizes, device), plot_loss_curve=False, fused_loss=fused_loss,
                                     **compile_args)
            trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                              callbacks=[clock])
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            start = time.perf_counter()
            trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**timed_args(out, sizes, device)),
                                           train_dataset=data, data_collator=default_data_collator, callbacks=[clock])
        with quiet_stdout():
            trainer.train()
    del trainer, model
    steady = (clock.ends[-1] - clock.ends[sizes.big_warmup - 1]) / sizes.big_steps
    return steady, clock.ends[0] - start


def check_big_training(ctx: Context, sec: Section) -> None:
    sizes, device = ctx.sizes, ctx.device
    folder = ctx.big_checkpoint()
    config = transformers.AutoConfig.from_pretrained(folder)
    flops = llama_step_flops(config, sizes.big_batch, sizes.big_seq)
    tokens = sizes.big_batch * sizes.big_seq
    sec.row("FLOPs per step (6NT + 12LHDST, from the shape)", f"{flops / 1e12:.4g} TFLOP, {tokens} tokens")
    auto = TrainingArguments(output_dir=ctx.workdir, use_cpu=not ctx.cuda).torch_compile
    sec.row("torch_compile='auto' (the default) resolves to", "on (each layer compiled)" if auto else "off (eager)")
    peaks = {"datasheet": datasheet_peak(ctx), "measured": measured_peak(ctx, torch.bfloat16)}

    def mfu(seconds: float) -> str:
        shares = [f"{flops / seconds / peak:.1%} of {name}" for name, peak in peaks.items() if peak]
        return ", MFU " + " / ".join(shares) if shares else ", MFU not given (no native bf16 peak)"

    runs = [("transformers Trainer, bf16=True", False, None, False), ("ours, bf16, eager", True, None, False),
            (f"ours, bf16, torch_compile=True ({ctx.backend})", True, ctx.backend, False),
            ("ours, bf16, eager, fused_loss=True", True, None, True)]
    reference = None
    for name, ours, backend, fused in runs:
        if sec.out_of_time(name):
            return
        with peak_memory(device) as mem:
            seconds, first = train_timed(folder, sizes, device, ours, backend, fused)
        release_memory()
        ratio = "" if reference is None else f" ({reference / seconds:.2f}x transformers)"
        reference = seconds if reference is None else reference
        sec.row(name, f"{seconds:.4f} s/step, {tokens / seconds:,.0f} tok/s{ratio}{mfu(seconds)}, "
                f"1st step {first:.1f} s", memory=mem[0])
    if not sec.out_of_time("saved-for-backward bytes"):
        check_saved_bytes(ctx, sec, folder)


def check_saved_bytes(ctx: Context, sec: Section, folder: str) -> None:
    """Bytes saved for backward per token in one bf16 forward of one row (benchmarks/saved_activations.py), ours
    against transformers' on the device: where the eager step's memory goes, with the device's attention kernels."""
    from saved_activations import ATTENTION_CORE, WEIGHT_COPIES, measure

    # one token short of the step's length: a token count equal to a weight's size would confuse the count's
    # telling of activations from autocast's weight copies
    ids = torch.stack([r["input_ids"] for r in progressions(1, ctx.sizes.big_seq - 1, 256, seed=1)]).to(ctx.device)
    batch = {"input_ids": ids, "labels": ids}
    saved = {}
    for side, auto in (("ours", mf.AutoModelForCausalLM), ("transformers", transformers.AutoModelForCausalLM)):
        model = auto.from_pretrained(folder, dtype=torch.float32).to(ctx.device)
        saved[side] = measure(model, batch, bf16=True, device=ctx.device)
        del model
        release_memory()
    per_token = {side: {k: v / ids.numel() for k, v in roles.items() if k != WEIGHT_COPIES}
                 for side, roles in saved.items()}
    totals = {side: sum(roles.values()) for side, roles in per_token.items()}
    cores = {side: roles.get(ATTENTION_CORE, 0) for side, roles in per_token.items()}
    sec.row("saved for backward per token (bf16, 1 row)",
            f"ours {totals['ours']:,.0f} B, transformers {totals['transformers']:,.0f} B "
            f"({totals['ours'] / totals['transformers']:.3f}x; attention core {cores['ours']:,.0f} / "
            f"{cores['transformers']:,.0f} B)")


# -- layouts: FSDP2, TP, PP against one device --------------------------------------------------------------------


def layout_configs(world: int) -> dict[str, mf.ParallelConfig]:
    semi = dict(parallel_mode="semi_auto_parallel")
    return {
        f"FSDP2 (ZeRO-3) over {world}": mf.ParallelConfig(parallel_mode="data_parallel", data_parallel=world,
                                                          optimizer_shard=3),
        f"tensor parallel over {world}": mf.ParallelConfig(**semi, model_parallel=world),
        f"pipeline over {world} stages": mf.ParallelConfig(**semi, pipeline_stage=world, micro_batch_num=world),
    }


def layout_losses(sizes: Sizes, device: str, parallel: mf.ParallelConfig, world: int) -> tuple[list[float], int | None]:
    """Per-step fp32 losses of our Trainer under ``parallel`` (global batch 2 x ``world`` rows, the same rows under
    every layout and on one device) and this rank's peak CUDA memory."""
    torch.backends.cuda.matmul.allow_tf32 = False
    heads = sizes.layout_model["num_attention_heads"]
    kv_heads = heads // 2 if (heads // 2) % world == 0 else heads  # grouped where tensor parallel can split them
    config = mf.GPTConfig(flavour="llama", vocab_size=512, max_position_embeddings=sizes.layout_seq,
                          num_key_value_heads=kv_heads, **sizes.layout_model)
    rows = 2 * world
    data = progressions(rows * sizes.layout_steps, sizes.layout_seq, config.vocab_size, seed=2)
    torch.manual_seed(0)
    model = mf.AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as out, peak_memory(device) as mem:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=rows // parallel.dp,
                                 max_steps=sizes.layout_steps, learning_rate=1e-3, warmup_steps=0, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, plot_loss_curve=False,
                                 bf16=False, torch_compile=False, use_cpu=device == "cpu", seed=0,
                                 parallel_config=parallel)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
        with quiet_stdout():
            trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], mem[0]


def layouts_worker(sizes: Sizes, device: str, world: int, deadline: float) -> dict[str, Any]:
    """Each layout in turn in one launched job (one process group for all), until ``deadline`` (``time.time()``)."""
    from mindformers_py.parallel.mesh import init_distributed

    init_distributed()  # joined here, so each Trainer's engine finds it and leaves it for the next layout
    if device.startswith("cuda"):
        import os

        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    results: dict[str, Any] = {}
    for name, parallel in layout_configs(world).items():
        if time.time() > deadline:
            results[name] = None
            continue
        try:
            results[name] = layout_losses(sizes, device, parallel, world)
        except Exception as exc:  # noqa: BLE001 - reported in the layout's row
            results[name] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:140]}"
        release_memory()
    return results


def check_layouts(ctx: Context, sec: Section) -> None:
    if ctx.world < 2:
        sec.row("FSDP2 / tensor parallel / pipeline", f"not run: they need >= 2 GPUs ({ctx.world} visible)")
        return
    with peak_memory(ctx.device) as mem:
        reference, _ = layout_losses(ctx.sizes, ctx.device, mf.ParallelConfig(), ctx.world)
    sec.row(f"one {'GPU' if ctx.cuda else 'process'}: {len(reference)} fp32 steps",
            f"loss {reference[0]:.4f} -> {reference[-1]:.4f}", memory=mem[0])
    release_memory()
    from mindformers_py.launcher.launch import launch_from_python

    deadline = time.time() + sec.left() - 5.0
    # Workers fork from a server that imported torch, transformers and the package once (spawned ones would each
    # import them: ~10 s apiece on a busy 2-core machine).
    # Workers unpickle the function and the sizes by module name: this file's, also when it runs as a script.
    module = importlib.import_module("gpu_check") if __name__ == "__main__" else sys.modules[__name__]
    sizes = module.Sizes(**dataclasses.asdict(ctx.sizes))
    results = launch_from_python(module.layouts_worker, ctx.world, sizes, ctx.device, ctx.world, deadline)
    for name in layout_configs(ctx.world):
        outcomes = [results[rank][name] for rank in sorted(results)]
        if any(o is None for o in outcomes):
            sec.row(STOPPED, f"{name}: not run, the budget of {sec.budget_s:.0f} s was spent")
            continue
        errors = [o for o in outcomes if isinstance(o, str)]
        if errors:
            sec.row(name, errors[0], ok=False)
            continue
        losses = outcomes[0][0]
        gap = largest_gap(losses, reference) if len(losses) == len(reference) else float("inf")
        memory = max((o[1] for o in outcomes if o[1] is not None), default=None)
        sec.row(f"{name}: losses vs one {'GPU' if ctx.cuda else 'process'}", f"largest relative gap {gap:.1e}",
                f"<= {LAYOUT_LOSS_RTOL:g}", gap <= LAYOUT_LOSS_RTOL, memory)


# -- decode -------------------------------------------------------------------------------------------------------


@dataclass
class Decoder:
    """One way of decoding: its name, the model (``hf`` or ``ours``) and the generate keyword arguments."""

    name: str
    side: str
    options: dict[str, Any]
    graphs: bool = True  # ours: capture the compiled step in a CUDA graph where it can (model.cuda_graph_decode)


def decoders(ctx: Context, correctness: bool) -> list[Decoder]:
    """The decoders compared, cheapest first; the CUDA-only ones only on CUDA."""
    ours_static = dict(cache_implementation="static",
                       compile_config=CompileConfig(backend=ctx.backend, mode="default", dynamic=None))
    out = [Decoder("transformers generate", "hf", {}), Decoder("ours, eager lean loop", "ours", {})]
    if ctx.cuda:  # (the compiled step without a graph, the CPU's, is left out: each compilation costs ~40 s at 1B)
        out.append(Decoder("ours, compiled step in a CUDA graph", "ours", ours_static))
        if not correctness:  # transformers compiles its static cache itself on CUDA (its default: CUDA graphs)
            out.append(Decoder("transformers, static cache (compiled)", "hf", dict(cache_implementation="static")))
    else:
        out.append(Decoder("ours, compiled step", "ours", ours_static))
    return out


def generate(models: dict[str, torch.nn.Module], decoder: Decoder, **kw) -> torch.Tensor:
    model = models[decoder.side]
    if decoder.side == "ours":
        model.cuda_graph_decode = decoder.graphs
    return model.generate(**kw, **decoder.options)


def load_pair(folder: str, dtype: torch.dtype, device: str) -> dict[str, torch.nn.Module]:
    return {"hf": transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval(),
            "ours": mf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()}


def check_decode_correctness(ctx: Context, sec: Section) -> None:
    """fp32 greedy tokens of every decoder equal transformers' on a model trained to continue progressions (a
    left-padded row included)."""
    sizes, device = ctx.sizes, ctx.device
    config = small_llama(max(64, sizes.width), positions=128)
    folder = str(Path(ctx.workdir) / "trained_small")
    data = progressions(8 * sizes.correct_steps, 64, config.vocab_size, seed=3)
    curve = train_small(config, data, False, sizes.correct_steps, device, save_to=folder)
    sec.row(f"fp32 model trained {sizes.correct_steps} steps to decode", f"loss {curve[0]:.3f} -> {curve[-1]:.3f}")
    torch.backends.cuda.matmul.allow_tf32 = False
    models = load_pair(folder, torch.float32, device)
    prompt, new = 16, 16
    rows = progressions(4, prompt + new, config.vocab_size, seed=4)
    ids = torch.stack([r["input_ids"][:prompt] for r in rows]).to(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # one left-padded row
    ids[0, :5] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    reference = None
    for decoder in decoders(ctx, correctness=True):
        if sec.out_of_time(f"fp32 {decoder.name}"):
            return
        tokens = generate(models, decoder, **kw)[:, prompt:].cpu()
        if reference is None:
            reference = tokens
            truth = torch.stack([r["input_ids"][prompt:] for r in rows])
            sec.row(f"fp32 {decoder.name}: tokens continuing the progression",
                    f"{float((tokens[1:] == truth[1:]).float().mean()):.0%} (the unpadded rows; reported only)")
            continue
        agree = float((tokens == reference).float().mean())
        sec.row(f"fp32 {decoder.name}: greedy tokens = transformers'", f"{agree:.0%}", "100%", agree == 1.0)
    del models
    release_memory()


def check_decode(ctx: Context, sec: Section) -> None:
    check_decode_correctness(ctx, sec)
    sizes, device = ctx.sizes, ctx.device
    folder = ctx.big_checkpoint()
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    if sec.out_of_time("the decode speed rows"):
        return
    models = load_pair(folder, dtype, device)
    vocab = models["hf"].config.vocab_size
    name = str(dtype).removeprefix("torch.")
    for batch in sizes.decode_batches:
        ids = torch.randint(1, vocab, (batch, sizes.prompt), generator=torch.Generator().manual_seed(batch)).to(device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=sizes.new_tokens,
                  do_sample=False, eos_token_id=None, pad_token_id=0)
        speeds: dict[str, float] = {}
        reference = None
        for decoder in decoders(ctx, correctness=False):
            if sec.out_of_time(f"batch {batch}: {decoder.name}"):
                return
            with peak_memory(device) as mem:
                start = synced_now(device)
                tokens = generate(models, decoder, **kw)[:, sizes.prompt:]  # the first call compiles, if it does
                first = synced_now(device) - start
                times = []
                for _ in range(sizes.repeats):
                    start = synced_now(device)
                    generate(models, decoder, **kw)
                    times.append(synced_now(device) - start)
            speeds[decoder.name] = batch * sizes.new_tokens / min(times)
            reference = tokens if reference is None else reference
            agree = float((tokens == reference).float().mean())
            ratio = speeds[decoder.name] / speeds["transformers generate"]
            sec.row(f"{name} batch {batch}: {decoder.name}",
                    f"{speeds[decoder.name]:,.0f} tok/s ({1000 * min(times) / sizes.new_tokens:.1f} ms/step, "
                    f"{ratio:.2f}x), 1st call {first:.1f} s, {agree:.0%} tokens = transformers'", memory=mem[0])
        compiled = "transformers, static cache (compiled)"
        graphed = "ours, compiled step in a CUDA graph"
        if compiled in speeds and graphed in speeds:
            ratio = speeds[graphed] / speeds[compiled]
            sec.row(f"batch {batch}: ours graphed / transformers compiled", f"{ratio:.2f}x", ">= 1.00x", ratio >= 1.0)


# -- the run ------------------------------------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Context, Section], None]] = {
    "peak": check_peak, "parity": check_parity, "curve": check_bf16_curve, "train": check_big_training,
    "layouts": check_layouts, "decode": check_decode,
}


def parse_budgets(items: list[str]) -> dict[str, float]:
    budgets = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds:
            raise SystemExit(f"--budget {item!r}: expected SECTION=SECONDS with SECTION one of {', '.join(SECTIONS)}")
        budgets[name] = float(seconds)
    return budgets


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (what the test suite runs)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections not to run")
    parser.add_argument("--budget", nargs="*", default=[], metavar="SECTION=SECONDS", help="change section budgets")
    parser.add_argument("--gpus", type=int, default=None,
                        help="ranks for the layouts section (default: every visible GPU; 2 with --smoke)")
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if opts.smoke:
        device, sizes, backend, budgets = "cpu", SMOKE, "eager", dict(SMOKE_BUDGETS)
        world = opts.gpus or 2
    elif torch.cuda.is_available():
        device, sizes, backend, budgets = "cuda", FULL, "inductor", dict(BUDGETS)
        world = opts.gpus or torch.cuda.device_count()
    else:
        print("no CUDA GPU is visible: run with --smoke for the CPU check of this script")
        return 2
    budgets.update(parse_budgets(opts.budget))
    chosen = [s for s in SECTIONS if s in opts.sections and s not in opts.skip]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke sizes: the numbers mean nothing)"
    title = (f"gpu_check on {name}, torch {torch.__version__}, transformers {transformers.__version__}; sections "
             + ", ".join(f"{s} ({budgets[s]:.0f} s)" for s in chosen))
    report = Report(out)
    report.start(title)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    if opts.smoke:  # tiny products gain nothing from threads, and on a busy machine OpenMP's waits cost 10-50x
        torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
            ctx = Context(device, replace(sizes), backend, world, workdir)
            for section in chosen:
                run_section(section, lambda sec, check=CHECKS[section]: check(ctx, sec), budgets[section], report)
    finally:
        torch.set_num_threads(threads)
    return report.summary(f"{title}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
