"""The study's claims on synthetic curves: roles and blocks, the per-run statistics (claim_stats.py), the
claims' verdicts when effects are planted or absent (claims.py), the LR grid and "learns" (lr_grid.py), the
files."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from musiclm_stab.analysis.claim_stats import (
    ROLES,
    Instability,
    RunStats,
    SpikeEvent,
    clip_share_early,
    diverged,
    early_loss,
    final_eval_cb0,
    instability,
    max_attn_logit,
    median_grad_norm,
    peak_ratio,
    precision_of,
    role_of,
    run_stats,
    spike_events,
)
from musiclm_stab.analysis.claims import (
    DOC_BEGIN,
    DOC_END,
    analyse,
    claims_of,
    cli_main,
    fill_doc,
    study_blocks,
    write_claims,
)
from musiclm_stab.analysis.decide import INCONCLUSIVE, NOT_TESTABLE, REFUTED, REPRODUCED
from musiclm_stab.analysis.lr_grid import largest_stable_lr, learns, sensitivity
from musiclm_stab.analysis.runs import RunMetrics, read_run
from musiclm_stab.config import Config, load_config, save_config
from musiclm_stab.experiments.study_plan import CPU_OVERLAYS, STUDY_RECIPES, recipe_path

ROLE_SETTINGS = {  # as the study recipes set them
    "clip10": {"optim.clip_grad": 10.0, "train.run": 1},
    "clip1": {"optim.clip_grad": 1.0, "train.run": 2},
    "deepnorm": {"model.norm_scheme": "deepnorm", "optim.clip_grad": 1.0},
    "relax": {"model.attention": "relax", "optim.clip_grad": 1.0},
    "qknorm": {"model.qk_norm": True, "optim.clip_grad": 1.0},
}
N, W = 60, 5  # logged steps 1..N (one row per step), warmup W: "early" is steps 1..10
LRS = (1e-4, 3e-4, 1e-3)


def config(role: str, lr: float, seed: int) -> Config:
    cfg = Config()
    for dotted, value in {**ROLE_SETTINGS[role], "optim.lr": lr, "train.seed": seed, "train.max_steps": N,
                          "optim.warmup_steps": W}.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg.validate()


@functools.cache
def config_dict(role: str, lr: float, seed: int) -> dict:
    return config(role, lr, seed).to_dict()


def curve(rng: np.random.Generator, *, offset: float = 0.0, early_gap: float = 0.0, noise: float = 0.01,
          spike_at: int | None = None, spike_rows: int = 1, recovers: bool = True) -> np.ndarray:
    """A fast-dropping loss (bits) 4 + 6 exp(-t/8) with noise of +-``noise``; ``early_gap`` added over 1..2W;
    a 2x excursion of ``spike_rows`` rows at ``spike_at`` (kept high to the end unless ``recovers``)."""
    t = np.arange(1, N + 1)
    loss = (4 + offset + 6 * np.exp(-t / 8)) * (1 + noise * rng.uniform(-1, 1, N))
    loss[t <= 2 * W] += early_gap
    if spike_at is not None:
        loss[spike_at - 1:(spike_at - 1 + spike_rows) if recovers else N] *= 2.0
    return loss


def make_run(role: str, lr: float, seed: int, loss: np.ndarray, *, grad: np.ndarray | None = None,
             clipped: float = 0.0, overflow: dict[int, int] | None = None,
             skipped: dict[int, int] | None = None, diverge_at: int | None = None,
             evals: tuple[float, float] | None = None, logit: float | None = None,
             path: Path | None = None) -> RunMetrics:
    """An in-memory run: one row per step (non-finite loss values kept out of the series, as read_run does),
    overflow/skipped counts at the given steps, held-out cb0 every 10 steps from evals[0] to evals[1]."""
    t = np.arange(1, N + 1)
    if diverge_at is not None:
        t, loss = t[t <= diverge_at], loss[:diverge_at]
    grad = np.ones(len(t)) if grad is None else grad[:len(t)]
    ok = np.isfinite(loss)
    series = {"loss": (t[ok], loss[ok]), "grad_norm": (t, grad),
              "grad_clipped": (t, np.full(len(t), clipped))}
    for name, counts in (("overflow_step", overflow), ("skipped_step", skipped)):
        series[name] = (t, np.array([float((counts or {}).get(int(s), 0)) for s in t]))
    if evals is not None:
        at = t[t % 10 == 0]
        series["eval/acoustic_mlm_loss/cb0"] = (at, np.linspace(evals[0], evals[1], len(at)))
    if logit is not None:
        series["diag/max_attn_logit/layer0"] = (t, np.linspace(1.0, logit, len(t)))
    return RunMetrics(name=f"{role}_{lr:g}_s{seed}", path=path or Path(f"/synthetic/{role}_{lr:g}_s{seed}"),
                      label=role, config=config_dict(role, lr, seed), series=series, diverged_at=diverge_at,
                      nonfinite={"loss": t[~ok]} if (~ok).any() else {})


def write_run(root: Path, run: RunMetrics) -> Path:
    """The run as a run directory: config.yaml (save_config), metrics.jsonl (+ the min_loss_scale event)."""
    run_dir = root / run.name
    run_dir.mkdir(parents=True)
    cfg = run.config
    save_config(config(role_of(cfg), cfg["optim"]["lr"], cfg["train"]["seed"]), run_dir / "config.yaml")
    rows: dict[int, dict] = {}
    for name, (steps, values) in run.series.items():
        for s, v in zip(steps, values):
            rows.setdefault(int(s), {"step": int(s)})[name] = float(v)
    for s in run.nonfinite.get("loss", []):
        rows.setdefault(int(s), {"step": int(s)})["loss"] = math.nan
    lines = [json.dumps(rows[s]) for s in sorted(rows)]
    if run.diverged_at is not None:
        lines.append(json.dumps({"step": run.diverged_at, "event": "min_loss_scale", "loss_scale": 0.0001,
                                 "overflow_step": 3, "reason": "loss scale at its floor"}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


# ---------------------------------------------------------------------------------------------------
# Roles, events kept, per-run statistics


def test_role_of_the_study_recipes_at_cpu_scale():
    """Each study recipe with the CPU overlays is its configuration; QK-Norm at clip 1 is the control;
    QK-Norm at clip 10 and adaptive clipping have no role."""
    roles = [role_of(load_config([recipe_path(stem), *CPU_OVERLAYS]).to_dict()) for stem in STUDY_RECIPES]
    assert roles == list(ROLES)
    base = [recipe_path(STUDY_RECIPES[0]), *CPU_OVERLAYS]
    assert role_of(load_config(base, ["--model.qk_norm=true"]).to_dict()) is None
    assert role_of(load_config(base, ["--model.qk_norm=true", "--optim.clip_grad=1"]).to_dict()) == "qknorm"
    assert role_of(load_config(base, ["--optim.clip_mode=zclip"]).to_dict()) is None
    cfg = config_dict("clip1", 1e-3, 0)
    assert precision_of(cfg) == "no"
    assert precision_of({"train": {"mixed_precision": "fp16", "fp16_mode": "fairseq"}}) == "fp16 (fairseq)"
    assert precision_of({"train": {"mixed_precision": "fp16"}}) == "fp16"  # a config from before fp16_mode
    bad = make_run("clip1", 1e-3, 0, curve(np.random.default_rng(0)))
    bad.config = {**cfg, "optim": {**cfg["optim"], "lr": "fast"}}
    with pytest.raises(ValueError, match=r"clip1_0.001_s0/config.yaml: optim.lr.*'fast'"):
        run_stats(bad)


def test_read_run_keeps_the_min_loss_scale_event(tmp_path):
    """runs.py keeps the min_loss_scale event (diverged_at) and the non-finite loss rows; a diverged run is
    the worst in early loss; an event on a branch abandoned by a resume from before it is dropped."""
    loss = curve(np.random.default_rng(0))
    loss[3] = math.nan
    run = read_run(write_run(tmp_path, make_run("clip1", 1e-3, 0, loss, diverge_at=8)))
    assert run.diverged_at == 8 and list(run.nonfinite["loss"]) == [4] and run.last_step == 8
    assert early_loss(run) == math.inf and diverged(run)
    assert spike_events(run)[-1].step == 8 and spike_events(run)[-1].recovered_at is None
    later = read_run(write_run(tmp_path / "late", make_run("clip1", 1e-3, 0, curve(np.random.default_rng(0)),
                                                          diverge_at=40)))
    assert later.diverged_at == 40 and math.isfinite(early_loss(later))  # after 2W: early loss measured
    resumed = tmp_path / "late" / later.name / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": 4.0}) + "\n" for s in range(30, 61))
    resumed.write_text(resumed.read_text() + rows)
    again = read_run(resumed.parent)
    assert again.diverged_at is None and again.last_step == 60


def test_planted_spikes_detected_by_the_progress_lost_rule():
    """A 2x excursion at step 5 of a fast-dropping curve is one event, recovered at step 6; kept high it is
    never recovered; back more than 20 rows (the window) after its last spiking step it is not recovered;
    a 2x value at step 2 (no progress yet) is no event; a non-finite loss is an unrecovered event."""
    rng = np.random.default_rng(0)
    run = make_run("deepnorm", 1e-3, 0, curve(rng, noise=0.0, spike_at=5))
    (event,) = spike_events(run)
    assert (event.step, event.recovered_at) == (5, 6) and event.lost > 1.0
    assert event.peak == pytest.approx(2 * (4 + 6 * math.exp(-5 / 8)))
    (kept,) = spike_events(make_run("deepnorm", 1e-3, 0, curve(rng, noise=0.0, spike_at=5, recovers=False)))
    assert kept.step == 5 and kept.recovered_at is None
    for rows_high, recovered_at in ((20, None), (19, 52)):
        # 2x at steps 30-32, then 1.3x (no longer spiking: 30% of the level is < half the progress, but not
        # back within 10% of the progress) for ``rows_high`` rows: back after 20 rows is not recovered.
        loss = curve(rng, noise=0.0, spike_at=30, spike_rows=3)
        loss[32:32 + rows_high] *= 1.3
        (event,) = spike_events(make_run("deepnorm", 1e-3, 0, loss))
        assert (event.step, event.recovered_at) == (30, recovered_at)
    assert spike_events(make_run("deepnorm", 1e-3, 0, curve(rng, noise=0.0, spike_at=2))) == []
    loss = curve(rng, noise=0.0)
    loss[20] = math.inf
    (bad,) = spike_events(make_run("deepnorm", 1e-3, 0, loss))
    assert (bad.step, bad.recovered_at, bad.peak) == (21, None, math.inf)


def test_noise_never_makes_a_spike_event():
    """+-2% noise on the fast-dropping curve: no event in 500 seeded runs."""
    rng = np.random.default_rng(1)
    assert sum(len(spike_events(make_run("clip1", 1e-3, 0, curve(rng, noise=0.02)))) for _ in range(500)) == 0


def test_a_smoothed_level_sees_the_spike_and_not_the_batch_scatter():
    """The learning study's batches: a loss falling from 85 to 62 bits over 1000 steps with per-step scatter of SD
    3 bits (its pilots': 3.2 about a 25-step mean), and one 2x step at 600; 20 seeded runs. The level of single
    steps (the running minimum of the losses) sits at the luckiest batch, so ordinary ones read as events: more
    than 10 a run. The level of the trailing 25-step median finds the planted step in every run, recovered, and
    under a fifth as many events in all."""
    t = np.arange(1, 1001)
    single = smoothed = 0
    for seed in range(20):
        loss = 62 + 23 * np.exp(-t / 40) + np.random.default_rng(seed).normal(0, 3.0, len(t))
        loss[599] *= 2
        run = RunMetrics(name="r", path=Path("r"), label="r", config=config_dict("clip1", 1e-3, 0),
                         series={"loss": (t, loss)})
        events = spike_events(run, smooth=25)
        assert any(e.step == 600 and e.recovered_at is not None for e in events), seed
        single, smoothed = single + len(spike_events(run)), smoothed + len(events)
    assert single > 10 * 20 and smoothed < single / 5


def test_statistics_as_defined():
    """early loss = mean over 1..2W; median and peak/median grad norm; early clip share; instability parts;
    diverged when the end is above L0; final held-out cb0 NaN for a diverged run; largest attention logit."""
    rng = np.random.default_rng(2)
    loss = curve(rng)
    grad = np.concatenate([np.full(10, 4.0), np.linspace(1.0, 3.0, N - 10)])
    grad[12] = 20.0
    run = make_run("clip1", 1e-3, 0, loss, grad=grad, clipped=0.25, overflow={3: 2, 40: 1}, skipped={41: 1},
                   evals=(9.0, 5.0), logit=30.0)
    assert early_loss(run) == pytest.approx(loss[:10].mean())
    assert median_grad_norm(run) == pytest.approx(np.median(grad))
    assert peak_ratio(run) == pytest.approx(20 / np.median(grad))
    assert clip_share_early(run) == pytest.approx(0.25)
    parts = instability(run)
    assert (parts.spikes, parts.overflow_steps, parts.skipped_steps, parts.diverged) == (0, 3, 1, False)
    assert parts.total == 4
    assert final_eval_cb0(run) == pytest.approx(5.0) and max_attn_logit(run) == pytest.approx(30.0)
    up = loss.copy()
    up[-6:] = loss[0] * 1.1  # the last 10% above L0
    gone = make_run("clip1", 1e-3, 0, up, evals=(9.0, 5.0))
    assert diverged(gone) and math.isnan(final_eval_cb0(gone)) and run_stats(gone).instability.total == 2


# ---------------------------------------------------------------------------------------------------
# Planted differences: each claim reproduced, refuted, not testable


def study(seeds: int = 6, seed: int = 0, lrs=LRS, **plant) -> list:
    """Run statistics of a study on synthetic curves: 4 roles x lrs x seeds, noise 1% and per-run offsets.
    ``plant``: role -> dict of curve()/make_run() settings plus grad_level, grad_peak; ``top`` -> settings
    for runs at the two highest lrs."""
    rng = np.random.default_rng(seed)
    stats = []
    for lr in lrs:
        for s in range(seeds):
            for role in ROLES:
                p = {**plant.get(role, {}), **(plant.get("top", {}).get(role, {}) if lr in lrs[-2:] else {})}
                loss = curve(rng, offset=rng.normal(0, 0.1), early_gap=p.get("early_gap", 0.0),
                             spike_at=p.get("spike_at"))
                grad = p.get("grad_level", 1.0) * np.exp(0.1 * rng.standard_normal(N))
                grad[W] *= p.get("grad_peak", 2.0)
                run = make_run(role, lr, s, loss, grad=grad, clipped=p.get("clipped", 0.3),
                               overflow=p.get("overflow"))
                stats.append(run_stats(run))
    return stats


def verdicts(stats) -> dict[str, str]:
    return {c.key: c.verdict for c in claims_of(study_blocks(stats))}


def test_claim_a_planted():
    """(a): clip 1 higher early at every block -> reproduced; lower -> refuted; clip 1 clipping < 20% of the
    early steps -> not testable."""
    assert verdicts(study(clip1={"early_gap": 0.5}))["a"] == REPRODUCED
    assert verdicts(study(clip10={"early_gap": 0.5}))["a"] == REFUTED
    claims = claims_of(study_blocks(study(clip1={"early_gap": 0.5, "clipped": 0.1})))
    assert claims[0].verdict == NOT_TESTABLE and "clip 1 clips 10% of early steps" in claims[0].why


def test_claim_b_planted():
    """(b): DeepNorm lower in level and peak/median at every block -> reproduced; higher -> refuted; lower in
    level but spikier -> refuted (the shape parts point against); lower in level, as spiky as the others
    -> inconclusive (the shape parts are noise)."""
    assert verdicts(study(deepnorm={"grad_level": 0.3, "grad_peak": 1.0}))["b"] == REPRODUCED
    assert verdicts(study(deepnorm={"grad_level": 3.0, "grad_peak": 6.0}))["b"] == REFUTED
    assert verdicts(study(deepnorm={"grad_level": 0.3, "grad_peak": 6.0}))["b"] == REFUTED
    assert verdicts(study(deepnorm={"grad_level": 0.3}))["b"] == INCONCLUSIVE


def test_claim_c_planted():
    """(c): a recovered DeepNorm spike at every block, none elsewhere -> reproduced; the others spiking,
    DeepNorm not -> refuted; no spike anywhere -> not testable."""
    spike = {"spike_at": 30}
    assert verdicts(study(deepnorm=spike))["c"] == REPRODUCED
    assert verdicts(study(clip10=spike, clip1=spike, relax=spike))["c"] == REFUTED
    claims = claims_of(study_blocks(study()))
    assert claims[2].verdict == NOT_TESTABLE and claims[2].why.startswith("no transient spike at this scale")


def test_claim_d_planted():
    """(d): relax slower early and clip 1 unstable (overflows) at the top rates -> reproduced; relax faster
    -> refuted; clip 1 steady at the top rates -> not testable (and still refutable by the slower part)."""
    unstable = {"top": {"clip1": {"overflow": {20: 2, 45: 1}}}}
    assert verdicts(study(relax={"early_gap": 0.5}, **unstable))["d"] == REPRODUCED
    assert verdicts(study(relax={"early_gap": -0.5}, **unstable))["d"] == REFUTED
    steady = claims_of(study_blocks(study(relax={"early_gap": 0.5})))[3]
    assert steady.verdict == NOT_TESTABLE and steady.refute_only and "no instability" in steady.why
    assert verdicts(study(relax={"early_gap": -0.5}))["d"] == REFUTED


# ---------------------------------------------------------------------------------------------------
# The no-difference world


def null_study(rng: np.random.Generator) -> list[RunStats]:
    """4 roles x 3 lrs x 3 seeds whose statistics are drawn from one distribution, from in-memory arrays:
    early loss with seed noise (now and then +inf: diverged early), log-normal gradient norms and peak
    ratios, clip shares from 0 to 50%, loss spikes in about a fifth of the runs (most recovered), overflow
    and skipped steps as counts (ties and zeros), a divergence in 3% of the runs."""
    n = len(LRS) * 3 * len(ROLES)
    early = 5.0 + rng.normal(0, 0.1, n)
    early[rng.random(n) < 0.02] = math.inf
    grad, ratio = np.exp(rng.normal(0, 0.3, n)), 1.0 + np.exp(rng.normal(0, 0.5, n))
    share = rng.uniform(0, 0.5, n)
    spikes, recovered = rng.poisson(0.25, n), rng.random(n) < 0.7
    overflow, skipped, gone = rng.poisson(1.0, n), rng.poisson(0.2, n), rng.random(n) < 0.03
    stats = []
    for i, (lr, s, role) in enumerate((lr, s, role) for lr in LRS for s in range(3) for role in ROLES):
        events = [SpikeEvent(20 + k, 8.0, 1.0, 21 + k if recovered[i] else None) for k in range(spikes[i])]
        stats.append(RunStats(f"/null/{role}_{lr:g}_s{s}", role, lr, s, "fp16 (fairseq)", float(early[i]),
                              float(grad[i]), float(ratio[i]), float(share[i]), events,
                              Instability(len(events), int(overflow[i]), int(skipped[i]), bool(gone[i]))))
    return stats


def test_no_difference_world_rarely_decides():
    """1000 simulated studies where every configuration is drawn from one distribution: a claim is
    reproduced or refuted in at most 5% of them (the measured rate is printed), and in a few seconds."""
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    decided, testable, by_claim = 0, dict.fromkeys("abcd", 0), dict.fromkeys("abcd", 0)
    for _ in range(1000):
        claims = claims_of(study_blocks(null_study(rng)))
        decided += any(c.verdict in (REPRODUCED, REFUTED) for c in claims)
        for c in claims:
            testable[c.key] += c.verdict != NOT_TESTABLE or c.refute_only
            by_claim[c.key] += c.verdict in (REPRODUCED, REFUTED)
    rate, took = decided / 1000, time.perf_counter() - t0
    print(f"\nno-difference world: a claim reproduced or refuted in {decided}/1000 studies ({rate:.1%}); "
          f"per claim {by_claim}; testable (d: at least refutable) {testable}; {took:.1f} s")
    assert rate <= 0.05
    assert all(k > 100 for k in testable.values())  # every claim was in the family often enough to matter


# ---------------------------------------------------------------------------------------------------
# LR grid, sensitivity, learns; the files and the command line


def grid_stats(finals: dict[float, list[float]], cap: float = 10.0, diverged_lrs=(),
               path: Path | None = None) -> list[RunStats]:
    """clip1 runs whose held-out cb0 goes from ``cap`` to the given finals per lr and seed."""
    out = []
    for lr, values in finals.items():
        for s, final in enumerate(values):
            loss = curve(np.random.default_rng(s))
            gone = lr in diverged_lrs and s == 0
            run = make_run("clip1", lr, s, loss, evals=(cap, final), diverge_at=40 if gone else None,
                           path=path / f"{lr:g}_{s}" if path else None)
            out.append(run_stats(run))
    return out


def test_lr_sensitivity_bootstrap_and_largest_stable_lr():
    """S = mean of min(L, cap) - min L with a diverged seed at the cap; the bootstrap interval (2000 seeded
    resamples of the seeds within each lr) holds S and is 0-wide when seeds agree; the largest stable lr."""
    finals = {1e-4: [6.0, 6.0, 6.0], 3e-4: [5.0, 5.0, 5.0], 1e-3: [7.0, 7.0, 7.0]}
    stats = grid_stats(finals, diverged_lrs=(1e-3,))
    by_lr = {lr: [s for s in stats if s.lr == lr] for lr in finals}
    result = sensitivity(by_lr)
    assert result["L"][1e-3] == pytest.approx((10 + 7 + 7) / 3)  # the diverged seed counts as the cap
    assert result["S"] == pytest.approx((6 + 5 + 8) / 3 - 5)
    lo, hi = result["ci95"]
    # at 1e-3 the seeds are (cap, 7, 7): resamples of only 7s (p = 8/27) and only the cap (p = 1/27 > 2.5%)
    assert lo < result["S"] < hi
    assert lo == pytest.approx((6 + 5 + 7) / 3 - 5) and hi == pytest.approx((6 + 5 + 10) / 3 - 5)
    assert sensitivity(by_lr) == result  # seeded
    agree = sensitivity({lr: [s for s in grid_stats({lr: v}) if s.lr == lr] for lr, v in
                         {1e-4: [6.0] * 3, 3e-4: [5.0] * 3}.items()})
    assert agree["ci95"] == pytest.approx([0.5, 0.5]) and agree["S"] == pytest.approx(0.5)
    assert largest_stable_lr(by_lr) == 3e-4


def write_probe(run_dir: Path, diff: float, ci: tuple[float, float]) -> None:
    paired = {"diff": diff, "ci95": list(ci)}
    probe = {"run": str(run_dir), "tasks": ["pitch"], "primary": {"pitch": "map"},
             "results": {"model": {"0": {"pitch": {"map": 0.4, "vs_random_init": paired}},
                                   "1": {"pitch": {"map": 0.5, "vs_random_init": paired}}},
                         "random_init": {"0": {"pitch": {"map": 0.4 - diff}}}}}
    (run_dir / "probe").mkdir(parents=True, exist_ok=True)
    (run_dir / "probe" / "probe.json").write_text(json.dumps(probe))


def test_learns_needs_both_numbers(tmp_path):
    """learns: yes when the best (role, lr) is >= 0.5 bits below the unigram level and its seed-0 probe beats
    random init with an interval above 0; no when either fails; not measured without unigram or probe."""
    stats = grid_stats({1e-4: [6.0, 6.2], 3e-4: [5.0, 5.2]}, path=tmp_path)
    assert learns(stats, None)["verdict"] == "not measured"
    result = learns(stats, 6.0)
    assert result["best"] == {"role": "clip1", "lr": 3e-4, "eval_cb0": pytest.approx(5.1)}
    assert result["eval"]["holds"] and result["verdict"] == "not measured"  # no probe.json yet
    assert learns(stats, 5.5)["verdict"] == "no"  # 0.4 bits below the unigram level
    write_probe(tmp_path / "0.0003_0", 0.05, (0.02, 0.08))
    result = learns(stats, 6.0)
    assert result["verdict"] == "yes" and result["probe"]["diff"] == 0.05 and result["probe"]["layer"] == 1
    (tmp_path / "0.0003_0" / "probe" / "probe.json").unlink()
    write_probe(tmp_path / "0.0003_0", 0.05, (-0.01, 0.1))
    assert learns(stats, 6.0)["verdict"] == "no"


def test_write_claims_files_cli_and_doc(tmp_path, capsys):
    """write_claims on run directories found below a folder: one table row per claim with its parts' numbers,
    claims.json with the same numbers, incomplete blocks and the control reported; the CLI and --doc; two
    runs of one role in a block, and no complete block, are clear errors."""
    rng = np.random.default_rng(3)
    root = tmp_path / "runs"
    for lr in (1e-4, 1e-3):
        for s in range(2):
            for role in ROLES:
                loss = curve(rng, early_gap=0.5 if role == "clip1" else 0.0)
                write_run(root, make_run(role, lr, s, loss, clipped=0.3, evals=(10.0, 6.0 + s), logit=5.0))
            if lr == 1e-3:
                write_run(root, make_run("qknorm", lr, s, curve(rng), evals=(10.0, 6.5), logit=2.0))
    write_run(root, make_run("clip1", 1e-3, 7, curve(rng)))  # a block with one run: incomplete
    # the study switched codes after the lr 1e-4 blocks (study_codes.switch_codes): claims.md names each set
    first = sorted(d.name for d in root.iterdir() if "_0.0001_" in d.name)
    (root / "data.json").write_text(json.dumps({"codes_sha256": "e" * 64, "earlier_codes": [
        {"codes_sha256": "7" * 64, "runs": first}]}))
    md, js = write_claims([root], tmp_path / "out", unigram_eval_cb0=7.0)
    text = md.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert [row[:5] for row in rows] == ["| (a)", "| (b)", "| (c)", "| (d)"]
    assert "early loss (bits): clip 1 - clip 10: n 4 of 4" in rows[0]
    assert "**not testable at this scale**" in rows[0]
    assert "Incomplete blocks, not used: lr 1e-3 seed 7 (clip1)" in text
    assert "max attention logit: clip 1 - QK-Norm: n 2 of 2, median +3" in text and "Learns: no" in text
    data = json.loads(js.read_text())
    assert data["claims"][0]["verdict"] == NOT_TESTABLE and data["blocks"]["complete"][0] == [1e-4, 0]
    assert data["claims"][1]["parts"][0]["blocks"] == 4 and data["learns"]["eval"]["unigram_eval_cb0"] == 7.0
    assert data["largest_stable_lr"]["clip1"] == 1e-3
    assert data["control"]["parts"][1]["estimate"] == pytest.approx(3.0)
    assert ("`77777777…`: lr 1e-4 seed 0, lr 1e-4 seed 1; `eeeeeeee…`: lr 1e-3 seed 0, lr 1e-3 seed 1."
            in text)
    assert [(c["lr"], c["seed"], c["codes_sha256"]) for c in data["codes"]] == [
        (1e-4, 0, ["7" * 64]), (1e-4, 1, ["7" * 64]), (1e-3, 0, ["e" * 64]), (1e-3, 1, ["e" * 64])]
    doc = tmp_path / "STUDY.md"
    doc.write_text(f"before\n{DOC_BEGIN}\nold table\n{DOC_END}\nafter\n")
    assert cli_main([str(root), "--out", str(tmp_path / "cli"), "--doc", str(doc), "--unigram", "7"]) == 0
    assert doc.read_text() == f"before\n{DOC_BEGIN}\n{text.rstrip()}\n{DOC_END}\nafter\n"
    assert "| (d)" in capsys.readouterr().out
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        fill_doc(tmp_path / "plain.md", text)
    twice = write_run(tmp_path / "twice", make_run("clip1", 1e-4, 0, curve(rng)))
    with pytest.raises(ValueError, match=f"{twice}.*both clip1"):
        write_claims([root, twice], tmp_path / "out2")
    lone = [root / f"{r}_0.0001_s0" for r in ROLES if r != "deepnorm"]
    with pytest.raises(ValueError, match="no complete block.*no deepnorm"):
        write_claims(lone, tmp_path / "out3")
    assert cli_main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "out4")]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_analyse_uses_complete_blocks_only():
    """A block missing a configuration is left out of every claim and listed; the rest are paired."""
    stats = study(seeds=2)
    stats = [s for s in stats if not (s.seed == 1 and s.lr == LRS[0] and s.role == "relax")]
    result = analyse(stats)
    assert len(result["blocks"].complete) == 5 and list(result["blocks"].incomplete) == [(LRS[0], 1)]
    assert result["claims"][0].parts[0].blocks == 5
