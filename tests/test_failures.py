"""Failure kinds and spike cascades (analysis/failures.py) on synthetic runs and on committed CPU-study runs;
the overflows of a divergence's event row are counted (analysis/runs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from musiclm_stab.analysis.claim_stats import instability
from musiclm_stab.analysis.failures import cascades, dead_input_step, divergence_step, failure, stalled
from musiclm_stab.analysis.runs import read_run

REPO = Path(__file__).resolve().parents[1]
CPU_RUNS = REPO / "docs" / "study_cpu" / "runs"
UNIGRAM = 9.2875  # the CPU study's held-out unigram level (docs/STUDY.md)


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"loss_unit": "bits"}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int = 100, *, pen=None, loss=None, scale=None, overflow=None, eval_cb0=None) -> list[dict]:
    """One row per step 1..n: a falling loss, a living frontend (features penalty 0.1 -> 0.002), scale 64."""
    out = []
    for i in range(n):
        t = i + 1
        row = {"step": t, "loss": 80.0 - 15.0 * (1 - math.exp(-t / 20)),
               "features_pen": 0.1 * math.exp(-t / 25) + 0.002, "loss_scale": 64.0, "overflow_step": 0}
        for key, series in (("features_pen", pen), ("loss", loss), ("loss_scale", scale),
                            ("overflow_step", overflow)):
            if series is not None:
                row[key] = series[i]
        if eval_cb0 is not None and t == n:
            row["eval/acoustic_mlm_loss/cb0"] = eval_cb0
        out.append(row)
    return out


def test_dead_input_is_a_frontend_rms_that_ends_below_one_percent(tmp_path):
    """A frontend whose RMS falls below 1% of its first value and ends there is dead from the first step
    below (flickering back above it in between); one that dips as low and recovers is alive."""
    pen = 0.1 * np.exp(-np.arange(1, 101) / 4.0)  # RMS below 1% (pen below 1e-4 of it) from step 38
    pen[50:55] = 0.01  # flickers back up, dies again
    run = read_run(write_run(tmp_path / "dead", rows(pen=list(pen))))
    assert dead_input_step(run) == 38
    assert failure(run).kind == "dead input" and failure(run).step == 38
    dip = pen.copy()
    dip[60:] = 0.002  # back to a living frontend's level
    alive = read_run(write_run(tmp_path / "alive", rows(pen=list(dip))))
    assert dead_input_step(alive) is None and failure(alive).kind == "none"


def test_divergence_step_is_the_floor_event_or_where_the_loss_stays_above_its_start(tmp_path):
    """Diverged at the floor event's step (its 20 overflows counted as overflow steps), or, without one, at
    the first step from which the loss stays above its first logged value; a transient excursion above it
    is not a divergence."""
    floor = rows(40) + [{"step": 40, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 20}]
    run = read_run(write_run(tmp_path / "floor", floor))
    assert run.final_overflows == 20 and instability(run).overflow_steps == 20
    assert divergence_step(run) == 40 and failure(run).kind == "diverged"
    assert [(c.step, c.scale, c.overflows) for c in cascades(run)] == [(40, 0.0, 20)]
    loss = [80.0 - 0.2 * t for t in range(60)] + [85.0 + t for t in range(40)]  # above 80 from step 61
    assert divergence_step(read_run(write_run(tmp_path / "up", rows(loss=loss)))) == 61
    blip = [80.0 - 0.2 * t for t in range(100)]
    blip[30:33] = [90.0, 95.0, 90.0]
    transient = read_run(write_run(tmp_path / "blip", rows(loss=blip)))
    assert divergence_step(transient) is None and failure(transient).kind == "none"


def test_stalled_is_a_final_held_out_cb0_within_the_margin_of_the_unigram_level(tmp_path):
    """Stalled: the final held-out cb0 no more than 0.05 bits below the unigram level; unknown without
    the level or the evaluation; a dead input takes precedence."""
    near = read_run(write_run(tmp_path / "near", rows(eval_cb0=UNIGRAM - 0.02)))
    far = read_run(write_run(tmp_path / "far", rows(eval_cb0=UNIGRAM - 0.4)))
    assert stalled(near, UNIGRAM) and not stalled(far, UNIGRAM)
    assert stalled(near, None) is None and stalled(read_run(write_run(tmp_path / "x", rows())), UNIGRAM) is None
    assert failure(near, UNIGRAM).kind == "stalled" and failure(far, UNIGRAM).kind == "none"


def test_routine_scaler_overflows_are_not_cascades_but_a_fall_of_8x_is(tmp_path):
    """The scaler's clock (doubling after the window, halving at the next overflow: 64, 128, 64, ...) is no
    cascade; a fall from 64 to 4 within 32 steps is one event however many rows it spans."""
    routine = [128.0 if t % 33 == 32 else 64.0 for t in range(1, 101)]
    overflow = [1 if t % 33 == 0 else 0 for t in range(1, 101)]
    assert cascades(read_run(write_run(tmp_path / "routine", rows(scale=routine, overflow=overflow)))) == []
    fall = [64.0] * 50 + [16.0, 4.0] + [4.0] * 10 + [8.0] * 38
    events = cascades(read_run(write_run(tmp_path / "fall", rows(scale=fall))))
    assert [(c.step, c.scale, c.before) for c in events] == [(52, 4.0, 64.0)]  # 16 is not yet 8x below


@pytest.mark.parametrize("name, kind", [
    ("study_prenorm_clip10_run1_tiny_lr1e-2_s2", "dead input"),
    ("study_postnorm_deepnorm_clip1_tiny_lr3e-3_s0", "dead input"),
    ("study_prenorm_clip10_run1_tiny_lr1e-3_s0", "none"),
])
def test_committed_cpu_study_runs_read_as_dead_input_or_healthy(name, kind):
    """On the CPU study's committed runs: a run stalled at the unigram level at lr 1e-2 (and DeepNorm at
    3e-3) is a dead input, its frontend RMS below 1% of its first value from a step in 120-500; a run that
    learned is none; clip 10's cascade at step 565 of lr 1e-2 seed 2 (6 overflows, 64 -> 0.5) is found."""
    run = read_run(CPU_RUNS / name)
    found = failure(run, UNIGRAM)
    assert found.kind == kind
    if kind == "dead input":
        assert 120 <= found.step <= 500
    if name.endswith("lr1e-2_s2"):
        assert any((c.step, c.scale, c.overflows) == (565, 0.5, 6) for c in cascades(run))


