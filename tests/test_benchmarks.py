"""The benchmark scripts keep working: each runs end to end at the smallest setting and prints its table.
(Correctness only: no timing is asserted anywhere in the tests.)"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from proc import run_group

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


def test_gpu_suite_smoke_runs_every_section_on_cpu(tokenized_dataset, local_weights, make_music, tmp_path):
    """benchmarks/gpu_suite.sh --smoke (CPU, tiny, one step each): every section (our step (bench_gpu.py) with the GEMM
    frontend and the profiler, ours vs HubertModel, frontend conv vs gemm, checkpoint blocking, real loop
    vs synthetic on real tokens, the tokenizer on two devices: here CPU twice, which must agree exactly) ends
    with its table row in tables.md, none failed or skipped, and the raw rows come back bundled, as the GPU
    run's will."""
    import os
    import tarfile

    import soundfile as sf

    audio = tmp_path / "audio"
    audio.mkdir()
    sf.write(audio / "track.wav", make_music(12.0, seed=7), 24000)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "GPU_SUITE_DATA": str(tokenized_dataset), "GPU_SUITE_AUDIO": str(audio),
           "GPU_SUITE_WEIGHTS": str(local_weights), "TMPDIR": str(tmp_path)}
    proc = run_group(["bash", "benchmarks/gpu_suite.sh", "--smoke"], timeout=1200, cwd=REPO, env=env)
    out = tmp_path / "out"
    log = (out / "suite.log").read_text() if (out / "suite.log").exists() else proc.stderr
    assert proc.returncode == 0, log[-3000:]
    tables = (out / "tables.md").read_text()
    assert "FAILED" not in tables and "SKIPPED" not in tables, log[-3000:]
    for section, row in [("bench_gpu", "| tiny | fp32 | gemm | 1 |"), ("peer", "| pre | fp32 |"),
                         ("frontend", "| fp32 |"), ("checkpoint", "| tiny |"), ("loop", "| tiny | fp32 | 1 x 0.5 s | 0 |"),
                         ("fp16_modes", "| fairseq |"), ("fp16_overflow", "| study_prenorm_attnrelax_clip1 | "),
                         ("tokenize", "cpu1 vs cpu0: equal codes per codebook 1.0000 1.0000 1.0000 1.0000 1.0000 1.0000 "
                                      "1.0000 1.0000; overall 1.0000")]:
        part = tables.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        assert row in part, (section, part)
    assert "self_cpu_time_total" in (out / "profile.txt").read_text()
    with tarfile.open(out / "raw.tar.gz") as tar:
        names = set(tar.getnames())
        (row,) = json.load(tar.extractfile("raw/bench_gpu.json"))
    for name in ("bench_gpu.json", "peer.json", "frontend.json", "checkpoint.json", "loop/loop.json"):
        assert f"raw/{name}" in names, sorted(names)
    # our step's row: vs_matmul is a ratio of two timings on shared cores, so only its being a finite
    # positive number is checked
    assert row["audio_s_per_s"] > 0 and row["tflop_per_step"] > 0
    assert math.isfinite(row["vs_matmul"]) and row["vs_matmul"] > 0
    assert not (out / "raw").exists()
