"""Seed-faithful figures (#45): the fp16 loss scale on the first seed figure's axes, the training loss under its
own name, every curve's start on the axis, failed runs marked by kind in the seed figures and in the lr
figure; on synthetic run directories and on the committed CPU study's runs. Then seeds, bands and the extra
figures (every codebook, attention logits, held-out curves, the legend below several panels)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import same_color
from test_plot import (
    STUDY_LABELS,
    STUDY_RUNS,
    legend_texts,
    make_config,
    run_lines,
    synthetic_rows,
    write_run,
)

from musiclm_stab import cli
from musiclm_stab.analysis.curves import ema, seed_curve, window_means
from musiclm_stab.analysis.lr_figure import lr_figure
from musiclm_stab.analysis.panels import BAND_LABEL, OUTSIDE_LABEL
from musiclm_stab.analysis.plot import make_figures, read_run
from musiclm_stab.analysis.runs import PlotWarning

REPO = Path(__file__).resolve().parents[1]
CPU_RUNS = REPO / "docs" / "study_cpu" / "runs"
UNIGRAM = 9.2875  # the CPU study's held-out unigram level (docs/STUDY.md)


def fp16_rows(max_step: int, every: int, scales) -> list[dict]:
    """synthetic_rows with the fp16 loss scale of each row from ``scales(step)``."""
    rows = synthetic_rows(max_step, every)
    for row in rows:
        row["loss_scale"] = float(scales(row["step"]))
    return rows


def gids(ax, prefix: str) -> dict[str, object]:
    """{gid: line} of the lines whose gid starts with ``prefix``."""
    return {line.get_gid(): line for line in ax.get_lines() if (line.get_gid() or "").startswith(prefix)}


def dying(rows: list[dict], at: int) -> list[dict]:
    """The rows with the frontend dying at step ``at``: features_pen (mean square, RMS^2) 1e-6 of its first
    value from there on, an RMS 1e-3 of its first."""
    for row in rows:
        row["features_pen"] = 0.01 if row["step"] < at else 1e-8
    return rows


# --- the fp16 loss scale: the seed's first figure --------------------------------------------------------


def test_loss_scale_is_the_first_figure_on_the_seeds_axes(tmp_path):
    """fp16 runs get loss_scale.png first: y "Loss Scale", linear from 0 to 2 ticked 0.00, 0.25 ... 2.00 as
    the seed's, steps linear; the values are fairseq's scale as logged (not divided by anything), and the
    training loss is its own figure under its own name."""
    seed_like = fp16_rows(10_000, 100, lambda s: 2.0 / 2 ** min(s // 1000, 5))  # 2, 1, 0.5 ... 0.0625
    figs = make_figures([write_run(tmp_path, "fp16", make_config(), seed_like)])
    assert list(figs)[:2] == ["loss_scale", "loss"]
    ax = figs["loss_scale"].axes[0]
    assert ax.get_ylabel() == "Loss Scale" and ax.get_xscale() == ax.get_yscale() == "linear"
    assert ax.get_ylim() == (0.0, 2.0)
    figs["loss_scale"].canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if 0.0 <= t.get_position()[1] <= 2.0]
    assert ticks == [f"{0.25 * i:.2f}" for i in range(9)]
    (line,) = run_lines(ax)
    np.testing.assert_array_equal(line.get_ydata(), [r["loss_scale"] for r in seed_like])
    assert figs["loss"].axes[0].get_ylabel() == "Training Loss (bits)"


def test_loss_scale_beyond_the_seeds_range_widens_the_axis_from_zero(tmp_path):
    """Our runs' scales live far above the seed's 2 (fairseq starts at 128): the axis still starts at 0 and
    reaches the curves' top, whose start is on it."""
    rows = fp16_rows(2000, 10, lambda s: 128.0 if s < 200 else 16.0)
    ax = make_figures([write_run(tmp_path, "fp16", make_config(), rows)])["loss_scale"].axes[0]
    lo, hi = ax.get_ylim()
    assert lo == 0.0 and 128.0 < hi < 160.0


