"""The learning study's calibration rule (docs/STUDY.md, "Calibration"), applied to its runs: the claims arm's
horizon H, its rate L and the early-loss margin DELTA_EARLY, from the four calibration runs alone.

    python -m musiclm_stab.analysis.horizon RUN_DIR_OR_FOLDER ... --unigram BITS [--json FILE]

The runs: Pre-Norm clip 1 and Post-Norm DeepNorm clip 1 (roles ``clip1`` and ``deepnorm``), each at lr 3e-3
and 1e-2, 1000 steps, a held-out evaluation every 100 steps. The rule, fixed before the runs:

- H is the smallest multiple of 100 from 200 to 1000 at which *both* runs at one rate have a held-out
  codebook-0 loss at least H_MARGIN = 0.2 bits below the unigram level; L is the rate with the smaller such H
  (a tie: the lower rate).
- If no rate reaches it by step 1000: H = 1000 at the rate whose two runs end lower on average (a run that
  failed ends at +inf), and the plan must say before its runs that fewer than half of them may learn.
- DELTA_EARLY, the margin of the early-loss claims, is 1% of the early loss (mean training loss in bits over
  steps 1..H/4, the study's own early window) of the Pre-Norm clip 1 calibration run at L.

The rule is applied only when all four runs are in: each reached its last step, or stopped at fp16's loss-scale
floor (a dead input is judged at a run's end: a run whose input is dying may still recover). Otherwise this refuses and names what is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.claim_stats import EVAL_CB0, block_of, logged, role_of
from musiclm_stab.analysis.claims import _plain, read_runs
from musiclm_stab.analysis.failures import failure
from musiclm_stab.analysis.instability import EARLY_SHARE
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.analysis.sweep_report import lr_text

CALIBRATION_LRS = (3e-3, 1e-2)  # the two rates, lower first
CALIBRATION_ROLES = ("clip1", "deepnorm")  # Pre-Norm clip 1, Post-Norm DeepNorm clip 1
CALIBRATION_STEPS = 1000
H_STEPS = tuple(range(200, CALIBRATION_STEPS + 1, 100))  # the horizons the rule may choose
H_MARGIN = 0.2  # bits below the unigram level both runs must be at H: twice the "learned" margin
DELTA_EARLY_SHARE = 0.01  # DELTA_EARLY: this share of the calibration's early loss


@dataclass
class Horizon:
    H: int
    L: float
    delta_early: float  # bits
    reached: bool  # False: no rate reached H_MARGIN by step 1000 (fewer than half may learn)
    early_loss: float  # bits: the Pre-Norm clip 1 run at L, steps 1..H/4
    below: dict[str, dict[int, float]]  # "role lr" -> {step: held-out cb0 - unigram level, bits}
    first_h: dict[str, int | None]  # lr (as text) -> the smallest H reached at that rate, None if none
    ends: dict[str, float]  # lr (as text) -> mean of its two runs' last held-out cb0 - unigram (inf: failed)


def _calibration_runs(runs: Sequence[RunMetrics]) -> dict[tuple[float, str], RunMetrics]:
    """The four runs by (lr, role); ValueError naming what is missing, doubled or unfinished."""
    found: dict[tuple[float, str], RunMetrics] = {}
    for run in runs:
        role, (lr, _) = role_of(run.config), block_of(run.config)
        rate = next((x for x in CALIBRATION_LRS if math.isclose(lr, x)), None)
        if role not in CALIBRATION_ROLES or rate is None:
            continue
        if (rate, role) in found:
            raise ValueError(f"two calibration runs of {role} at lr {lr_text(rate)}: {found[rate, role].path}, {run.path}")
        found[rate, role] = run
    missing = [f"{role} at lr {lr_text(lr)}" for lr in CALIBRATION_LRS for role in CALIBRATION_ROLES if (lr, role) not in found]
    if missing:
        raise ValueError("the rule needs all four calibration runs; missing: " + ", ".join(missing))
    unfinished = []
    for (lr, role), run in found.items():
        steps = int((run.config.get("train") or {}).get("max_steps", 0))
        if steps != CALIBRATION_STEPS:
            raise ValueError(f"{run.path}: {steps} steps, the calibration's runs have {CALIBRATION_STEPS}")
        if (run.last_step or 0) < steps and run.diverged_at is None:  # a dead input is judged at the end
            unfinished.append(f"{role} at lr {lr_text(lr)} (at step {run.last_step or 0} of {steps})")
    if unfinished:
        raise ValueError("the rule is applied when every calibration run is in; still running: " + ", ".join(unfinished))
    return found


def _below(run: RunMetrics, unigram: float, failed_at: int | None) -> dict[int, float]:
    """{step: held-out cb0 - unigram} of a run, bits (none from ``failed_at`` on: a failed run's evaluations end)."""
    series = run.metric(EVAL_CB0)
    if series is None:
        return {}
    return {int(s): float(v) - unigram for s, v in zip(*series, strict=True) if failed_at is None or s < failed_at}


def _early_loss(run: RunMetrics, H: int) -> float:
    """Mean training loss (bits) over steps 1..H * EARLY_SHARE: the study's early window at horizon H."""
    s, v = logged(run, "loss")
    window = v[(s >= 1) & (s <= max(1, int(EARLY_SHARE * H)))]
    window = window[np.isfinite(window)]
    if not len(window):
        raise ValueError(f"{run.path}: no training loss logged in steps 1..{int(EARLY_SHARE * H)}")
    return float(window.mean())


def choose_horizon(run_dirs: Sequence[str | Path | RunMetrics], unigram_eval_cb0: float) -> Horizon:
    """The rule (module docstring) on the calibration runs found in ``run_dirs``."""
    runs = _calibration_runs(read_runs(run_dirs))
    fails = {key: failure(run) for key, run in runs.items()}
    below = {key: _below(run, unigram_eval_cb0, fails[key].step) for key, run in runs.items()}
    first_h: dict[float, int | None] = {}
    for lr in CALIBRATION_LRS:
        first_h[lr] = next((h for h in H_STEPS if all(below[lr, role].get(h, math.inf) <= -H_MARGIN
                                                    for role in CALIBRATION_ROLES)), None)
    ends = {}
    for lr in CALIBRATION_LRS:
        last = [below[lr, role][max(below[lr, role])] if below[lr, role] and fails[lr, role].kind == "none"
                else math.inf for role in CALIBRATION_ROLES]
        ends[lr] = float(np.mean(last))
    reached = [lr for lr in CALIBRATION_LRS if first_h[lr] is not None]
    if reached:
        L = min(reached, key=lambda lr: (first_h[lr], lr))  # the smaller H; a tie: the lower rate
        H = int(first_h[L])
    else:
        L = min(CALIBRATION_LRS, key=lambda lr: (ends[lr], lr))  # the rate whose runs end lower on average
        H = CALIBRATION_STEPS
    early = _early_loss(runs[L, "clip1"], H)
    return Horizon(H=H, L=L, delta_early=DELTA_EARLY_SHARE * early, reached=bool(reached), early_loss=early,
                   below={f"{role} {lr_text(lr)}": values for (lr, role), values in sorted(below.items())},
                   first_h={lr_text(lr): h for lr, h in first_h.items()},
                   ends={lr_text(lr): e for lr, e in ends.items()})


def markdown(h: Horizon, unigram_eval_cb0: float) -> str:
    """The calibration's table (held-out cb0 minus the unigram level per run and step) and what the rule chose."""
    steps = sorted({s for values in h.below.values() for s in values})
    lines = [f"Held-out codebook-0 loss minus the unigram level ({unigram_eval_cb0:.3f} bits), bits; the rule "
             f"needs both runs of a rate at -{H_MARGIN:g} or below.", "",
             "| run | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---:|" * len(steps)]
    for name, values in h.below.items():
        role, lr = name.split()
        label = {"clip1": "Pre-Norm clip 1", "deepnorm": "DeepNorm clip 1"}[role]
        lines.append(f"| {label}, lr {lr} | " + " | ".join(f"{values[s]:+.3f}" if s in values else "-" for s in steps)
                     + " |")
    reached = "; ".join(f"lr {lr}: " + (f"step {s}" if s is not None else "not by step 1000")
                        for lr, s in h.first_h.items())
    lines += ["", f"Both runs {H_MARGIN:g} bits below: {reached}.",
              f"**H = {h.H}, L = {lr_text(h.L)}, DELTA_EARLY = {h.delta_early:.3f} bits** (1% of {h.early_loss:.2f} bits, "
              f"the Pre-Norm clip 1 run's mean training loss over steps 1-{int(EARLY_SHARE * h.H)} at L)."]
    if not h.reached:
        lines.append("No rate reached the margin by step 1000: H = 1000 at the rate whose runs end lower on average; "
                     "the plan must say before its runs that fewer than half of them may learn.")
    return "\n".join(lines) + "\n"


def rule_cli(prog: str, doc: str, apply: Callable, show: Callable, plain: Callable, argv: list[str] | None) -> int:
    """The command of a study rule on run directories (this calibration rule, pilot_rule's): ``apply(run_dirs,
    unigram)`` its result, ``show(result, unigram)`` its markdown, ``plain(result)`` its JSON; exit 2 with one line
    when the rule refuses."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0], epilog="Reference: docs/STUDY.md")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or folders to search for them")
    p.add_argument("--unigram", type=float, required=True, metavar="BITS",
                   help="held-out codebook-0 CE of the unigram model (bits)")
    p.add_argument("--json", metavar="FILE", help="also write every number here")
    args = p.parse_args(argv)
    try:
        result = apply(args.run_dirs, args.unigram)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog.rsplit('.', 1)[-1]}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps({"unigram_eval_cb0": args.unigram, **plain(result)}, indent=2) + "\n")
    print(show(result, args.unigram), end="")
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    return rule_cli("python -m musiclm_stab.analysis.horizon", __doc__, choose_horizon, markdown, _plain, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
