"""The rates the learning study's power simulation draws its runs from (analysis/power_runs.py), measured on run
directories: the instability study's archive by default (DEFAULT_RATES), the calibration runs when the lead
re-runs ``measure_rates`` on them (``python -m musiclm_stab.analysis.power_runs --measure ...``).

What is measured, on the runs at the calibration lrs that did not fail (blocks: lr and seed; configurations:
instability.role6, else the run's name): the first logged training loss L0, the mean of the last 10, and the
steps the mean curve takes to fall 63% of the way; the per-step loss noise shared by a block (the robust SD of
each run's residual about its centred 9-step mean, from step 20) and a run's own (the robust SD of two runs'
residual differences in a block, / sqrt 2: the same batches cancel); spike events (claim_stats.spike_events)
per run per 100 steps, the share shared within the block (learning_params.SHARED_STEPS) and recovered;
cascades per 100 steps; the SD of block means and the pooled run SD (configuration means removed; where no two
blocks share two configurations, the SD across a block's configurations for both: ``_within``) of early loss, ln
median gradient norm and final held-out cb0; the per-step ln gradient-norm noise, its first and late
medians and time constant; the first training cb0 (the cap); and the divergence steps of the Pre-Norm runs at
``failure_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from musiclm_stab.analysis import learning_params
from musiclm_stab.analysis.claim_stats import block_of, logged, spike_events
from musiclm_stab.analysis.claims import read_runs
from musiclm_stab.analysis.failures import cascades
from musiclm_stab.analysis.instability import EARLY_SHARE, endpoints, role6
from musiclm_stab.analysis.learning import learning_role
from musiclm_stab.analysis.runs import RunMetrics


@dataclass
class Rates:
    """What the simulation draws from, measured on run directories (``measure_rates``; module docstring)."""

    source: str  # the command and runs that measured them
    runs: int  # calibration runs (those at the calibration lrs that did not fail)
    blocks: int
    l0: float  # first logged training loss, bits
    loss_end: float  # mean of the last 10 logged losses
    tau: float  # steps for the mean loss to fall 63% of the way from l0 to loss_end
    batch_sd: float  # per-step loss noise shared by a block (robust SD of the residual about a 9-step mean)
    run_sd: float  # per-step loss noise of a run (robust SD of same-block paired residual differences / sqrt 2)
    spikes_per_100: float  # spike events (progress-lost rule) per run per 100 steps
    shared_share: float  # share of them shared within the block (learning_params.SHARED_STEPS)
    recovered_share: float
    cascades_per_100: float
    early_block_sd: float  # early loss (the first quarter): SD of block means, and the run SD within blocks
    early_run_sd: float
    early_steps: int  # the calibration runs' early window (for what per-step noise explains)
    lngrad_block_sd: float
    lngrad_run_sd: float
    lngrad_step_sd: float
    grad_first: float  # median gradient norm at step 1, and over the second half of the runs
    grad_late: float
    tau_grad: float
    final_block_sd: float  # final held-out cb0
    final_run_sd: float
    cap: float  # first logged training cb0
    pre_ln_failure_steps: list[int] = field(default_factory=list)

    @property
    def own_per_100(self) -> float:
        return self.spikes_per_100 * (1 - self.shared_share)

    @property
    def shared_per_100(self) -> float:
        return self.spikes_per_100 * self.shared_share


# Measured on docs/instability_cpu/runs.tar.xz (arm schemes, 180 runs; calibration lrs 3e-3 and 1e-2, failures at
# 1e-1; spikes by the single-step level): python -m musiclm_stab.analysis.power_runs --measure runs/instability_cpu
# --spike-smooth 0 --out DIR
DEFAULT_RATES = Rates(
    source="python -m musiclm_stab.analysis.power_runs --measure runs/instability_cpu --spike-smooth 0 --out DIR "
           "(docs/instability_cpu/runs.tar.xz unpacked into runs/; calibration lrs 3e-3 1e-2, Pre-LN failures at 1e-1)",
    runs=72, blocks=12, l0=84.92822901407878, loss_end=67.42991783883836, tau=11.0, batch_sd=2.3436650998433475,
    run_sd=0.011582908310308915, spikes_per_100=1.712962962962963, shared_share=0.972972972972973,
    recovered_share=0.46621621621621623, cascades_per_100=0.011574074074074073, early_block_sd=0.5186581104369914,
    early_run_sd=0.7719710299017367, early_steps=30, lngrad_block_sd=0.02520260596198087,
    lngrad_run_sd=0.01087415767718881, lngrad_step_sd=0.15087731414913713, grad_first=11.406880378723145,
    grad_late=0.6220107972621918, tau_grad=5.0, final_block_sd=0.010017831698587578,
    final_run_sd=0.0019367335937276044, cap=10.315359512964884,
    pre_ln_failure_steps=[15, 15, 16, 16, 16, 17, 18, 19, 20, 20, 20, 21, 21, 21, 22, 22, 23, 24, 25, 25, 26, 29, 29, 59])


# ---------------------------------------------------------------------------------------------------
# Measuring the rates


def _robust_sd(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(1.4826 * np.median(np.abs(x - np.median(x)))) if len(x) else math.nan


def _residual(v: np.ndarray, k: int = 9) -> np.ndarray:
    """v less its centred k-step mean, away from the ends and the first steps' fall."""
    mean = np.convolve(v, np.ones(k) / k, mode="same")
    lo, hi = max(20, k), len(v) - k
    return (v - mean)[lo:hi] if hi > lo else np.zeros(0)


