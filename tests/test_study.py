"""The one-command study: launch lines for the cluster, the CPU-scale plan, and a real (very short) CPU study."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from musiclm_stab.analysis.plot import run_label
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.experiments.study import (
    CPU_OVERLAYS,
    STUDY_RECIPES,
    cli_main,
    merge_overrides,
    plan_study,
    recipe_path,
    run_study,
)

LABELS = [
    "Pre-Norm | Gradient Clip=10 | Run 1",
    "Pre-Norm | Gradient Clip=1 | Run 2",
    "Post-Norm | DeepNorm | Gradient Clip=1",
    "Pre-Norm | Attn. Relax | Gradient Clip=1",
]
FIGURES = ["loss.png", "grad_norm.png", "musical_mlm_loss.png", "acoustic_mlm_loss_cb0.png"]


def test_full_print_only_lines_are_the_recipes(tmp_path, capsys):
    """--scale full --print-only prints one valid launch line per study recipe, in legend order, then the plot line."""
    runs = tmp_path / "runs"
    assert cli_main(["--scale", "full", "--print-only", "--runs", str(runs), "--data", "/data/tokens"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    for line, stem, label in zip(lines, STUDY_RECIPES, LABELS):
        argv = shlex.split(line)
        assert argv[:2] == ["accelerate", "launch"] and argv[2].endswith("recipes/pretrain.py")
        assert argv[3] == "--config" and Path(argv[4]).name == f"{stem}.yaml"
        cfg = load_config(argv[4], argv[5:])  # exactly what recipes/pretrain.py would parse
        assert (cfg.model.size, cfg.train.mixed_precision, cfg.train.max_steps) == ("large", "fp16", 100_000)
        assert (cfg.train.name, cfg.train.output_dir, cfg.data.path) == (stem, str(runs), "/data/tokens")
        assert run_label(cfg.to_dict()) == label
    plot = shlex.split(lines[4])
    assert plot[:2] == ["musiclm-stab", "plot"]
    assert plot[2:6] == [str(runs / stem) for stem in STUDY_RECIPES]
    assert plot[6:] == ["--out", str(runs / "study_figures")]


def test_recipe_headers_show_the_tiny_twin_overlay_command():
    """Each study recipe's header shows the command that layers the tiny-twin overlay on it."""
    for stem in STUDY_RECIPES:
        text = recipe_path(stem).read_text()
        assert f"--config recipes/{stem}.yaml --config recipes/overlays/tiny.yaml" in text
        assert CPU_OVERLAYS[0].name == "tiny.yaml" and all(p.is_file() for p in CPU_OVERLAYS)


def test_cpu_plan_validates_and_keeps_study_legends(tmp_path):
    """CPU scale: recipes + CPU_OVERLAYS validate, keep each run's legend, and land in <runs>/<name>."""
    study = plan_study("cpu", tmp_path, data="/data/tokens")
    assert study.figures_dir == tmp_path / "study_cpu" / "figures"
    for run, stem, label in zip(study.runs, STUDY_RECIPES, LABELS):
        keys = [o.split("=", 1)[0] for o in run.overrides]
        assert len(keys) == len(set(keys))  # merged: one value per setting
        cfg = run.config()
        m = cfg.model.resolved()
        assert (m.size, m.num_layers, m.width, cfg.train.mixed_precision) == ("tiny", 2, 128, "bf16")
        assert (cfg.optim.lr, cfg.train.max_steps, cfg.data.crop_seconds) == (3e-2, 400, 2.0)
        assert cfg.run_dir == tmp_path / "study_cpu" / f"{stem}_tiny"
        assert cfg.data.path == "/data/tokens"
        assert run_label(cfg.to_dict()) == label
    assert study.runs[0].configs[1:] == list(CPU_OVERLAYS)
    short = plan_study("cpu", tmp_path, data="x", steps=7).runs[2].config()
    assert (short.train.max_steps, short.optim.warmup_steps, short.train.checkpoint_every) == (7, 1, 7)
    assert merge_overrides(["--a.b=1", "--c.d=2", "--a.b=3"]) == ["--a.b=3", "--c.d=2"]
    with pytest.raises(ConfigError, match="model.norm_scheme"):
        plan_study("cpu", tmp_path, data="x", extra=["model.norm_scheme=nope"])


@pytest.mark.slow
def test_cpu_study_runs_and_draws_the_figures(tokenized_dataset, tmp_path, capsys):
    """A real 2-step CPU study launches 4 runs through accelerate, draws the 4 figures, refuses a changed rerun."""
    small = ["data.batch_size=2", "data.crop_seconds=2.0", "data.eval_fraction=0.3"]
    argv = [
        "--scale",
        "cpu",
        "--steps",
        "2",
        "--data",
        str(tokenized_dataset),
        "--runs",
        str(tmp_path),
        "--set",
        *small,
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    root = tmp_path / "study_cpu"
    for i, stem in enumerate(STUDY_RECIPES):
        rows = [json.loads(x) for x in (root / f"{stem}_tiny" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert f"study run {i + 1}/4: {LABELS[i]}" in out
    assert sorted(p.name for p in (root / "figures").glob("*.png")) == sorted(FIGURES)
    summary = json.loads((root / "figures" / "summary.json").read_text())
    assert [r["label"] for r in summary] == LABELS and all(r["steps"] == 2 for r in summary)
    assert str(root / "figures" / "loss.png") in out
    # Same directories, another config: refused before anything is launched.
    with pytest.raises(ConfigError, match="another config"):
        run_study(plan_study("cpu", tmp_path, tokenized_dataset, steps=3, extra=small))
