"""The study's statistics of one run, fixed before the runs were read (analysis/claims.py pairs them).

Which run is which. ``role_of(config)``: ``clip10`` = Pre-Norm, standard attention (not relax), no QK-Norm,
fixed clipping at 10; ``clip1`` the same clipped at 1; ``deepnorm`` = norm_scheme deepnorm, standard
attention, no QK-Norm, clip 1; ``relax`` = Pre-Norm with attention relax, clip 1; ``qknorm`` = Pre-Norm,
standard attention, QK-Norm, clip 1 (the positive control, run at the top learning rates only). Any
other config (adaptive clipping, other clip values or schemes) has no role. A run's block is
``(optim.lr, train.seed)``; the runs of one block share the data order (``data.order_seed`` unset is
``train.seed``), so differences within a block are paired. W = ``optim.warmup_steps``.

Every statistic reads the logged rows of ``metrics.jsonl`` (window means as the trainer logged them),
losses in bits. A *logged value* is one row's value; a row whose value was not finite is kept as such.

- early loss: the mean training loss over the logged steps 1..2W; +inf when the run diverged (a
  ``min_loss_scale`` event) at or before step 2W, so a run that diverged early is the worst.
- median gradient norm: the median of the finite logged (pre-clip) ``grad_norm`` over the whole run;
  peak ratio: their maximum / that median (a scale-free spikiness).
- early clip share: the mean of ``grad_clipped`` (share of a row's steps that were clipped) over 1..2W.
- spike events, the progress-lost rule. L0 = the first logged value. For each logged step from the
  second on, level = the minimum of the logged values before it and progress = L0 - level. A step
  *spikes* when progress >= DELTA_MIN x L0 (there is real progress to lose: no spike can be judged
  before it) and (value - level) / progress >= LOST (half the progress is lost). A non-finite value is
  a spiking step too. Consecutive spiking steps form one event. An event is *recovered* when, within
  max(RECOVER_ROWS, n // 10) logged steps (n = the run's logged steps of the metric) after its last
  step, a logged value is <= level + RECOVERED x progress, level and progress taken at the event's first
  step; an event with a non-finite value never is. A divergence is an unrecovered event at its step
  (the event the run ended in, when its last logged step was spiking).
- instability: spike events of the training loss + fp16 overflow steps (``overflow_step`` counts) +
  skipped steps (``skipped_step`` counts) + 1 if the run diverged; the parts are kept.
- diverged: a ``min_loss_scale`` event, or the mean of the finite training losses of the last 10% of
  the logged steps is above L0, or none of them is finite.
- final held-out codebook-0 CE: the last logged ``eval/acoustic_mlm_loss/cb0`` (NaN without one, or when
  the run diverged); initial: the first logged one (the cap of the LR sensitivity).
- max attention logit: the largest logged ``diag/max_attn_logit/layer{i}`` over layers and steps.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.config.sections import OptimConfig

# The four configurations of the claims, in the study's legend order, and the positive control.
ROLES = ("clip10", "clip1", "deepnorm", "relax")
CONTROL = "qknorm"
ROLE_TITLES = {
    "clip10": "Pre-Norm, clip 10",
    "clip1": "Pre-Norm, clip 1",
    "deepnorm": "Post-Norm DeepNorm, clip 1",
    "relax": "Pre-Norm Attn. Relax, clip 1",
    "qknorm": "Pre-Norm QK-Norm, clip 1",
}
DELTA_MIN = 0.02  # progress (share of L0) before a spike can be judged
LOST = 0.5  # share of the progress a spiking step has lost
RECOVERED = 0.1  # back within this share of the progress above the level: recovered
RECOVER_ROWS = 20  # the recovery window is at least this many logged steps (or 10% of them)
EVAL_CB0 = "eval/acoustic_mlm_loss/cb0"
ATTN_LOGIT = "diag/max_attn_logit/layer"


def role_of(cfg: dict) -> str | None:
    """Which of the study's roles a run's config is: one of ROLES, CONTROL, or None (none of them)."""
    model, optim = cfg.get("model") or {}, cfg.get("optim") or {}
    scheme, relax = model.get("norm_scheme", "pre"), model.get("attention", "sdpa") == "relax"
    clip, qk = float(optim.get("clip_grad", 10.0)), bool(model.get("qk_norm", False))
    if optim.get("clip_mode", "fixed") != "fixed":
        return None
    if scheme == "pre" and not relax and not qk:
        return {10.0: "clip10", 1.0: "clip1"}.get(clip)
    if clip != 1.0:
        return None
    if scheme == "deepnorm" and not relax and not qk:
        return "deepnorm"
    if scheme == "pre" and relax and not qk:
        return "relax"
    if scheme == "pre" and not relax and qk:
        return CONTROL
    return None


def block_of(cfg: dict) -> tuple[float, int]:
    """(learning rate, seed): the runs of one block are paired."""
    optim, train = cfg.get("optim") or {}, cfg.get("train") or {}
    return float(optim.get("lr", OptimConfig().lr)), int(train.get("seed", 0))


def warmup_steps(cfg: dict) -> int:
    """W from a run's saved config (warmup_share x max_steps in a config saved before it was resolved)."""
    train, optim = cfg.get("train") or {}, cfg.get("optim") or {}
    warmup = optim.get("warmup_steps")
    if warmup is None:
        warmup = round(float(optim.get("warmup_share", 0.08)) * int(train.get("max_steps", 100)))
    return int(warmup)


