"""The learning study's analysis (issue 55): the claims judged where the models learn, a positive control that
can detect, mechanism checks, and verdicts that can say "absent". Fixed, with its parameters, before the
study's runs (docs/STUDY.md, "The learning study").

    python -m musiclm_stab.analysis.learning RUN_DIR_OR_FOLDER ... --out DIR --unigram BITS [--doc MD]
        [--control-layers N]

Runs, arms and blocks. ``learning_role(config)`` finds a run's arm and role from its config alone (norm
scheme, attention, QK-Norm, clipping, warmup or none, precision, layers, steps, lr); anything else has none
and is listed as ignored. A *block* is a seed within an arm: every run of a seed sees the same batches.

- Arm ``claims``: lr ``L``, ``H`` steps, fairseq fp16, a warmup (any > 0; the plan's is 8% of H) then linear
  decay. The seed figures' four (``clip10``, ``clip1``, ``deepnorm``, ``relax``: claim_stats.role_of) at
  CLAIMS_LAYERS layers, and the positive control's 2 x 2 of warmup x Pre/Post-LN (Xiong et al. 2020):
  ``pre_w`` = Pre-Norm clip 1 with warmup (at CLAIMS_LAYERS that is ``clip1``), ``pre_nw`` the same without
  warmup, ``post_w`` = plain Post-Norm clip 1 with warmup, ``post_nw`` without. The control may be run at
  another depth N or at 3L by its pre-registered rule: its runs' roles then carry the depth and the rate
  (``pre_nw_24L``, ``post_w_lr3e-2``; ``pre_w`` is ``clip1_24L``), and ``control_layers`` and ``control_lr``
  say which the analysis reads. At 3L only the control's four have roles.
- Arm ``mechanism``: lr MECH_LR = 1e-1 (where the instability study's Pre-LN overflowed fp16), MECH_STEPS =
  120 steps, CLAIMS_LAYERS layers, no warmup unless stated: ``m_fp16`` Pre-Norm clip 1 in fairseq fp16;
  ``m_warmup`` the same with a warmup (the plan's: 30 steps); ``m_fp32`` the same without warmup in fp32
  (``train.mixed_precision=no``); ``m_post10`` plain Post-Norm clip 10 with ``model.attention=math``, fp16;
  ``m_post10_relax`` the same with ``model.attention=relax``.

Per run (``LearningRun``: analysis/instability.py's ``endpoints``, losses in bits, and more):

- failure kind and step (analysis/failures.py); in arm ``claims`` stalls are assessed: a run *learned* when
  it neither diverged nor lost its input and its final held-out cb0 is at least MARGIN_LEARNED = 0.1 bits
  below the unigram level (a run without a final evaluation did not show that it learned); *failed* = did
  not learn. In arm ``mechanism`` (120 steps: nothing learns) failed = diverged or dead input.
- early loss (the first EARLY_SHARE of the steps), early clip share, median gradient norm, cascades, final
  held-out cb0, cap (the loss at initialisation) and the headroom maxima, as instability.endpoints.
- ``survived``: the step of a divergence or dead input, else the run's max_steps (continuous, censored at
  the horizon).
- own spikes: a spike event of the training loss (claim_stats.spike_events, the progress-lost rule, its level
  the running minimum of the trailing SPIKE_SMOOTH = 25-step median: fixed after the pilots, before the study's
  runs, where the level of single steps made 38-49 events of batch-to-batch scatter in each 1000-step run) is
  *shared* when a run of another role in the same block has an event starting within SHARED_STEPS = 3
  steps of its start (the same hard batch), else *own*; ``own_recovered`` counts the own events that
  recovered. Computed over the block (``mark_own_spikes``), never from one run alone.
- ``instability``: own spike events (recovered or not) + cascades; +inf when the run diverged.
- at a failure: the headroom of each place at the last diagnostic step at or before the failure step.

Verdicts (analysis/decide.py ``decide_margins``): each part is a paired comparison over blocks, oriented so
that > 0 is what the claim says, with an equivalence margin in its unit fixed in advance: the exact
two-sided Wilcoxon for the difference, TOST with exact one-sided Wilcoxon tests for equivalence;
**reproduced**, **refuted**, **absent** (within the margin), **inconclusive**, or **not testable at this
scale** when a precondition fails. Holm at ALPHA over the testable claims, the difference and the
equivalence families apart.

The positive control, stated first (not in the claims' family; p not adjusted): per block, the interaction
in bits of the final held-out cb0 at H, (post_nw - post_w) - (pre_nw - pre_w), a run that diverged or lost
its input scored at its cap; > 0 = Post-LN hurt more by the missing warmup. Exact two-sided Wilcoxon over
the blocks with all four; it *detects* when p < ALPHA with a positive median; TOST against CONTROL_MARGIN =
0.1 bits says whether the effect is absent at this scale. Beside it, secondary (added after the pilots, before
the study's runs: in every pilot plain Post-LN lost its input with and without warmup, so both of its cells sat
at the cap, and warmup delayed the failure): the same interaction of the steps survived, (post_w - post_nw) -
(pre_w - pre_nw), > 0 = warmup postpones Post-LN's failure more than Pre-LN's; the exact two-sided Wilcoxon and
TOST against DELTA_STEPS = 10 steps, read as the primary is.

The claims (one family):

- (a) Pre-Norm with clip 10 converges faster early than with clip 1: early loss(clip 1) - early loss(clip
  10), over blocks where both learned and clip 1 clipped >= CLIP_SHARE_MIN of its early steps; margin
  DELTA_EARLY bits. At least MIN_BLOCKS such blocks, else not testable.
- (b) DeepNorm keeps the lowest gradient norm: for c of clip 10, clip 1, relax, ln median grad norm(c) - ln
  median grad norm(DeepNorm), over blocks where the four learned; margin DELTA_LN_GRAD = 0.1. At least
  MIN_BLOCKS.
- (c) DeepNorm shows a transient loss spike and recovers: for each c, own_recovered(DeepNorm) -
  own_recovered(c), over all blocks; margin DELTA_COUNT = 0.5 events per run. No precondition: when no run
  has an own spike every difference is 0 and the claim can be absent, which is the answer.
- (d) Pre-Norm with Attn. Relax converges more slowly, but steadily: slower, early loss(relax) - early
  loss(clip 1) over blocks where both learned (margin DELTA_EARLY; at least MIN_BLOCKS, else the claim is
  not testable); steadier, instability(clip 1) - instability(relax) over all blocks (margin DELTA_COUNT).
  Its text says when relax cannot have acted: the largest attention-logit headroom of the relax and clip 1
  runs below RELAX_ACTS = 0.1 of fp16's range.

A claim needs the blocks that have its four roles (``clip10``, ``clip1``, ``deepnorm``, ``relax``); the
control the blocks with its four.

The mechanism checks (a family of three, Holm at ALPHA, after the claims): survived(treated) -
survived(baseline) > 0, margin DELTA_STEPS = 10 steps, over the blocks with both runs; McNemar of failed
reported beside them, not decided. M1 warmup: m_warmup against m_fp16 (warmup delays or prevents the Pre-LN
failure). M2 fp16's range: m_fp32 against m_fp16 (in fp32 the same run survives longer: the failure is
fp16's range, not the optimization). M3 relax where it can act: m_post10_relax against m_post10.

Also reported: per role the runs that learned, final held-out cb0 mean [min, max], failures by kind and
step, cascades, own and shared spike events, headroom maxima; the share of arm ``claims``'s runs that did
not diverge or lose their input that learned (issue 55's "done when": at least half).

Where it lives: the parameters named above in analysis/learning_params.py (what the pre-registration fixes;
they are handed on from here too); the roles in words, the tables of claims.md and claims.json's form in
analysis/learning_report.py; here the roles, the per-run endpoints, the blocks, the analysis, ``write_claims``
and the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.claim_stats import ROLES, logged, precision_of, role_of, spike_events, warmup_steps
from musiclm_stab.analysis.claims import _diff, _ln, fill_doc, read_runs, runs_by_block
from musiclm_stab.analysis.decide import ALPHA, MarginClaim, MarginPart, decide_margins
from musiclm_stab.analysis.instability import (
    CLIP_SHARE_MIN,
    MIN_BLOCKS,
    POST,
    SHORT,
    Endpoints,
    endpoints,
    headroom_place,
    num_text,
    role6,
)
from musiclm_stab.analysis.learning_params import (
    CLAIMS,
    CLAIMS_LAYERS,
    CONTROL_CELLS,
    CONTROL_LAYERS,
    CONTROL_LR,
    CONTROL_LRS,
    CONTROL_MARGIN,
    DELTA_COUNT,
    DELTA_EARLY,
    DELTA_LN_GRAD,
    DELTA_STEPS,
    MARGIN_LEARNED,
    MECH_CHECKS,
    MECH_LR,
    MECH_ROLES,
    MECH_STEPS,
    MECHANISM,
    RELAX_ACTS,
    SHARED_STEPS,
    SPIKE_SMOOTH,
    H,
    L,
)
from musiclm_stab.analysis.learning_report import (
    DOC_BEGIN,
    DOC_END,
    ROLE_TITLES,
    markdown,
    role_order,
    run_json,
    to_json,
)
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.analysis.sweep_report import lr_text

# The parameters are learning_params.py's, handed on here too (``from musiclm_stab.analysis.learning import L``).
__all__ = ["CLAIMS", "CLAIMS_LAYERS", "CONTROL_CELLS", "CONTROL_LAYERS", "CONTROL_LR", "CONTROL_LRS", "CONTROL_MARGIN",
           "DELTA_COUNT", "DELTA_EARLY", "DELTA_LN_GRAD", "DELTA_STEPS", "DOC_BEGIN", "DOC_END", "MARGIN_LEARNED",
           "MECHANISM", "MECH_CHECKS", "MECH_LR", "MECH_ROLES", "MECH_STEPS", "RELAX_ACTS", "SHARED_STEPS", "SPIKE_SMOOTH", "Blocks", "H",
           "L", "LearningRun", "analyse", "arm_blocks", "claims_of", "cli_main", "control_of", "control_roles",
           "control_score", "depth_role", "having", "headroom_at", "learned_share", "learning_role", "learning_run",
           "learning_runs", "mark_own_spikes", "mechanism_of", "roles_of", "write_claims"]


def depth_role(role: str, layers: int, lr: float | None = None) -> str:
    """A control role's name at ``layers`` and ``lr`` (the depth suffixed when it is not CLAIMS_LAYERS, the
    rate when it is not L: ``pre_nw_24L``, ``post_w_lr3e-2``)."""
    depth = "" if layers == CLAIMS_LAYERS else f"_{layers}L"
    rate = "" if lr is None or _is(lr, L) else f"_lr{lr_text(float(lr))}"
    return f"{role}{depth}{rate}"


def control_roles(layers: int = CLAIMS_LAYERS, lr: float | None = None) -> dict[str, str]:
    """The positive control's cells -> the roles that fill them at ``layers`` and ``lr`` (default L)."""
    return {"pre_w": depth_role("clip1", layers, lr), "pre_nw": depth_role("pre_nw", layers, lr),
            "post_w": depth_role("post_w", layers, lr), "post_nw": depth_role("post_nw", layers, lr)}


