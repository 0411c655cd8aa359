"""The instability study's analysis: where each run failed and why, the seed claims where the schemes act,
and the two controls. Fixed, with its parameters, before the study's runs (docs/STUDY.md, "The
instability study").

    python -m musiclm_stab.analysis.instability RUN_DIR_OR_FOLDER ... --out DIR [--unigram BITS] [--doc MD]
    python -m musiclm_stab.analysis.instability RUN_DIR_OR_FOLDER ... --out DIR [--unigram BITS] --describe

The second form decides nothing: it writes the failures by configuration and lr of every run (failures.md,
failures.json), for an arm outside the claims (``mert-frontend``: one seed, MERT's own frontend lr).

Runs and blocks. The six configurations (``ROLES6``): the seed figures' four (``claim_stats.ROLES``),
Pre-Norm clip 1 with QK-Norm (``qknorm``) and plain Post-Norm clip 1 (``post``, the positive control). A
block is (peak lr, seed), its runs trained on the same batches; a block is complete when it has one run of
each of the six; only complete blocks are used.

Per run (``Endpoints``; losses in bits, from the logged rows):

- failure kind and step (analysis/failures.py): diverged, dead input, or none; *failed* = any kind but
  none, *learned* = none. A stall (the final held-out cb0 within a margin of the unigram level) is not
  assessed by default (``stall_margin`` None): at the study's horizon no pilot run, healthy or not, had got
  below the unigram level, so a stall cannot be told from a run that learns (docs/STUDY.md).
- early loss: the mean training loss over the first EARLY_SHARE of the run's steps (+inf when it diverged
  within them: the worst).
- early clip share: the mean share of clipped steps over the same steps.
- median gradient norm: the median of the finite logged pre-clip norms.
- recovered spike: a loss-spike event of the CPU study's progress-lost rule that recovered
  (claim_stats.spike_events).
- cascades: spike cascades of the fp16 loss scale (failures.cascades: a fall of 8x below its maximum over
  the 32 steps before; the scaler's routine halvings are not); a divergence counts as one.
- final held-out cb0 (NaN when diverged) and the cap of the LR sensitivity: the first logged training
  cb0 loss (the model at initialisation, logged before any update when ``train.log_every`` is 1).
- fp16 headroom: max |x| / 65504 of the attention logits (``diag/max_attn_logit``) and of the places
  ``diag/headroom/...`` logs (frontend, residual stream, FFN, heads, gradients), the largest over the run.

The controls, stated first (not in the claims' family; p not adjusted):

- **Positive control**: plain Post-Norm fails where Pre-Norm (clip 1) does not. McNemar of failed(post) vs
  failed(clip 1) over all complete blocks; it *detects* the effect when p < ALPHA with Post-Norm failing
  more. If it does not, the study cannot see the failure its claims are about, and says so.
- **QK-Norm**: the largest attention logit, Wilcoxon of ln max logit(clip 1) - ln max logit(QK-Norm), and
  McNemar of failed(clip 1) vs failed(QK-Norm), over all complete blocks.

The claims (one family, Holm at ALPHA, verdicts as analysis/decide.py; each part > 0 is what the claim
says):

- (a) Pre-Norm with clip 10 converges faster early than with clip 1: early loss(clip 1) - early
  loss(clip 10), Wilcoxon, over the blocks where clip 1 clipped at least CLIP_SHARE_MIN of its early
  steps and neither run failed. Precondition: at least MIN_BLOCKS such blocks.
- (b) Post-Norm with DeepNorm keeps the lowest gradient norm: for each c of clip 10, clip 1, relax,
  ln median grad norm(c) - ln median grad norm(DeepNorm), Wilcoxon, over the blocks where none of the four
  failed (a blind or diverged model's gradient says nothing of its stability). Precondition: at least
  MIN_BLOCKS such blocks.
- (c) Post-Norm/DeepNorm shows a transient loss spike and recovers: recovered spike of DeepNorm vs each c,
  McNemar, over all complete blocks. Precondition: some run of the four has a recovered spike.
- (d) Pre-Norm with Attn. Relax converges more slowly, but steadily: slower, early loss(relax) - early
  loss(clip 1) over the blocks where neither failed; steadier, instability(clip 1) - instability(relax)
  over all complete blocks, instability = cascades, +inf when diverged. Precondition of the steadier part:
  clip 1 has a cascade or a divergence in some block; without it (d) can be refuted, not reproduced.

Also reported, not decided: per configuration and lr the failures by kind and their steps, the final
held-out cb0, cascades and the headroom maxima; LR sensitivity (Wortsman et al. 2023: the mean over the
grid of min(L, cap) minus the best, with L the mean over seeds of the final held-out cb0, a failed run at
the cap) with a seeded bootstrap over seeds; the largest rate that learns (the largest lr at which every
seed learned).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.claim_stats import (
    ATTN_LOGIT,
    ROLES,
    SpikeEvent,
    block_of,
    diverged,
    final_eval_cb0,
    logged,
    median_grad_norm,
    precision_of,
    role_of,
    spike_events,
)
from musiclm_stab.analysis.claims import (
    _diff,
    _ln,
    _plain,
    claims_table,
    fill_doc,
    part_text,
    read_runs,
    runs_by_block,
)
from musiclm_stab.analysis.decide import ALPHA, Claim, Part, decide
from musiclm_stab.analysis.failures import STALL_MARGIN, cascades, failure
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.analysis.sweep_report import lr_sensitivity, lr_text

POST = "post"
QKNORM = "qknorm"
ROLES6 = (*ROLES, QKNORM, POST)
TITLES = {"clip10": "Pre-Norm, clip 10", "clip1": "Pre-Norm, clip 1", "deepnorm": "Post-Norm DeepNorm, clip 1",
          "relax": "Pre-Norm Attn. Relax, clip 1", QKNORM: "Pre-Norm QK-Norm, clip 1", POST: "Post-Norm, clip 1"}
SHORT = {"clip10": "clip 10", "clip1": "clip 1", "deepnorm": "DeepNorm", "relax": "relax", QKNORM: "QK-Norm",
         POST: "Post-Norm"}
EARLY_SHARE = 0.25  # "early": the first quarter of the run's steps
CLIP_SHARE_MIN = 0.2  # (a): clip 1 must clip at least this share of its early steps
MIN_BLOCKS = 6  # the fewest blocks with which an exact two-sided Wilcoxon can reach p < 0.05
BOOTSTRAP = 2000
HEADROOM = "diag/headroom/"
FP16_MAX = 65504.0  # fp16's largest finite value: headroom = max |x| / FP16_MAX
Block = tuple[float, int]


def role6(cfg: dict) -> str | None:
    """The run's configuration among ROLES6 (claim_stats.role_of, plus plain Post-Norm clip 1), or None."""
    role = role_of(cfg)
    if role is not None:
        return role
    model, optim = cfg.get("model") or {}, cfg.get("optim") or {}
    plain = model.get("attention", "sdpa") != "relax" and not model.get("qk_norm", False)
    if (model.get("norm_scheme") == "post" and plain and optim.get("clip_mode", "fixed") == "fixed"
            and float(optim.get("clip_grad", 10.0)) == 1.0):
        return POST
    return None