def _two_way(table: dict[tuple, dict[str, float]]) -> tuple[float, float]:
    """(SD of block means, pooled run SD) of a block x configuration table, configurations present in every
    block, their means removed (a configuration's own effect is not noise). Where no two blocks share two
    configurations (the learning study's pilots: one block of several configurations beside the calibration's
    block of one), ``_within``."""
    roles = sorted(set.intersection(*(set(v) for v in table.values()))) if table else []
    m = np.array([[table[b][r] for r in roles] for b in table], dtype=np.float64)
    if m.shape[0] < 2 or m.shape[1] < 2 or not np.isfinite(m).all():
        return _within(table)
    resid = m - m.mean(0, keepdims=True) - m.mean(1, keepdims=True) + m.mean()
    return float(m.mean(1).std(ddof=1)), float(math.sqrt((resid ** 2).sum() / ((m.shape[0] - 1) * (m.shape[1] - 1))))


def _within(table: dict[tuple, dict[str, float]]) -> tuple[float, float]:
    """(block SD, run SD) where the two-way table cannot part them: the run SD is the SD across the
    configurations of each block with two or more finite values, pooled over such blocks (the configurations'
    own effects counted as run noise: a larger SD, so a smaller power), and the block SD, which the paired
    comparisons cancel, is taken equal to it; nan when no block has two finite values."""
    found = []
    for row in table.values():
        v = np.array([x for x in row.values() if math.isfinite(x)], dtype=np.float64)
        if len(v) >= 2:
            found.append((float(v.std(ddof=1)), len(v) - 1))
    if not found:
        return math.nan, math.nan
    sd = math.sqrt(sum(s * s * k for s, k in found) / sum(k for _, k in found))
    return sd, sd


def _pooled(pairs: list[tuple[float, float]], weights: list[int]) -> float:
    ok = [(v, w) for v, w in zip(pairs, weights) if math.isfinite(v)]
    return float(math.sqrt(sum(v * v * w for v, w in ok) / sum(w for _, w in ok))) if ok else math.nan


def _configuration(run: RunMetrics) -> str:
    """A calibration run's configuration: its learning-study role (which tells warmup from none), else
    instability.role6, else its name."""
    role = learning_role(run.config)
    return role[1] if role else role6(run.config) or run.name


