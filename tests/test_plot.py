"""Tests for musiclm_stab.analysis.plot: legend text, reading run directories, and the study's four figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.colors import same_color

from musiclm_stab import cli
from musiclm_stab.analysis.curves import ema
from musiclm_stab.analysis.panels import ROLLBACK_LABEL, SKIPPED_LABEL
from musiclm_stab.analysis.plot import PlotWarning, make_figures, plot_runs, read_run, run_label
from musiclm_stab.analysis.style import RAW_ALPHA, StepFormatter
from musiclm_stab.config import Config, save_config

STUDY_LABELS = [
    "Pre-Norm | Gradient Clip=10 | Run 1",
    "Pre-Norm | Gradient Clip=1 | Run 2",
    "Post-Norm | DeepNorm | Gradient Clip=1",
    "Pre-Norm | Attn. Relax | Gradient Clip=1",
]
# (name, overrides) of the study's four runs
STUDY_RUNS = [
    ("pre_clip10", {"optim.clip_grad": 10.0, "train.run": 1}),
    ("pre_clip1", {"optim.clip_grad": 1.0, "train.run": 2}),
    ("deepnorm", {"model.norm_scheme": "deepnorm", "optim.clip_grad": 1.0}),
    ("relax", {"model.attention": "relax", "optim.clip_grad": 1.0}),
]


def make_config(**overrides) -> Config:
    cfg = Config()
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg.validate()


def synthetic_rows(max_step: int, every: int, seed: int = 0, spike_at: int | None = None) -> list[dict]:
    """Rows shaped like the trainer's: decaying losses with a little noise, all metric names."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(0, max_step + 1, every):
        decay = math.exp(-step / (max_step / 20 + 1))
        spike = 1.5 if spike_at is not None and step == spike_at else 0.0
        row = {
            "step": step,
            "loss": 1.5 * decay + 0.05 + 0.01 * rng.random() + spike,
            "grad_norm": 10 * decay + 2 + rng.random(),
            "grad_clipped": int(rng.random() < 0.3),
            "lr": 5e-4,
            "musical_mlm_loss": 1.1 * decay + 0.2 + 0.01 * rng.random(),
            "features_pen": 0.01,
            "skipped_step": 0,
            "audio_s_per_s": 2.0,
        }
        for k in range(8):
            row[f"acoustic_mlm_loss/cb{k}"] = 3.8 * decay + 5.7 + 0.05 * rng.random()
            row[f"acoustic_acc/cb{k}"] = 0.5 * (1 - decay)
        rows.append(row)
    return rows