def test_summary_row_names_the_failure_its_step_headroom_and_lr():
    """A study's summary.json row (experiments/study.summarize) names the run's failure kind and step, its lr,
    its cascades and the largest fp16 headroom logged, and counts a divergence's own overflows."""
    from musiclm_stab.experiments.study import summarize

    dead = summarize(CPU_RUNS / "study_prenorm_clip10_run1_tiny_lr1e-2_s2", unigram_eval_cb0=UNIGRAM)
    assert (dead["failure"], dead["failure_step"], dead["lr"]) == ("dead input", 375, 0.01)
    assert dead["headroom"]["attn_logit"] == pytest.approx(970 / 65504, rel=0.01) and dead["cascades"] >= 1
    healthy = summarize(CPU_RUNS / "study_prenorm_clip10_run1_tiny_lr1e-3_s0", unigram_eval_cb0=UNIGRAM)
    assert (healthy["failure"], healthy["failure_step"]) == ("none", None)
    gpu = summarize(REPO / "docs" / "study_gpu" / "runs" / "study_prenorm_clip1_run2_gpu_lr1.5e-2_s0")
    assert (gpu["failure"], gpu["failure_step"], gpu["overflow_steps"]) == ("diverged", 39, 21)


def test_a_design_that_assesses_no_stalls_finds_none_in_its_rows_or_lr_figure(tmp_path):
    """The instability design assesses no stalls (its analysis does not): its study's summary rows and lr
    figure mark a run at the unigram level as such only where the design assesses stalls (the claims
    design), so a healthy run is not drawn as a failed one."""
    import matplotlib.pyplot as plt

    from musiclm_stab.analysis.lr_figure import lr_figure
    from musiclm_stab.analysis.runs import read_run
    from musiclm_stab.experiments.study import summarize
    from musiclm_stab.experiments.study_plan import plan_study

    assert not plan_study("cpu", tmp_path, data="x", design="instability", seeds=1, lrs=(1e-2,)).assesses_stalls
    assert plan_study("cpu", tmp_path, data="x", seeds=1, lrs=(1e-3,)).assesses_stalls
    healthy = CPU_RUNS / "study_prenorm_clip10_run1_tiny_lr1e-3_s0"
    level = summarize(healthy)["final_eval_cb0"] + 0.01  # a unigram level its final loss is not 0.05 below
    assert summarize(healthy, unigram_eval_cb0=level)["failure"] == "stalled"
    assert summarize(healthy, unigram_eval_cb0=level, stalls=False)["failure"] == "none"
    run = read_run(healthy, "bits")
    for stalls, marks in ((True, ["stalled:" + run.label]), (False, [])):
        fig = lr_figure([run], level, stalls=stalls)
        assert [a.get_gid() for a in fig.axes[0].lines if a.get_gid()] == marks
        assert any(line.get_label().startswith("Unigram level") for line in fig.axes[0].lines)  # drawn either way
        plt.close(fig)


def cascades_by_row(steps: np.ndarray, scale: np.ndarray, overflow: dict, bits: int = 3, window: int = 32) -> list:
    """The cascade rule row by row, as written first (the reference for the vectorised ``cascades``)."""
    events, previous = [], None
    for step, s in zip(steps, scale):
        earlier = scale[(steps >= step - window) & (steps < step)]
        if len(earlier) and s * 2**bits <= earlier.max():
            n = int(overflow.get(step, 0))
            if previous is not None:
                events[-1] = (events[-1][0], min(events[-1][1], float(s)), events[-1][2], events[-1][3] + n)
            else:
                events.append((int(step), float(s), float(earlier.max()), n))
            previous = step
        else:
            previous = None
    return events


def test_cascades_equal_the_row_by_row_rule_on_random_scales():
    """The vectorised cascades (a sparse table of window maxima) find exactly the events, lowest scales, maxima
    before and overflow counts of the rule applied row by row, on random loss-scale walks with gaps in the
    logged steps (every step, every few steps, a row missing here and there)."""
    from musiclm_stab.analysis.runs import RunMetrics

    rng = np.random.default_rng(0)
    found = 0
    for trial in range(60):
        n = int(rng.integers(1, 400))
        steps = np.cumsum(rng.choice([1, 1, 1, 2, 5, 40], n) if trial % 3 else np.ones(n, dtype=np.int64))
        scale = 2.0 ** np.clip(np.cumsum(rng.choice([-3, -1, 0, 0, 0, 1], n)), -14, 7)
        overflow = rng.integers(0, 3, n).astype(np.float64)
        run = RunMetrics("r", Path("r"), "r", {}, series={"loss_scale": (steps, scale), "overflow_step": (steps, overflow)})
        got = [(c.step, c.scale, c.before, c.overflows) for c in cascades(run)]
        assert got == cascades_by_row(steps, scale, dict(zip(steps, overflow))), trial
        found += len(got)
    assert found > 50  # the walks do fall: the comparison is not of empty lists
