"""The one-command study: launch lines for the cluster, the CPU and GPU plans (seeds, data order), and the
GPU study script run for real at tiny size on CPU."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from musiclm_stab.analysis.plot import run_label
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.experiments.study import cli_main, run_study
from musiclm_stab.experiments.study_plan import (
    CPU_OVERLAYS,
    SCALE_OVERLAYS,
    STUDY_RECIPES,
    merge_overrides,
    plan_study,
    recipe_path,
)

REPO = Path(__file__).resolve().parent.parent

LABELS = [
    "Pre-Norm | Gradient Clip=10 | Run 1",
    "Pre-Norm | Gradient Clip=1 | Run 2",
    "Post-Norm | DeepNorm | Gradient Clip=1",
    "Pre-Norm | Attn. Relax | Gradient Clip=1",
]
FIGURES = ["loss.png", "grad_norm.png", "musical_mlm_loss.png", "acoustic_mlm_loss_cb0.png"]
EXTRA = ["acoustic_mlm_loss_codebooks.png", "grad_norm_log.png", "max_attn_logit.png", "max_attn_logit_layers.png",
         "eval.png"]


def test_full_print_only_lines_are_the_recipes(tmp_path, capsys):
    """--scale full --print-only prints one valid launch line per study recipe, in legend order, then the plot
    and the claims lines."""
    runs = tmp_path / "runs"
    assert cli_main(["--scale", "full", "--print-only", "--runs", str(runs), "--data", "/data/tokens"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    for line, stem, label in zip(lines, STUDY_RECIPES, LABELS):
        argv = shlex.split(line)
        assert argv[:2] == ["accelerate", "launch"] and argv[2].endswith("recipes/pretrain.py")
        assert argv[3] == "--config" and Path(argv[4]).name == f"{stem}.yaml"
        cfg = load_config(argv[4], argv[5:])  # exactly what recipes/pretrain.py would parse
        assert (cfg.model.size, cfg.train.mixed_precision, cfg.train.stop_at) == ("large", "fp16", 100_000)
        assert (cfg.train.name, cfg.train.output_dir, cfg.data.path) == (stem, str(runs), "/data/tokens")
        assert run_label(cfg.to_dict()) == label
    plot = shlex.split(lines[4])
    assert plot[:2] == ["musiclm-stab", "plot"]
    assert plot[2:6] == [str(runs / stem) for stem in STUDY_RECIPES]
    assert plot[6:8] == ["--out", str(runs / "study_figures")] and "--bands" in plot and "--extra" in plot
    claims = shlex.split(lines[5])
    assert claims[:3] == ["python", "-m", "musiclm_stab.analysis.claims"] and claims[3:7] == plot[2:6]


def test_recipe_headers_show_the_tiny_twin_overlay_command():
    """Each study recipe's header shows the command that layers the tiny-twin overlay on it."""
    for stem in STUDY_RECIPES:
        text = recipe_path(stem).read_text()
        assert f"--config recipes/{stem}.yaml --config recipes/overlays/tiny.yaml" in text
        assert CPU_OVERLAYS[0].name == "tiny.yaml" and all(p.is_file() for p in CPU_OVERLAYS)


def test_cpu_plan_seeds_order_and_settings(tmp_path):
    """CPU scale: 4 configurations x 3 seeds, legends kept, the chosen regime, seeds as train.seed, and the
    data order paired by seed (default), shared, or independent per run."""
    study = plan_study("cpu", tmp_path, data="/data/tokens")
    assert study.figures_dir == tmp_path / "study_cpu" / "figures" and len(study.runs) == 12
    for i, run in enumerate(study.runs):
        seed, stem = divmod(i, 4)
        keys = [o.split("=", 1)[0] for o in run.overrides]
        assert len(keys) == len(set(keys))  # merged: one value per setting
        cfg = run.config()
        m = cfg.model.resolved()
        assert (m.size, m.num_layers, m.width, cfg.train.mixed_precision) == ("tiny", 8, 128, "no")
        assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.max_steps, cfg.data.crop_seconds) == (
            0.1, 24, 240, 2.0)
        assert (cfg.train.eval_every, cfg.train.diagnostics_every) == (20, 10)
        assert cfg.run_dir == tmp_path / "study_cpu" / f"{STUDY_RECIPES[stem]}_tiny_s{seed}"
        assert (cfg.train.seed, cfg.data.order_seed, cfg.data_order_seed) == (seed, None, seed)
        assert cfg.data.path == "/data/tokens" and run_label(cfg.to_dict()) == LABELS[stem]
    assert study.runs[0].configs[1:] == list(CPU_OVERLAYS)
    shared = [r.config() for r in plan_study("cpu", tmp_path, data="x", order="shared").runs]
    assert {c.data_order_seed for c in shared} == {0} and {c.train.seed for c in shared} == {0, 1, 2}
    independent = [r.config() for r in plan_study("cpu", tmp_path, data="x", order="independent").runs]
    assert len({c.data_order_seed for c in independent}) == 12
    short = plan_study("cpu", tmp_path, data="x", steps=30, seeds=1).runs[2].config()
    assert (short.train.max_steps, short.optim.warmup_steps, short.train.checkpoint_every) == (30, 3, 30)
    assert (short.train.eval_every, short.train.diagnostics_every) == (3, 3)
    assert merge_overrides(["--a.b=1", "--c.d=2", "--a.b=3"]) == ["--a.b=3", "--c.d=2"]
    with pytest.raises(ConfigError, match="model.norm_scheme"):
        plan_study("cpu", tmp_path, data="x", extra=["model.norm_scheme=nope"])


