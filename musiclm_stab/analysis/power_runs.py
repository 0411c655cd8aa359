"""Power of the learning study's design by simulating its runs, not its endpoints (issue 55, docs/STUDY.md).

    python -m musiclm_stab.analysis.power_runs --out DIR [--seeds 6 8 10] [--studies 200] [--rates FILE] [--seed 0]
        [--dead ROLE=P:FIRST:LAST ...]
    python -m musiclm_stab.analysis.power_runs --measure RUN_DIR_OR_FOLDER ... --out DIR [--calibration-lrs ...]
        [--spike-smooth N]

Each simulated study is a set of runs of the design (analysis/learning.py): per run a metrics series as the
trainer logs it, every step, held as the ``RunMetrics`` that ``runs.read_run`` makes of its run directory
(``write_run`` writes the same run as files; a test reads them back and finds the same endpoints), with a config
of the plan (the real recipes and overlays through ``config.load_config``, so ``learning_role`` finds its role).
Every simulated run goes through the analysis's own code: ``learning.learning_run`` (instability.endpoints:
failures.failure, the spike and cascade detectors), ``mark_own_spikes``, and ``control_of``, ``claims_of``,
``mechanism_of`` with their four verdicts. The share of studies reproducing a planted effect is its power.

A run of arm ``claims`` (H steps, a warmup of 8% of them; in bits):

- training loss: a curve falling from L0 to ``loss_end`` with time constant ``tau`` steps, plus a block offset
  and a run offset (their SDs: the measured block and run SDs of early loss less what the per-step noise
  explains), plus per-step batch noise shared by every run of the block at the same step (``batch_sd``: the
  same batches) and per-run noise (``run_sd``), both scaled by the share of the fall made so far (at
  initialisation every batch costs about L0: in the learning pilots the scatter about a 9-step mean was 1.0 bits
  over steps 5-20 and 2.6-3.2 from step 100), plus spikes: shared hard-batch events (per block, Poisson at
  ``shared_per_100`` per 100 steps, hitting every run of the block) and own events (per run, ``own_per_100``),
  each a one-step jump of 1-2x the progress made so far, back the step after;
- fairseq's loss scale: 128 at first, halved at an overflow, doubled after 32 clean steps, overflowing at 128
  (the scale sits at 64, as it did in the instability study); a cascade (three overflows in a row) at
  ``cascades_per_100``; gradient norms log-normal around a curve falling from ``grad_first`` to ``grad_late``
  (``lngrad_step_sd`` per step; block and run levels), clipped at the run's clip value; features_pen of an alive
  frontend; diagnostics every 5 steps (attention logit, residual and frontend headroom); the training cb0 at
  step 1 at ``cap``; held-out cb0 every 100 steps and at H, ending ``FINAL_GAIN`` below the unigram level with
  block and run SDs (``final_block_sd``, ``final_run_sd``).

A run of arm ``mechanism`` (MECH_STEPS steps, no warmup but m_warmup's) diverges at a step drawn from
``pre_ln_failure_steps`` (the Pre-LN failures at lr 1e-1 of the calibration): its loss scale falls to the
floor and a ``min_loss_scale`` event ends it, as the trainer writes it (m_fp32: no loss scale; its loss stays
above L0 from that step on).

The null study: every role of an arm drawn alike (no configuration more stable or faster); every claims run
learns, unless the scenario says a role's frontend dies (``--dead ROLE=P:FIRST:LAST``, the ``dead`` argument):
the calibration's DeepNorm run lost its input at step 672 of 1000 at L (docs/STUDY.md "Calibration: the
result"). Such a run dies with probability P at a step drawn uniformly from FIRST..LAST (from a generator of its
own key, so a run dies at the same step in every effect, and one that does not die is the run of the default
scenario): from that step its features_pen is 1e-8 of its first value (the frontend's RMS 1e-4 of it: the CPU
study's dead runs ended at most 4e-4), its loss makes no more progress and its held-out cb0 sits at the
unigram level (about: the block and run SDs); failures.failure finds it dead at that step. The table states
its scenario and, per number of seeds, the share of null studies where each claim is not testable at this
scale (fewer than MIN_BLOCKS blocks where its roles learned).

The planted effects (``EFFECTS``), each alone on the null study (in the same scenario): the control's
interaction 0.2 and 0.5 bits (Post-LN without warmup that much worse at H); (a) clip 10's early loss 2 x
DELTA_EARLY lower; (b) DeepNorm's gradient norm 0.3 lower in ln than each; (c) DeepNorm one more own recovered
spike per run; (d) relax 2 x DELTA_EARLY slower early and clip 1 one more cascade per run; M1, M2, M3 the
treated role surviving the horizon while its baseline fails at its drawn step. Common random numbers: an
effect re-draws only the runs it plants into, from the same generators, and a study of n seeds is the first n
blocks of the largest; each study's runs come from generators keyed by (seed, study, block, role), so a table
reproduces exactly.

Rates (analysis/power_rates.py ``Rates``) are measured on run directories by ``measure_rates``: by default on
the instability study's archive (DEFAULT_RATES; the command in its ``source``); the lead re-runs it on the
calibration runs (``--measure``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from musiclm_stab.analysis import learning, learning_params
from musiclm_stab.analysis.claim_stats import EVAL_CB0
from musiclm_stab.analysis.decide import ABSENT, NOT_TESTABLE, REFUTED, REPRODUCED
from musiclm_stab.analysis.instability import EARLY_SHARE
from musiclm_stab.analysis.learning import LearningRun
from musiclm_stab.analysis.learning_params import CLAIMS, MECH_ROLES, MECHANISM
from musiclm_stab.analysis.power_dead import (
    CLAIM_ROLES,
    DEAD_PEN,
    DeadInput,
    check_dead,
    dead_input_at,
    describe_dead,
    keyed_rng,
    parse_dead,
)
from musiclm_stab.analysis.power_rates import DEFAULT_RATES, Rates, measure_rates
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.config.loading import load_config

UNIGRAM = 9.287458645197248  # the instability study's held-out unigram level (docs/STUDY.md)
FINAL_GAIN = 0.3  # bits below the unigram level at H: the CPU study's runs were 0.24-0.41 below at step 1000
SCALE_CAP = 128.0  # the loss scale overflows at this scale (the instability study's sat at 64)
SCALE_WINDOW = 32
DIAG_EVERY = 5
EVAL_EVERY = 100
ROLE_KEYS = {r: i for i, r in enumerate((*CLAIM_ROLES, *MECH_ROLES))}
NULL = "null"
EFFECTS = (NULL, "control 0.2", "control 0.5", "a", "b", "c", "d", "M1", "M2", "M3")
TARGET = {"control 0.2": "control", "control 0.5": "control", "a": "a", "b": "b", "c": "c", "d": "d", "M1": "M1",
          "M2": "M2", "M3": "M3"}
PLANTED = {"control 0.2": {"post_nw"}, "control 0.5": {"post_nw"}, "a": {"clip10"}, "b": {"deepnorm"},
           "c": {"deepnorm"}, "d": {"relax", "clip1"}, "M1": {"m_warmup"}, "M2": {"m_fp32"}, "M3": {"m_post10_relax"}}
WHAT = {"control 0.2": "interaction +0.2 bits", "control 0.5": "interaction +0.5 bits",
        "a": "clip 10 early loss 2 x DELTA_EARLY lower", "b": "DeepNorm ln grad norm 0.3 lower",
        "c": "DeepNorm +1 own recovered spike a run", "d": "relax 2 x DELTA_EARLY slower, clip 1 +1 cascade a run",
        "M1": "m_warmup survives", "M2": "m_fp32 survives", "M3": "m_post10_relax survives"}
KEYS = ("a", "b", "c", "d", "M1", "M2", "M3")
CLAIM_KEYS = ("a", "b", "c", "d")


# ---------------------------------------------------------------------------------------------------
# Simulated runs


def _config(role: str) -> dict:
    """The plan's config of ``role`` (seed 0): the real recipe, the cpu overlays and the spec's overrides, at
    the design's present L and H."""
    return _config_at(role, learning_params.L, learning_params.H)


