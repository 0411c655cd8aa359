"""The study's learning-rate grid: where each configuration's runs ended, its LR sensitivity, its largest
stable learning rate, and whether the study learns at all (analysis/claims.py puts them in claims.md).

Per configuration (role) and learning rate, over the seeds: the final held-out codebook-0 CE (mean, min,
max, n of the runs that did not diverge), how many seeds diverged, the overflow steps of each run (its
smallest and largest count: fairseq's scaler overflows about once per window by design), skipped steps and
loss-spike events (summed over the seeds), and the largest attention logit (claim_stats.py defines each).

- L(lr) = the mean over seeds of the final held-out codebook-0 CE, a diverged seed counting as the cap;
  the cap = the mean over the role's runs of their initial (first logged) held-out codebook-0 CE.
- LR sensitivity (Wortsman et al. 2023): S = the mean over the grid of min(L(lr), cap) minus the lowest
  L(lr) (experiments/sweep_report.lr_sensitivity), with a 95% bootstrap interval: the seeds are
  resampled with replacement within each learning rate (BOOTSTRAP = 2000 resamples, numpy's
  default_rng(0) per role, the cap held fixed), S recomputed, and the 2.5th and 97.5th percentiles of
  the defined values taken (a resample where no learning rate trained has no S; they are counted).
- Largest stable learning rate: the largest lr of the grid at which no seed diverged.
- The study *learns* when both hold: (1) the lowest L(role, lr) over the claims' four configurations is
  at least LEARN_MARGIN = 0.5 bits below the unigram level (the cross-entropy of the held-out masked
  frames' codebook-0 codes under the training split's add-one smoothed code frequencies: an input), and
  (2) the pitch probe of that (role, lr) at seed 0 is above its random init with a 95% track-bootstrap
  interval above 0 (its RUN/probe/probe.json). "learns: yes" when both hold, "no" when one fails, else
  "not measured" (no unigram level, no held-out evaluation, or the run not probed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from musiclm_stab.analysis.claim_stats import ROLE_TITLES, ROLES, RunStats, probe_vs_random_init
from musiclm_stab.analysis.sweep_report import lr_sensitivity, lr_text

BOOTSTRAP = 2000
LEARN_MARGIN = 0.5


def _by(runs: Sequence[RunStats]) -> dict[str, dict[float, list[RunStats]]]:
    """{role: {lr: runs by seed}}, roles in legend order (the control last), learning rates ascending."""
    out: dict[str, dict[float, list[RunStats]]] = {}
    for role in [*ROLES, *sorted({r.role for r in runs if r.role not in ROLES})]:
        mine = [r for r in runs if r.role == role]
        if mine:
            out[role] = {lr: sorted((r for r in mine if r.lr == lr), key=lambda r: r.seed)
                         for lr in sorted({r.lr for r in mine})}
    return out


def cap_of(runs: Sequence[RunStats]) -> float:
    """Mean initial held-out codebook-0 CE of the runs (NaN when none evaluated)."""
    values = [r.initial_eval_cb0 for r in runs if math.isfinite(r.initial_eval_cb0)]
    return float(np.mean(values)) if values else math.nan


def capped_values(runs: Sequence[RunStats], cap: float) -> np.ndarray:
    """Per seed: the final held-out codebook-0 CE, the cap where the run diverged (NaN: not evaluated)."""
    return np.array([cap if r.diverged else r.final_eval_cb0 for r in runs], dtype=np.float64)


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else math.nan


def grid_rows(runs: Sequence[RunStats]) -> list[dict]:
    """One row per (role, lr): the numbers of the grid table (module docstring)."""
    rows = []
    for role, by_lr in _by(runs).items():
        cap = cap_of([r for seeds in by_lr.values() for r in seeds])
        for lr, seeds in by_lr.items():
            final = np.array([r.final_eval_cb0 for r in seeds
                              if not r.diverged and math.isfinite(r.final_eval_cb0)])
            logits = [r.max_attn_logit for r in seeds if math.isfinite(r.max_attn_logit)]
            rows.append({
                "role": role, "lr": lr, "seeds": [r.seed for r in seeds],
                "precision": sorted({r.precision for r in seeds}),
                "final_eval_cb0": {"mean": float(final.mean()) if len(final) else math.nan,
                                   "min": float(final.min()) if len(final) else math.nan,
                                   "max": float(final.max()) if len(final) else math.nan,
                                   "n": int(len(final))},
                "L": _mean(capped_values(seeds, cap)),
                "diverged": sum(r.diverged for r in seeds),
                "overflow_steps": sum(r.instability.overflow_steps for r in seeds),
                "overflow_steps_per_run": [min(r.instability.overflow_steps for r in seeds),
                                           max(r.instability.overflow_steps for r in seeds)],
                "skipped_steps": sum(r.instability.skipped_steps for r in seeds),
                "spike_events": sum(len(r.spikes) for r in seeds),
                "max_attn_logit": max(logits) if logits else math.nan,
            })
    return rows


def sensitivity(by_lr: dict[float, list[RunStats]], resamples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """S of one role with its bootstrap interval: {"S", "ci95", "cap", "L", "undefined_resamples"}."""
    lrs = sorted(by_lr)
    cap = cap_of([r for lr in lrs for r in by_lr[lr]])
    values = [capped_values(by_lr[lr], cap) for lr in lrs]
    level = [_mean(v) for v in values]
    caps = [cap] * len(lrs)
    s = lr_sensitivity(level, caps) if math.isfinite(cap) else math.nan
    rng = np.random.default_rng(seed)
    draws = []
    for v in values:
        picked = v[rng.integers(0, len(v), size=(resamples, len(v)))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a resample of only unevaluated seeds: NaN
            draws.append(np.nanmean(picked, axis=1))
    if not math.isfinite(cap):  # no held-out evaluation: nothing to resample
        return {"S": s, "ci95": [math.nan, math.nan], "cap": cap, "L": dict(zip(lrs, level)),
                "undefined_resamples": resamples}
    boot = np.array([lr_sensitivity([d[i] for d in draws], caps) for i in range(resamples)])
    defined = boot[np.isfinite(boot)]
    ci = [float(x) for x in np.percentile(defined, [2.5, 97.5])] if len(defined) else [math.nan, math.nan]
    return {"S": s, "ci95": ci, "cap": cap, "L": dict(zip(lrs, level)),
            "undefined_resamples": int(resamples - len(defined))}


def largest_stable_lr(by_lr: dict[float, list[RunStats]]) -> float | None:
    """The largest learning rate at which no seed diverged (None: every rate had a diverged seed)."""
    stable = [lr for lr, seeds in by_lr.items() if not any(r.diverged for r in seeds)]
    return max(stable) if stable else None


def best_cell(runs: Sequence[RunStats]) -> tuple[str, float, float, list[RunStats]] | None:
    """The (role, lr) of the claims' four configurations with the lowest L(lr) (a diverged seed at the
    cap): (role, lr, L, its runs by seed); None when no cell has a finite L. The "learns" check's cell,
    and so the one the study probes beside the figure lr's."""
    best = None
    for role, by_lr in _by([r for r in runs if r.role in ROLES]).items():
        cap = cap_of([r for seeds in by_lr.values() for r in seeds])
        for lr, seeds in by_lr.items():
            level = _mean(capped_values(seeds, cap))
            if math.isfinite(level) and (best is None or level < best[2]):
                best = (role, lr, level, seeds)
    return best


