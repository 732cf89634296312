"""``benchmarks/gpu_check.py``: the smoke runs every section end to end on the CPU at tiny sizes (so the script works
the day a GPU arrives) and passes its checks; rows stream as they are measured; a section that overruns its budget or
crashes leaves a row and the run goes on; a peak is measured only in a dtype the CPU computes natively."""

import io
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check as module

    yield module
    sys.modules.pop("gpu_check", None)


def rows_of(report: str, section: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith(f"{section:8} ")]


def test_smoke_passes_every_check_and_streams_its_rows(gpu_check):
    out = io.StringIO()
    assert gpu_check.main(["--smoke"], out=out) == 0
    report = out.getvalue()
    streamed, summary = report.split("\ngpu_check on", 1)  # the rows as measured, then the table again
    for family in ("gpt2", "llama", "gpt_moe", "bert", "t5", "vit"):
        assert f"{family} fp32 cpu vs cpu" in streamed and f"{family} bf16 cpu vs cpu fp32" in streamed
    assert "bf16 vs fp32 of the same seed: largest gap" in streamed
    assert len([r for r in rows_of(streamed, "train") if "tok/s" in r]) == 4  # transformers, eager, compiled, fused
    assert "saved for backward per token" in streamed
    layouts = rows_of(streamed, "layouts")
    for name in ("FSDP2 (ZeRO-3) over 2", "tensor parallel over 2", "pipeline over 2 stages"):
        assert any(name in r and r.endswith(" ok") for r in layouts), layouts
    correct = [r for r in rows_of(streamed, "decode") if "greedy tokens = transformers'" in r]
    assert len(correct) == 2 and all(r.endswith(" ok") for r in correct)  # eager and compiled, fp32
    assert "batch 2: ours, compiled step" in streamed
    assert gpu_check.STOPPED not in report and gpu_check.CRASHED not in report
    assert summary.rstrip().endswith("every check passed")


def test_a_row_is_printed_when_it_is_added(gpu_check):
    out = io.StringIO()
    report = gpu_check.Report(out)
    section = gpu_check.Section("decode", 10.0, report)
    section.row("batch 1: ours", "100 tok/s")
    assert "batch 1: ours" in out.getvalue() and "100 tok/s" in out.getvalue()


def test_a_section_past_its_budget_is_stopped_and_the_next_runs(gpu_check):
    out = io.StringIO()
    report = gpu_check.Report(out)

    def hangs(section):
        section.row("first", "measured")
        while True:  # a measurement that never ends (a compilation that hangs)
            time.sleep(0.01)

    start = time.perf_counter()
    gpu_check.run_section("train", hangs, 0.2, report)
    assert time.perf_counter() - start < 30
    gpu_check.run_section("decode", lambda section: section.row("next", "measured"), 5.0, report)
    checks = [(r.section, r.check) for r in report.rows]
    assert checks == [("train", "first"), ("train", gpu_check.STOPPED), ("decode", "next")]
    assert report.summary("t") == 0  # a stopped section is unmeasured, not failed
    assert "1 section(s) stopped at their budget" in out.getvalue()


def test_an_alarm_set_outside_is_kept(gpu_check):
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)  # pytest-timeout's, say
        gpu_check.run_section("curve", lambda section: section.row("quick", "measured"), 5.0, gpu_check.Report(io.StringIO()))
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90 < left <= 100 and signal.getsignal(signal.SIGALRM) is not None and not fired
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # an outer alarm due before the section's budget runs its handler
        report = gpu_check.Report(io.StringIO())
        gpu_check.run_section("curve", lambda section: time.sleep(1.0), 5.0, report)
        time.sleep(0.05)
        assert len(fired) == 1 and not report.rows  # once, and not set again after the section
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_spent_budget_stops_starting_measurements(gpu_check):
    report = gpu_check.Report(io.StringIO())
    section = gpu_check.Section("curve", 0.0, report)
    assert section.out_of_time("the bf16 curve")
    assert report.rows[-1].check == gpu_check.STOPPED and "the bf16 curve" in report.rows[-1].value


def test_a_crashing_section_fails_in_a_row_and_the_run_goes_on(gpu_check):
    report = gpu_check.Report(io.StringIO())

    def crashes(section):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    gpu_check.run_section("train", crashes, 5.0, report)
    gpu_check.run_section("decode", lambda section: section.row("next", "measured"), 5.0, report)
    crashed = report.rows[0]
    assert (crashed.check, crashed.ok) == (gpu_check.CRASHED, False) and "shapes are incompatible" in crashed.value
    assert report.rows[1].check == "next" and report.summary("t") == 1


@pytest.mark.parametrize("native", [True, False])
def test_peaks_are_measured_only_in_native_dtypes(gpu_check, monkeypatch, native):
    import flops

    measured = []
    monkeypatch.setattr(flops, "native_bf16", lambda device: native)
    monkeypatch.setattr(gpu_check, "matmul_peak", lambda dtype, *a, **k: measured.append(dtype) or 1e9)
    out = io.StringIO()
    assert gpu_check.main(["--smoke", "--sections", "peak"], out=out) == 0
    assert measured == ([torch.float32, torch.bfloat16] if native else [torch.float32])
    peak_rows = rows_of(out.getvalue().split("\ngpu_check on")[0], "peak")
    assert len(peak_rows) == 2 and ("only emulates bfloat16" in peak_rows[1]) is not native


def test_bad_budget_names_the_sections(gpu_check):
    with pytest.raises(SystemExit, match=r"--budget 'trian=5': expected SECTION=SECONDS with SECTION one of peak"):
        gpu_check.main(["--smoke", "--budget", "trian=5"])