def test_loss_scale_windows_keep_the_last_value_as_fairseq_logs_it(tmp_path):
    """With --window, the loss scale of each window is its last logged value (fairseq logs loss_scale with
    weight 0: the latest value, not a mean), the training loss the window's mean; each curve starts at its
    first logged row."""
    rows = fp16_rows(40, 1, lambda s: 2.0 ** (s % 4))  # 1, 2, 4, 8, 1, ...: a mean would be 3.75
    figs = make_figures([write_run(tmp_path, "fp16", make_config(), rows)], window=4)
    (scale,) = run_lines(figs["loss_scale"].axes[0])
    assert scale.get_xdata().tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert scale.get_ydata().tolist() == [1.0] + [1.0] * 10  # step 0, then the scale at each 4th step: 2^0
    (loss,) = run_lines(figs["loss"].axes[0])
    assert loss.get_ydata()[1] == pytest.approx(np.mean([r["loss"] for r in rows[1:5]]))


def test_runs_without_a_loss_scale_have_no_such_figure_and_no_warning(tmp_path, recwarn):
    """fp32 / bf16 runs log no loss scale: the figure is left out silently (it is no problem of the files)."""
    figs = make_figures([write_run(tmp_path, "fp32", make_config(), synthetic_rows(100, 10))])
    assert "loss_scale" not in figs and "loss" in figs
    assert not [w for w in recwarn if issubclass(w.category, PlotWarning)]


# --- every curve's start on the axis ------------------------------------------------------------------------


def _musical(tmp_path: Path, name: str, start: float, spike: float | None = None) -> Path:
    """A 2400-step run logged every 5 steps (the CPU study's shape): the musical loss starts at ``start``,
    is near 0.25 from step 30 on, with one logged value of ``spike`` at step 1200."""
    rows = synthetic_rows(2400, 5)[1:]  # steps 5 .. 2400
    for row in rows:
        row["musical_mlm_loss"] = start if row["step"] == 5 else (0.5 if row["step"] < 30 else 0.25)
        row["musical_mlm_loss"] += 0.01 * math.sin(row["step"])
        if spike is not None and row["step"] == 1200:
            row["musical_mlm_loss"] = spike
    return write_run(tmp_path, name, make_config(), rows)


@pytest.mark.parametrize("window", [1, 24])
def test_a_curves_first_logged_point_is_on_the_axis(tmp_path, window):
    """The musical loss's 0.84 at step 5, one point above a long tail near 0.25, is on the axis and drawn
    as a point of the line (with --window 24 too, where the first window's mean had hidden it), not a
    mark beyond the edge."""
    ax = make_figures([_musical(tmp_path, "start", 0.84)], window=window)["musical_mlm_loss"].axes[0]
    (line,) = run_lines(ax)
    assert line.get_xdata()[0] == 5 and line.get_ydata()[0] == pytest.approx(0.84 + 0.01 * math.sin(5))
    assert ax.get_ylim()[1] > 0.85
    assert not gids(ax, "outside")


def test_a_spike_no_higher_than_the_start_is_drawn_and_a_blowup_is_still_marked(tmp_path):
    """A spike to 1.4 beside a start at 1.35 (the seed's DeepNorm) is on the axis; a logged 2000 is still a
    triangle at the top edge, not the axis' top."""
    ax = make_figures([_musical(tmp_path, "spike", 1.35, spike=1.4)])["musical_mlm_loss"].axes[0]
    assert 1.4 < ax.get_ylim()[1] < 1.6 and not gids(ax, "outside")
    ax = make_figures([_musical(tmp_path, "blowup", 1.35, spike=2000.0)])["musical_mlm_loss"].axes[0]
    assert 1.35 < ax.get_ylim()[1] < 1.6
    (mark,) = gids(ax, "outside:^").values()
    assert mark.get_xdata().tolist() == [1200]


# --- failed runs in the seed figures ------------------------------------------------------------------------


def test_dead_input_run_is_dashed_from_its_step_with_a_mark_and_its_kind_in_the_legend(tmp_path):
    """A run whose frontend dies at step 250 is solid to 250, dashed and faded after, with a hollow square at
    250 and "(dead input at 250)" in its legend entry, in every figure; a healthy run beside it is drawn
    as before."""
    healthy = write_run(tmp_path, "healthy", make_config(**STUDY_RUNS[0][1]), synthetic_rows(1000, 10))
    dead = write_run(tmp_path, "dead", make_config(**STUDY_RUNS[2][1]), dying(synthetic_rows(1000, 10, seed=1), 250))
    for name, fig in make_figures([healthy, dead]).items():
        ax = fig.axes[0]
        before, healthy_line = run_lines(ax)[1], run_lines(ax)[0]
        assert before.get_xdata()[-1] == 250 and before.get_linestyle() == "-"
        after = gids(ax, "failed:")["failed:dead"]
        assert after.get_xdata()[0] == 250 and after.get_xdata()[-1] == 1000
        assert after.get_linestyle() == "--" and after.get_alpha() == 0.5
        assert same_color(after.get_color(), "tab:orange") and after.get_marker() == "^"  # the run's own
        mark = gids(ax, "failure:")["failure:dead input:dead"]
        assert mark.get_xdata().tolist() == [250] and mark.get_marker() == "s"
        texts = legend_texts(ax)
        assert texts[:2] == [STUDY_LABELS[0], f"{STUDY_LABELS[2]} (dead input at 250)"], name
        assert any(t.startswith("Dead input") for t in texts)
        assert healthy_line.get_linestyle() == "-" and len(healthy_line.get_xdata()) == 101
        assert not gids(ax, "failure:dead input:healthy")


