"""Under torchrun, a layout its world cannot hold is one error line, printed once (not once per rank), naming the
fix, with a non-zero exit. torchrun's own failure report follows it: that is the torchrun process's output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_layout_the_world_cannot_hold_is_reported_once_with_the_fix(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mindformers_py",
         "run", str(ROOT / "tasks" / "gpt" / "pretrain_tiny.yaml"), "--parallel_mode", "semi_auto_parallel",
         "--data_parallel", "2", "--model_parallel", "2", "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert errors == ["error: data_parallel*model_parallel*pipeline_stage = 2*2*1 = 4 does not match world_size=2; "
                      "run 4 processes (torchrun --nproc_per_node 4, or mindformers-py run without torchrun), or set "
                      "data_parallel=1"], out.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # refused before anything was prepared or written