def precision_of(cfg: dict) -> str:
    """``no``, ``bf16``, or ``fp16 (fairseq)`` / ``fp16 (amp)`` (older configs lack train.fp16_mode)."""
    train = cfg.get("train") or {}
    precision = str(train.get("mixed_precision", "no"))
    mode = train.get("fp16_mode")
    return f"{precision} ({mode})" if precision == "fp16" and mode else precision


# ---------------------------------------------------------------------------------------------------
# Per-run statistics


def logged(run: RunMetrics, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of every logged row of ``metric``, NaN where it was logged non-finite."""
    series = run.metric(metric)
    steps, values = series if series is not None else (np.zeros(0, np.int64), np.zeros(0))
    bad = run.nonfinite.get(metric)
    if bad is None or not len(bad):
        return steps, values
    all_steps = np.concatenate([steps, bad])
    order = np.argsort(all_steps, kind="stable")
    return all_steps[order], np.concatenate([values, np.full(len(bad), np.nan)])[order]


def early_loss(run: RunMetrics, metric: str = "loss") -> float:
    """Mean of the finite logged ``metric`` over steps 1..2W; +inf when the run diverged by 2W."""
    horizon = max(1, 2 * warmup_steps(run.config))
    if run.diverged_at is not None and run.diverged_at <= horizon:
        return math.inf
    steps, values = logged(run, metric)
    window = values[(steps >= 1) & (steps <= horizon)]
    window = window[np.isfinite(window)]
    return float(window.mean()) if len(window) else math.nan


def median_grad_norm(run: RunMetrics) -> float:
    """Median of the finite logged gradient norms (before clipping), over the whole run."""
    series = run.metric("grad_norm")
    return float(np.median(series[1])) if series is not None else math.nan


def peak_ratio(run: RunMetrics) -> float:
    """Largest / median finite logged gradient norm (NaN without norms, or with a median of 0)."""
    series = run.metric("grad_norm")
    if series is None:
        return math.nan
    mid = float(np.median(series[1]))
    return float(series[1].max()) / mid if mid > 0 else math.nan


def clip_share_early(run: RunMetrics) -> float:
    """Mean logged share of clipped steps over steps 1..2W."""
    series = run.metric("grad_clipped")
    if series is None:
        return math.nan
    steps, values = series
    window = values[(steps >= 1) & (steps <= max(1, 2 * warmup_steps(run.config)))]
    return float(window.mean()) if len(window) else math.nan


@dataclass
class SpikeEvent:
    step: int  # first spiking step
    peak: float  # largest value in the event (inf: a non-finite value or the divergence)
    lost: float  # (peak - level) / progress at the peak's step
    recovered_at: int | None  # first step back within RECOVERED x progress of the level; None: not in reach
    level: float = math.nan  # at the first step
    progress: float = math.nan


def spike_events(run: RunMetrics, metric: str = "loss", smooth: int = 0) -> list[SpikeEvent]:
    """The spike events of ``metric`` by the progress-lost rule (module docstring). With ``smooth`` > 0 the
    level is the running minimum of the trailing median of the ``smooth`` logged values before each step
    (its finite ones), not of the values themselves: where the loss of one batch scatters by a fair share of
    the progress (the learning study's 1000-step runs), a lucky batch does not set the level and an ordinary
    one is not a spike."""
    steps, v = logged(run, metric)
    events: list[SpikeEvent] = []
    finite = np.isfinite(v)
    ends_spiking = False  # the last logged step spikes: a divergence there is that event
    if len(v):
        start = v[finite][0] if finite.any() else math.nan
        level = np.empty(len(v))
        level[0] = math.nan
        if smooth > 0:
            level[1:] = np.fmin.accumulate(_trailing_median(v, smooth))
        else:
            level[1:] = np.fmin.accumulate(v)[:-1]  # running minimum of the values before; fmin skips NaN
        progress = start - level
        with np.errstate(invalid="ignore", divide="ignore"):
            lost = (v - level) / progress
            spiking = (progress >= DELTA_MIN * start) & (lost >= LOST)
        spiking |= ~finite
        ends_spiking = bool(spiking[-1])
        edges = np.diff(np.concatenate([[0], spiking.astype(np.int8), [0]]))
        reach = max(RECOVER_ROWS, len(v) // 10)
        for i, j in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
            window = v[i:j + 1]
            recovered_at = None
            if np.isfinite(window).all():
                k = i + int(np.argmax(window))
                after = v[j + 1:j + 1 + reach] <= level[i] + RECOVERED * progress[i]
                if after.any():
                    recovered_at = int(steps[j + 1 + int(np.argmax(after))])
                events.append(SpikeEvent(int(steps[i]), float(v[k]), float(lost[k]), recovered_at,
                                         float(level[i]), float(progress[i])))
            else:
                events.append(SpikeEvent(int(steps[i]), math.inf, math.inf, None, float(level[i]),
                                         float(progress[i])))
    if run.diverged_at is not None and not ends_spiking:
        events.append(SpikeEvent(int(run.diverged_at), math.inf, math.inf, None))
    return events


def _trailing_median(v: np.ndarray, k: int) -> np.ndarray:
    """For each i of 0..n-2, the median of the finite values among v[i-k+1..i] (NaN when none is finite)."""
    padded = np.concatenate([np.full(k - 1, np.nan), np.where(np.isfinite(v), v, np.nan)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, k)[:len(v) - 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a window with no finite value: NaN, as documented
        return np.nanmedian(windows, axis=1) if len(windows) else np.zeros(0)


def diverged(run: RunMetrics) -> bool:
    """A min_loss_scale event, or the last 10% of the logged training losses above L0 or not finite."""
    if run.diverged_at is not None:
        return True
    _, v = logged(run, "loss")
    finite = v[np.isfinite(v)]
    if not len(finite):
        return True
    tail = v[-max(1, len(v) // 10):]
    tail = tail[np.isfinite(tail)]
    return not len(tail) or float(tail.mean()) > float(finite[0])


def _count(run: RunMetrics, metric: str) -> int:
    """The logged counts of ``metric`` summed; for ``overflow_step`` with the overflows of a divergence's
    ``min_loss_scale`` event, which no metrics row holds."""
    series = run.metric(metric)
    total = int(round(float(series[1].sum()))) if series is not None else 0
    return total + (run.final_overflows if metric == "overflow_step" else 0)


@dataclass
class Instability:
    spikes: int  # spike events of the training loss
    overflow_steps: int  # fp16 overflow iterations
    skipped_steps: int  # updates skipped for a non-finite gradient
    diverged: bool

    @property
    def total(self) -> int:
        return self.spikes + self.overflow_steps + self.skipped_steps + int(self.diverged)


def instability(run: RunMetrics) -> Instability:
    """Spike events + overflow steps + skipped steps + (1 if diverged), with the parts."""
    return Instability(len(spike_events(run)), _count(run, "overflow_step"), _count(run, "skipped_step"),
                       diverged(run))


def final_eval_cb0(run: RunMetrics) -> float:
    """The last logged held-out codebook-0 CE (NaN without one, or when the run diverged)."""
    series = run.metric(EVAL_CB0)
    return float(series[1][-1]) if series is not None and not diverged(run) else math.nan


def initial_eval_cb0(run: RunMetrics) -> float:
    """The first logged held-out codebook-0 CE (NaN without one)."""
    series = run.metric(EVAL_CB0)
    return float(series[1][0]) if series is not None else math.nan


def max_attn_logit(run: RunMetrics) -> float:
    """The largest logged attention logit over layers and steps (NaN without diagnostics)."""
    values = [float(v.max()) for k, (_, v) in run.series.items() if k.startswith(ATTN_LOGIT) and len(v)]
    return max(values) if values else math.nan


def probe_score(run: RunMetrics | str | Path) -> float:
    """Best-layer pitch mAP of the run's linear probes (``musiclm-stab probe``), NaN when not probed."""
    paired = probe_vs_random_init(run)
    return paired["map"] if paired is not None else math.nan


def probe_vs_random_init(run: RunMetrics | str | Path) -> dict | None:
    """The pitch probe of a run at its best layer: {"map", "layer", "diff", "ci95"} (diff and its
    track-bootstrap 95% interval: the model minus its random init, NaN when not probed against it);
    None when the run has no RUN/probe/probe.json."""
    from musiclm_stab.analysis.probe import read_probe, summary  # here: the probe stack is heavier

    path = Path(run.path if isinstance(run, RunMetrics) else run)
    if not (path / "probe" / "probe.json").is_file():
        return None
    pitch = summary(read_probe(path))["pitch"]
    paired = pitch.get("vs_random_init") or {}
    ci = paired.get("ci95") or [math.nan, math.nan]
    return {"map": float(pitch["model"]), "layer": int(pitch["model_layer"]),
            "diff": float(paired.get("diff", math.nan)), "ci95": [float(ci[0]), float(ci[1])]}


# ---------------------------------------------------------------------------------------------------
# Everything the analysis needs of one run, computed once


@dataclass
class RunStats:
    path: str
    role: str | None
    lr: float
    seed: int
    precision: str
    early_loss: float
    median_grad_norm: float
    peak_ratio: float
    clip_share_early: float
    spikes: list[SpikeEvent] = field(default_factory=list)
    instability: Instability = field(default_factory=lambda: Instability(0, 0, 0, False))
    final_eval_cb0: float = math.nan
    initial_eval_cb0: float = math.nan
    max_attn_logit: float = math.nan

    @property
    def diverged(self) -> bool:
        return self.instability.diverged

    @property
    def has_recovered_spike(self) -> bool:
        return any(e.recovered_at is not None for e in self.spikes)


def run_stats(run: RunMetrics) -> RunStats:
    """Every per-run statistic of ``run`` (losses read in bits: ``run.in_unit("bits")``)."""
    run = run.in_unit("bits")
    cfg = run.config
    try:
        lr, seed = block_of(cfg)
        warmup_steps(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(run.path) / 'config.yaml'}: optim.lr, train.seed and optim.warmup_steps must "
                         f"be numbers ({e})") from None
    spikes = spike_events(run)
    gone = diverged(run)
    unstable = Instability(len(spikes), _count(run, "overflow_step"), _count(run, "skipped_step"), gone)
    evals = run.metric(EVAL_CB0)
    return RunStats(
        path=str(run.path), role=role_of(cfg), lr=lr, seed=seed, precision=precision_of(cfg),
        early_loss=early_loss(run), median_grad_norm=median_grad_norm(run), peak_ratio=peak_ratio(run),
        clip_share_early=clip_share_early(run), spikes=spikes, instability=unstable,
        final_eval_cb0=float(evals[1][-1]) if evals is not None and not gone else math.nan,
        initial_eval_cb0=float(evals[1][0]) if evals is not None else math.nan,
        max_attn_logit=max_attn_logit(run))
