"""LR sensitivity sweep: the Wortsman et al. formula with capping, the figure, and a real tiny sweep."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from matplotlib.colors import same_color

from musiclm_stab.analysis.sweep_report import (
    SweepResult,
    format_table,
    lr_sensitivity,
    make_sweep_figure,
    sensitivities,
)
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.experiments.sweep import cli_main, run_sweep, scheme_label, scheme_overrides


def result(
    scheme: str, lr: float, final: float, initial: float = 60.0, label: str | None = None
) -> SweepResult:
    return SweepResult(
        scheme=scheme,
        lr=lr,
        label=label or scheme,
        initial_loss=initial,
        final_loss=final,
        steps=100,
        grad_norm_max=1.0,
        skipped_steps=0,
        seconds=1.0,
        run_dir=f"runs/{scheme}_{lr}",
    )


def test_lr_sensitivity_formula_caps_divergent_runs():
    """E_lr[min(loss, cap)] - min loss: a NaN run and a run above its initial loss both count as the cap."""
    # capped: 50, 40, 60 (nan), 60 (70 > cap) -> mean 52.5, best 40
    assert lr_sensitivity([50.0, 40.0, math.nan, 70.0], [60.0] * 4) == pytest.approx(12.5)
    assert lr_sensitivity([42.0, 42.0], [60.0, 60.0]) == 0.0  # flat over the grid: insensitive
    assert math.isnan(lr_sensitivity([math.nan, 61.0], [60.0, 60.0]))  # nothing trained: undefined
    with pytest.raises(ValueError):
        lr_sensitivity([1.0], [])


def test_result_divergence_and_per_scheme_sensitivity():
    """SweepResult flags non-finite / above-initial runs, caps them, and sensitivities() groups by scheme."""
    runs = [
        result("pre", 1e-3, 45.0),
        result("pre", 1e-2, math.inf),
        result("post", 1e-3, 50.0),
        result("post", 1e-2, 61.0),
    ]
    assert [r.diverged for r in runs] == [False, True, False, True]
    assert [r.capped_loss for r in runs] == [45.0, 60.0, 50.0, 60.0]
    assert sensitivities(runs) == {"pre": pytest.approx(7.5), "post": pytest.approx(5.0)}
    table = format_table(runs)
    assert "60.000*" in table and table.splitlines()[2].split()[-1] == "7.500"


def test_sweep_figure_axes_legend_and_markers():
    """Log lr axis, one line per scheme in plot.py's colour/marker order, diverged points marked at the cap."""
    runs = [
        result("pre", lr, f, label="Pre-Norm | Gradient Clip=1") for lr, f in ((1e-3, 45.0), (1e-2, 44.0))
    ]
    runs += [
        result("post", lr, f, label="Post-Norm | Gradient Clip=1")
        for lr, f in ((1e-3, 46.0), (1e-2, math.nan))
    ]
    ax = make_sweep_figure(runs, last=5).axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "Learning Rate"
    assert ax.get_ylabel() == "Final Loss (mean of last 5 steps)"
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert texts == [
        "Pre-Norm | Gradient Clip=1 (LR sens. 0.5)",
        "Post-Norm | Gradient Clip=1 (LR sens. 7)",
        "Diverged (capped at initial loss)",
    ]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    pre, post, bad = lines["scheme:pre"], lines["scheme:post"], lines["diverged:post"]
    assert same_color(pre.get_color(), "tab:blue") and pre.get_marker() == "o"
    assert same_color(post.get_color(), "tab:orange") and post.get_marker() == "^"
    assert list(post.get_ydata()) == [46.0, 60.0] and list(bad.get_xdata()) == [1e-2]
    assert bad.get_marker() == "x" and "diverged:pre" not in lines


def test_scheme_names_and_labels():
    """Sweep scheme names resolve to overrides (variants included); legends drop the run number."""
    cfg = load_config("recipes/tiny.yaml", scheme_overrides("relax"))
    assert (cfg.model.norm_scheme, cfg.model.attention) == ("pre", "relax")
    assert scheme_label(cfg.to_dict()) == "Pre-Norm | Attn. Relax | Gradient Clip=10"
    cfg = load_config("recipes/tiny.yaml", scheme_overrides("deepnorm"))
    assert scheme_label(cfg.to_dict()) == "Post-Norm | DeepNorm | Gradient Clip=10"
    assert scheme_label(load_config("recipes/tiny.yaml").to_dict()) == "Pre-Norm | Gradient Clip=10"
    cfg = load_config("recipes/tiny.yaml", scheme_overrides("math"))
    assert scheme_label(cfg.to_dict()) == "Pre-Norm | Math Attn. | Gradient Clip=10"
    with pytest.raises(ConfigError, match="relax"):
        scheme_overrides("nope")


def test_tiny_sweep_end_to_end(tokenized_dataset, tmp_path, capsys):
    """2 schemes x 2 lrs x 2 steps train in-process; table, JSON, CSV and figure are written; reruns reuse."""
    threads = torch.get_num_threads()
    small = ["data.batch_size=2", "data.eval_fraction=0.3"]
    argv = [
        "--schemes",
        "pre",
        "deepnorm",
        "--lrs",
        "1e-3",
        "1e-2",
        "--steps",
        "2",
        "--last",
        "1",
        "--out",
        str(tmp_path),
        "--data",
        str(tokenized_dataset),
        "--set",
        *small,
    ]
    assert cli_main(argv) == 0
    assert torch.get_num_threads() == threads  # --threads is restored afterwards
    out = capsys.readouterr().out
    assert "LR sens." in out and "Post-Norm | DeepNorm | Gradient Clip=10" in out
    payload = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["scheme"], r["lr"]) for r in payload["results"]] == [
        ("pre", 1e-3),
        ("pre", 1e-2),
        ("deepnorm", 1e-3),
        ("deepnorm", 1e-2),
    ]
    assert set(payload["lr_sensitivity"]) == {"pre", "deepnorm"}
    for r in payload["results"]:
        assert r["steps"] == 2 and math.isfinite(r["initial_loss"]) and r["initial_loss"] > 0
    # Same init and first batch at every lr of a scheme: the same initial loss (the cap).
    assert payload["results"][0]["initial_loss"] == payload["results"][1]["initial_loss"]
    with (tmp_path / "sweep.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (tmp_path / "lr_sensitivity.png").stat().st_size > 0
    again = run_sweep(["pre"], [1e-3], 2, tmp_path, data=tokenized_dataset, extra=small, last=1)
    assert "reusing" in capsys.readouterr().out
    assert again[0].final_loss == payload["results"][0]["final_loss"]