def test_stalled_and_diverged_runs_are_marked_by_kind(tmp_path):
    """Given the unigram level, a run whose final held-out cb0 stays within 0.05 bits of it is dashed from
    its start with a star at its end, "(stalled)"; without the level it is healthy. A run that hit the loss
    scale's floor at step 300 is "(diverged at 300)" with an x there."""
    stall_rows = synthetic_rows(500, 10)
    stall_rows[-1]["eval/acoustic_mlm_loss/cb0"] = UNIGRAM - 0.02
    stall = write_run(tmp_path, "stall", make_config(**STUDY_RUNS[1][1]), stall_rows)
    floor = json.dumps({"step": 300, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 20})
    div = write_run(tmp_path, "div", make_config(**STUDY_RUNS[3][1]),
                    [r for r in synthetic_rows(500, 10, seed=2) if r["step"] < 300], [floor])
    with pytest.warns(PlotWarning, match="different steps"):
        ax = make_figures([stall, div], unigram_eval_cb0=UNIGRAM)["loss"].axes[0]
    assert legend_texts(ax)[:2] == [f"{STUDY_LABELS[1]} (stalled)", f"{STUDY_LABELS[3]} (diverged at 300)"]
    stall_line, div_line = run_lines(ax)
    assert stall_line.get_linestyle() == "--" and stall_line.get_alpha() == 0.5
    assert gids(ax, "failure:stalled:")["failure:stalled:stall"].get_xdata().tolist() == [500]
    assert gids(ax, "failure:stalled:")["failure:stalled:stall"].get_marker() == "*"
    assert gids(ax, "failure:diverged:")["failure:diverged:div"].get_xdata().tolist() == [300]
    assert div_line.get_linestyle() == "-" and div_line.get_xdata()[-1] == 290  # its rows end before the floor
    with pytest.warns(PlotWarning, match="different steps"):
        ax = make_figures([stall, div])["loss"].axes[0]
    assert legend_texts(ax)[0] == STUDY_LABELS[1] and run_lines(ax)[0].get_linestyle() == "-"


def test_bands_keep_a_dead_seed_out_of_the_healthy_mean(tmp_path):
    """--bands: of three seeds one died at step 200: the configuration's line is the mean of the two healthy
    seeds, and the dead seed is a dashed line of its own, "(dead input at 200, 1 of 3 seeds)", in the
    configuration's colour."""
    dirs = []
    for s in range(3):
        rows = synthetic_rows(600, 10, seed=s)
        dirs.append(write_run(tmp_path, f"s{s}", make_config(**{"train.seed": s, "train.run": 1}),
                              dying(rows, 200) if s == 1 else rows))
    ax = make_figures(dirs, bands=True)["loss"].axes[0]
    healthy, dead = run_lines(ax)
    means = np.mean([[r["loss"] for r in synthetic_rows(600, 10, seed=s)] for s in (0, 2)], axis=0)
    np.testing.assert_allclose(healthy.get_ydata(), means)
    assert dead.get_label() == f"{STUDY_LABELS[0]} (dead input at 200, 1 of 3 seeds)"
    assert same_color(dead.get_color(), healthy.get_color())
    assert gids(ax, "failure:")["failure:dead input:s1"].get_xdata().tolist() == [200]


