"""How the learning study's results are written (analysis/learning.py computes them, docs/STUDY.md "The learning
study"): its roles in words, claims.md (the positive control first, the claims with their four verdicts, the
mechanism checks, the runs by role), claims.json's form (every number; NaN as null, infinities as "inf"/"-inf")
and the markers of the generated table in a doc (``--doc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from musiclm_stab.analysis.claim_stats import ROLES
from musiclm_stab.analysis.claims import _plain, part_text
from musiclm_stab.analysis.decide import ALPHA, NOT_TESTABLE, MarginClaim, MarginPart
from musiclm_stab.analysis.instability import MIN_BLOCKS, SHORT, TITLES, headroom_text, num_text
from musiclm_stab.analysis.learning_params import (
    CONTROL_MARGIN,
    DELTA_COUNT,
    DELTA_EARLY,
    DELTA_LN_GRAD,
    DELTA_STEPS,
    MARGIN_LEARNED,
    MECH_ROLES,
    MECHANISM,
    SHARED_STEPS,
    H,
    L,
)
from musiclm_stab.analysis.sweep_report import lr_text

if TYPE_CHECKING:
    from musiclm_stab.analysis.learning import LearningRun

ROLE_TITLES = {**TITLES, "clip1": "Pre-Norm, clip 1 (warmup)", "pre_nw": "Pre-Norm, clip 1, no warmup",
               "post_w": "Post-Norm, clip 1, warmup", "post_nw": "Post-Norm, clip 1, no warmup",
               "m_fp16": "Pre-Norm clip 1, fp16, no warmup", "m_warmup": "Pre-Norm clip 1, fp16, warmup",
               "m_fp32": "Pre-Norm clip 1, fp32, no warmup", "m_post10": "Post-Norm clip 10, math attention",
               "m_post10_relax": "Post-Norm clip 10, Attn. Relax"}
ROLE_SHORT = {**SHORT, "pre_nw": "Pre-LN no warmup", "post_w": "Post-LN warmup", "post_nw": "Post-LN no warmup"}


def _base_role(role: str) -> str:
    """The design's role a (possibly depth- or rate-suffixed) role name is of."""
    known = [*ROLES, "pre_nw", "post_w", "post_nw", *MECH_ROLES]
    return role if role in known else max((r for r in known if role.startswith(r + "_")), key=len, default=role)


def role_order(role: str) -> tuple[int, str]:
    """A role's sort key: the design's order (the seed figures' four, the control's, the mechanism arm's)."""
    order = [*ROLES, "pre_nw", "post_w", "post_nw", *MECH_ROLES]
    base = _base_role(role)
    return (order.index(base) if base in order else len(order), role)


def role_title(role: str) -> str:
    """A role in words, its depth or rate (a control run off the claims' setting) after it."""
    base = _base_role(role)
    return ROLE_TITLES.get(base, base) + (f" ({role[len(base) + 1:].replace('_', ', ')})" if role != base else "")


def margin_text(q: MarginPart) -> str:
    """A part as claims.part_text writes it, with its margin and TOST p where it has one."""
    if q.margin is None:
        return part_text(q)
    adjusted = "" if math.isnan(q.p_tost_adjusted) else f", adj. {q.p_tost_adjusted:.3g}"
    return f"{part_text(q)}; margin +-{q.margin:g}: TOST p {q.p_tost:.3g}{adjusted}"


def margin_table(claims: Sequence[MarginClaim]) -> list[str]:
    """The four-verdict table: a row per claim, its parts, difference and equivalence p, verdict and why."""
    lines = ["| claim | parts: n, median difference, p, adjusted p; margin: TOST p, adjusted | difference p "
             "(direction), adjusted | equivalence p, adjusted | verdict | why |", "|---|---|---|---|---|---|"]
    for c in claims:
        tested = c.testable and not math.isnan(c.p_adjusted)
        diff = f"{c.p:.3g} ({c.direction or 'none'}), {c.p_adjusted:.3g}" if tested else "-"
        equiv = f"{c.p_tost:.3g}, {c.p_tost_adjusted:.3g}" if tested else "-"
        why = c.why if c.verdict == NOT_TESTABLE or not c.reason else f"{c.why}; {c.reason}"
        lines.append(f"| ({c.key}) {c.text} | {'<br>'.join(margin_text(q) for q in c.parts) or 'none'} | {diff} | "
                     f"{equiv} | **{c.verdict}** | {why} |")
    return lines


def control_markdown(control: dict) -> list[str]:
    part: MarginPart = control["part"]
    n = len(control["seeds"])
    if not n:
        return ["### The positive control (first; not in the claims' family, p not adjusted)", "",
                "No block has the control's four runs (" + ", ".join(control["roles"].values()) + "): not run."]
    verdict = ("**detects** it: Post-LN is hurt more by the missing warmup, the literature's effect, so the study "
               "can see a failure where it is expected" if control["detects"] else
               f"**does not detect** it, and the effect is **absent at this scale** (within +-{CONTROL_MARGIN:g} bits)"
               if control["absent"] else "**does not detect** it, and cannot say it is absent (inconclusive)")
    cells = ", ".join(f"{ROLE_SHORT.get(c, c)} {control['cells'][c]:.3f}" for c in ("post_nw", "post_w", "pre_nw"))
    return ["### The positive control (first; not in the claims' family, p not adjusted)", "",
            f"- Warmup x Pre/Post-LN at {control['layers']} layers and lr {lr_text(control['lr'])}, final held-out cb0 at the horizon (a diverged or "
            f"dead run at its cap), over {n} blocks: means {cells}, Pre-LN warmup {control['cells']['pre_w']:.3f} "
            f"bits; failed (diverged or dead input) " + ", ".join(
                f"{c} {k}" for c, k in control["failed"].items()) + ".",
            f"- {margin_text(part)}; the control {verdict}.",
            *survival_markdown(control)]