def _is(x, value: float) -> bool:
    try:
        return math.isclose(float(x), value, rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


def learning_role(cfg: dict) -> tuple[str, str] | None:
    """(arm, role) of a run's config in the learning study (module docstring), or None."""
    model, optim, train = (cfg.get(k) or {} for k in ("model", "optim", "train"))
    layers, steps, lr = int(model.get("num_layers") or 0), train.get("max_steps"), optim.get("lr")
    warm, precision = warmup_steps(cfg) > 0, precision_of(cfg)
    plain = not model.get("qk_norm", False) and optim.get("clip_mode", "fixed") == "fixed"
    attention, scheme = model.get("attention", "sdpa"), model.get("norm_scheme", "pre")
    if any(_is(lr, x) for x in CONTROL_LRS) and _is(steps, H) and precision == "fp16 (fairseq)":
        role = role6(cfg)
        if role in ROLES and warm and layers == CLAIMS_LAYERS and _is(lr, L):
            return CLAIMS, role
        if role in ("clip1", POST):
            cell = {("clip1", True): "clip1", ("clip1", False): "pre_nw", (POST, True): "post_w",
                    (POST, False): "post_nw"}[(role, warm)]
            return CLAIMS, depth_role(cell, layers, float(lr))
        return None
    if not (_is(lr, MECH_LR) and _is(steps, MECH_STEPS) and layers == CLAIMS_LAYERS and plain):
        return None
    if role_of(cfg) == "clip1":
        if precision == "fp16 (fairseq)":
            return MECHANISM, "m_warmup" if warm else "m_fp16"
        return (MECHANISM, "m_fp32") if precision == "no" and not warm else None
    if (scheme == "post" and _is(optim.get("clip_grad", 10.0), 10.0) and not warm and precision == "fp16 (fairseq)"
            and attention in ("math", "relax")):
        return MECHANISM, "m_post10" if attention == "math" else "m_post10_relax"
    return None


# ---------------------------------------------------------------------------------------------------
# Per-run endpoints


@dataclass
class LearningRun(Endpoints):
    """instability.Endpoints of one run, with the learning study's arm, role and endpoints (module docstring)."""

    arm: str = ""
    layers: int = 0
    max_steps: int = 0
    learned: bool = False
    spike_steps: list[int] = field(default_factory=list)  # first step of each spike event of the training loss
    spike_recovered: list[bool] = field(default_factory=list)
    spike_own: list[bool] = field(default_factory=list)  # set by mark_own_spikes
    failure_diag_step: int | None = None  # the last diagnostic step at or before a failure
    failure_headroom: dict[str, float] = field(default_factory=dict)  # place -> headroom there

    @property
    def failed(self) -> bool:
        return not self.learned if self.arm == CLAIMS else self.kind in ("diverged", "dead input")

    @property
    def survived(self) -> int:
        return self.kind_step if self.kind in ("diverged", "dead input") else self.max_steps

    @property
    def own_spikes(self) -> int:
        return sum(self.spike_own)

    @property
    def shared_spikes(self) -> int:
        return len(self.spike_own) - sum(self.spike_own)

    @property
    def own_recovered(self) -> int:
        return sum(own and rec for own, rec in zip(self.spike_own, self.spike_recovered))

    @property
    def instability(self) -> float:
        return math.inf if self.diverged else float(self.own_spikes + self.cascades)


def headroom_at(run: RunMetrics, step: int) -> tuple[int | None, dict[str, float]]:
    """(s, headroom by place at s): s the last step at or before ``step`` with a headroom logged (a
    diagnostic step), each place's largest over its layers (inf where it was logged non-finite)."""
    found: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = {}
    for name in set(run.series) | set(run.nonfinite):
        place = headroom_place(name)
        if place is not None:
            s, v = logged(run, name)
            found.setdefault(place[0], []).append((s, np.where(np.isnan(v), math.inf, v), place[1]))
    steps = [int(s[s <= step].max()) for series in found.values() for s, _, _ in series if (s <= step).any()]
    if not steps:
        return None, {}
    at = max(steps)
    out = {place: max((float(v[s == at].max()) * scale for s, v, scale in series if (s == at).any()),
                      default=-math.inf) for place, series in found.items()}
    return at, dict(sorted((p, v) for p, v in out.items() if v != -math.inf))


def learning_run(run: RunMetrics, unigram_eval_cb0: float) -> LearningRun | None:
    """The endpoints of one run (module docstring); None when it has no role in the study."""
    run = run.in_unit("bits")
    found = learning_role(run.config)
    if found is None:
        return None
    arm, role = found
    claims = arm == CLAIMS
    events = spike_events(run, smooth=SPIKE_SMOOTH)
    ends = endpoints(run, unigram_eval_cb0 if claims else None, MARGIN_LEARNED if claims else None, events)
    cfg = run.config
    out = LearningRun(**{**vars(ends), "role": role}, arm=arm, layers=int(cfg["model"]["num_layers"]),
                      max_steps=int(cfg["train"]["max_steps"]),
                      learned=claims and ends.kind == "none" and ends.final_eval_cb0 <= unigram_eval_cb0 - MARGIN_LEARNED,
                      spike_steps=[e.step for e in events], spike_recovered=[e.recovered_at is not None for e in events],
                      spike_own=[True] * len(events))
    if ends.kind in ("diverged", "dead input"):
        out.failure_diag_step, out.failure_headroom = headroom_at(run, ends.kind_step)
    return out


def mark_own_spikes(runs: Sequence[LearningRun], within: int = SHARED_STEPS) -> None:
    """Mark each spike event own or shared (module docstring): shared when a run of another role in the same
    arm and block (seed) has an event starting within ``within`` steps of it."""
    blocks: dict[tuple[str, int], list[LearningRun]] = {}
    for r in runs:
        blocks.setdefault((r.arm, r.seed), []).append(r)
    for members in blocks.values():
        for r in members:
            steps = np.asarray(r.spike_steps, dtype=np.int64)
            others = np.array([s for o in members if o.role != r.role for s in o.spike_steps], dtype=np.int64)
            near = np.abs(steps[:, None] - others[None, :]) <= within
            r.spike_own = (~near.any(axis=1)).tolist()


def learning_runs(runs: Sequence[RunMetrics], unigram_eval_cb0: float) -> tuple[list[LearningRun], list[str]]:
    """(the runs with a role, their own spikes marked; the paths of the others)."""
    found, ignored = [], []
    for run in runs:
        r = learning_run(run, unigram_eval_cb0)
        if r is None:
            ignored.append(str(run.path))
        else:
            found.append(r)
    mark_own_spikes(found)
    return found, ignored


# ---------------------------------------------------------------------------------------------------
# The control, the claims, the mechanism checks


Blocks = dict[int, dict[str, LearningRun]]  # seed -> role -> run, one arm


def arm_blocks(runs: Sequence[LearningRun], arm: str) -> Blocks:
    """{seed: {role: run}} of one arm (the control's runs at 3L in their seed's block: the same batches);
    ValueError for two runs of one role in a block."""
    out: Blocks = {}
    for (_, seed), have in runs_by_block([r for r in runs if r.arm == arm]).items():
        out.setdefault(seed, {}).update(have)  # roles at another rate carry it in their name: no clash
    return dict(sorted(out.items()))


def having(blocks: Blocks, roles: Sequence[str]) -> list[int]:
    """The seeds whose block has a run of each of ``roles``."""
    return [s for s, have in blocks.items() if all(r in have for r in roles)]


def _values(blocks: Blocks, fn, role: str, seeds: Sequence[int]) -> np.ndarray:
    return np.array([fn(blocks[s][role]) for s in seeds], dtype=np.float64)


def control_score(r: LearningRun) -> float:
    """The control's score of a run: its final held-out cb0, its cap when it diverged or lost its input."""
    return r.cap if r.kind in ("diverged", "dead input") else r.final_eval_cb0


def control_of(blocks: Blocks, layers: int = CLAIMS_LAYERS, lr: float | None = None) -> dict:
    """The positive control (module docstring) at ``layers`` and ``lr`` (default L): the cells' means, the
    interaction's Wilcoxon and TOST."""
    roles = control_roles(layers, lr)
    seeds = having(blocks, list(roles.values()))
    cells = {c: _values(blocks, control_score, r, seeds) for c, r in roles.items()}
    d = (cells["post_nw"] - cells["post_w"]) - (cells["pre_nw"] - cells["pre_w"])
    part = MarginPart.paired("interaction (bits): (Post-LN no warmup - warmup) - (Pre-LN no warmup - warmup)", d,
                             CONTROL_MARGIN)
    detects = bool(part.p < ALPHA and part.estimate > 0)
    survived = {c: _values(blocks, lambda e: e.survived, r, seeds) for c, r in roles.items()}
    ds = (survived["post_w"] - survived["post_nw"]) - (survived["pre_w"] - survived["pre_nw"])
    survival = MarginPart.paired("survival interaction (steps): (Post-LN warmup - no warmup) - (Pre-LN warmup - "
                                 "no warmup)", ds, DELTA_STEPS)
    seen = bool(survival.p < ALPHA and survival.estimate > 0)

    def means(values: dict[str, np.ndarray]) -> dict[str, float]:
        return {c: float(v.mean()) if len(v) else math.nan for c, v in values.items()}

    return {"layers": layers, "lr": L if lr is None else lr, "roles": roles, "seeds": seeds, "part": part,
            "survival": survival, "survived": means(survived), "survival_detects": seen,
            "survival_absent": bool(not seen and survival.p_tost < ALPHA), "interaction": [float(x) for x in d],
            "cells": means(cells),
            "failed": {c: sum(blocks[s][r].kind in ("diverged", "dead input") for s in seeds) for c, r in roles.items()},
            "detects": detects, "absent": bool(not detects and part.p_tost < ALPHA)}


def claims_of(blocks: Blocks) -> list[MarginClaim]:
    """The four claims with their parts and preconditions, decided with four verdicts (module docstring)."""
    seeds = having(blocks, ROLES)

    def learned(*roles: str) -> list[int]:
        return [s for s in seeds if all(blocks[s][r].learned for r in roles)]

    def early(role: str, at: Sequence[int]) -> np.ndarray:
        return _values(blocks, lambda e: e.early_loss, role, at)

    # (a)
    a = MarginClaim("a", "Pre-Norm with clip 10 converges faster early than with clip 1")
    both = learned("clip1", "clip10")
    share = _values(blocks, lambda e: e.clip_share_early, "clip1", both)
    used = [s for s, x in zip(both, share) if x >= CLIP_SHARE_MIN]
    a.parts = [MarginPart.paired("early loss (bits): clip 1 - clip 10", _diff(early("clip1", used), early("clip10", used)),
                                 DELTA_EARLY)]
    a.reason = (f"{len(used)} of {len(seeds)} blocks where both learned and clip 1 clipped >= {CLIP_SHARE_MIN:.0%} "
                "of its early steps")
    if len(used) < MIN_BLOCKS:
        a.testable, a.reason = False, a.reason + f"; {MIN_BLOCKS} needed"

    # (b)
    b = MarginClaim("b", "Post-Norm with DeepNorm keeps the lowest gradient norm")
    calm = learned(*ROLES)
    dn = _ln(_values(blocks, lambda e: e.median_grad_norm, "deepnorm", calm))
    b.parts = [MarginPart.paired(f"ln median grad norm: {SHORT[c]} - DeepNorm",
                                 _diff(_ln(_values(blocks, lambda e: e.median_grad_norm, c, calm)), dn), DELTA_LN_GRAD)
               for c in ("clip10", "clip1", "relax")]
    b.reason = f"{len(calm)} of {len(seeds)} blocks where the four learned"
    if len(calm) < MIN_BLOCKS:
        b.testable, b.reason = False, b.reason + f"; {MIN_BLOCKS} needed"

    # (c)
    own = {r: _values(blocks, lambda e: e.own_recovered, r, seeds) for r in ROLES}
    c = MarginClaim("c", "Post-Norm/DeepNorm shows a transient loss spike and recovers",
                    [MarginPart.paired(f"own recovered spikes: DeepNorm - {SHORT[r]}", own["deepnorm"] - own[r],
                                       DELTA_COUNT) for r in ("clip10", "clip1", "relax")])
    c.reason = f"own recovered spikes over {len(seeds)} blocks: " + ", ".join(
        f"{SHORT[r]} {int(own[r].sum())}" for r in ROLES)
    if not seeds:
        c.testable, c.reason = False, "no block with the four"

    # (d)
    pair = learned("clip1", "relax")
    steady = {r: _values(blocks, lambda e: e.instability, r, seeds) for r in ("clip1", "relax")}
    d = MarginClaim("d", "Pre-Norm with Attn. Relax converges more slowly, but steadily",
                    [MarginPart.paired("slower: early loss (bits) relax - clip 1",
                                       _diff(early("relax", pair), early("clip1", pair)), DELTA_EARLY),
                     MarginPart.paired("steadier: instability clip 1 - relax", _diff(steady["clip1"], steady["relax"]),
                                       DELTA_COUNT)])
    logit = [blocks[s][r].headroom.get("attn_logit", math.nan) for s in seeds for r in ("clip1", "relax")]
    top = max((x for x in logit if not math.isnan(x)), default=math.nan)
    d.reason = (f"slower over {len(pair)} of {len(seeds)} blocks where both learned, steadier over {len(seeds)}; "
                f"largest attention-logit headroom of clip 1 and relax {num_text(top, '{:.2g}')}")
    if top < RELAX_ACTS:
        d.reason += f" (below {RELAX_ACTS:g}: relax equals plain attention at this rate)"
    if len(pair) < MIN_BLOCKS:
        d.testable, d.reason = False, d.reason + f"; slower needs {MIN_BLOCKS} blocks"
    return decide_margins([a, b, c, d])


def mechanism_of(blocks: Blocks) -> dict:
    """The three mechanism checks, decided as a family of their own, with McNemar of failed beside each."""
    checks, mcnemar = [], {}
    for key, text, treated, baseline in MECH_CHECKS:
        seeds = having(blocks, (treated, baseline))
        survived = {r: _values(blocks, lambda e: e.survived, r, seeds) for r in (treated, baseline)}
        claim = MarginClaim(key, f"{ROLE_TITLES[treated]} against {ROLE_TITLES[baseline]}: {text}",
                            [MarginPart.paired(f"steps survived: {treated} - {baseline}",
                                               survived[treated] - survived[baseline], DELTA_STEPS)],
                            reason=f"{len(seeds)} blocks with both runs")
        if not seeds:
            claim.testable = False
        checks.append(claim)
        mcnemar[key] = MarginPart.binary(f"failed: {baseline} vs {treated}",
                                         [blocks[s][baseline].failed for s in seeds],
                                         [blocks[s][treated].failed for s in seeds])
    return {"checks": decide_margins(checks), "mcnemar": mcnemar}


def roles_of(runs: Sequence[LearningRun]) -> list[dict]:
    """Per arm and role: runs, learned, final held-out cb0, failures by kind and step (with the place of the
    largest headroom at the last diagnostic step before), cascades, own and shared spikes, headroom maxima."""
    rows = []
    for arm in (CLAIMS, MECHANISM):
        for role in sorted({r.role for r in runs if r.arm == arm}, key=role_order):
            mine = sorted((r for r in runs if r.arm == arm and r.role == role), key=lambda r: r.seed)
            final = [r.final_eval_cb0 for r in mine if math.isfinite(r.final_eval_cb0)]
            places = sorted({p for r in mine for p in r.headroom})
            rows.append({
                "arm": arm, "role": role, "seeds": [r.seed for r in mine], "learned": sum(r.learned for r in mine),
                "failed": sum(r.failed for r in mine),
                "final_eval_cb0": {"mean": float(np.mean(final)) if final else math.nan, "n": len(final),
                                   "min": min(final, default=math.nan), "max": max(final, default=math.nan)},
                "failures": [{"seed": r.seed, "kind": r.kind, "step": r.kind_step, "diag_step": r.failure_diag_step,
                              "place": _largest(r.failure_headroom)} for r in mine if r.kind != "none"],
                "cascades": sum(r.cascades for r in mine), "own_spikes": sum(r.own_spikes for r in mine),
                "shared_spikes": sum(r.shared_spikes for r in mine),
                "own_recovered": sum(r.own_recovered for r in mine),
                "headroom": {p: max(r.headroom.get(p, -math.inf) for r in mine) for p in places},
            })
    return rows


def _largest(headroom: dict[str, float]) -> tuple[str, float] | None:
    return max(headroom.items(), key=lambda kv: kv[1]) if headroom else None


def learned_share(runs: Sequence[LearningRun]) -> dict:
    """Of arm claims's runs that neither diverged nor lost their input, how many learned (issue 55: >= half)."""
    alive = [r for r in runs if r.arm == CLAIMS and r.kind not in ("diverged", "dead input")]
    n = sum(r.learned for r in alive)
    return {"learned": n, "of": len(alive), "share": n / len(alive) if alive else math.nan}


def analyse(runs: Sequence[LearningRun], control_layers: int = CONTROL_LAYERS,
            control_lr: float | None = CONTROL_LR) -> dict:
    """Everything claims.md shows, as one dict (module docstring); ValueError when no run has a role."""
    if not runs:
        raise ValueError("no run of the learning study (learning_role: arm claims at lr "
                         f"{lr_text(L)} x {H} steps, arm mechanism at lr {lr_text(MECH_LR)} x {MECH_STEPS} steps)")
    claims, mech = arm_blocks(runs, CLAIMS), arm_blocks(runs, MECHANISM)
    return {"control": control_of(claims, control_layers, control_lr), "claims": claims_of(claims),
            "claims_blocks": having(claims, ROLES), "mechanism": mechanism_of(mech), "roles": roles_of(runs),
            "learned_share": learned_share(runs)}


# ---------------------------------------------------------------------------------------------------
# Files and the command line


def write_claims(run_dirs: Sequence[str | Path | RunMetrics], out_dir: str | Path, unigram_eval_cb0: float,
                 control_layers: int = CONTROL_LAYERS, control_lr: float | None = CONTROL_LR) -> tuple[Path, Path]:
    """Analyse ``run_dirs`` (run directories, folders of them, or RunMetrics); write claims.md and claims.json
    (every number; NaN as null, infinities as "inf"/"-inf") into ``out_dir``."""
    runs = read_runs(run_dirs)
    found, ignored = learning_runs(runs, unigram_eval_cb0)
    result = analyse(found, control_layers, control_lr)
    result["ignored"] = ignored
    result["levels"] = {"unigram_eval_cb0": unigram_eval_cb0, "margin_learned": MARGIN_LEARNED}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "claims.md", out / "claims.json"
    md.write_text(markdown(result))
    js.write_text(json.dumps({"run_dirs": [str(r.path) for r in runs], **to_json(result),
                              "runs": [run_json(r) for r in found]}, indent=2) + "\n")
    return md, js


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.learning",
                                description=__doc__.split("\n\n")[0], epilog="Reference: docs/STUDY.md")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or folders to search for them")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for claims.md and claims.json")
    p.add_argument("--unigram", type=float, required=True, metavar="BITS",
                   help="held-out codebook-0 CE of the unigram model (bits): learned = "
                        f"{MARGIN_LEARNED:g} bits below it at the end")
    p.add_argument("--control-layers", type=int, default=CONTROL_LAYERS, metavar="N",
                   help=f"the positive control's depth (default {CONTROL_LAYERS}, as its pre-registered rule chose)")
    p.add_argument("--control-lr", type=float, default=CONTROL_LR, metavar="LR",
                   help=f"the positive control's rate: L or 3L (default {lr_text(CONTROL_LR)}, as its pre-registered "
                        "rule chose)")
    p.add_argument("--doc", metavar="MD", help="also put the tables into this file, between its markers")
    args = p.parse_args(argv)
    if args.control_layers < 1:
        p.error("--control-layers must be >= 1")
    if args.control_lr is not None and not any(_is(args.control_lr, x) for x in CONTROL_LRS):
        p.error(f"--control-lr must be L ({lr_text(L)}) or 3L ({lr_text(3 * L)})")
    try:
        md, _ = write_claims(args.run_dirs, args.out, args.unigram, args.control_layers, args.control_lr)
        if args.doc:
            fill_doc(args.doc, md.read_text(), DOC_BEGIN, DOC_END)
    except (FileNotFoundError, ValueError) as e:
        print(f"learning: error: {e}", file=sys.stderr)
        return 2
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