def test_committed_cpu_study_marks_deepnorms_dead_input_at_the_figure_lr():
    """On the CPU study's committed runs at the figure lr 3e-3 (window 24, bands, as `musiclm-stab study`
    draws them): DeepNorm's three seeds, dead inputs at steps 430-475, are one dashed line marked at each
    seed's step; the other three configurations are healthy; the musical loss's first logged mean (0.82-0.87
    at step 5) is on the axis."""
    order = ["prenorm_clip10_run1", "prenorm_clip1_run2", "postnorm_deepnorm_clip1", "prenorm_attnrelax_clip1"]
    dirs = [CPU_RUNS / f"study_{o}_tiny_lr3e-3_s{s}" for o in order for s in range(3)]
    figs = make_figures(dirs, bands=True, window=24, unigram_eval_cb0=UNIGRAM)
    ax = figs["loss"].axes[0]
    assert legend_texts(ax)[:4] == [*STUDY_LABELS[:2], f"{STUDY_LABELS[2]} (dead input at 430-475, 3 of 3 seeds)",
                                    STUDY_LABELS[3]]
    marks = gids(ax, "failure:")
    assert list(marks) == [f"failure:dead input:{STUDY_LABELS[2]} (dead input)"]
    assert sorted(marks[list(marks)[0]].get_xdata().tolist()) == [430, 460, 475]
    assert [ln.get_linestyle() for ln in run_lines(ax)] == ["-"] * 4  # DeepNorm learned until step 430
    assert len(gids(ax, "failed:")) == 1
    musical = figs["musical_mlm_loss"].axes[0]
    firsts = [float(ln.get_ydata()[0]) for ln in run_lines(musical)]
    assert min(firsts) > 0.8 and musical.get_ylim()[1] > max(firsts)
    assert list(figs)[0] == "loss_scale" and figs["loss_scale"].axes[0].get_ylim()[0] == 0.0


def test_cli_plot_unigram(tmp_path, capsys):
    """`musiclm-stab plot --unigram BITS` draws the figures with stalled runs found; a non-number is refused."""
    rows = synthetic_rows(100, 10)
    rows[-1]["eval/acoustic_mlm_loss/cb0"] = UNIGRAM
    run = write_run(tmp_path, "stall", make_config(), rows)
    out = tmp_path / "figs"
    assert cli.main(["plot", str(run), "--out", str(out), "--unigram", str(UNIGRAM), "--format", "png"]) == 0
    assert (out / "loss.png").is_file()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plot", str(run), "--out", str(out), "--unigram", "low"])
    assert exit_info.value.code == 2 and "--unigram: invalid float value: 'low'" in capsys.readouterr().err


def test_cli_plot_stall_margin(tmp_path):
    """`--stall-margin BITS` sets how far below the unigram level a run must end not to be drawn as stalled: a
    run 0.08 bits below it is healthy at the default 0.05 and stalled at the learning study's 0.1 (the star's
    gid in the SVG)."""
    rows = synthetic_rows(100, 10)
    rows[-1]["eval/acoustic_mlm_loss/cb0"] = UNIGRAM - 0.08
    run = write_run(tmp_path, "near", make_config(), rows)
    for margin, stalled in ((None, False), ("0.1", True)):
        out = tmp_path / f"figs{margin}"
        argv = ["plot", str(run), "--out", str(out), "--unigram", str(UNIGRAM), "--format", "svg"]
        assert cli.main(argv + (["--stall-margin", margin] if margin else [])) == 0
        assert ('id="failure:stalled:near"' in (out / "loss.svg").read_text()) is stalled, margin


# --- the lr figure: failures by kind -------------------------------------------------------------------------


def _lr_run(root: Path, name: str, lr: float, final: float, *, dead_at: int | None = None,
            rising: bool = False, clip: float = 10.0, seed: int = 0) -> Path:
    rows = synthetic_rows(100, 10, seed=seed)
    rows[-1]["eval/acoustic_mlm_loss/cb0"] = final
    if dead_at is not None:
        dying(rows, dead_at)
    if rising:  # the training loss ends above its start, with no floor event: diverged by the claims' rule
        for row in rows[-3:]:
            row["loss"] = 5.0
    cfg = make_config(**{"optim.lr": lr, "optim.clip_grad": clip, "train.seed": seed, "train.run": 1})
    return write_run(root, name, cfg, rows)


