"""The learning study's pilot rule for its positive control (docs/STUDY.md, "Pilots"), applied to the pilots'
runs: where the control runs (CONTROL_LAYERS, CONTROL_LR), or which pilots the rule needs next.

    python -m musiclm_stab.analysis.pilot_rule RUN_DIR_OR_FOLDER ... --unigram BITS [--json FILE]

The control is the 2 x 2 of warmup x Pre/Post-LN; its score is the interaction (Post-LN without warmup - with)
- (Pre-LN without - with) of the final held-out codebook-0 loss, a run that diverged or whose input died scored
at its loss at initialisation (learning.control_score). The rule, fixed before the pilots:

1. The interaction at L with CLAIMS_LAYERS layers is at least PILOT_MARGIN = 0.1 bits: the control runs there.
2. Else, piloted at 3L (CLAIMS_LAYERS layers): at least 0.1 bits there, the control runs at 3L.
3. Else, piloted with DEEP_LAYERS = 24 layers at whichever of L and 3L gave the larger interaction (a tie: L):
   at least 0.1 bits there, the control runs so.
4. Else the control runs at CLAIMS_LAYERS layers at the rate with the larger interaction, and the plan says
   before its runs that the pilots showed no sign of the effect.

A setting counts only when all four of its runs are in (each reached its last step, or stopped at fp16's
loss-scale floor) in one block (the pilots' seed); a setting the rule needs that is not in yet is named, with
the roles to run, and nothing is chosen. The table shows every setting whose four are in, also one the rule has
not reached yet (pilots run in another order).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from musiclm_stab.analysis.claims import read_runs
from musiclm_stab.analysis.horizon import rule_cli
from musiclm_stab.analysis.learning import (
    CLAIMS,
    CLAIMS_LAYERS,
    CONTROL_LRS,
    arm_blocks,
    control_of,
    control_roles,
    learning_role,
    learning_runs,
)
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.analysis.sweep_report import lr_text

PILOT_MARGIN = 0.1  # bits: the interaction a setting needs to be chosen (the rule's steps 1-3)
DEEP_LAYERS = 24  # the rule's step 3: DeepNet's depth


@dataclass
class PilotDecision:
    step: int | None  # the rule's step that chose (1-4); None: a pilot setting is still needed
    layers: int | None  # CONTROL_LAYERS (None until chosen)
    lr: float | None  # CONTROL_LR (None until chosen)
    no_sign: bool  # step 4: the pilots showed no sign of the effect
    seed: int | None  # the pilots' block (None: no pilot of the control is in yet)
    interactions: dict[str, float] = field(default_factory=dict)  # "layers lr" -> bits, the settings piloted
    cells: dict[str, dict[str, float]] = field(default_factory=dict)  # "layers lr" -> cell -> score, bits
    failed: dict[str, dict[str, int]] = field(default_factory=dict)  # "layers lr" -> cell -> 1 if it failed
    needs: dict = field(default_factory=dict)  # when step is None: {"layers", "lr", "roles"} to pilot next


def _key(layers: int, lr: float) -> str:
    return f"{layers} {lr_text(lr)}"


def _unfinished(runs: Sequence[RunMetrics]) -> list[str]:
    """The control-cell runs of the claims arm still running: not at their last step and not stopped at fp16's
    loss-scale floor (a dead input or a loss above its start is judged at a run's end: it may still recover)."""
    cells = {r for layers in (CLAIMS_LAYERS, DEEP_LAYERS) for lr in CONTROL_LRS
             for r in control_roles(layers, lr).values()}
    out = []
    for run in runs:
        found = learning_role(run.config)
        steps = int((run.config.get("train") or {}).get("max_steps", 0))
        if found is not None and found[0] == CLAIMS and found[1] in cells and (run.last_step or 0) < steps \
                and run.diverged_at is None:
            out.append(f"{run.path} (at step {run.last_step or 0} of {steps})")
    return out


def apply_rule(run_dirs: Sequence[str | Path | RunMetrics], unigram_eval_cb0: float) -> PilotDecision:
    """The rule (module docstring) on the pilot runs found in ``run_dirs``; ValueError when a run the rule
    reads is still running, or the runs are of more than one block."""
    runs = read_runs(run_dirs)
    unfinished = _unfinished(runs)
    if unfinished:
        raise ValueError("the rule is applied when the pilots it reads are in; still running: " + ", ".join(unfinished))
    found, _ = learning_runs(runs, unigram_eval_cb0)
    blocks = arm_blocks(found, CLAIMS)
    if len(blocks) > 1:
        raise ValueError(f"the pilots are one block (seed); these runs are of seeds {sorted(blocks)}")
    seed = next(iter(blocks), None)
    decision = PilotDecision(step=None, layers=None, lr=None, no_sign=False, seed=seed)
    for layers in (CLAIMS_LAYERS, DEEP_LAYERS):  # the table: every setting whose four are in, in the rule's order
        for lr in CONTROL_LRS:
            roles = control_roles(layers, lr)
            if blocks and all(role in blocks[seed] for role in roles.values()):
                c = control_of(blocks, layers, lr)
                key = _key(layers, lr)
                decision.interactions[key], decision.cells[key], decision.failed[key] = (
                    c["interaction"][0], c["cells"], c["failed"])

    def interaction(layers: int, lr: float) -> float | None:
        got = decision.interactions.get(_key(layers, lr))
        if got is None:
            decision.needs = {"layers": layers, "lr": lr, "roles": control_roles(layers, lr)}
        return got

    def choose(step: int, layers: int, lr: float, no_sign: bool = False) -> PilotDecision:
        decision.step, decision.layers, decision.lr, decision.no_sign, decision.needs = step, layers, lr, no_sign, {}
        return decision

    low, high = CONTROL_LRS
    at_low = interaction(CLAIMS_LAYERS, low)
    if at_low is None:
        return decision
    if at_low >= PILOT_MARGIN:
        return choose(1, CLAIMS_LAYERS, low)
    at_high = interaction(CLAIMS_LAYERS, high)
    if at_high is None:
        return decision
    if at_high >= PILOT_MARGIN:
        return choose(2, CLAIMS_LAYERS, high)
    best = high if at_high > at_low else low
    deep = interaction(DEEP_LAYERS, best)
    if deep is None:
        return decision
    if deep >= PILOT_MARGIN:
        return choose(3, DEEP_LAYERS, best)
    return choose(4, CLAIMS_LAYERS, best, no_sign=True)


def markdown(d: PilotDecision, unigram_eval_cb0: float) -> str:
    """The pilots' cells and interactions per setting, and what the rule chose or needs."""
    if not d.cells:
        return "No pilot of the positive control is in yet. " + _needs(d) + "\n"
    lines = [f"The positive control's pilots (seed {d.seed}): final held-out codebook-0 loss minus the unigram level "
             f"({unigram_eval_cb0:.3f} bits), bits (a failed run at its loss at initialisation); the interaction is "
             "(Post-LN no warmup - warmup) - (Pre-LN no warmup - warmup).", "",
             "| layers | lr | Pre-LN warmup | Pre-LN none | Post-LN warmup | Post-LN none | interaction |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for key, cells in d.cells.items():
        layers, lr = key.split()
        shown = [f"{cells[c] - unigram_eval_cb0:+.3f}" + (" (failed)" if d.failed[key][c] else "")
                 for c in ("pre_w", "pre_nw", "post_w", "post_nw")]
        lines.append(f"| {layers} | {lr} | " + " | ".join(shown) + f" | {d.interactions[key]:+.3f} |")
    lines.append("")
    if d.step is None:
        lines.append(_needs(d))
    else:
        lines.append(f"**Rule step {d.step}: CONTROL_LAYERS = {d.layers}, CONTROL_LR = {lr_text(d.lr)}** "
                     f"(an interaction of at least {PILOT_MARGIN:g} bits chooses a setting).")
        if d.no_sign:
            lines.append("No setting reached it: the plan says before its runs that the pilots showed no sign of "
                         "the effect.")
    return "\n".join(lines) + "\n"


def _needs(d: PilotDecision) -> str:
    at = f"{d.needs['layers']}:{lr_text(d.needs['lr'])}"
    return (f"Not chosen yet: the rule needs the pilots at {d.needs['layers']} layers, lr {lr_text(d.needs['lr'])} "
            f"(roles {', '.join(d.needs['roles'].values())}): the pilots' study command with "
            f"`--only {' '.join(control_roles().values())} --control-at {at}`.")


def _plain(d: PilotDecision) -> dict:
    out = asdict(d)
    out["interactions"] = {k: (v if math.isfinite(v) else str(v)) for k, v in d.interactions.items()}
    return out


def cli_main(argv: list[str] | None = None) -> int:
    return rule_cli("python -m musiclm_stab.analysis.pilot_rule", __doc__, apply_rule, markdown, _plain, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