def learns(runs: Sequence[RunStats], unigram_eval_cb0: float | None) -> dict:
    """Whether the study learns (module docstring): {"verdict", "best", "eval", "probe"} with the numbers."""
    best = best_cell(runs)
    out: dict = {"best": None, "eval": None, "probe": None}
    if best is not None:
        role, lr, level, seeds = best
        out["best"] = {"role": role, "lr": lr, "eval_cb0": level}
        if unigram_eval_cb0 is not None and math.isfinite(unigram_eval_cb0):
            out["eval"] = {"eval_cb0": level, "unigram_eval_cb0": float(unigram_eval_cb0),
                           "below_unigram": float(unigram_eval_cb0) - level,
                           "holds": bool(level <= unigram_eval_cb0 - LEARN_MARGIN)}
        seed0 = [r for r in seeds if r.seed == 0]
        probe = probe_vs_random_init(seed0[0].path) if seed0 else None
        if probe is not None and math.isfinite(probe["diff"]):
            above = bool(probe["diff"] > 0 and probe["ci95"][0] > 0)
            out["probe"] = {**probe, "run": seed0[0].path, "holds": above}
    checks = [c["holds"] for c in (out["eval"], out["probe"]) if c is not None]
    out["verdict"] = "no" if False in checks else "yes" if len(checks) == 2 else "not measured"
    return out


def summarise_grid(runs: Sequence[RunStats], unigram_eval_cb0: float | None = None) -> dict:
    """Everything of this module for ``runs``: the grid rows, S with its interval and the largest stable
    rate per role, "learns", and the seed-0 probes per (role, lr)."""
    by = _by(runs)
    probes = {}
    for role, by_lr in by.items():
        for lr, seeds in by_lr.items():
            seed0 = [r for r in seeds if r.seed == 0]
            probe = probe_vs_random_init(seed0[0].path) if seed0 else None
            if probe is not None:
                probes.setdefault(lr, {})[role] = probe
    return {"grid": grid_rows(runs),
            "lr_sensitivity": {role: sensitivity(by_lr) for role, by_lr in by.items()},
            "largest_stable_lr": {role: largest_stable_lr(by_lr) for role, by_lr in by.items()},
            "learns": learns(runs, unigram_eval_cb0), "probes": probes}


