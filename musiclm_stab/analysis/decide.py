"""The study's decision rule: exact paired tests, claims made of parts, Holm over the claims, verdicts.

Tests, exact (no normal approximation), two-sided:

- ``wilcoxon(d)``: Wilcoxon signed-rank test of paired differences d (one per block). Zeros are dropped,
  and so are undefined differences (NaN: both runs diverged early, or a statistic the runs lack). |d| is
  ranked with average ranks for ties; +inf and -inf (a diverged run is the worst) take the largest ranks.
  The statistic is the sum of the ranks of the positive differences; its null distribution is that of
  all 2^n sign flips of the signed ranks, counted exactly (a dynamic programme over the doubled ranks,
  which are integers: the same counts an enumeration of the 2^n flips gives, for any n, with or without
  ties). p = min(1, 2 x the smaller tail). The estimate is the median of d (NaN left out, zeros kept).
- ``mcnemar(a, b)``: McNemar test of paired yes/no outcomes: the binomial test on the discordant pairs,
  p = min(1, 2 P(X <= min(n01, n10))) with X ~ Bin(n01 + n10, 1/2); n10 counts pairs with a yes and b no.
- ``holm(p)``: Holm's step-down adjusted p-values (monotone, capped at 1).

A *part* of a claim is one paired comparison, oriented so that a positive estimate is what the claim
says. A claim's p combines its parts: p_for = the largest part p when every part's estimate is > 0 (an
intersection-union test: the claim holds only if every part does), else 1; p_against = min(1, number of
parts x the smallest p of the parts with estimate < 0) (Bonferroni), else 1. The claim's p is p_for when
p_for < 1, else p_against, with its direction. A *refute-only* claim (a part it needs is not testable)
has p_for = 1.

Verdicts: the testable claims form one family; their p are Holm-adjusted at ALPHA = 0.05. Adjusted p <
0.05 in the claimed direction: **reproduced**; in the opposite direction: **refuted**; otherwise
**inconclusive** (a refute-only claim that is not refuted: **not testable at this scale**). A claim
whose precondition fails is **not testable at this scale** and is left out of the family. Each part also
gets an adjusted p: the family's Holm adjustment with the part's own p (times the number of parts for a
part against the claim) in place of its claim's p, so the part that decides a claim shows the claim's
adjusted p, and any other part shows what it alone would have given.

Four verdicts (``decide_margins``; the learning study's rule, the older studies keep ``decide``): a part
may carry an equivalence margin delta in its unit, fixed in advance (``MarginPart``), and is then also
tested for equivalence by TOST with the exact Wilcoxon test, one-sided each way (``tost``): p_lo tests
H0 median(d) <= -delta against > -delta (the upper tail of d + delta), p_hi tests H0 median(d) >= +delta
against < +delta (the lower tail of d - delta), counted on the same sign flips as the two-sided test;
zeros after the shift and NaN are dropped, +-inf kept (they never fall inside the margin); TOST p =
max(p_lo, p_hi). A claim's equivalence p is the largest TOST p of its parts (intersection-union: absent
only if every part is equivalent; a part without a margin, McNemar's, makes it 1). The testable claims'
equivalence p are Holm-adjusted as a family of their own. **absent** when a claim's adjusted equivalence
p < ALPHA (with "a difference smaller than the margin" in its why when its difference is significant
too); otherwise the verdict ``decide`` gives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

ALPHA = 0.05
REPRODUCED, REFUTED, INCONCLUSIVE, NOT_TESTABLE = (
    "reproduced", "refuted", "inconclusive", "not testable at this scale")
ABSENT = "absent"  # the four-verdict rule's (decide_margins): equivalence within a margin fixed in advance


# ---------------------------------------------------------------------------------------------------
# Exact tests


def median(values: Sequence[float]) -> float:
    """Median of the non-NaN values; +-inf allowed (the middle pair -inf, +inf gives 0); NaN when empty."""
    v = np.sort(np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64))
    n = len(v)
    if n == 0:
        return math.nan
    lo, hi = float(v[(n - 1) // 2]), float(v[n // 2])
    if lo == hi:
        return lo
    if math.isinf(lo) and math.isinf(hi):
        return 0.0
    if math.isinf(lo) or math.isinf(hi):
        return lo if math.isinf(lo) else hi
    return (lo + hi) / 2


def doubled_ranks(magnitudes: np.ndarray) -> np.ndarray:
    """2 x the average ranks (1-based) of ``magnitudes``: integers, equal values sharing their mean rank."""
    n = len(magnitudes)
    order = np.argsort(magnitudes, kind="mergesort")
    ordered = magnitudes[order]
    ranks2 = np.empty(n, dtype=np.int64)
    i = 0
    while i < n:
        j = i
        while j + 1 < n and ordered[j + 1] == ordered[i]:
            j += 1
        ranks2[order[i:j + 1]] = (i + 1) + (j + 1)  # 2 x the mean of the ranks i+1 .. j+1
        i = j + 1
    return ranks2


def sign_flip_counts(ranks2: np.ndarray) -> np.ndarray:
    """counts[s] = how many of the 2^n sign assignments give the positive doubled ranks the sum s."""
    total = int(ranks2.sum())
    dtype = np.int64 if len(ranks2) <= 62 else object  # exact integer counts either way
    counts = np.zeros(total + 1, dtype=dtype)
    counts[0] = 1
    for r in ranks2:
        r = int(r)
        counts[r:] = counts[r:] + counts[:-r]  # the right side is a new array: the old counts, shifted by r
    return counts


def signed_rank_tails(d: Sequence[float]) -> tuple[int, int, int]:
    """(lower, upper, n): of the 2^n sign flips of the non-zero, defined differences of ``d``, how many give
    a sum of positive doubled ranks <= the observed one (lower) and >= it (upper); n of them used."""
    d = np.asarray(d, dtype=np.float64)
    used = d[~np.isnan(d) & (d != 0)]
    n = len(used)
    if n == 0:
        return 1, 1, 0
    ranks2 = doubled_ranks(np.abs(used))
    counts = sign_flip_counts(ranks2)
    observed = int(ranks2[used > 0].sum())
    return int(counts[:observed + 1].sum()), int(counts[observed:].sum()), n


def wilcoxon(d: Sequence[float]) -> tuple[float, int, float]:
    """(p, n used, median of d): the exact two-sided Wilcoxon signed-rank test (module docstring)."""
    estimate = median(d)
    lower, upper, n = signed_rank_tails(d)
    if n == 0:
        return 1.0, 0, estimate
    p = Fraction(2 * min(lower, upper), 2 ** n)
    return float(min(p, Fraction(1))), n, estimate


def wilcoxon_greater(d: Sequence[float]) -> tuple[float, int]:
    """(p, n used): the exact one-sided Wilcoxon signed-rank test of H0 "d centred at or below 0" against
    "above 0": the upper tail, counted as the two-sided test counts it (zeros and NaN dropped)."""
    _, upper, n = signed_rank_tails(d)
    return (1.0, 0) if n == 0 else (float(Fraction(upper, 2 ** n)), n)


def wilcoxon_less(d: Sequence[float]) -> tuple[float, int]:
    """(p, n used): the one-sided test the other way, H0 "at or above 0" against "below 0" (the lower tail)."""
    lower, _, n = signed_rank_tails(d)
    return (1.0, 0) if n == 0 else (float(Fraction(lower, 2 ** n)), n)


def tost(d: Sequence[float], margin: float) -> tuple[float, float, float]:
    """(p, p_lo, p_hi): two one-sided exact Wilcoxon tests that the differences ``d`` lie within +-``margin``
    (equivalence, module docstring): p_lo of H0 median <= -margin (on d + margin, upper tail), p_hi of H0
    median >= +margin (on d - margin, lower tail), p = max of the two. NaN dropped; +-inf kept (never
    inside the margin); zeros after the shift dropped, as the two-sided test drops them."""
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be > 0, got {margin}")
    d = np.asarray(d, dtype=np.float64)
    p_lo, _ = wilcoxon_greater(d + margin)
    p_hi, _ = wilcoxon_less(d - margin)
    return max(p_lo, p_hi), p_lo, p_hi


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> tuple[float, int, int]:
    """(p, n01, n10): the exact two-sided McNemar test of paired yes/no outcomes (module docstring)."""
    if len(a) != len(b):
        raise ValueError(f"mcnemar needs paired outcomes, got {len(a)} and {len(b)}")
    n10 = sum(1 for x, y in zip(a, b) if x and not y)
    n01 = sum(1 for x, y in zip(a, b) if y and not x)
    n, k = n01 + n10, min(n01, n10)
    if n == 0:
        return 1.0, n01, n10
    tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2 ** n)
    return float(min(Fraction(1), 2 * tail)), n01, n10


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest (from 0) is multiplied
    by m - i, then made non-decreasing along that order and capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adjusted[i] = running
    return adjusted


# ---------------------------------------------------------------------------------------------------
# Claims and verdicts


@dataclass
class Part:
    """One paired comparison of a claim, oriented so that estimate > 0 is what the claim says."""

    name: str  # in words, e.g. "early loss: clip 1 - clip 10"
    test: str  # "wilcoxon" or "mcnemar"
    p: float
    n: int  # Wilcoxon: non-zero differences used; McNemar: blocks compared
    estimate: float  # Wilcoxon: median difference; McNemar: n10 - n01
    blocks: int = 0  # blocks the comparison had (before dropping zeros / undefined differences)
    n01: int | None = None
    n10: int | None = None
    p_adjusted: float = math.nan  # set by decide()

    @classmethod
    def paired(cls, name: str, d: Sequence[float]) -> Part:
        p, n, est = wilcoxon(d)
        return cls(name, "wilcoxon", p, n, est, blocks=len(d))

    @classmethod
    def binary(cls, name: str, a: Sequence[bool], b: Sequence[bool]) -> Part:
        p, n01, n10 = mcnemar(a, b)
        return cls(name, "mcnemar", p, len(a), float(n10 - n01), blocks=len(a), n01=n01, n10=n10)


@dataclass
class Claim:
    """A claim with its parts; ``decide`` fills in p, direction, adjusted p, verdict and why."""

    key: str  # "a" .. "d"
    text: str
    parts: list[Part] = field(default_factory=list)
    testable: bool = True  # False: its precondition failed (``reason`` says which)
    refute_only: bool = False  # a part it needs is not testable: it can be refuted, not reproduced
    reason: str = ""  # why not testable / refute-only
    p: float = 1.0
    direction: str | None = None  # "for", "against" or None (p = 1: no direction)
    p_adjusted: float = math.nan
    verdict: str = ""
    why: str = ""


def oriented_p(part: Part, n_parts: int) -> float:
    """A part's p as its claim uses it: as is pointing the claim's way, x n_parts (Bonferroni) against it."""
    return min(1.0, n_parts * part.p) if part.estimate < 0 else part.p


def claim_p(parts: Sequence[Part], refute_only: bool = False) -> tuple[float, str | None]:
    """(p, direction) of a claim from its parts (the intersection-union / Bonferroni rule above)."""
    if not parts:
        return 1.0, None
    p_for = max(q.p for q in parts) if all(q.estimate > 0 for q in parts) and not refute_only else 1.0
    against = [q.p for q in parts if q.estimate < 0]
    p_against = min(1.0, len(parts) * min(against)) if against else 1.0
    if p_for < 1.0:
        return p_for, "for"
    if p_against < 1.0:
        return p_against, "against"
    return 1.0, None


def decide(claims: Sequence[Claim], alpha: float = ALPHA) -> list[Claim]:
    """Verdicts for ``claims`` (in place, returned): Holm over the testable ones (module docstring)."""
    family = [c for c in claims if c.testable]
    for c in family:
        c.p, c.direction = claim_p(c.parts, c.refute_only)
    base = [c.p for c in family]
    adjusted = holm(base)
    for i, c in enumerate(family):
        c.p_adjusted = adjusted[i]
        for part in c.parts:
            swapped = list(base)
            swapped[i] = oriented_p(part, len(c.parts))
            part.p_adjusted = holm(swapped)[i]
        c.verdict, c.why = _verdict(c, alpha)
    for c in claims:
        if not c.testable:
            c.verdict, c.why = NOT_TESTABLE, c.reason
    return list(claims)


def _verdict(c: Claim, alpha: float) -> tuple[str, str]:
    significant = c.p_adjusted < alpha
    if significant and c.direction == "for":
        weakest = max(c.parts, key=lambda q: q.p)
        return REPRODUCED, (f"every part points the claimed way; the weakest ({weakest.name}) has p = "
                            f"{c.p:.3g}, adjusted {c.p_adjusted:.3g} < {alpha}")
    if significant and c.direction == "against":
        strongest = min((q for q in c.parts if q.estimate < 0), key=lambda q: q.p)
        return REFUTED, (f"{strongest.name} points against the claim: p = {strongest.p:.3g}, "
                         f"x {len(c.parts)} parts = {c.p:.3g}, adjusted {c.p_adjusted:.3g} < {alpha}")
    if c.refute_only:
        return NOT_TESTABLE, f"{c.reason}; not refuted (adjusted p {c.p_adjusted:.3g})"
    against = [q.name for q in c.parts if q.estimate < 0]
    if against and any(q.estimate > 0 for q in c.parts):
        return INCONCLUSIVE, (f"the parts disagree ({', '.join(against)} against the claim); "
                              f"adjusted p {c.p_adjusted:.3g}")
    if c.direction is None:
        return INCONCLUSIVE, "no part points either way (median differences of 0, or no data)"
    return INCONCLUSIVE, f"adjusted p {c.p_adjusted:.3g} >= {alpha}"


# ---------------------------------------------------------------------------------------------------
# Four verdicts: a claim can also be found absent (the learning study, docs/STUDY.md)


@dataclass
class MarginPart(Part):
    """A part with an equivalence margin, in the part's unit, fixed before the runs: besides the difference
    test it gets a TOST p (``tost``); a part without a margin (McNemar's yes/no) cannot show equivalence."""

    margin: float | None = None
    p_tost: float = 1.0
    p_lo: float = 1.0
    p_hi: float = 1.0
    p_tost_adjusted: float = math.nan  # set by decide_margins()

    @classmethod
    def paired(cls, name: str, d: Sequence[float], margin: float | None = None) -> MarginPart:
        part = super().paired(name, d)
        part.margin = margin
        if margin is not None:
            part.p_tost, part.p_lo, part.p_hi = tost(d, margin)
        return part


@dataclass
class MarginClaim(Claim):
    """A claim of MarginParts; ``decide_margins`` also fills in its equivalence p and their adjustment."""

    p_tost: float = 1.0
    p_tost_adjusted: float = math.nan


def claim_p_tost(parts: Sequence[Part], refute_only: bool = False) -> float:
    """A claim's equivalence p: the largest TOST p of its parts (intersection-union: the claim is absent only
    if every part is within its margin); 1 when a part has no margin, or a part it needs is not testable."""
    if not parts or refute_only or any(getattr(q, "margin", None) is None for q in parts):
        return 1.0
    return max(q.p_tost for q in parts)


def decide_margins(claims: Sequence[MarginClaim], alpha: float = ALPHA) -> list[MarginClaim]:
    """Four verdicts for ``claims`` (in place, returned): the difference family as ``decide`` adjusts it,
    and the equivalence family (each claim's ``claim_p_tost``) Holm-adjusted alone over the same testable
    claims. **absent** when the adjusted equivalence p < ``alpha``; else reproduced / refuted / inconclusive
    as ``decide`` says; not testable as there. Each part's adjusted TOST p: the family's with it in its
    claim's place."""
    decide(claims, alpha)
    family = [c for c in claims if c.testable]
    base = [claim_p_tost(c.parts, c.refute_only) for c in family]
    adjusted = holm(base)
    for i, c in enumerate(family):
        c.p_tost, c.p_tost_adjusted = base[i], adjusted[i]
        for part in c.parts:
            if getattr(part, "margin", None) is not None:
                swapped = list(base)
                swapped[i] = part.p_tost
                part.p_tost_adjusted = holm(swapped)[i]
        if c.p_tost_adjusted < alpha:
            widest = max(c.parts, key=lambda q: q.p_tost)
            also = (f"; the difference is significant too (adjusted p {c.p_adjusted:.3g}, {c.direction} the "
                    "claim): a difference smaller than the margin" if c.p_adjusted < alpha else "")
            c.verdict, c.why = ABSENT, (f"every part within its margin; the widest ({widest.name}, margin "
                                        f"{widest.margin:g}) has TOST p = {c.p_tost:.3g}, adjusted "
                                        f"{c.p_tost_adjusted:.3g} < {alpha}{also}")
        elif c.verdict == INCONCLUSIVE:
            c.why += f"; not shown absent (equivalence p {c.p_tost:.3g}, adjusted {c.p_tost_adjusted:.3g})"
    return list(claims)
