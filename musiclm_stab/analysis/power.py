"""Power of the instability study's design, by simulation, before its runs (docs/STUDY.md).

    python -m musiclm_stab.analysis.power --out DIR [--seeds 3 4 6 8] [--lrs 5] [--studies 400]

Simulated studies go through the study's own decision code (analysis/instability.py: ``controls_of`` and
``claims_of``) on synthetic per-run endpoints; the share of studies in which a planted effect is found
(a claim *reproduced*, the positive control *detects*) is that effect's power, and with nothing planted the
share of studies in which a claim is decided at all is its false-positive rate. Each (seeds, effect) cell
draws from its own generator (numpy default_rng of the cell's index), so any cell can be recomputed alone.

The null study (``NULL``): six configurations (instability.ROLES6) at ``lrs`` peak learning rates and
``seeds`` seeds; a block is (lr, seed). Every configuration learns at the grid's lowest LEARN_RATES rates and
diverges at the rates above (a boundary shared by all: no configuration is more stable). Per run, in a
block: early loss = block level N(0, 0.3) + run noise N(0, EARLY_SD); ln median gradient norm = block level
N(0, 0.3) + N(0, GRAD_SD); a recovered spike with probability SPIKE_P; cascades Poisson(CASCADE_RATE) at the
rates where runs learn (inf when diverged); clip 1 clips 70% of its early steps; the attention logit's
headroom lognormal around 0.01 (QK-Norm's 100x smaller). EARLY_SD and GRAD_SD are the CPU study's: within a
block, two configurations that train alike (clip 1 and relax at lr 1e-3 and 3e-3) differed by 0.01-0.05
bits of early loss and by 0.01-0.31 in ln median gradient norm (docs/study_cpu/runs).

The effects (``EFFECTS``), each planted alone on the null study, at the sizes issue 45 names:

- ``control``: plain Post-Norm fails at the highest rate where the others learn, in every seed (its
  boundary one grid step lower: the literature's Post-LN failure);
- ``control 3 of 6``: the same in half the seeds (a divergence-rate difference of 3 in 6);
- ``a: 0.3 bits``: clip 10's early loss 0.3 bits below clip 1's in every block (claim (a) as stated);
- ``b: 0.3 ln``: DeepNorm's median gradient norm 26% (0.3 in ln) below each other configuration's;
- ``c: spikes 50%``: DeepNorm has a recovered spike in half its runs (the others at SPIKE_P);
- ``d: 0.3 bits + blow-up``: relax 0.3 bits slower early than clip 1, and clip 1 has one seed blowing up
  (diverging) at the highest rate where the others learn, relax not;
- ``d: 0.3 bits + 1 cascade``: relax 0.3 bits slower, and clip 1 has one more cascade than relax in every
  block where they learn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.decide import REPRODUCED
from musiclm_stab.analysis.instability import POST, QKNORM, ROLES6, Blocks, Endpoints, claims_of, controls_of

EARLY_SD = 0.03
GRAD_SD = 0.15
SPIKE_P = 0.1
CASCADE_RATE = 1.0
LEARN_RATES = 3  # the null study learns at the grid's lowest 3 rates, diverges above
NULL = "null"
EFFECTS = (NULL, "control", "control 3 of 6", "a: 0.3 bits", "b: 0.3 ln", "c: spikes 50%", "d: 0.3 bits + blow-up",
           "d: 0.3 bits + 1 cascade")
WHAT = {"control": "control", "control 3 of 6": "control", "a: 0.3 bits": "a", "b: 0.3 ln": "b", "c: spikes 50%": "c",
        "d: 0.3 bits + blow-up": "d", "d: 0.3 bits + 1 cascade": "d"}


def _run(role: str, lr: float, seed: int, learns: bool, early: float, grad: float, rng: np.random.Generator,
         spike_p: float = SPIKE_P, cascades: float | None = None) -> Endpoints:
    n_cascades = int(rng.poisson(CASCADE_RATE)) if cascades is None else int(cascades)
    logit = float(np.exp(rng.normal(math.log(0.01), 0.3))) / (100.0 if role == QKNORM else 1.0)
    return Endpoints(
        path=f"{role}_lr{lr:g}_s{seed}", role=role, lr=lr, seed=seed, precision="fp16 (fairseq)",
        kind="none" if learns else "diverged", kind_step=None if learns else 50, kind_why="simulated",
        early_loss=early if learns else math.inf, clip_share_early=0.7 if role == "clip1" else 0.0,
        median_grad_norm=float(np.exp(grad)), recovered_spike=bool(rng.random() < spike_p),
        cascades=n_cascades if learns else 0, diverged=not learns, final_eval_cb0=9.0 if learns else math.nan,
        cap=10.3, headroom={"attn_logit": logit})


def simulate(seeds: int, lrs: int, effect: str, rng: np.random.Generator) -> Blocks:
    """One simulated study (module docstring) with ``effect`` planted, as the blocks the decision code reads."""
    if effect not in EFFECTS:
        raise ValueError(f"effect {effect!r}: choose one of {', '.join(EFFECTS)}")
    grid = [10.0 ** (-3 + 0.5 * i) for i in range(lrs)]
    learning = min(LEARN_RATES, lrs)
    edge = grid[learning - 1]  # the highest rate where the null study learns
    complete = {}
    for seed in range(seeds):
        for lr in grid:
            block_early, block_grad = rng.normal(0.0, 0.3), rng.normal(0.0, 0.3)
            runs = {}
            for role in ROLES6:
                learns = lr <= edge
                early = 60.0 + block_early + rng.normal(0.0, EARLY_SD)
                grad = block_grad + rng.normal(0.0, GRAD_SD)
                spike_p, cascades = SPIKE_P, None
                if role == POST and lr == edge and (effect == "control" or (effect == "control 3 of 6" and seed % 2 == 0)):
                    learns = False
                if effect == "a: 0.3 bits" and role == "clip10":
                    early -= 0.3
                if effect == "b: 0.3 ln" and role == "deepnorm":
                    grad -= 0.3
                if effect == "c: spikes 50%" and role == "deepnorm":
                    spike_p = 0.5
                if effect.startswith("d:") and role == "relax":
                    early += 0.3
                if effect == "d: 0.3 bits + blow-up" and role == "clip1" and lr == edge and seed == 0:
                    learns = False
                if effect == "d: 0.3 bits + 1 cascade" and role in ("clip1", "relax"):
                    base = runs["clip1"].cascades - 1 if role == "relax" else int(rng.poisson(CASCADE_RATE)) + 1
                    cascades = max(0, base)
                runs[role] = _run(role, lr, seed, learns, early, grad, rng, spike_p, cascades)
            complete[(lr, seed)] = runs
    return Blocks(dict(sorted(complete.items())))


def found(blocks: Blocks, effect: str) -> dict[str, bool]:
    """What the decision code says of one simulated study: the control's detection and, per claim, whether
    it was decided at all (reproduced or refuted) and whether it was reproduced."""
    controls = controls_of(blocks)
    claims = {c.key: c for c in claims_of(blocks)}
    out = {"control": controls["detects"]}
    for key, c in claims.items():
        out[key] = c.verdict == REPRODUCED
        out[f"{key} decided"] = c.verdict in (REPRODUCED, "refuted")
    return out


def cell(seeds: int, lrs: int, effect: str, studies: int, index: int) -> dict:
    """Power of one (seeds, effect) cell over ``studies`` simulated studies, from default_rng(index)."""
    rng = np.random.default_rng(index)
    counts: dict[str, int] = {}
    for _ in range(studies):
        for key, yes in found(simulate(seeds, lrs, effect, rng), effect).items():
            counts[key] = counts.get(key, 0) + int(yes)
    target = WHAT.get(effect)
    row = {"seeds": seeds, "lrs": lrs, "effect": effect, "studies": studies, "index": index,
           "shares": {k: v / studies for k, v in sorted(counts.items())}}
    row["power"] = None if target is None else row["shares"][target]
    return row


def power_table(seeds: Sequence[int], lrs: int, studies: int) -> list[dict]:
    """Every (seeds, effect) cell, indexed in this order (the index seeds its generator)."""
    rows, index = [], 0
    for n in seeds:
        for effect in EFFECTS:
            rows.append(cell(n, lrs, effect, studies, index))
            index += 1
    return rows


def markdown(rows: list[dict]) -> str:
    seeds = sorted({r["seeds"] for r in rows})
    lines = ["| effect (what finds it) | " + " | ".join(f"{n} seeds" for n in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for effect in EFFECTS:
        cells = []
        for n in seeds:
            r = next(x for x in rows if x["seeds"] == n and x["effect"] == effect)
            if effect == NULL:
                decided = max(v for k, v in r["shares"].items() if k.endswith("decided"))
                cells.append(f"{decided:.1%} decided (worst claim); control {r['shares']['control']:.1%}")
            else:
                cells.append(f"{r['power']:.0%}")
        what = "none planted: false positives" if effect == NULL else (
            "the positive control detects" if WHAT[effect] == "control" else f"claim ({WHAT[effect]}) reproduced")
        lines.append(f"| {effect} ({what}) | " + " | ".join(cells) + " |")
    r0 = rows[0]
    lines += ["", f"{r0['studies']} simulated studies per cell, {r0['lrs']} learning rates (the null study learns at "
              f"the lowest {min(LEARN_RATES, r0['lrs'])}); `python -m musiclm_stab.analysis.power` (analysis/power.py)."]
    return "\n".join(lines) + "\n"


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.power", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md (offline: musiclm-stab docs STUDY)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for power.md and power.json")
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5, 6, 8], help="seeds per configuration and lr")
    p.add_argument("--lrs", type=int, default=5, help="learning rates in the grid (half-decade steps)")
    p.add_argument("--studies", type=int, default=400, help="simulated studies per cell")
    args = p.parse_args(argv)
    if args.lrs < 1 or args.studies < 1 or min(args.seeds) < 1:
        p.error("--lrs, --studies and --seeds must be >= 1")
    rows = power_table(args.seeds, args.lrs, args.studies)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "power.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "power.md").write_text(markdown(rows))
    print((out / "power.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