@functools.cache
def _config_at(role: str, lr: float, horizon: int) -> dict:
    repo = Path(__file__).resolve().parents[2]
    stems = {"clip10": "study_prenorm_clip10_run1", "deepnorm": "study_postnorm_deepnorm_clip1",
             "relax": "study_prenorm_attnrelax_clip1", "post": "study_postnorm_clip1"}
    overlays = [repo / "recipes" / "overlays" / f for f in ("tiny.yaml", "study_cpu.yaml", "instability_cpu.yaml")]
    claims = [f"--optim.lr={lr}", f"--train.max_steps={horizon}", f"--train.eval_every={EVAL_EVERY}"]
    warm = [f"--optim.warmup_steps={round(0.08 * horizon)}"]
    mech = [f"--optim.lr={learning_params.MECH_LR}", f"--train.max_steps={learning_params.MECH_STEPS}"]
    stem, own = {"clip10": ("clip10", claims + warm), "clip1": ("clip1", claims + warm),
                 "deepnorm": ("deepnorm", claims + warm), "relax": ("relax", claims + warm),
                 "pre_nw": ("clip1", claims), "post_w": ("post", claims + warm), "post_nw": ("post", claims),
                 "m_fp16": ("clip1", mech), "m_warmup": ("clip1", [*mech, "--optim.warmup_steps=30"]),
                 "m_fp32": ("clip1", [*mech, "--train.mixed_precision=no"]),
                 "m_post10": ("post", [*mech, "--optim.clip_grad=10", "--model.attention=math"]),
                 "m_post10_relax": ("post", [*mech, "--optim.clip_grad=10", "--model.attention=relax"])}[role]
    recipe = repo / "recipes" / f"{stems.get(stem, 'study_prenorm_clip1_run2')}.yaml"
    cfg = load_config([recipe, *overlays], [f"--train.name=sim_{role}", *own]).to_dict()
    if learning.learning_role(cfg) != ((MECHANISM if role in MECH_ROLES else CLAIMS), role):
        raise ValueError(f"the simulated {role} config reads as {learning.learning_role(cfg)}")
    return cfg


