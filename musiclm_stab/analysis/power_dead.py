"""The power simulation's dead-input scenario (analysis/power_runs.py, issue 55): which claims roles' conv
frontends die in the simulated studies, with what probability and where. The calibration's DeepNorm run lost
its input at step 672 of 1000 at L (docs/STUDY.md "Calibration: the result"), so the power stated before the
learning study's runs says under which such assumption it holds (``--dead ROLE=P:FIRST:LAST``).

A run's draw comes from the generator of its own key with DEAD_KEY appended: its other draws are untouched,
it dies at the same step in every planted effect, and one that does not die is the run of the default
scenario.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from musiclm_stab.analysis import learning_params
from musiclm_stab.analysis.learning_report import ROLE_SHORT

CLAIM_ROLES = ("clip10", "clip1", "deepnorm", "relax", "pre_nw", "post_w", "post_nw")


def keyed_rng(*key: int) -> np.random.Generator:
    """A generator of a run's key: the same draws on every machine and in every process."""
    return np.random.default_rng([int(k) for k in key])


DeadInput = dict[str, tuple[float, int, int]]  # claims role -> (probability, first step, last step)
DEAD_KEY = 7  # a run's dead-input draw: the generator of its key with this appended (its other draws untouched)
DEAD_PEN = 1e-8  # a dead frontend's features_pen, a share of its first value


def check_dead(dead: DeadInput | None) -> DeadInput:
    """The dead-input scenario as {role: (p, first, last)}; ValueError naming the role and the reason when a
    role is not a claims role, p is not in [0, 1] or the steps are not 2 <= first <= last <= H."""
    out = {}
    for role, (p, first, last) in (dead or {}).items():
        if role not in CLAIM_ROLES:
            raise ValueError(f"dead input of {role!r}: not a claims role (one of {', '.join(CLAIM_ROLES)})")
        if not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"dead input of {role}: probability {p} not in [0, 1]")
        if not 2 <= int(first) <= int(last) <= learning_params.H:
            raise ValueError(f"dead input of {role}: steps {first}-{last} not within 2..H = {learning_params.H}")
        out[role] = (float(p), int(first), int(last))
    return out


def parse_dead(texts: Sequence[str]) -> DeadInput:
    """``--dead ROLE=P:FIRST:LAST`` values as a scenario (check_dead); ValueError naming the value."""
    out: DeadInput = {}
    for text in texts:
        role, _, rest = text.partition("=")
        parts = rest.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            p, first, last = float(parts[0]), int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--dead {text}: not ROLE=P:FIRST:LAST (e.g. deepnorm=1.0:300:700)") from None
        try:
            out.update(check_dead({role: (p, first, last)}))
        except ValueError as e:
            raise ValueError(f"--dead {text}: {e}") from None
    return out


def dead_input_at(dead: DeadInput | None, role: str, key: tuple[int, ...]) -> int | None:
    """The step the run of ``role`` keyed ``key`` loses its input in scenario ``dead``; None when it does not.
    Both numbers are drawn for every such run, so a run that dies at probability p dies at any higher one."""
    if not dead or role not in dead:
        return None
    p, first, last = dead[role]
    rng = keyed_rng(*key, DEAD_KEY)
    u, step = float(rng.uniform()), int(rng.integers(first, last + 1))
    return step if u < p else None


def describe_dead(dead: DeadInput | None) -> str:
    """The scenario in words, for the table."""
    if not dead:
        return "every claims run's frontend lives (no dead input)"
    return "; ".join(f"{ROLE_SHORT[role]}'s frontend dies (dead input) in {p:.0%} of its runs, at a step drawn "
                     f"from {first}-{last}" for role, (p, first, last) in dead.items())