# ---------------------------------------------------------------------------------------------------
# Markdown


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return fmt.format(x)


def _range(low_high: list[int]) -> str:
    low, high = low_high
    return str(low) if low == high else f"{low}-{high}"


def grid_markdown(summary: dict) -> list[str]:
    """The grid, sensitivity, learns and probe tables of ``summarise_grid``'s result, as markdown lines."""
    lines = ["### Learning-rate grid", "",
             "| configuration | lr | precision | final held-out cb0 (bits): mean [min, max] (n) | diverged "
             "| overflow steps per run | skipped steps (all seeds) | loss spike events (all seeds) | max attention logit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["grid"]:
        f = row["final_eval_cb0"]
        final = f"{_num(f['mean'])} [{_num(f['min'])}, {_num(f['max'])}] ({f['n']})" if f["n"] else "n/a (0)"
        lines.append(f"| {ROLE_TITLES.get(row['role'], row['role'])} | {lr_text(row['lr'])} | "
                     f"{', '.join(row['precision'])} | {final} | {row['diverged']} of {len(row['seeds'])} | "
                     f"{_range(row['overflow_steps_per_run'])} | {row['skipped_steps']} | {row['spike_events']} | "
                     f"{_num(row['max_attn_logit'], '{:.3g}')} |")
    lines += ["", "| configuration | LR sensitivity S (bits) [95% bootstrap] | cap (bits) "
              "| largest stable lr |", "|---|---|---|---|"]
    for role, s in summary["lr_sensitivity"].items():
        stable = summary["largest_stable_lr"][role]
        undefined = f"; {s['undefined_resamples']} resamples undefined" if s["undefined_resamples"] else ""
        value = (f"{_num(s['S'])} [{_num(s['ci95'][0])}, {_num(s['ci95'][1])}]{undefined}"
                 if math.isfinite(s["cap"]) else "not measured (no held-out evaluation)")
        lines.append(f"| {ROLE_TITLES.get(role, role)} | {value} | {_num(s['cap'])} | "
                     f"{lr_text(stable) if stable is not None else 'none'} |")
    lines += ["", learns_text(summary["learns"])]
    if summary["probes"]:
        lines += ["", "| probe at seed 0 | " + " | ".join(ROLE_TITLES[r] for r in ROLES) + " |",
                  "|" + "---|" * (len(ROLES) + 1)]
        for lr, by_role in sorted(summary["probes"].items()):
            cells = [by_role.get(r) for r in ROLES]
            lines.append(f"| probe: best-layer pitch mAP (lr {lr_text(lr)}) | "
                         + " | ".join(_num(c["map"]) if c else "not probed" for c in cells) + " |")
            signed = "{:+.3f}"
            lines.append(f"| probe: pitch mAP - random init [95%] (lr {lr_text(lr)}) | " + " | ".join(
                f"{_num(c['diff'], signed)} [{_num(c['ci95'][0], signed)}, {_num(c['ci95'][1], signed)}]"
                if c else "not probed" for c in cells) + " |")
    return lines


def learns_text(result: dict) -> str:
    """One paragraph: learns yes/no/not measured, with both numbers."""
    best = result["best"]
    if best is None:
        return "**Learns: not measured** (no configuration has a held-out codebook-0 CE)."
    where = f"{ROLE_TITLES[best['role']]} at lr {lr_text(best['lr'])}"
    ev = result["eval"]
    first = (f"held-out cb0 {ev['eval_cb0']:.3f} bits, {ev['below_unigram']:.3f} below the unigram level "
             f"{ev['unigram_eval_cb0']:.3f} (needs >= {LEARN_MARGIN}: {'yes' if ev['holds'] else 'no'})"
             if ev else f"held-out cb0 {best['eval_cb0']:.3f} bits, unigram level not measured")
    pr = result["probe"]
    second = (f"pitch probe at seed 0 {pr['diff']:+.3f} mAP over random init, 95% [{pr['ci95'][0]:+.3f}, "
              f"{pr['ci95'][1]:+.3f}] (needs the interval above 0: {'yes' if pr['holds'] else 'no'})"
              if pr else "pitch probe at seed 0 not measured")
    return f"**Learns: {result['verdict']}.** Best: {where}; {first}; {second}."
