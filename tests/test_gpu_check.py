"""``benchmarks/gpu_check.py --smoke``: the GPU check runs end to end on the CPU at tiny sizes (so it works the day a
GPU arrives): every family's parity rows, the bf16 loss curve, the FSDP2 training section on two gloo ranks beside
transformers' Trainer, and decoding whose fp32 tokens equal transformers'."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_check_smoke_passes_every_check(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    assert gpu_check.main(["--smoke"]) == 0
    report = capsys.readouterr().out
    for family in ("gpt2", "llama", "gpt_moe", "bert", "t5", "vit"):
        assert f"{family} fp32 cpu vs cpu" in report and f"{family} bf16 cpu vs cpu fp32" in report
    assert "FSDP2 (ZeRO-3) over 2 ranks" in report and "batch 2: ours, compiled step" in report
    assert "every check passed" in report
    sys.modules.pop("gpu_check", None)