def test_lr_figure_marks_dead_input_and_stalled_by_kind(tmp_path):
    """Dead-input seeds are a hollow square around their final loss (which stays in the mean), stalled ones a
    star, "n/N" beside a mark when only n of the cell's N seeds failed that way, each kind in the legend."""
    runs = [_lr_run(tmp_path, "a_lr1e-3", 1e-3, 8.8),
            _lr_run(tmp_path, "a_lr1e-2_s0", 1e-2, 9.27, dead_at=50),
            _lr_run(tmp_path, "a_lr1e-2_s1", 1e-2, 9.0, seed=1),
            _lr_run(tmp_path, "b_lr1e-3", 1e-3, UNIGRAM - 0.01, clip=1.0)]
    fig = lr_figure(runs, unigram_eval_cb0=UNIGRAM)
    ax = fig.axes[0]
    dead = gids(ax, "dead input:")
    (mark,) = dead.values()
    assert list(dead) == [f"dead input:{STUDY_LABELS[0]}"] and mark.get_marker() == "s"
    assert mark.get_xdata().tolist() == [1e-2] and mark.get_ydata().tolist() == [9.27]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == STUDY_LABELS[0]]
    assert line.get_ydata()[1] == pytest.approx((9.27 + 9.0) / 2)  # the dead seed's loss is a real final loss
    (star,) = gids(ax, "stalled:").values()
    assert star.get_marker() == "*" and star.get_xdata().tolist() == [1e-3]
    assert [t.get_text() for t in ax.texts] == ["1/2"]
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("Dead input") for t in texts) and any(t.startswith("Stalled") for t in texts)


def test_lr_figure_a_loss_ending_above_its_start_is_diverged(tmp_path):
    """A run whose training loss ends above its first value (the claims' divergence rule, no floor event) is
    an x above the curves and out of the mean, as the claims count it."""
    runs = [_lr_run(tmp_path, "lr1e-3", 1e-3, 8.8), _lr_run(tmp_path, "lr1e-2_s0", 1e-2, 9.0),
            _lr_run(tmp_path, "lr1e-2_s1", 1e-2, 8.0, rising=True, seed=1)]
    ax = lr_figure(runs).axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == STUDY_LABELS[0]]
    assert line.get_ydata().tolist() == [8.8, 9.0]
    (x,) = gids(ax, "diverged:").values()
    assert x.get_xdata().tolist() == [1e-2] and x.get_ydata()[0] > 9.0


def test_lr_figure_on_the_committed_cpu_study_marks_every_dead_cell():
    """The CPU study's 42 runs: every configuration's cell at lr 1e-2 and DeepNorm's at 3e-3 are dead
    inputs (all three seeds: no "n/N"), nothing else is marked."""
    ax = lr_figure(sorted(CPU_RUNS.glob("study_*")), unigram_eval_cb0=UNIGRAM).axes[0]
    dead = sorted((ln.get_gid().split(":", 1)[1], ln.get_xdata()[0]) for ln in ax.get_lines()
                  if (ln.get_gid() or "").startswith("dead input:"))
    qk = "Pre-Norm | QK-Norm | Gradient Clip=1"
    assert dead == sorted([(label, 1e-2) for label in [*STUDY_LABELS, qk]] + [(STUDY_LABELS[2], 3e-3)])
    assert not gids(ax, "stalled:") and not gids(ax, "diverged:") and not ax.texts


# --- seeds, bands and the extra figures (issue 16) ----------------------------------------------------


def _seed_runs(root: Path, seeds: int = 3, steps: int = 60) -> list[Path]:
    """Two configurations x ``seeds`` seeds (train.seed), every step logged, with layer diagnostics and
    held-out rows every 10 steps; seed s adds 0.1 * s to every loss, so the band's edges are known."""
    dirs = []
    for name, ov in STUDY_RUNS[:2]:
        for s in range(seeds):
            rows = synthetic_rows(steps, 1, seed=s)
            for row in rows:
                for key in list(row):
                    if "loss" in key:
                        row[key] += 0.1 * s
                if row["step"] % 10 == 0:
                    row["eval/loss"] = row["loss"]
                    row["eval/acoustic_mlm_loss/cb0"] = row["acoustic_mlm_loss/cb0"]
                    row["eval/musical_mlm_loss"] = row["musical_mlm_loss"]
                    for layer in range(3):
                        row[f"diag/max_attn_logit/layer{layer}"] = float(layer + s + row["step"])
            dirs.append(write_run(root, f"{name}_s{s}", make_config(**ov, **{"train.seed": s}), rows))
    return dirs