@dataclass
class Endpoints:
    """Everything the analysis reads of one run (module docstring)."""

    path: str
    role: str | None
    lr: float
    seed: int
    precision: str
    kind: str  # failures.KINDS
    kind_step: int | None
    kind_why: str
    early_loss: float
    clip_share_early: float
    median_grad_norm: float
    recovered_spike: bool
    cascades: int
    diverged: bool
    final_eval_cb0: float
    cap: float
    headroom: dict[str, float] = field(default_factory=dict)  # "attn_logit", "residual", ... -> largest

    @property
    def failed(self) -> bool:
        return self.kind != "none"

    @property
    def instability(self) -> float:
        return math.inf if self.diverged else float(self.cascades)


def _early(run: RunMetrics, steps: int) -> tuple[float, float]:
    """(early loss, early clip share) over the first EARLY_SHARE of ``steps``."""
    horizon = max(1, int(EARLY_SHARE * steps))
    if run.diverged_at is not None and run.diverged_at <= horizon:
        loss = math.inf
    else:
        s, v = logged(run, "loss")
        window = v[(s >= 1) & (s <= horizon)]
        window = window[np.isfinite(window)]
        loss = float(window.mean()) if len(window) else math.nan
    clipped = run.metric("grad_clipped")
    share = math.nan
    if clipped is not None:
        s, v = clipped
        window = v[(s >= 1) & (s <= horizon)]
        share = float(window.mean()) if len(window) else math.nan
    return loss, share