def test_gpu_plan_is_base_fp16_past_warmup(tmp_path):
    """GPU scale: the recipes + study_gpu.yaml at base size in fp16, 1000 steps past an 80-step warmup."""
    study = plan_study("gpu", tmp_path, data="/data/tokens")
    assert study.figures_dir == tmp_path / "study_gpu" / "figures" and len(study.runs) == 4
    assert [r.configs[1:] for r in study.runs] == [list(SCALE_OVERLAYS["gpu"])] * 4
    for run, stem, label in zip(study.runs, STUDY_RECIPES, LABELS):
        cfg = run.config().resolved()
        assert (cfg.model.size, cfg.model.num_layers, cfg.train.mixed_precision) == ("base", 12, "fp16")
        assert (cfg.train.max_steps, cfg.optim.warmup_steps) == (1000, 80)
        assert cfg.train.eval_every and cfg.train.diagnostics_every and run_label(cfg.to_dict()) == label
        assert cfg.run_dir == tmp_path / "study_gpu" / f"{stem}_gpu_s0"


@pytest.mark.slow
def test_gpu_study_script_runs_at_tiny_size_on_cpu(tokenized_dataset, tmp_path):
    """benchmarks/study_gpu.sh, the GPU study's one script, runs the whole path at tiny size on CPU: 4 real
    runs through accelerate (2 at a time), the figures with bands and extras, the claims table, one archive."""
    out = tmp_path / "out"
    tiny = ["model.size=tiny", "model.cqt_bins=84", "model.cqt_bins_per_octave=12", "train.mixed_precision=no",
            "train.log_every=1", "data.batch_size=2", "data.crop_seconds=2.0", "data.eval_fraction=0.3",
            "data.num_workers=0"]
    # STUDY_GPU_WHEELS empty: this venv's packages, not the GPU machine's wheels that benchmarks/gpu_prep.sh or
    # study_gpu_wheels.sh may have left in .whl/ (built for its Python, 3.12)
    env = {**os.environ, "PYTHON": sys.executable, "STUDY_ALLOW_CPU": "1", "OMP_NUM_THREADS": "1",
           "STUDY_GPU_WHEELS": ""}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "study_gpu.sh"), str(out), "--steps", "2",
                           "--jobs", "2", "--data", str(tokenized_dataset), "--set", *tiny],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp_path / "out" / "runs" / "study_gpu"
    for stem in STUDY_RECIPES:
        rows = [json.loads(x) for x in (root / f"{stem}_gpu_s0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and "eval/loss" in rows[-1]
    assert sorted(p.name for p in (root / "figures").glob("*.png")) == sorted(FIGURES + EXTRA)
    summary = json.loads((root / "figures" / "summary.json").read_text())
    assert [r["label"] for r in summary] == LABELS and all(r["steps"] == 2 for r in summary)
    claims = (root / "figures" / "claims.md").read_text()
    assert all(f"| ({c})" in claims for c in "abcd")
    with tarfile.open(out / "study_gpu.tar.gz") as tar:
        names = tar.getnames()
    assert "figures/claims.md" in names and f"{STUDY_RECIPES[2]}_gpu_s0/metrics.jsonl" in names
    assert "study exited with 0" in (out / "study_gpu.log").read_text()
    # Same directories, another config: refused before anything is launched.
    with pytest.raises(ConfigError, match="another config"):
        run_study(plan_study("gpu", tmp_path / "out" / "runs", tokenized_dataset, steps=3, extra=tiny))
