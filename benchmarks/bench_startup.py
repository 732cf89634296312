"""Start-up time: what a user waits for before the first useful line, against ``import torch, transformers``.

Each case is a fresh Python process (imports are cached per process), run ``--rounds`` times with the cases
interleaved so a busy machine slows them alike; the best wall time and the best CPU time (user + system of the
process: steadier than wall time on a shared machine) are printed, each with its ratio to the baseline
``import torch, transformers`` measured in the same run.

Cases: ``import mindformers_py`` (our model types registered with transformers' Auto classes), the same followed by
``transformers.AutoConfig`` (the registration loads), ``from mindformers_py import Trainer, AutoModelForCausalLM``,
``mindformers-py --help``, a one-line config error of ``run`` (an unknown flag, and a bad value of a training field),
and ``plan`` on a preset and on a recipe.

    python benchmarks/bench_startup.py
    python benchmarks/bench_startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "tasks" / "gpt" / "pretrain_tiny.yaml")
BASELINE = "import torch, transformers"

CASES: dict[str, list[str]] = {
    BASELINE: ["-c", "import torch, transformers"],
    "import mindformers_py": ["-c", "import mindformers_py"],
    "... + transformers.AutoConfig": ["-c", "import mindformers_py, transformers; transformers.AutoConfig"],
    "from mindformers_py import Trainer, AutoModelForCausalLM": [
        "-c", "from mindformers_py import Trainer, AutoModelForCausalLM"],
    "mindformers-py --help": ["-m", "mindformers_py", "--help"],
    "run: unknown flag (error)": ["-m", "mindformers_py", "run", RECIPE, "--max_stepz", "3"],
    "run: bad training value (error)": ["-m", "mindformers_py", "run", RECIPE, "--warmup_ratio", "2"],
    "plan llama_1b --devices 64": ["-m", "mindformers_py", "plan", "llama_1b", "--devices", "64"],
    "plan <gpt recipe> --devices 8": ["-m", "mindformers_py", "plan", RECIPE, "--devices", "8"],
}


def run_once(args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit status) of one fresh interpreter running ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each case (best one reported)")
    args = parser.parse_args()
    best: dict[str, tuple[float, float]] = {}
    status: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, case in CASES.items():
            wall, cpu, status[name] = run_once(case)
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], wall), min(old[1], cpu))
    base_wall, base_cpu = best[BASELINE]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"best of {args.rounds} fresh processes")
    print(f"{'case':58s} {'wall s':>7s} {'x base':>7s} {'cpu s':>7s} {'x base':>7s}  exit")
    for name, (wall, cpu) in best.items():
        print(f"{name:58s} {wall:7.2f} {wall / base_wall:7.2f} {cpu:7.2f} {cpu / base_cpu:7.2f}  {status[name]}")


if __name__ == "__main__":
    main()