def headroom_place(name: str) -> tuple[str, float] | None:
    """(place, factor to headroom) of a logged metric that measures fp16 headroom: the attention logits
    (``attn_logit``, logged as values: / 65504) and each ``diag/headroom/`` kind (layers merged:
    ``residual``, ``ffn``, ``frontend``, ``heads``, ``grad``, logged as headroom); None for any other."""
    if name.startswith(ATTN_LOGIT):
        return "attn_logit", 1.0 / FP16_MAX
    if name.startswith(HEADROOM):
        return name[len(HEADROOM):].split("/")[0], 1.0
    return None


def headroom_of(run: RunMetrics) -> dict[str, float]:
    """The largest fp16 headroom logged, by place: attention logits and each ``diag/headroom/`` kind (layers
    merged: ``residual``, ``ffn``, ``frontend``, ``heads``, ``grad``). A place that overflowed is inf."""
    out: dict[str, float] = {}
    for name in set(run.series) | set(run.nonfinite):
        found = headroom_place(name)
        if found is None:
            continue
        place, scale = found
        top = math.inf if len(run.nonfinite.get(name, ())) else -math.inf
        series = run.metric(name)
        if series is not None and len(series[1]):
            top = max(top, float(series[1].max()) * scale)
        out[place] = max(out.get(place, -math.inf), top)
    return dict(sorted(out.items()))


def endpoints(run: RunMetrics, unigram_eval_cb0: float | None, stall_margin: float | None = None,
              spikes: list[SpikeEvent] | None = None) -> Endpoints:
    """Every per-run endpoint of ``run`` (module docstring); ``stall_margin`` (bits, with the unigram level):
    also find stalled runs; ``spikes``: the run's spike events when the caller has them (spike_events of the
    run in bits), not found again."""
    run = run.in_unit("bits")
    cfg = run.config
    lr, seed = block_of(cfg)
    steps = int((cfg.get("train") or {}).get("max_steps", run.last_step or 1))
    early, share = _early(run, steps)
    found = failure(run, unigram_eval_cb0 if stall_margin is not None else None,
                    STALL_MARGIN if stall_margin is None else stall_margin)
    cb0 = run.metric("acoustic_mlm_loss/cb0")
    return Endpoints(
        path=str(run.path), role=role6(cfg), lr=lr, seed=seed, precision=precision_of(cfg), kind=found.kind,
        kind_step=found.step, kind_why=found.why, early_loss=early, clip_share_early=share,
        median_grad_norm=median_grad_norm(run),
        recovered_spike=any(e.recovered_at is not None for e in (spike_events(run) if spikes is None else spikes)),
        cascades=len(cascades(run)), diverged=diverged(run), final_eval_cb0=final_eval_cb0(run),
        cap=float(cb0[1][0]) if cb0 is not None and len(cb0[1]) else math.nan, headroom=headroom_of(run))


# ---------------------------------------------------------------------------------------------------
# Blocks, controls, claims