def test_seed_bands_one_line_per_configuration_with_min_max_band(tmp_path):
    """--bands: the seeds of a configuration are one line (mean of their EMAs) in a min-max band, legend kept."""
    dirs = _seed_runs(tmp_path)
    fig = make_figures(dirs, smooth=0.5, bands=True)["loss"]
    ax = fig.axes[0]
    lines = run_lines(ax)
    assert [line.get_label() for line in lines] == STUDY_LABELS[:2]
    assert legend_texts(ax) == [*STUDY_LABELS[:2], BAND_LABEL.format(3, " (EMA 0.5)")]
    runs = [read_run(d) for d in dirs[:3]]  # the first configuration's three seeds
    curves = [ema(r.metric("loss")[1], 0.5) for r in runs]
    np.testing.assert_allclose(lines[0].get_ydata(), np.mean(curves, axis=0))
    (band,) = [c for c in ax.collections if c.get_gid() == f"band:{STUDY_LABELS[0]}"]
    ys = band.get_paths()[0].vertices[:, 1]
    # The band spans the lowest to the highest seed's EMA: seed 0 and seed 2 (+0.2 on every loss).
    assert ys.min() == pytest.approx(min(c.min() for c in curves))
    assert ys.max() == pytest.approx(max(c.max() for c in curves))
    raw = [line for line in ax.get_lines() if (line.get_gid() or "") == f"raw:{STUDY_LABELS[0]}"]
    np.testing.assert_allclose(raw[0].get_ydata(), np.mean([r.metric("loss")[1] for r in runs], axis=0))
    assert same_color(band.get_facecolor()[0][:3], lines[0].get_color())


def test_seed_curve_runs_with_different_steps(tmp_path):
    """A seed missing steps (stopped early) leaves the others' curves whole: each seed smoothed on its own."""
    short = write_run(tmp_path, "short", make_config(), synthetic_rows(20, 1, seed=0))
    long = write_run(tmp_path, "long", make_config(), synthetic_rows(40, 1, seed=1))
    runs = [read_run(short), read_run(long)]
    curve = seed_curve(runs, "loss", 0.6)
    assert list(curve.steps) == list(range(41)) and list(curve.count[:21]) == [2] * 21
    assert list(curve.count[21:]) == [1] * 20
    np.testing.assert_allclose(curve.line[21:], ema(runs[1].metric("loss")[1], 0.6)[21:])
    assert (curve.lo <= curve.line).all() and (curve.line <= curve.hi).all()


def test_max_attention_logit_keeps_steps_where_layerdrop_skipped_a_layer(tmp_path):
    """The overall max attention logit at a step is the largest of the layers logged there: a layer skipped
    by layerdrop (base size) logs nothing at that step, and the step stays in the curve (requiring every
    layer had dropped about half the steps of the GPU study's 12-layer runs, and its peak)."""
    from musiclm_stab.analysis.curves import MAX_LOGIT, with_derived

    rows = synthetic_rows(40, 10)
    for row in rows:
        for layer in range(3):
            if not (layer == 2 and row["step"] == 20):  # layer 2 dropped at step 20
                row[f"diag/max_attn_logit/layer{layer}"] = float(10 * layer + row["step"])
    steps, values = with_derived(read_run(write_run(tmp_path, "layerdrop", make_config(), rows))).series[MAX_LOGIT]
    assert steps.tolist() == [0, 10, 20, 30, 40]
    assert values.tolist() == [20.0, 30.0, 30.0, 50.0, 60.0]  # at step 20 layer 1's 10 + 20