def write_run(
    root: Path, name: str, cfg: Config, rows: list[dict] | None, extra_lines: list[str] = ()
) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    if rows is not None:
        lines = [json.dumps(r) for r in rows] + list(extra_lines)
        (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run_dir


@pytest.fixture
def study_runs(tmp_path) -> list[Path]:
    """The study's four runs, 100K steps logged every 1000."""
    return [
        write_run(
            tmp_path,
            name,
            make_config(**ov),
            synthetic_rows(100_000, 1000, seed=i, spike_at=20_000 if name == "deepnorm" else None),
        )
        for i, (name, ov) in enumerate(STUDY_RUNS)
    ]


def run_lines(ax):
    """The per-run lines (not raw, skipped or rollback marks), in drawing order."""
    return [line for line in ax.get_lines() if (line.get_gid() or "").startswith("run:")]


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def tick_texts(ax) -> list[str]:
    """The x tick labels inside the view."""
    ax.figure.canvas.draw()
    lo, hi = ax.get_xlim()
    return [t.get_text() for t in ax.get_xticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi]


# --- legend text -----------------------------------------------------------------------------------


def test_run_label_study_configs():
    """The four study configs give exactly the study's legend entries."""
    assert [run_label(make_config(**ov).to_dict()) for _, ov in STUDY_RUNS] == STUDY_LABELS


def test_run_label_override_modifiers_and_clip_format():
    """train.label wins; modifiers come in order; clip values lose only a trailing '.0'."""
    assert run_label(make_config(**{"train.label": "My run"}).to_dict()) == "My run"
    cfg = make_config(
        **{
            "model.norm_scheme": "sandwich",
            "model.qk_norm": True,
            "model.norm_type": "rmsnorm",
            "optim.clip_mode": "zclip",
            "optim.clip_grad": 0.5,
        }
    )
    assert run_label(cfg.to_dict()) == "Sandwich-Norm | QK-Norm | RMSNorm | ZClip | Gradient Clip=0.5"
    cfg = make_config(**{"model.norm_scheme": "subln", "optim.clip_mode": "autoclip", "train.run": 3})
    assert run_label(cfg.to_dict()) == "Sub-LN | AutoClip | Gradient Clip=10"
    assert run_label(make_config(**{"model.norm_scheme": "post", "train.run": 4}).to_dict()) == (
        "Post-Norm | Gradient Clip=10 | Run 4"
    )
    assert (
        run_label(make_config(**{"model.attention": "math", "train.run": 1}).to_dict())
        == "Pre-Norm | Gradient Clip=10 | Run 1"
    )


def test_a_run_that_is_no_study_run_has_no_study_label():
    """A run of the tiny recipe (train.run not set) reads as its configuration, without the study's run
    number: not "Pre-Norm | Gradient Clip=10 | Run 1", the study run it is not."""
    from musiclm_stab.config import load_config

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    assert run_label(load_config(recipes / "tiny.yaml").to_dict()) == "Pre-Norm | Gradient Clip=10"
    study_run = load_config(recipes / "study_prenorm_clip10_run1.yaml")
    assert run_label(study_run.to_dict()) == "Pre-Norm | Gradient Clip=10 | Run 1"


# --- the figures -----------------------------------------------------------------------------------


def test_figures_axes_labels_scales_and_k_ticks(study_runs):
    """Four figures with the study's axis labels (the loss unit stated), K step ticks, and log steps for
    the MLM losses."""
    figs = make_figures(study_runs)
    assert list(figs) == ["loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss_cb0"]
    ylabels = {name: fig.axes[0].get_ylabel() for name, fig in figs.items()}
    assert ylabels == {
        "loss": "Training Loss (bits)",
        "grad_norm": "Gradient Norm",
        "musical_mlm_loss": "Musical MLM Loss (MSE / ln 2)",
        "acoustic_mlm_loss_cb0": "Acoustic MLM Loss on Codebook-0 (bits)",
    }
    for name, fig in figs.items():
        ax = fig.axes[0]
        assert ax.get_xlabel() == "Training Step"
        assert ax.get_xscale() == ("symlog" if "mlm" in name else "linear")
    assert tick_texts(figs["loss"].axes[0]) == ["0K", "20K", "40K", "60K", "80K", "100K"]
    assert tick_texts(figs["musical_mlm_loss"].axes[0]) == ["0K", "1K", "10K", "100K"]
    # step 0 is drawn on the log-step figures (symlog), not dropped
    assert run_lines(figs["acoustic_mlm_loss_cb0"].axes[0])[0].get_xdata()[0] == 0


def test_legend_position_colours_markers_and_sparse_markers(study_runs):
    """One line per run, legend upper right with the study's text, colours and markers in order."""
    for fig in make_figures(study_runs).values():
        ax = fig.axes[0]
        lines = run_lines(ax)
        assert len(lines) == 4
        assert legend_texts(ax) == STUDY_LABELS
        for line, colour, marker in zip(lines, ["tab:blue", "tab:orange", "tab:green", "tab:pink"], "o^vD"):
            assert same_color(line.get_color(), colour)
            assert line.get_marker() == marker
            assert 5 <= len(line.get_markevery()) <= 10  # sparse: ~10 markers on 101 points
        fig.canvas.draw()
        legend_box, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
        assert legend_box.x1 > axes_box.x1 - 20 and legend_box.y1 > axes_box.y1 - 20  # upper right corner
        assert legend_box.x0 > axes_box.x0 + axes_box.width / 4


def test_markers_sparse_and_spread_on_long_noisy_runs(tmp_path):
    """Markers stay ~10 per line and evenly spread in x, also for 20K noisy points on a log axis."""
    rows = synthetic_rows(20_000, 1)
    for r in rows:
        r["musical_mlm_loss"] += 0.5 * ((r["step"] % 2) - 0.5)  # zigzag: long path, same x extent
    figs = make_figures([write_run(tmp_path, "long", make_config(), rows)])
    for name in ("loss", "musical_mlm_loss"):
        ax = figs[name].axes[0]
        (line,) = run_lines(ax)
        idx = line.get_markevery()
        assert 8 <= len(idx) <= 10
        x = ax.xaxis.get_transform().transform(line.get_xdata()[idx].astype(float))
        gaps = np.diff(x)
        assert gaps.max() < 1.5 * gaps.min()


def test_more_codebooks_forced_linear_and_label_override(study_runs):
    """--codebooks adds figures, --no-log-x / --log-x force the step scale, labels override the legend."""
    figs = make_figures(study_runs, codebooks=(0, 3), log_x=False, labels=["A", "B", "C", "D"])
    assert "acoustic_mlm_loss_cb3" in figs
    assert figs["acoustic_mlm_loss_cb3"].axes[0].get_ylabel() == "Acoustic MLM Loss on Codebook-3 (bits)"
    assert all(f.axes[0].get_xscale() == "linear" for f in figs.values())
    assert legend_texts(figs["loss"].axes[0]) == ["A", "B", "C", "D"]
    assert all(f.axes[0].get_xscale() == "symlog" for f in make_figures(study_runs, log_x=True).values())
    with pytest.raises(ValueError, match="2 labels for 4 runs"):
        make_figures(study_runs, labels=["A", "B"])


def test_step_formatter_k_labels_and_short_runs():
    """K labels as the study's; short runs get 0.1K-style labels, very short ones plain step numbers."""
    linear, log = StepFormatter(log=False), StepFormatter(log=True)
    assert linear.format_ticks([0, 20_000, 40_000, 100_000]) == ["0K", "20K", "40K", "100K"]
    assert linear.format_ticks([0, 500, 1000, 1500]) == ["0K", "0.5K", "1K", "1.5K"]
    assert linear.format_ticks([0, 100, 200, 500]) == ["0K", "0.1K", "0.2K", "0.5K"]
    assert linear.format_ticks([0, 20, 40, 100]) == ["0K", "0.02K", "0.04K", "0.1K"]
    assert linear.format_ticks([0, 5, 10, 15]) == ["0", "5", "10", "15"]
    assert log.format_ticks([0, 1000, 10_000, 100_000]) == ["0K", "1K", "10K", "100K"]
    assert log.format_ticks([0, 1, 10, 100]) == ["0", "1", "10", "100"]


def test_short_run_axis_ticks(tmp_path):
    """A 500-step run is labelled in tenths of K; a 30-step run in plain steps."""
    short = write_run(tmp_path, "short", make_config(), synthetic_rows(500, 10))
    tiny = write_run(tmp_path, "tiny", make_config(), synthetic_rows(30, 1))
    assert tick_texts(make_figures([short])["loss"].axes[0]) == ["0K", "0.1K", "0.2K", "0.3K", "0.4K", "0.5K"]
    texts = tick_texts(make_figures([tiny])["loss"].axes[0])
    assert texts[0] == "0" and all(t.isdigit() for t in texts) and "30" in texts


def test_smoothing_draws_faint_raw_line_behind(study_runs):
    """With smoothing, each run has its EMA line plus the raw line, faint and in the same colour."""
    ax = make_figures(study_runs, smooth=0.9)["loss"].axes[0]
    raw = [line for line in ax.get_lines() if (line.get_gid() or "").startswith("raw:")]
    smoothed = run_lines(ax)
    assert len(raw) == len(smoothed) == 4 and legend_texts(ax) == STUDY_LABELS
    for r, s in zip(raw, smoothed):
        assert same_color(r.get_color(), s.get_color())
        assert r.get_alpha() == pytest.approx(RAW_ALPHA) and r.get_zorder() < s.get_zorder()
        np.testing.assert_allclose(s.get_ydata(), ema(r.get_ydata(), 0.9))
        assert np.std(np.diff(s.get_ydata()[50:])) < np.std(np.diff(r.get_ydata()[50:]))


def test_ema_values():
    """EMA is debiased (starts at the first value), keeps constants, and smooth=0 is the identity."""
    np.testing.assert_allclose(ema(np.full(5, 3.0), 0.9), 3.0)
    np.testing.assert_allclose(ema(np.array([0.0, 1.0]), 0.5), [0.0, 1.0 / 1.5])  # weights 0.5, 1
    np.testing.assert_array_equal(ema(np.array([1.0, 5.0]), 0.0), [1.0, 5.0])
    with pytest.raises(ValueError):
        ema(np.ones(3), 1.0)


# --- units ---------------------------------------------------------------------------------------


def _old_nats_run(root: Path, name: str = "old") -> Path:
    """A run directory as written before train.loss_unit existed: no such key, losses in nats."""
    run_dir = write_run(root, name, make_config(), [
        {"step": 1, "loss": 60.0, "acoustic_mlm_loss/cb0": math.log(1024), "musical_mlm_loss": 2.0,
         "features_pen": 0.5, "acoustic_acc/cb0": 0.25, "grad_norm": 3.0, "mask_fraction": 0.58}])
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    del cfg["train"]["loss_unit"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run_dir


def test_run_made_before_loss_unit_is_plotted_in_bits(tmp_path):
    """A run without train.loss_unit logged nats: read in bits, its losses are divided by ln 2 (codebook-0
    at ln 1024 nats becomes 10 bits); accuracy, grad norm and mask share are not losses and stay; a bits
    run is not converted; in nats the bits run is multiplied back."""
    old, new = _old_nats_run(tmp_path), write_run(tmp_path, "new", make_config(**{"train.run": 2}), [
        {"step": 1, "loss": 80.0, "acoustic_mlm_loss/cb0": 10.0, "musical_mlm_loss": 3.0, "grad_norm": 3.0}])
    run = read_run(old)
    assert (run.logged_unit, run.unit) == ("nats", "bits")
    value = {k: float(v[1][0]) for k, v in run.series.items()}
    assert value["acoustic_mlm_loss/cb0"] == pytest.approx(10.0, rel=1e-12)
    assert value["loss"] == pytest.approx(60.0 / math.log(2)) and value["musical_mlm_loss"] == pytest.approx(2.0 / math.log(2))
    assert value["features_pen"] == pytest.approx(0.5 / math.log(2))
    assert (value["acoustic_acc/cb0"], value["grad_norm"], value["mask_fraction"]) == (0.25, 3.0, 0.58)
    assert float(read_run(new).metric("acoustic_mlm_loss/cb0")[1][0]) == 10.0
    figs = make_figures([old, new])
    ys = [float(line.get_ydata()[0]) for line in run_lines(figs["acoustic_mlm_loss_cb0"].axes[0])]
    assert ys == pytest.approx([10.0, 10.0])
    figs = make_figures([old, new], unit="nats")
    assert figs["acoustic_mlm_loss_cb0"].axes[0].get_ylabel() == "Acoustic MLM Loss on Codebook-0 (nats)"
    assert figs["musical_mlm_loss"].axes[0].get_ylabel() == "Musical MLM Loss (MSE)"
    ys = [float(line.get_ydata()[0]) for line in run_lines(figs["acoustic_mlm_loss_cb0"].axes[0])]
    assert ys == pytest.approx([math.log(1024), 10.0 * math.log(2)])
    with pytest.raises(ValueError, match="loss unit 'dB' is not valid; choose one of: bits, nats"):
        make_figures([new], unit="dB")


def test_cli_plot_unit(tmp_path, capsys):
    """`musiclm-stab plot --unit nats` draws the loss axes in nats; the default is bits."""
    old = _old_nats_run(tmp_path)
    assert cli.main(["plot", str(old), "--out", str(tmp_path / "figs"), "--unit", "nats", "--format", "png"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "figs" / f"{n}.png") for n in
                                               ["loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss_cb0"]]
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses an unknown unit, listing the choices
        cli.main(["plot", str(old), "--out", str(tmp_path / "figs"), "--unit", "dB"])
    assert exit_info.value.code == 2 and "invalid choice: 'dB'" in capsys.readouterr().err


# --- robustness ------------------------------------------------------------------------------------


def test_resumed_run_later_rows_win(tmp_path):
    """A resumed run's rows replace the earlier ones from the resume step on (abandoned tail dropped)."""
    rows = [{"step": s, "loss": 1.0} for s in range(1, 11)]  # first attempt ran to step 10
    rows += [{"step": s, "loss": 2.0} for s in range(6, 9)]  # resumed at 6, ended at 8
    run = read_run(write_run(tmp_path, "resumed", make_config(), rows))
    steps, values = run.metric("loss")
    np.testing.assert_array_equal(steps, np.arange(1, 9))
    np.testing.assert_array_equal(values, [1.0] * 5 + [2.0] * 3)
    assert run.last_step == 8


def test_partial_run_missing_metric(study_runs, tmp_path):
    """A run that never logged musical_mlm_loss has no line there (warned) and keeps its colour elsewhere."""
    rows = [{k: v for k, v in r.items() if k != "musical_mlm_loss"} for r in synthetic_rows(100_000, 1000)]
    runs = study_runs[:3] + [write_run(tmp_path, "partial", make_config(**STUDY_RUNS[3][1]), rows)]
    with pytest.warns(PlotWarning, match="'partial' has no 'musical_mlm_loss' values"):
        figs = make_figures(runs)
    assert len(run_lines(figs["musical_mlm_loss"].axes[0])) == 3
    pink = run_lines(figs["loss"].axes[0])[3]
    assert same_color(pink.get_color(), "tab:pink") and pink.get_marker() == "D"


def test_empty_and_missing_metrics_file(study_runs, tmp_path):
    """Empty or absent metrics.jsonl is a warning naming the file; the other runs still plot."""
    empty = write_run(tmp_path, "empty", make_config(), [])
    absent = write_run(tmp_path, "absent", make_config(**{"train.run": 7}), None)
    with pytest.warns(PlotWarning, match="empty.metrics.jsonl has no metric rows"):
        assert read_run(empty).series == {}
    with pytest.warns(PlotWarning, match="absent.metrics.jsonl is missing"):
        figs = make_figures(study_runs[:2] + [absent])
    assert len(run_lines(figs["loss"].axes[0])) == 2
    with pytest.warns(PlotWarning) as record:
        assert plot_runs([empty], tmp_path / "figs") == []
    assert "no run has 'loss' values: figure loss not drawn" in [str(w.message) for w in record]


def test_malformed_line_is_skipped_with_line_number(tmp_path):
    """A malformed line (e.g. cut off by a crash) is skipped with a warning naming its line number."""
    rows = [{"step": s, "loss": float(s)} for s in range(3)]
    run_dir = write_run(
        tmp_path, "bad", make_config(), rows, extra_lines=['{"step": 3, "loss": 0.', '"text"']
    )
    with pytest.warns(PlotWarning) as record:
        run = read_run(run_dir)
    assert [str(w.message) for w in record] == run.warnings
    assert "metrics.jsonl:4: malformed line skipped" in run.warnings[0]
    assert "metrics.jsonl:5: line skipped" in run.warnings[1]
    np.testing.assert_array_equal(run.metric("loss")[0], [0, 1, 2])


def test_runs_of_different_lengths(tmp_path):
    """Runs ending at different steps are warned about and the x axis spans the longest."""
    long = write_run(tmp_path, "long", make_config(), synthetic_rows(4000, 100))
    short = write_run(tmp_path, "short", make_config(**{"train.run": 2}), synthetic_rows(1500, 100))
    with pytest.warns(PlotWarning, match="different steps .*long: 4000, short: 1500"):
        figs = make_figures([long, short])
    for fig in figs.values():
        assert fig.axes[0].get_xlim()[1] >= 4000
    assert [len(line.get_xdata()) for line in run_lines(figs["loss"].axes[0])] == [41, 16]


def test_skipped_nonfinite_steps_are_marked_not_drawn(tmp_path):
    """NaN/inf/absent loss on skipped steps is kept out of the line and marked with x's instead."""
    rows = synthetic_rows(50, 1)
    rows[10].update(loss=float("nan"), grad_norm=float("inf"), skipped_step=1)
    rows[20].update(loss=float("inf"), skipped_step=1)
    del rows[30]["loss"]
    rows[30]["skipped_step"] = 1
    run = read_run(write_run(tmp_path, "fp16", make_config(), rows))
    np.testing.assert_array_equal(run.skipped_steps, [10, 20, 30])
    for fig in make_figures([run]).values():
        ax = fig.axes[0]
        (line,) = run_lines(ax)
        assert np.isfinite(line.get_ydata()).all()
        (marks,) = [m for m in ax.get_lines() if m.get_gid() == "skipped:fp16"]
        np.testing.assert_array_equal(marks.get_xdata(), [10, 20, 30])
        assert marks.get_marker() == "x" and marks.get_linestyle() == "None"
        assert legend_texts(ax)[-1] == SKIPPED_LABEL
    assert not {10, 20, 30} & set(run.metric("loss")[0].tolist())
    assert 10 not in run.metric("grad_norm")[0] and 20 in run.metric("grad_norm")[0]


def test_rollback_event_drawn(tmp_path):
    """A rollback event is a dashed vertical line at its step, with one legend entry."""
    rows = synthetic_rows(200, 10)
    rollback = json.dumps({"step": 150, "event": "rollback", "to_step": 100, "reason": "loss spike"})
    resumed = [json.dumps(r) for r in synthetic_rows(200, 10, seed=1) if r["step"] > 100]
    run_dir = write_run(
        tmp_path,
        "spiky",
        make_config(),
        [r for r in rows if r["step"] <= 150],
        extra_lines=[rollback, *resumed],
    )
    run = read_run(run_dir)
    assert [(r.step, r.to_step, r.reason) for r in run.rollbacks] == [(150, 100, "loss spike")]
    ax = make_figures([run])["grad_norm"].axes[0]
    (vline,) = [line for line in ax.get_lines() if line.get_gid() == "rollback:spiky"]
    assert list(vline.get_xdata()) == [150, 150] and vline.get_linestyle() == "--"
    assert legend_texts(ax).count(ROLLBACK_LABEL) == 1
    assert len(run_lines(ax)[0].get_xdata()) == 21  # steps 0..200 once each


def test_duplicate_legend_text_gets_run_name(tmp_path):
    """Two runs with the same derived legend text are told apart by their directory names (warned)."""
    runs = [write_run(tmp_path, name, make_config(), synthetic_rows(100, 10)) for name in ("a", "b")]
    with pytest.warns(PlotWarning, match="share the legend text"):
        ax = make_figures(runs)["loss"].axes[0]
    assert legend_texts(ax) == [
        "Pre-Norm | Gradient Clip=10 (a)",
        "Pre-Norm | Gradient Clip=10 (b)",
    ]


def test_missing_run_dir_or_config_is_an_error(tmp_path):
    """A missing run directory or config.yaml is a clear error naming the path."""
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        read_run(tmp_path / "nowhere")
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(FileNotFoundError, match="noconfig.config.yaml is missing"):
        read_run(tmp_path / "noconfig")


# --- files and command line ------------------------------------------------------------------------


def test_plot_runs_writes_png_and_pdf(study_runs, tmp_path):
    """PNG and PDF of each figure are written, non-empty and of the right kind."""
    written = plot_runs(study_runs, tmp_path / "figs")
    names = sorted(p.name for p in written)
    assert names == sorted(
        f"{n}.{ext}"
        for n in ["loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss_cb0"]
        for ext in ("png", "pdf")
    )
    for path in written:
        head = path.read_bytes()[:8]
        assert head.startswith(b"\x89PNG" if path.suffix == ".png" else b"%PDF")
        assert path.stat().st_size > 5000


def test_cli_plot(study_runs, tmp_path, capsys):
    """`musiclm-stab plot` writes the figures, prints their paths, and reports bad input clearly."""
    out = tmp_path / "out"
    argv = [
        "plot",
        *map(str, study_runs),
        "--out",
        str(out),
        "--smooth",
        "0.5",
        "--codebooks",
        "0",
        "1",
        "--format",
        "svg",
        "--labels",
        "A",
        "B",
        "C",
        "D",
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [
        str(out / f"{n}.svg")
        for n in ["loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss_cb0", "acoustic_mlm_loss_cb1"]
    ]
    assert all(Path(p).stat().st_size > 0 for p in printed)
    assert cli.main(["plot", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert cli.main(["plot", str(study_runs[0]), "--out", str(out), "--format", "bmpx"]) == 2
    assert "unknown figure format 'bmpx'" in capsys.readouterr().err