@dataclass
class Blocks:
    complete: dict[Block, dict[str, Endpoints]]  # ascending (lr, seed); role -> run, the six ROLES6
    incomplete: dict[Block, list[str]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def values(self, fn, role: str, at: Sequence[Block] | None = None) -> np.ndarray:
        keys = self.complete if at is None else at
        return np.array([fn(self.complete[b][role]) for b in keys], dtype=np.float64)

    def flags(self, fn, role: str, at: Sequence[Block] | None = None) -> list[bool]:
        keys = self.complete if at is None else at
        return [bool(fn(self.complete[b][role])) for b in keys]


def study_blocks(runs: Sequence[Endpoints]) -> Blocks:
    """Sort runs into blocks; ValueError for two runs of one role in a block or no complete block."""
    ignored = [r.path for r in runs if r.role is None]
    seen = runs_by_block(runs)
    complete = {b: {k: have[k] for k in ROLES6} for b, have in seen.items() if all(k in have for k in ROLES6)}
    incomplete = {b: [k for k in ROLES6 if k in have] for b, have in seen.items() if b not in complete}
    if not complete:
        raise ValueError("no complete block (one run of each of " + ", ".join(ROLES6) + " at one lr and seed)")
    return Blocks(complete, incomplete, ignored)


def controls_of(blocks: Blocks) -> dict:
    """The positive control (plain Post-Norm) and the QK-Norm control (module docstring), with whether the
    positive control detects its effect."""
    failed = {r: blocks.flags(lambda e: e.failed, r) for r in ("clip1", POST, QKNORM)}
    positive = Part.binary("failed: Post-Norm vs clip 1", failed[POST], failed["clip1"])
    logit = {r: _ln(blocks.values(lambda e: e.headroom.get("attn_logit", math.nan), r)) for r in ("clip1", QKNORM)}
    qk = [Part.paired("ln max attention logit: clip 1 - QK-Norm", _diff(logit["clip1"], logit[QKNORM])),
          Part.binary("failed: clip 1 vs QK-Norm", failed["clip1"], failed[QKNORM])]
    detects = positive.p < ALPHA and positive.estimate > 0
    return {"positive": positive, "detects": bool(detects), "qknorm": qk,
            "failed": {r: int(sum(v)) for r, v in failed.items()}, "blocks": len(blocks.complete)}


def claims_of(blocks: Blocks) -> list[Claim]:
    """The four claims with their parts and preconditions, decided (module docstring)."""
    keys = list(blocks.complete)

    def healthy(*roles: str) -> list[Block]:
        return [k for k in keys if not any(blocks.complete[k][r].failed for r in roles)]

    def early(role: str, at: Sequence[Block]) -> np.ndarray:
        return blocks.values(lambda e: e.early_loss, role, at)

    # (a)
    a = Claim("a", "Pre-Norm with clip 10 converges faster early than with clip 1")
    both = healthy("clip1", "clip10")
    share = blocks.values(lambda e: e.clip_share_early, "clip1", both)
    used = [k for k, x in zip(both, share) if x >= CLIP_SHARE_MIN]
    if used:
        a.parts = [Part.paired("early loss (bits): clip 1 - clip 10", _diff(early("clip1", used), early("clip10", used)))]
    a.reason = (f"{len(used)} of {len(keys)} blocks with neither run failed and clip 1 clipping >= "
                f"{CLIP_SHARE_MIN:.0%} of its early steps")
    if len(used) < MIN_BLOCKS:
        a.testable, a.reason = False, a.reason + f"; {MIN_BLOCKS} needed"

    # (b)
    b = Claim("b", "Post-Norm with DeepNorm keeps the lowest gradient norm")
    calm = healthy(*ROLES)
    dn = _ln(blocks.values(lambda e: e.median_grad_norm, "deepnorm", calm))
    for c in ("clip10", "clip1", "relax"):
        b.parts.append(Part.paired(f"ln median grad norm: {SHORT[c]} - DeepNorm",
                                   _diff(_ln(blocks.values(lambda e: e.median_grad_norm, c, calm)), dn)))
    b.reason = f"{len(calm)} of {len(keys)} blocks where none of the four failed"
    if len(calm) < MIN_BLOCKS:
        b.testable, b.reason = False, b.reason + f"; {MIN_BLOCKS} needed"

    # (c)
    spiked = {r: blocks.flags(lambda e: e.recovered_spike, r) for r in ROLES}
    c = Claim("c", "Post-Norm/DeepNorm shows a transient loss spike and recovers",
              [Part.binary(f"recovered loss spike: DeepNorm vs {SHORT[r]}", spiked["deepnorm"], spiked[r])
               for r in ("clip10", "clip1", "relax")])
    counts = ", ".join(f"{SHORT[r]} {sum(spiked[r])}" for r in ROLES)
    c.reason = f"runs with a recovered spike, of {len(keys)}: {counts}"
    if not any(any(v) for v in spiked.values()):
        c.testable = False

    # (d)
    pair = healthy("clip1", "relax")
    d = Claim("d", "Pre-Norm with Attn. Relax converges more slowly, but steadily",
              [Part.paired("slower: early loss (bits) relax - clip 1", _diff(early("relax", pair), early("clip1", pair)))])
    unsteady = blocks.values(lambda e: e.instability, "clip1")
    if np.any(unsteady > 0):
        d.parts.append(Part.paired("steadier: instability clip 1 - relax",
                                   _diff(unsteady, blocks.values(lambda e: e.instability, "relax"))))
        d.reason = (f"slower over {len(pair)} blocks where neither failed; clip 1 has a cascade or diverged in "
                    f"{int(np.sum(unsteady > 0))} of {len(keys)} blocks")
    else:
        d.refute_only = True
        d.reason = "clip 1 has no cascade and no divergence in any block: the steadier part is not testable"
    return decide([a, b, c, d])


# ---------------------------------------------------------------------------------------------------
# The learning-rate grid


def _capped(runs: Sequence[Endpoints], cap: float) -> np.ndarray:
    return np.array([cap if r.failed or not math.isfinite(r.final_eval_cb0) else min(r.final_eval_cb0, cap)
                     for r in runs], dtype=np.float64)


def sensitivity(by_lr: dict[float, list[Endpoints]], resamples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """LR sensitivity of one configuration with a bootstrap interval over seeds (module docstring)."""
    lrs = sorted(by_lr)
    caps = [r.cap for lr in lrs for r in by_lr[lr] if math.isfinite(r.cap)]
    cap = float(np.mean(caps)) if caps else math.nan
    values = [_capped(by_lr[lr], cap) for lr in lrs]
    level = [float(np.nanmean(v)) if np.isfinite(v).any() else math.nan for v in values]
    if not math.isfinite(cap):
        return {"S": math.nan, "ci95": [math.nan, math.nan], "cap": cap, "L": dict(zip(lrs, level))}
    s = lr_sensitivity(level, [cap] * len(lrs))
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        draws = [np.nanmean(v[rng.integers(0, len(v), size=(resamples, len(v)))], axis=1) for v in values]
    boot = np.array([lr_sensitivity([d[i] for d in draws], [cap] * len(lrs)) for i in range(resamples)])
    boot = boot[np.isfinite(boot)]
    ci = [float(x) for x in np.percentile(boot, [2.5, 97.5])] if len(boot) else [math.nan, math.nan]
    return {"S": s, "ci95": ci, "cap": cap, "L": dict(zip(lrs, level))}


def grid_of(runs: Sequence[Endpoints]) -> dict:
    """Per configuration and lr: failures by kind (with their steps), final held-out cb0, cascades, the
    headroom maxima; per configuration: LR sensitivity and the largest rate that learns."""
    rows, summary = [], {}
    for role in ROLES6:
        mine = [r for r in runs if r.role == role]
        if not mine:
            continue
        by_lr = {lr: sorted((r for r in mine if r.lr == lr), key=lambda r: r.seed) for lr in sorted({r.lr for r in mine})}
        for lr, seeds in by_lr.items():
            final = [r.final_eval_cb0 for r in seeds if not r.failed and math.isfinite(r.final_eval_cb0)]
            places = sorted({p for r in seeds for p in r.headroom})
            rows.append({
                "role": role, "lr": lr, "seeds": [r.seed for r in seeds],
                "kinds": {k: [r.kind_step for r in seeds if r.kind == k] for k in ("diverged", "dead input", "stalled")},
                "learned": sum(not r.failed for r in seeds),
                "final_eval_cb0": {"mean": float(np.mean(final)) if final else math.nan, "n": len(final)},
                "cascades": sum(r.cascades for r in seeds),
                "headroom": {p: max(r.headroom.get(p, -math.inf) for r in seeds) for p in places},
            })
        learning = [lr for lr, seeds in by_lr.items() if all(not r.failed for r in seeds)]
        summary[role] = {"lr_sensitivity": sensitivity(by_lr), "largest_lr_that_learns": max(learning) if learning else None}
    return {"grid": rows, "configurations": summary}


def analyse(runs: Sequence[Endpoints]) -> dict:
    blocks = study_blocks(runs)
    used = [r for have in blocks.complete.values() for r in have.values()]
    return {"blocks": blocks, "controls": controls_of(blocks), "claims": claims_of(blocks), **grid_of(used)}


# ---------------------------------------------------------------------------------------------------
# Markdown, JSON, files and the command line


def num_text(x: float | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def headroom_text(h: dict[str, float]) -> str:
    return ", ".join(f"{p} {num_text(v, '{:.2g}')}" for p, v in h.items() if v != -math.inf) or "not logged"


def controls_markdown(controls: dict) -> list[str]:
    pos = controls["positive"]
    verdict = ("**detects** it: Post-Norm fails where Pre-Norm trains, so the study can see the failure its "
               "claims are about" if controls["detects"] else
               "**does not detect** it: the study cannot see the failure its claims are about at this scale")
    return ["### The controls (first; not in the claims' family, p not adjusted)", "",
            f"- Positive control, plain Post-Norm (clip 1) against Pre-Norm (clip 1), over {controls['blocks']} "
            f"blocks: {part_text(pos)}; the control {verdict}.",
            *[f"- QK-Norm: {part_text(q)}" for q in controls["qknorm"]],
            f"- Runs that failed (any kind), of {controls['blocks']}: " + ", ".join(
                f"{SHORT[r]} {n}" for r, n in controls["failed"].items()) + "."]


def markdown(result: dict) -> str:
    """claims.md of the instability study: the controls first, the claims, the failures, the configurations."""
    lines = controls_markdown(result["controls"])
    lines += ["", "### The claims", "", *claims_table(result["claims"])]
    blocks: Blocks = result["blocks"]
    lines += ["", f"Family: the testable claims, Holm-adjusted at {ALPHA}. Complete blocks ({len(blocks.complete)}): "
              + "; ".join(f"lr {lr_text(lr)}, seeds {', '.join(str(s) for x, s in blocks.complete if x == lr)}"
                          for lr in sorted({x for x, _ in blocks.complete})) + "."]
    if blocks.incomplete:
        lines.append("Incomplete blocks, not used: " + "; ".join(
            f"lr {lr_text(lr)} seed {s} ({', '.join(have) or 'nothing'})" for (lr, s), have in blocks.incomplete.items()) + ".")
    return "\n".join(lines + ["", *failures_markdown(result)]) + "\n"


def failures_markdown(result: dict) -> list[str]:
    """The failures by configuration and lr, and each configuration's LR sensitivity (``grid_of``)."""
    levels = result.get("levels") or {}
    unigram = levels.get("unigram_eval_cb0")
    lines = ["### Failures by configuration and learning rate", "",
             (f"Held-out unigram level (codebook 0): {unigram:.3f} bits; " if unigram is not None else "")
             + ("stalls not assessed (no margin given)." if levels.get("stall_margin") is None else
                f"a run within {levels['stall_margin']:g} bits of it at the end is stalled."), "",
             "| configuration | lr | learned | diverged (steps) | dead input (steps) | stalled | final held-out cb0 "
             "of those that learned (n) | cascades | largest fp16 headroom, max abs / 65504 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["grid"]:
        k = row["kinds"]
        steps = {kind: f"{len(v)} ({', '.join(str(s) for s in v)})" if v else "0" for kind, v in k.items()}
        f = row["final_eval_cb0"]
        lines.append(f"| {TITLES[row['role']]} | {lr_text(row['lr'])} | {row['learned']} of {len(row['seeds'])} | "
                     f"{steps['diverged']} | {steps['dead input']} | {len(k['stalled'])} | {num_text(f['mean'])} ({f['n']}) | "
                     f"{row['cascades']} | {headroom_text(row['headroom'])} |")
    lines += ["", "| configuration | LR sensitivity S (bits) [95% bootstrap] | cap (bits) | largest lr that learns |",
              "|---|---|---|---|"]
    for role, s in result["configurations"].items():
        sens, top = s["lr_sensitivity"], s["largest_lr_that_learns"]
        lines.append(f"| {TITLES[role]} | {num_text(sens['S'])} [{num_text(sens['ci95'][0])}, {num_text(sens['ci95'][1])}] | "
                     f"{num_text(sens['cap'])} | {lr_text(top) if top is not None else 'none'} |")
    return lines


def to_json(result: dict) -> dict:
    blocks: Blocks = result["blocks"]
    out = {k: _plain(v) for k, v in result.items() if k != "blocks"}
    out["alpha"] = ALPHA
    out["blocks"] = {"complete": [list(b) for b in blocks.complete],
                     "incomplete": [{"lr": lr, "seed": s, "roles": have} for (lr, s), have in blocks.incomplete.items()],
                     "ignored": blocks.ignored}
    out["runs"] = [_plain(r) for have in blocks.complete.values() for r in have.values()]
    return out


DOC_BEGIN = ("<!-- instability claims table: generated by `python -m musiclm_stab.analysis.instability ... --doc`; "
             "do not edit -->")
DOC_END = "<!-- end of the generated instability claims table -->"


def write_claims(run_dirs: Sequence[str | Path | RunMetrics], out_dir: str | Path, unigram_eval_cb0: float | None,
                 stall_margin: float | None = None) -> tuple[Path, Path]:
    """Analyse ``run_dirs`` (run directories, folders of them, or RunMetrics); write claims.md and claims.json
    (every number of the markdown; NaN as null, infinities as "inf"/"-inf") into ``out_dir``."""
    runs = read_runs(run_dirs)
    result = analyse([endpoints(r, unigram_eval_cb0, stall_margin) for r in runs])
    result["levels"] = {"unigram_eval_cb0": unigram_eval_cb0, "stall_margin": stall_margin}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "claims.md", out / "claims.json"
    md.write_text(markdown(result))
    js.write_text(json.dumps({"run_dirs": [str(r.path) for r in runs], **to_json(result)}, indent=2) + "\n")
    return md, js


def write_failures(run_dirs: Sequence[str | Path | RunMetrics], out_dir: str | Path, unigram_eval_cb0: float | None,
                   stall_margin: float | None = None) -> tuple[Path, Path]:
    """Describe ``run_dirs`` without deciding anything: failures.md and failures.json in ``out_dir``, the
    failures by configuration and lr of every run of the six configurations, complete blocks or not (the arm
    ``mert-frontend``: one seed, descriptive, not in the claims)."""
    runs = read_runs(run_dirs)
    ends = [endpoints(r, unigram_eval_cb0, stall_margin) for r in runs]
    known = [e for e in ends if e.role is not None]
    if not known:
        raise ValueError("no run of the six configurations (" + ", ".join(ROLES6) + ")")
    result = {**grid_of(known), "levels": {"unigram_eval_cb0": unigram_eval_cb0, "stall_margin": stall_margin}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "failures.md", out / "failures.json"
    md.write_text("\n".join(["Descriptive: where each configuration failed, by kind and step; nothing here is "
                             "decided (no claims, no tests).", "", *failures_markdown(result)]) + "\n")
    js.write_text(json.dumps({"run_dirs": [str(r.path) for r in runs], **_plain(result),
                              "ignored": [e.path for e in ends if e.role is None],
                              "runs": [_plain(e) for e in known]}, indent=2) + "\n")
    return md, js


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.instability",
                                description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md (offline: musiclm-stab docs STUDY)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or folders to search for them")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for claims.md and claims.json")
    p.add_argument("--unigram", type=float, metavar="BITS",
                   help="held-out codebook-0 CE of the unigram model (bits), reported beside the final losses")
    p.add_argument("--stall-margin", type=float, metavar="BITS",
                   help="also find stalled runs: a final held-out cb0 within BITS of the unigram level (needs "
                        "--unigram; not assessed by default: docs/STUDY.md)")
    p.add_argument("--doc", metavar="MD", help="also put the table into this file, between its markers")
    p.add_argument("--describe", action="store_true",
                   help="decide nothing: failures.md and failures.json, the failures by configuration and lr of "
                        "every run (an arm outside the claims, such as mert-frontend)")
    args = p.parse_args(argv)
    if args.stall_margin is not None and args.unigram is None:
        p.error("--stall-margin needs --unigram")
    if args.describe and args.doc:
        p.error("--doc takes the claims table: not with --describe")
    try:
        write = write_failures if args.describe else write_claims
        md, _ = write(args.run_dirs, args.out, args.unigram, args.stall_margin)
        if args.doc:
            fill_doc(args.doc, md.read_text(), DOC_BEGIN, DOC_END)
    except (FileNotFoundError, ValueError) as e:
        print(f"instability: error: {e}", file=sys.stderr)
        return 2
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