def test_extra_figures_codebooks_attention_logits_and_held_out(tmp_path):
    """--extra draws every codebook's panel, the max attention logit (overall and per layer) and the held-out curves."""
    dirs = _seed_runs(tmp_path, seeds=2)
    figs = make_figures(dirs, bands=True, extra=True)
    assert {"acoustic_mlm_loss_codebooks", "max_attn_logit", "max_attn_logit_layers", "eval"} <= set(figs)
    assert figs["grad_norm_log"].axes[0].get_yscale() == "log" and figs["grad_norm"].axes[0].get_yscale() == "linear"
    panels = [ax for ax in figs["acoustic_mlm_loss_codebooks"].axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == [f"Acoustic MLM Loss on Codebook-{k} (bits)" for k in range(8)]
    assert all(ax.get_xscale() == "symlog" for ax in panels)  # the study's log-scaled steps, as codebook 0
    layers = [ax for ax in figs["max_attn_logit_layers"].axes if ax.get_visible()]
    assert len(layers) == 3
    # The overall max is the largest layer (layer 2: 2 + seed + step), averaged over the 2 seeds.
    (line,) = [ln for ln in run_lines(figs["max_attn_logit"].axes[0]) if ln.get_label() == STUDY_LABELS[0]]
    np.testing.assert_allclose(line.get_ydata(), [2 + 0.5 + s for s in range(0, 61, 10)])
    eval_axes = [ax for ax in figs["eval"].axes if ax.get_visible()]
    assert len(eval_axes) == 3 and all(len(run_lines(ax)[0].get_xdata()) == 7 for ax in eval_axes)
    assert "Held-out Loss (bits)" in eval_axes[0].get_title()
    assert [ax.get_xscale() for ax in eval_axes] == ["linear"] * 3  # evaluations evenly spaced, from the first
    # Without diagnostics or held-out rows those figures are left out, silently (the study's four stay).
    plain = make_figures([write_run(tmp_path, "plain", make_config(), synthetic_rows(50, 1))], extra=True)
    assert "max_attn_logit" not in plain and "eval" not in plain and "loss" in plain


def test_the_legend_below_several_panels_fits_the_figure(tmp_path):
    """A figure of several panels has one legend below them, in as many columns (at most 3) as fit its width:
    long entries (a failure's steps and seeds in each) no longer run past the right edge of the saved file."""
    dirs = _seed_runs(tmp_path, seeds=1, steps=30)
    for labels, columns in ((None, 2), (["Post-Norm | DeepNorm | Gradient Clip=1 (dead input at 274-781, 7 of 8 "
                                         f"seeds) and more words to make it long {k}" for k in range(2)], 1)):
        fig = make_figures(dirs, labels=labels, extra=True)["eval"]
        fig.canvas.draw()
        (legend,) = fig.legends
        assert 0 <= legend.get_window_extent().x0 and legend.get_window_extent().x1 <= fig.bbox.width
        rows = {round(t.get_window_extent().y0) for t in legend.get_texts()}
        assert len(legend.get_texts()) == 2 and len(rows) == 2 // columns  # side by side when they fit


def test_cli_plot_bands_and_extra(tmp_path, capsys):
    """`musiclm-stab plot --bands --extra` writes the study's four figures and the extra ones."""
    dirs = _seed_runs(tmp_path / "runs", seeds=2, steps=30)
    out = tmp_path / "figs"
    assert cli.main(["plot", *map(str, dirs), "--out", str(out), "--bands", "--extra", "--format", "svg"]) == 0
    assert sorted(p.stem for p in out.glob("*.svg")) == sorted(
        ["loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss_cb0", "acoustic_mlm_loss_codebooks",
         "grad_norm_log", "max_attn_logit", "max_attn_logit_layers", "eval"])


def test_window_means_are_fairseqs_log_rows():
    """window_means: the mean over each window of N steps, placed at its last logged step (fairseq's rows)."""
    steps = np.arange(1, 11)
    at, means = window_means(steps, steps.astype(float), 4)
    assert at.tolist() == [4, 8, 10] and means.tolist() == [2.5, 6.5, 9.5]
    at, means = window_means(np.array([2, 4, 6, 8]), np.array([1.0, 3.0, 5.0, 7.0]), 4)
    assert at.tolist() == [4, 8] and means.tolist() == [2.0, 6.0]


def test_one_outlier_is_marked_not_scaling_the_axis(tmp_path):
    """A loss near 0.1 with one logged value of 2000: the y axis stays on the curve (its descent from 1.5
    included) and the outlier is a triangle at the top edge; without it nothing is marked."""
    rows = synthetic_rows(10_000, 100, seed=1)
    rows[60]["loss"] = 2000.0
    spiky = write_run(tmp_path, "spiky", make_config(), rows)
    ax = make_figures([spiky])["loss"].axes[0]
    lo, hi = ax.get_ylim()
    assert 1.5 < hi < 3.0 and lo < 0.1
    marks = [line for line in ax.get_lines() if line.get_gid() == "outside:^"]
    assert len(marks) == 1 and marks[0].get_xdata().tolist() == [6000]
    assert OUTSIDE_LABEL in legend_texts(ax)
    calm = write_run(tmp_path, "calm", make_config(), synthetic_rows(10_000, 100, seed=1))
    ax = make_figures([calm])["loss"].axes[0]
    assert not [line for line in ax.get_lines() if (line.get_gid() or "").startswith("outside")]


def test_loss_scale_and_evaluation_figures_say_what_they_draw(tmp_path):
    """--extra with fp16 rows draws loss_scale_log.png on a log axis (loss_scale.png is the seed's linear
    one); the held-out curves are drawn as evaluated (no window means, no EMA) and their band says so."""
    dirs = []
    for seed in range(2):
        rows = synthetic_rows(1000, 10, seed=seed)
        for r in rows:
            r["loss_scale"] = 128.0 / (1 + r["step"] // 500)
            if r["step"] % 100 == 0:
                r["eval/acoustic_mlm_loss/cb0"] = 9.0 - r["step"] / 1000
        dirs.append(write_run(tmp_path, f"s{seed}", make_config(**{"train.seed": seed}), rows))
    figs = make_figures(dirs, bands=True, extra=True, window=5, smooth=0.5)
    assert figs["loss_scale_log"].axes[0].get_yscale() == "log"
    assert figs["loss_scale"].axes[0].get_yscale() == "linear"
    eval_ax = figs["eval"].axes[0]  # one panel: the runs logged only the codebook-0 held-out loss
    assert eval_ax.get_ylabel().startswith("Held-out Acoustic MLM Loss on Codebook-0")
    assert [t for t in legend_texts(eval_ax) if t.startswith("Band")] == [BAND_LABEL.format(2, "")]
    loss_band = [t for t in legend_texts(figs["loss"].axes[0]) if t.startswith("Band")]
    assert loss_band == [BAND_LABEL.format(2, " (means over 5 steps, EMA 0.5)")]


def test_lr_figure_lines_bands_unigram_and_diverged_marks(tmp_path):
    """lr_sensitivity.png: one line per configuration over the lrs (mean of the seeds' last held-out
    codebook-0 loss, min-max band), the unigram level dashed, a diverged seed an x above every point and
    not in the mean; configurations diverging at one lr on rows of their own (none hides another), the
    number of seeds beside an x for more than one; the legend below the axes, over no point."""
    from musiclm_stab.analysis.lr_figure import DIVERGED_LABEL, lr_figure, lr_table

    dirs = []
    for clip, cells in ((10.0, ((1e-3, (9.0, 9.2)), (1e-2, (8.5, 8.7)), (1e-1, (9.9, None)))),
                        (1.0, ((1e-3, (9.1, 9.3)), (1e-1, (None, None))))):
        for lr, finals in cells:
            for seed, final in enumerate(finals):
                rows = synthetic_rows(100, 10, seed=seed)
                rows[-1]["eval/acoustic_mlm_loss/cb0"] = final if final is not None else 9.0
                extra = ([json.dumps({"step": 100, "event": "min_loss_scale", "loss_scale": 1.0})]
                         if final is None else [])
                config = make_config(**{"optim.lr": lr, "train.seed": seed, "optim.clip_grad": clip})
                dirs.append(write_run(tmp_path, f"clip{clip}_lr{lr}_s{seed}", config, rows, extra))
    runs = [read_run(d) for d in dirs]
    table = lr_table(runs)
    label, other = table
    assert {lr: [round(v, 3) if math.isfinite(v) else None for v in vals] for lr, vals in table[label].items()} == {
        1e-3: [9.0, 9.2], 1e-2: [8.5, 8.7], 1e-1: [9.9, None]}
    fig = lr_figure(runs, unigram_eval_cb0=9.5)
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert line.get_xdata().tolist() == [1e-3, 1e-2, 1e-1]
    assert [round(y, 3) for y in line.get_ydata()] == [9.1, 8.6, 9.9]
    marks = {ln.get_gid(): (ln.get_xdata().tolist(), ln.get_ydata().tolist()) for ln in ax.get_lines()
             if (ln.get_gid() or "").startswith("diverged")}
    assert sorted(marks) == sorted([f"diverged:{label}", f"diverged:{other}"])
    (x1, (y1,)), (x2, (y2,)) = marks[f"diverged:{label}"], marks[f"diverged:{other}"]
    assert x1 == x2 == [0.1] and y1 != y2 and min(y1, y2) > 9.9 and max(y1, y2) < ax.get_ylim()[1]
    # "1/2": the first configuration's seed at 0.1 ended at 9.9, above the unigram level: stalled (a star);
    # "2": both seeds of the second configuration diverged at 0.1
    assert [t.get_text() for t in ax.texts] == ["1/2", "2"]
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert "Unigram level (held-out): 9.50 bits" in texts and DIVERGED_LABEL in texts and ax.get_xscale() == "log"
    fig.canvas.draw()
    assert legend.get_window_extent().y1 <= ax.get_window_extent().y0  # below the axes: it hides no point