def config_of(role: str, seed: int) -> dict:
    base = _config(role)
    return {**base, "train": {**base["train"], "seed": seed}}  # the other sections shared: nothing changes them


@dataclass
class Block:
    """What every run of a block shares: its batches (per-step noise, hard-batch spikes) and its levels."""

    noise: np.ndarray  # per-step loss noise, steps 1..n
    spikes: list[tuple[int, float]]  # (step, height as a share of the progress)
    early: float
    lngrad: float
    final: float
    failure: int  # the mechanism arm's baseline failure step (each run draws its own; unused by claims)


def block_of_study(rates: Rates, steps: int, key: tuple[int, ...]) -> Block:
    rng = keyed_rng(*key)
    n_spikes = rng.poisson(rates.shared_per_100 * steps / 100)
    spikes = [(int(rng.integers(max(2, steps // 10), steps)), float(rng.uniform(1.0, 2.0))) for _ in range(n_spikes)]
    offset_sd = math.sqrt(max(0.0, rates.early_block_sd ** 2 - rates.batch_sd ** 2 / max(1, rates.early_steps)))
    return Block(noise=rng.normal(0.0, rates.batch_sd, steps), spikes=spikes, early=float(rng.normal(0, offset_sd)),
                 lngrad=float(rng.normal(0, rates.lngrad_block_sd)), final=float(rng.normal(0, rates.final_block_sd)),
                 failure=0)


def _series(out: dict, name: str, steps: np.ndarray, values: np.ndarray) -> None:
    out[name] = (np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64))


def claims_run(rates: Rates, role: str, seed: int, block: Block, key: tuple[int, ...], effect: str,
               dead: DeadInput | None = None) -> RunMetrics:
    """One simulated run of arm claims (module docstring) with ``effect`` planted where it concerns ``role``, its
    frontend dying where scenario ``dead`` draws it."""
    h = learning_params.H
    rng = keyed_rng(*key)
    planted = role in PLANTED.get(effect, ())
    died = dead_input_at(dead, role, key)
    t = np.arange(1, h + 1)
    trend = rates.loss_end + (rates.l0 - rates.loss_end) * np.exp(-(t - 1) / max(rates.tau, 1.0))
    if died is not None:
        trend[died - 1:] = trend[died - 1]  # no progress from the step its input died
    run_offset_sd = math.sqrt(max(0.0, rates.early_run_sd ** 2 - rates.run_sd ** 2 / max(1, rates.early_steps)))
    # the batches' scatter grows with what the model has learned (at initialisation every batch costs about L0)
    spread = np.clip((rates.l0 - trend) / max(rates.l0 - rates.loss_end, 1e-9), 0.0, 1.0)
    loss = trend + block.early + rng.normal(0, run_offset_sd) + spread * (block.noise[:h] + rng.normal(0, rates.run_sd, h))
    early = max(1, int(EARLY_SHARE * h))
    early_shift = 2.0 * learning_params.DELTA_EARLY
    shift = {"a": -early_shift, "d": early_shift}.get(effect, 0.0) if planted else 0.0
    if shift and role in ("clip10", "relax"):
        loss += shift * np.clip((2 * early - t) / early, 0.0, 1.0)  # the whole shift early, fading out after
    progress = np.maximum(rates.l0 - np.minimum.accumulate(trend), 0.0)
    own = [(int(rng.integers(max(2, h // 10), h)), float(rng.uniform(1.0, 2.0)))
           for _ in range(rng.poisson(rates.own_per_100 * h / 100))]
    if planted and effect == "c":
        own.append((int(rng.integers(int(0.3 * h), int(0.9 * h))), 1.5))
    for step, height in [*block.spikes, *own]:
        loss[step - 1] += height * progress[step - 1]
    # fairseq's loss scale: overflow at SCALE_CAP; cascades: three overflows in a row
    n_casc = rng.poisson(rates.cascades_per_100 * h / 100) + (1 if planted and effect == "d" and role == "clip1" else 0)
    forced = set()
    for _ in range(n_casc):
        at = int(rng.integers(SCALE_WINDOW + 2, h - 3))
        forced.update((at, at + 1, at + 2))
    scale, clean = 128.0, 0
    scales, overflow = np.empty(h), np.zeros(h)
    for i in range(h):
        if scale >= SCALE_CAP or (i + 1) in forced:
            overflow[i], scale, clean = 1.0, scale / 2, 0
        else:
            clean += 1
            if clean == SCALE_WINDOW:
                scale, clean = scale * 2, 0
        scales[i] = scale
    clip = 10.0 if role == "clip10" else 1.0
    lngrad = (math.log(rates.grad_late) + np.log1p((rates.grad_first / rates.grad_late - 1)
                                                   * np.exp(-(t - 1) / max(rates.tau_grad, 1.0)))
              + block.lngrad + rng.normal(0, rates.lngrad_run_sd) + rng.normal(0, rates.lngrad_step_sd, h)
              - (0.3 if planted and effect == "b" else 0.0))
    grad = np.exp(lngrad)
    run_final = rng.normal(0, rates.final_run_sd)
    final = UNIGRAM - FINAL_GAIN + block.final + run_final
    if planted and effect.startswith("control"):
        final += float(effect.split()[1])
    series: dict = {}
    _series(series, "loss", t, loss)
    _series(series, "grad_norm", t, grad)
    _series(series, "grad_clipped", t, (grad > clip).astype(np.float64))
    _series(series, "loss_scale", t, scales)
    _series(series, "overflow_step", t, overflow)
    _series(series, "skipped_step", t, np.zeros(h))
    pen = 0.1 * np.exp(-t / h) + 0.02
    if died is not None:
        pen[died - 1:] = DEAD_PEN * pen[0]
    _series(series, "features_pen", t, pen)
    _series(series, "acoustic_mlm_loss/cb0", t, rates.cap + (trend - rates.l0) / 8)
    diag = t[t % DIAG_EVERY == 0]
    _series(series, "diag/max_attn_logit/layer0", diag, 50.0 + 100.0 * diag / h)
    _series(series, "diag/headroom/residual/layer0", diag, 0.02 + 0.1 * diag / h)
    _series(series, "diag/headroom/frontend", diag, np.full(len(diag), 2e-4))
    evals = np.array(sorted({*range(EVAL_EVERY, h + 1, EVAL_EVERY), h}))
    held_out = final + 0.2 * (1 - evals / h)
    if died is not None:  # blind from then on: the unigram level, the block's and the run's offsets
        held_out[evals >= died] = UNIGRAM + block.final + run_final
    _series(series, EVAL_CB0, evals, held_out)
    return _metrics(role, seed, series)


def mechanism_run(rates: Rates, role: str, seed: int, block: Block, key: tuple[int, ...], effect: str) -> RunMetrics:
    """One simulated run of arm mechanism: it diverges at a drawn Pre-LN failure step, unless ``effect`` makes
    ``role`` the treated one that survives the horizon."""
    h = learning_params.MECH_STEPS
    rng = keyed_rng(*key)
    fails = role not in PLANTED.get(effect, ())
    at = int(rng.choice(rates.pre_ln_failure_steps)) if fails else h + 1
    t = np.arange(1, min(h, at - 1) + 1)
    n = len(t)
    trend = rates.loss_end + (rates.l0 - rates.loss_end) * np.exp(-(t - 1) / max(rates.tau, 1.0))
    loss = trend + block.noise[:n] + rng.normal(0, rates.run_sd, n)
    fp32 = role == "m_fp32"
    grad = np.exp(math.log(rates.grad_late) + rng.normal(0, rates.lngrad_step_sd, n))
    residual = 0.05 + 0.9 * (t / max(at - 1, 1)) ** 4 if fails else np.full(n, 0.05)
    series: dict = {}
    diverged_at, final_overflows = None, 0
    if fails and fp32:  # no loss scale: the loss stays above its first value from the failure on
        t = np.arange(1, h + 1)
        loss = np.concatenate([loss, np.full(h - n, 3.0 * rates.l0)])
        grad = np.concatenate([grad, np.full(h - n, 1e3)])
        residual = np.concatenate([residual, np.full(h - n, 0.95)])
        n = h
    elif fails:
        loss[-3:] += np.array([0.5, 1.0, 2.0]) * rates.l0
        diverged_at, final_overflows = at, 7
    if not fp32:
        scales = np.full(n, 64.0)
        if fails:
            scales[-3:] = [8.0, 1.0, 0.0625]
        _series(series, "loss_scale", t, scales)
        _series(series, "overflow_step", t, np.r_[1.0, np.zeros(n - 1)] if n else np.zeros(0))
    _series(series, "loss", t, loss)
    _series(series, "grad_norm", t, grad)
    clip = 10.0 if role.startswith("m_post10") else 1.0
    _series(series, "grad_clipped", t, (grad > clip).astype(np.float64))
    _series(series, "features_pen", t, np.full(n, 0.05))
    _series(series, "acoustic_mlm_loss/cb0", t[:1], np.array([rates.cap]))
    diag = t[t % DIAG_EVERY == 0]
    place = "diag/max_attn_logit/layer0" if role.startswith("m_post10") else "diag/headroom/residual/layer0"
    scale = 65504.0 if place.startswith("diag/max_attn") else 1.0
    _series(series, place, diag, residual[diag - 1] * scale)
    run = _metrics(role, seed, series)
    run.diverged_at, run.final_overflows = diverged_at, final_overflows
    return run


def _metrics(role: str, seed: int, series: dict) -> RunMetrics:
    arm = MECHANISM if role in MECH_ROLES else CLAIMS
    path = Path("simulated") / arm / f"{role}_s{seed}"
    return RunMetrics(name=path.name, path=path, label=role, config=config_of(role, seed), series=series)


def write_run(run: RunMetrics, root: str | Path) -> Path:
    """``run`` as the trainer would have left its run directory (config.yaml, metrics.jsonl: a row per logged
    step, a ``min_loss_scale`` event where it diverged), under ``root``; read_run reads the same run back."""
    import yaml

    run_dir = Path(root) / run.path
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.config))
    rows: dict[int, dict] = {}
    for name, (steps, values) in run.series.items():
        for s, v in zip(steps.tolist(), values.tolist()):
            rows.setdefault(s, {"step": s})[name] = v
    lines = [json.dumps(rows[s]) for s in sorted(rows)]
    if run.diverged_at is not None:
        lines.append(json.dumps({"step": run.diverged_at, "event": "min_loss_scale", "loss_scale": 6.1e-5,
                                 "overflow_step": run.final_overflows}))
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run_dir


# ---------------------------------------------------------------------------------------------------
# Simulated studies


def simulate(rates: Rates, seeds: int, study: int, base_seed: int = 0, effect: str = NULL,
             cache: dict | None = None, dead: DeadInput | None = None) -> list[LearningRun]:
    """The runs of one simulated study (``seeds`` blocks per arm) with ``effect`` planted in dead-input scenario
    ``dead``, as the analysis reads them (learning.learning_run, own spikes marked). ``cache`` keeps the
    unplanted runs for the next effect (of the same scenario)."""
    if effect not in EFFECTS:
        raise ValueError(f"effect {effect!r}: choose one of {', '.join(EFFECTS)}")
    dead = check_dead(dead)
    cache = {} if cache is None else cache
    out = []
    for seed in range(seeds):
        for role in (*CLAIM_ROLES, *MECH_ROLES):
            planted = effect if role in PLANTED.get(effect, ()) else NULL
            if (seed, role, planted) not in cache:
                metrics = study_run(rates, role, seed, study, base_seed, planted, dead=dead)
                cache[(seed, role, planted)] = learning.learning_run(metrics, UNIGRAM)
            out.append(cache[(seed, role, planted)])
    learning.mark_own_spikes(out)
    return out


def study_run(rates: Rates, role: str, seed: int, study: int, base_seed: int = 0, effect: str = NULL, *,
              dead: DeadInput | None = None) -> RunMetrics:
    """One simulated run (``role`` in block ``seed`` of study ``study``) as read_run would read it; its block's
    shared draws and its own come from generators keyed by (base_seed, study, seed, arm or role)."""
    mech = role in MECH_ROLES
    horizon = learning_params.MECH_STEPS if mech else learning_params.H
    block = block_of_study(rates, horizon, (base_seed, study, seed, 1000 + mech))
    key = (base_seed, study, seed, ROLE_KEYS[role])
    if mech:
        return mechanism_run(rates, role, seed, block, key, effect)
    return claims_run(rates, role, seed, block, key, effect, dead)


def verdicts_of(runs: Sequence[LearningRun], seeds: int) -> dict[str, str]:
    """The analysis's verdicts on the first ``seeds`` blocks: control (detects / absent / neither) and each key."""
    used = [r for r in runs if r.seed < seeds]
    result = learning.analyse(used)
    control = result["control"]
    out = {"control": "detects" if control["detects"] else ABSENT if control["absent"] else "inconclusive",
           "control survival": ("detects" if control["survival_detects"] else ABSENT if control["survival_absent"]
                                else "inconclusive")}
    out.update({c.key: c.verdict for c in result["claims"]})
    out.update({c.key: c.verdict for c in result["mechanism"]["checks"]})
    return out


def _studies(job: tuple[Rates, tuple[int, ...], tuple[int, ...], int, DeadInput]) -> tuple[dict, dict]:
    """Verdict counts {effect: {n: {key: {verdict: count}}}} and the null runs' sums over the studies given."""
    rates, seeds, studies, base_seed, dead = job
    counts: dict = {effect: {n: {} for n in seeds} for effect in EFFECTS}
    sums = {"claims_runs": 0, "own": 0, "shared": 0, "recovered": 0, "events": 0, "cascades": 0, "learned": 0,
            "dead": 0, "clip1_share": []}
    for study in studies:
        cache: dict = {}
        for effect in EFFECTS:
            runs = simulate(rates, max(seeds), study, base_seed, effect, cache, dead)
            if effect == NULL:
                claims = [r for r in runs if r.arm == CLAIMS]
                sums["claims_runs"] += len(claims)
                sums["own"] += sum(r.own_spikes for r in claims)
                sums["shared"] += sum(r.shared_spikes for r in claims)
                sums["events"] += sum(len(r.spike_steps) for r in claims)
                sums["recovered"] += sum(sum(r.spike_recovered) for r in claims)
                sums["cascades"] += sum(r.cascades for r in claims)
                sums["learned"] += sum(r.learned for r in claims)
                sums["dead"] += sum(r.kind == "dead input" for r in claims)
                sums["clip1_share"] += [r.clip_share_early for r in claims if r.role == "clip1"]
            for n in seeds:
                for key, verdict in verdicts_of(runs, n).items():
                    cell = counts[effect][n].setdefault(key, {})
                    cell[verdict] = cell.get(verdict, 0) + 1
    return counts, sums


def power_table(rates: Rates, seeds: Sequence[int], studies: int, base_seed: int = 0, jobs: int = 1,
                dead: DeadInput | None = None) -> dict:
    """Verdict counts per (effect, seeds) over ``studies`` simulated studies in dead-input scenario ``dead``,
    and the null runs' spike and learning numbers (to compare with the rates). ``jobs`` processes share the
    studies; each study's runs come from its own generators, so the table is the same for any ``jobs``."""
    seeds = tuple(sorted(seeds))
    dead = check_dead(dead)
    parts = [(rates, seeds, tuple(range(i, studies, jobs)), base_seed, dead) for i in range(max(1, jobs))]
    if jobs > 1:
        import multiprocessing

        for role in ROLE_KEYS:
            _config(role)  # once, before the workers fork

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            found = pool.map(_studies, parts)
    else:
        found = [_studies(parts[0])]
    counts: dict = {effect: {n: {} for n in seeds} for effect in EFFECTS}
    sums: dict = {}
    for part_counts, part_sums in found:
        for effect, by_n in part_counts.items():
            for n, cell in by_n.items():
                for key, verdicts in cell.items():
                    mine = counts[effect][n].setdefault(key, {})
                    for verdict, k in verdicts.items():
                        mine[verdict] = mine.get(verdict, 0) + k
        for k, v in part_sums.items():
            sums[k] = sums.get(k, [] if isinstance(v, list) else 0) + v
    runs = max(1, sums["claims_runs"])
    null = {"own_spikes_per_run": sums["own"] / runs, "shared_spikes_per_run": sums["shared"] / runs,
            "recovered_share": sums["recovered"] / max(1, sums["events"]), "cascades_per_run": sums["cascades"] / runs,
            "learned_share": sums["learned"] / runs, "dead_input_share": sums["dead"] / runs,
            "clip1_early_clip_share": float(np.median(sums["clip1_share"])) if sums["clip1_share"] else math.nan}
    return {"studies": studies, "seeds": list(seeds), "base_seed": base_seed,
            "scenario": {"dead_input": {role: list(v) for role, v in dead.items()}}, "counts": _plain_counts(counts),
            "null_runs": null, "rates": asdict(rates),
            "design": {"L": learning_params.L, "H": learning_params.H, "DELTA_EARLY": learning_params.DELTA_EARLY,
                       "MECH_STEPS": learning_params.MECH_STEPS, "UNIGRAM": UNIGRAM, "FINAL_GAIN": FINAL_GAIN}}


def _plain_counts(counts: dict) -> dict:
    return {effect: {str(n): {k: dict(sorted(v.items())) for k, v in sorted(cell.items())} for n, cell in by_n.items()}
            for effect, by_n in counts.items()}


def share(table: dict, effect: str, n: int, key: str, verdicts: Sequence[str]) -> float:
    cell = table["counts"][effect][str(n)].get(key, {})
    return sum(cell.get(v, 0) for v in verdicts) / table["studies"]


def markdown(table: dict, command: str = "", seconds: float | None = None) -> str:
    seeds = table["seeds"]
    head = "| | " + " | ".join(f"{n} seeds" for n in seeds) + " |"
    dead = {role: tuple(v) for role, v in table.get("scenario", {}).get("dead_input", {}).items()}
    lines = ["### Power: the share of simulated studies that find each planted effect", "",
             f"Under the failure assumption: {describe_dead(dead)}.", "", head, "|---|" + "---|" * len(seeds)]
    for effect in EFFECTS[1:]:
        key = TARGET[effect]
        found = "detects" if key == "control" else REPRODUCED
        cells = []
        for n in seeds:
            idle = share(table, effect, n, key, [NOT_TESTABLE])
            cells.append(f"{share(table, effect, n, key, [found]):.0%}" + (f" ({idle:.0%} not testable)" if idle else ""))
        what = "the control detects" if key == "control" else f"{key} reproduced"
        lines.append(f"| {effect}: {WHAT[effect]} ({what}) | " + " | ".join(cells) + " |")
    lines += ["", "### The null study (nothing planted)", "", head, "|---|" + "---|" * len(seeds)]
    wrong = []
    for n in seeds:
        studies = table["studies"]
        cell = table["counts"][NULL][str(n)]
        wrong_n = 0
        for key in KEYS:
            wrong_n = max(wrong_n, sum(cell.get(key, {}).get(v, 0) for v in (REPRODUCED, REFUTED)))
        wrong.append(wrong_n / studies)
    lines.append("| a claim or check decided (reproduced or refuted), the worst one | "
                 + " | ".join(f"{w:.1%}" for w in wrong) + " |")
    lines.append("| the control detects | " + " | ".join(
        f"{share(table, NULL, n, 'control', ['detects']):.1%}" for n in seeds) + " |")
    lines.append("| the control's effect called absent | " + " | ".join(
        f"{share(table, NULL, n, 'control', [ABSENT]):.0%}" for n in seeds) + " |")
    lines.append("| the control's secondary (steps survived) detects: its power where the scenario has Post-LN "
                 "with warmup die later, else its false positives | " + " | ".join(
                     f"{share(table, NULL, n, 'control survival', ['detects']):.1%}" for n in seeds) + " |")
    for key in KEYS:
        lines.append(f"| {key} called absent | " + " | ".join(
            f"{share(table, NULL, n, key, [ABSENT]):.0%}" for n in seeds) + " |")
    for key in CLAIM_KEYS:
        lines.append(f"| {key} not testable at this scale | " + " | ".join(
            f"{share(table, NULL, n, key, [NOT_TESTABLE]):.0%}" for n in seeds) + " |")
    r, null = table["rates"], table["null_runs"]
    lines += ["", f"{table['studies']} simulated studies per cell (generators keyed by seed {table['base_seed']}, study, "
              f"block and role), arm claims at lr {learning_params.L:g} for H = {learning_params.H} steps, "
              f"DELTA_EARLY {learning_params.DELTA_EARLY:g} bits (the calibration's)"
              + (f"; `{command}` ran in {seconds:.0f} s" if command and seconds is not None else "") + ".", "",
              "Rates the runs are drawn from (measured: " + r["source"] + "): " + ", ".join(
                  f"{k} {_fmt(v)}" for k, v in r.items() if k != "source") + ".", "",
              f"The simulated null's claims runs, through the same detectors: own spike events "
              f"{null['own_spikes_per_run']:.3f} and shared {null['shared_spikes_per_run']:.2f} a run, "
              f"{null['recovered_share']:.0%} of them recovered (measured: "
              f"{r['spikes_per_100'] * learning_params.H / 100 * (1 - r['shared_share']):.3f} and "
              f"{r['spikes_per_100'] * learning_params.H / 100 * r['shared_share']:.2f} over {learning_params.H} "
              "steps, "
              f"{r['recovered_share']:.0%} recovered), cascades "
              f"{null['cascades_per_run']:.3f} a run, {null['learned_share']:.0%} learned "
              f"({null.get('dead_input_share', 0.0):.0%} lost their input), clip 1's early clip share "
              f"{null['clip1_early_clip_share']:.2f} (median)."]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_rates(path: str | Path) -> Rates:
    """Rates from a JSON file (``--measure`` writes one); ValueError naming the file when it does not fit."""
    try:
        return Rates(**json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a rates file ({e})") from None


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.power_runs", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for power_runs.md/json (or rates.json)")
    p.add_argument("--seeds", type=int, nargs="+", default=[6, 8, 10], help="blocks per arm")
    p.add_argument("--studies", type=int, default=200, help="simulated studies per cell")
    p.add_argument("--seed", type=int, default=0, help="the generators' first key")
    p.add_argument("--jobs", type=int, default=1, help="processes sharing the studies (the table is the same)")
    p.add_argument("--rates", metavar="FILE", help="rates.json (from --measure) instead of DEFAULT_RATES")
    p.add_argument("--measure", nargs="+", metavar="RUN_DIR", help="measure the rates on these runs: rates.json")
    p.add_argument("--dead", action="append", default=[], metavar="ROLE=P:FIRST:LAST",
                   help="the scenario: ROLE's frontend dies with probability P at a step drawn from FIRST..LAST "
                        "(e.g. deepnorm=1.0:300:700; repeatable)")
    p.add_argument("--calibration-lrs", type=float, nargs="+", default=[3e-3, 1e-2],
                   help="with --measure: the lrs of the calibration runs")
    p.add_argument("--spike-smooth", type=int, default=learning_params.SPIKE_SMOOTH, metavar="N",
                   help="with --measure: spike events' level from the trailing N-step median, as the learning "
                        f"study's analysis reads them (default {learning_params.SPIKE_SMOOTH}; 0: single steps, as the "
                        "instability study read them)")
    args = p.parse_args(argv)
    if args.studies < 1 or min(args.seeds) < 1 or args.jobs < 1:
        p.error("--studies, --seeds and --jobs must be >= 1")
    out = Path(args.out)
    command = "python -m musiclm_stab.analysis.power_runs " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        if args.measure:
            rates = measure_rates(args.measure, args.calibration_lrs, source=command, spike_smooth=args.spike_smooth)
            out.mkdir(parents=True, exist_ok=True)
            (out / "rates.json").write_text(json.dumps(asdict(rates), indent=2) + "\n")
            print((out / "rates.json").read_text())
            return 0
        dead = parse_dead(args.dead)
        rates = read_rates(args.rates) if args.rates else DEFAULT_RATES
        start = time.perf_counter()
        table = power_table(rates, args.seeds, args.studies, args.seed, args.jobs, dead)
        seconds = time.perf_counter() - start
    except (FileNotFoundError, ValueError) as e:
        print(f"power_runs: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "power_runs.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "power_runs.md").write_text(markdown(table, command, seconds))
    print((out / "power_runs.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
