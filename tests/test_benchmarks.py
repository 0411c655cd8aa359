"""The benchmark scripts keep working: each runs end to end at the smallest setting and prints its table.
(Correctness only: no timing is asserted anywhere in the tests.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_train_step_runs_every_variant():
    out = _run("benchmarks/bench_train_step.py", "--size", "tiny", "--schemes", "pre", "--dtypes", "fp32",
               "--repeats", "1", "--variants", "ours", "before", "peer", "ckpt")
    row = next(line for line in out.splitlines() if line.startswith("| pre | fp32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 2 + 4 + 3 + 3 + 4  # scheme, dtype; 4 times; 3 rates; 3 ratios; flops columns
    assert all(re.fullmatch(r"[\d.]+x?|\d+%", c) for c in cells[2:]), cells


def test_bench_gpu_smoke_runs_on_cpu(tmp_path):
    """The GPU script, on CPU at tiny size: a table row and a JSON row with finite, positive numbers."""
    out = _run("benchmarks/bench_gpu.py", "--device", "cpu", "--sizes", "tiny", "--dtypes", "bf16", "--batch", "2",
               "--steps", "1", "--warmup", "1", "--json", str(tmp_path / "gpu.json"))
    assert "| tiny | bf16 | 2 |" in out
    (row,) = json.loads((tmp_path / "gpu.json").read_text())
    assert row["audio_s_per_s"] > 0 and row["tflop_per_step"] > 0 and 0 < row["vs_matmul"] < 10