def survival_markdown(control: dict) -> list[str]:
    """The control's secondary endpoint: the interaction of the steps survived (learning.control_of)."""
    part: MarginPart = control["survival"]
    seen = ("warmup postpones Post-LN's failure more than Pre-LN's (**detected**)" if control["survival_detects"]
            else f"no difference in survival (**absent**, within +-{part.margin:g} steps)" if control["survival_absent"]
            else "**not detected**, not shown absent (inconclusive)")
    short = {**ROLE_SHORT, "pre_w": "Pre-LN warmup"}
    means = ", ".join(f"{short.get(c, c)} {float(v):.0f}" for c, v in control["survived"].items())
    return [f"- Secondary, fixed after the pilots and before the runs: steps survived (a run that neither diverged "
            f"nor lost its input at its horizon), means {means}; {margin_text(part)}; {seen}."]


def mechanism_markdown(mech: dict, roles: list[dict]) -> list[str]:
    lines = ["### The mechanism checks (a family of three, Holm-adjusted at 0.05)", "",
             *margin_table(mech["checks"]), "",
             "McNemar of failed, reported, not decided: " + "; ".join(
                 f"{k}: {part_text(q)}" for k, q in mech["mcnemar"].items()) + "."]
    for row in (r for r in roles if r["arm"] == MECHANISM):
        fails = "; ".join(f"seed {f['seed']} {f['kind']} at {f['step']}" + (
            f" ({f['place'][0]} {f['place'][1]:.2g} at step {f['diag_step']})" if f["place"] else "")
            for f in row["failures"]) or "none"
        lines.append(f"- {role_title(row['role'])}: failed {row['failed']} of "
                     f"{len(row['seeds'])}: {fails}.")
    return lines


def roles_markdown(result: dict) -> list[str]:
    share = result["learned_share"]
    lines = ["### Runs by role", "",
             f"Arm claims: {share['learned']} of {share['of']} runs that neither diverged nor lost their input "
             f"learned (final held-out cb0 >= {MARGIN_LEARNED:g} bits below the unigram level), "
             f"{num_text(share['share'], '{:.0%}')}.", "",
             "| arm | role | learned | failed | final held-out cb0 mean [min, max] (n) | failures (seed: kind at step) "
             "| cascades | spike events own / shared (own recovered) | largest fp16 headroom |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["roles"]:
        f = row["final_eval_cb0"]
        fails = ", ".join(f"{x['seed']}: {x['kind']}" + (f" at {x['step']}" if x["step"] is not None else "")
                          for x in row["failures"]) or "none"
        lines.append(f"| {row['arm']} | {role_title(row['role'])} | {row['learned']} of "
                     f"{len(row['seeds'])} | {row['failed']} | {num_text(f['mean'])} [{num_text(f['min'])}, "
                     f"{num_text(f['max'])}] ({f['n']}) | {fails} | {row['cascades']} | {row['own_spikes']} / "
                     f"{row['shared_spikes']} ({row['own_recovered']}) | {headroom_text(row['headroom'])} |")
    return lines


def markdown(result: dict) -> str:
    """claims.md: the positive control first, the claims, the mechanism checks, the runs by role."""
    levels = result.get("levels") or {}
    lines = control_markdown(result["control"])
    lines += ["", "### The claims", "", *margin_table(result["claims"]), "",
              f"Family: the testable claims, Holm-adjusted at {ALPHA}, the difference and the equivalence p apart. "
              f"Blocks with the four configurations ({len(result['claims_blocks'])}): seeds "
              + (", ".join(str(s) for s in result["claims_blocks"]) or "none") + "."]
    if "unigram_eval_cb0" in levels:
        lines.append(f"Held-out unigram level (codebook 0): {levels['unigram_eval_cb0']:.3f} bits; learned = "
                     f"{MARGIN_LEARNED:g} bits below it at the end.")
    if result.get("ignored"):
        lines.append(f"Runs with no role in the study, ignored: {len(result['ignored'])} (claims.json lists them).")
    lines += ["", *mechanism_markdown(result["mechanism"], result["roles"]), "", *roles_markdown(result)]
    return "\n".join(lines) + "\n"


def to_json(result: dict) -> dict:
    out = _plain(result)
    out["alpha"] = ALPHA
    out["constants"] = {"L": L, "H": H, "DELTA_EARLY": DELTA_EARLY, "MARGIN_LEARNED": MARGIN_LEARNED,
                        "CONTROL_MARGIN": CONTROL_MARGIN, "DELTA_LN_GRAD": DELTA_LN_GRAD, "DELTA_COUNT": DELTA_COUNT,
                        "DELTA_STEPS": DELTA_STEPS, "SHARED_STEPS": SHARED_STEPS, "MIN_BLOCKS": MIN_BLOCKS}
    return out


def run_json(r: LearningRun) -> dict:
    """A run's endpoints for claims.json, with those computed from them (survived, spikes, instability)."""
    return {**_plain(r), "failed": r.failed, "survived": r.survived, "own_spikes": r.own_spikes,
            "shared_spikes": r.shared_spikes, "own_recovered": r.own_recovered, "instability": _plain(r.instability)}


DOC_BEGIN = ("<!-- learning claims table: generated by `python -m musiclm_stab.analysis.learning ... --doc`; "
             "do not edit -->")
DOC_END = "<!-- end of the generated learning claims table -->"