def measure_rates(run_dirs: Sequence[str | Path | RunMetrics], calibration_lrs: Sequence[float] = (3e-3, 1e-2),
                  failure_lr: float = 1e-1, source: str = "", spike_smooth: int = 0) -> Rates:
    """The simulation's rates measured on ``run_dirs``: the runs at ``calibration_lrs`` that did not fail
    (blocks: lr and seed; configurations: ``_configuration``), and the divergence steps of the Pre-Norm runs
    (norm_scheme pre) at ``failure_lr``. Spike events by claim_stats.spike_events with ``spike_smooth`` (the
    learning study's analysis: learning_params.SPIKE_SMOOTH; DEFAULT_RATES were measured with 0)."""
    runs = [r.in_unit("bits") for r in read_runs(run_dirs)]
    calib, failures = [], []
    for r in runs:
        lr, seed = block_of(r.config)
        ends = endpoints(r, None)
        if math.isclose(lr, failure_lr) and (r.config.get("model") or {}).get("norm_scheme", "pre") == "pre":
            if ends.kind == "diverged":
                failures.append(int(ends.kind_step))
        elif any(math.isclose(lr, x) for x in calibration_lrs) and ends.kind == "none":
            calib.append((r, ends, (lr, seed), _configuration(r)))
    if not calib:
        raise ValueError("no run that did not fail at the calibration lrs " + ", ".join(f"{x:g}" for x in calibration_lrs))
    by_block: dict[tuple, list] = {}
    for item in calib:
        by_block.setdefault(item[2], []).append(item)
    if all(len(members) < 2 for members in by_block.values()):
        raise ValueError(f"a run's own noise needs a block (lr, seed) with two runs that did not fail: "
                         f"{len(by_block)} blocks of one run ({', '.join(r.name for r, *_ in calib)})")
    events, shared, recovered, steps, n_casc = 0, 0, 0, 0, 0
    batch, pair = [], []
    for members in by_block.values():
        spikes = {id(r): spike_events(r, smooth=spike_smooth) for r, *_ in members}
        res = {id(r): _residual(logged(r, "loss")[1]) for r, *_ in members}
        for r, _, _, _ in members:
            others = [e.step for o, *_ in members if o is not r for e in spikes[id(o)]]
            for e in spikes[id(r)]:
                events += 1
                shared += any(abs(e.step - s) <= learning_params.SHARED_STEPS for s in others)
                recovered += e.recovered_at is not None
            steps += int(r.last_step or 0)
            n_casc += len(cascades(r))
            batch.append(res[id(r)])
        keys = [id(r) for r, *_ in members]
        for i in range(len(keys)):
            for j in range(i + 1, len(keys)):
                a, b = res[keys[i]], res[keys[j]]
                n = min(len(a), len(b))
                pair.append(a[:n] - b[:n])
    tables = {name: {} for name in ("early", "lngrad", "final")}
    for _, ends, block, role in calib:
        for name, value in (("early", ends.early_loss), ("lngrad", math.log(ends.median_grad_norm)),
                            ("final", ends.final_eval_cb0)):
            tables[name].setdefault(block[0], {}).setdefault(block, {})[role] = value
    sds = {}
    for name, per_lr in tables.items():
        found = [_two_way(t) for t in per_lr.values()]
        weights = [len(t) for t in per_lr.values()]
        sds[name] = (_pooled([f[0] for f in found], weights), _pooled([f[1] for f in found], weights))
    losses = [logged(r, "loss")[1] for r, *_ in calib]
    n = min(len(v) for v in losses)
    curve = np.mean([v[:n] for v in losses], axis=0)
    l0, end = float(curve[0]), float(np.mean([np.nanmean(v[-10:]) for v in losses]))
    tau = float(np.argmax(curve <= end + (l0 - end) / math.e) + 1)
    grads = [r.metric("grad_norm")[1] for r, *_ in calib if r.metric("grad_norm") is not None]
    m = min(len(g) for g in grads)
    gcurve = np.median([g[:m] for g in grads], axis=0)
    first, late = float(gcurve[0]), float(np.median([np.median(g[len(g) // 2:]) for g in grads]))
    tau_grad = float(np.argmax(np.log(gcurve) <= math.log(late) + math.log(first / late) / math.e) + 1)
    lnres = np.concatenate([_residual(np.log(g)) for g in grads])
    early_steps = int(np.median([max(1, int(EARLY_SHARE * int((r.config.get("train") or {}).get("max_steps", 1))))
                                 for r, *_ in calib]))
    return Rates(
        source=source or "measure_rates", runs=len(calib), blocks=len(by_block), l0=l0, loss_end=end, tau=tau,
        batch_sd=_robust_sd(np.concatenate(batch)), run_sd=_robust_sd(np.concatenate(pair)) / math.sqrt(2),
        spikes_per_100=100 * events / steps, shared_share=shared / events if events else 0.0,
        recovered_share=recovered / events if events else math.nan, cascades_per_100=100 * n_casc / steps,
        early_block_sd=sds["early"][0], early_run_sd=sds["early"][1], early_steps=early_steps,
        lngrad_block_sd=sds["lngrad"][0], lngrad_run_sd=sds["lngrad"][1], lngrad_step_sd=_robust_sd(lnres),
        grad_first=first, grad_late=late, tau_grad=tau_grad, final_block_sd=sds["final"][0],
        final_run_sd=sds["final"][1], cap=float(np.mean([e.cap for _, e, *_ in calib])),
        pre_ln_failure_steps=sorted(failures))
