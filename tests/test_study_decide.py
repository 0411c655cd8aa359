"""The study's decision rule (analysis/decide.py): exact Wilcoxon and McNemar, Holm, claims, verdicts."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.stats

from musiclm_stab.analysis.decide import (
    ABSENT,
    INCONCLUSIVE,
    NOT_TESTABLE,
    REFUTED,
    REPRODUCED,
    Claim,
    MarginClaim,
    MarginPart,
    Part,
    claim_p,
    claim_p_tost,
    decide,
    decide_margins,
    holm,
    mcnemar,
    median,
    tost,
    wilcoxon,
    wilcoxon_greater,
    wilcoxon_less,
)


def brute_force_p(d: list[float]) -> float:
    """Two-sided exact Wilcoxon p by listing every sign flip of the signed average ranks."""
    used = np.array([x for x in d if x != 0 and not math.isnan(x)])
    ranks = scipy.stats.rankdata(np.abs(used))  # average ranks; inf ties with inf
    observed = ranks[used > 0].sum()
    flips = itertools.product((0, 1), repeat=len(used))
    sums = np.array([sum(r for r, s in zip(ranks, signs) if s) for signs in flips])
    tail = min((sums <= observed + 1e-9).sum(), (sums >= observed - 1e-9).sum())
    return min(1.0, 2 * tail / len(sums))


def test_wilcoxon_exact_values_by_hand():
    """Hand-counted exact p: six positives 2/64; n=5 with one negative 14/32; ties {1,1,-2,3} 10/16;
    zeros and NaN dropped; an infinite difference takes the largest rank."""
    assert wilcoxon([1, 2, 3, 4, 5, 6]) == (pytest.approx(2 / 64), 6, 3.5)
    assert wilcoxon([1, 2, 3, -4, 5])[0] == pytest.approx(14 / 32)
    # |d| = 1, 1, 2, 3: doubled ranks 3, 3, 6, 8; T+ = 14 of 20; 5 of the 16 flips reach 14 or more.
    assert wilcoxon([1, 1, -2, 3])[0] == pytest.approx(10 / 16)
    p, n, est = wilcoxon([0.0, 1, 2, 3, 4, 5, 6, math.nan])
    assert (p, n, est) == (pytest.approx(2 / 64), 6, 3.0)  # median of 0..6 (zero kept, NaN not)
    assert wilcoxon([math.inf, 1, 2, 3, 4, 5]) == (pytest.approx(2 / 64), 6, 3.5)
    # -inf is the largest rank against: the same p as a large finite negative difference (28/64).
    assert wilcoxon([-math.inf, 1, 2, 3, 4, 5])[0] == pytest.approx(28 / 64)
    assert wilcoxon([-100.0, 1, 2, 3, 4, 5])[0] == pytest.approx(28 / 64)
    assert wilcoxon([1, 2, 3, 4, 5]) == (pytest.approx(2 / 32), 5, 3.0)  # 5 blocks can never reach p < 0.05
    assert wilcoxon([0.0, 0.0]) == (1.0, 0, 0.0) and wilcoxon([])[1] == 0


def test_wilcoxon_equals_scipy_exact_without_ties_and_brute_force_with_ties():
    """No ties or zeros: the same p as scipy.stats.wilcoxon(method="exact"); with ties and infinities: the
    same p as listing all 2^n sign flips."""
    rng = np.random.default_rng(0)
    for n in range(1, 16):
        for _ in range(3):
            d = rng.normal(0.3, 1.0, n)
            exact = scipy.stats.wilcoxon(d, method="exact").pvalue
            assert wilcoxon(d)[0] == pytest.approx(exact, rel=1e-12, abs=0)
    for n in range(1, 11):
        for _ in range(5):
            d = list(rng.choice([-3, -2, -1, 0, 1, 2, 3, -math.inf, math.inf], n))
            assert wilcoxon(d)[0] == pytest.approx(brute_force_p(d), rel=1e-12), d


def test_wilcoxon_large_n_is_exact_and_fast():
    """n = 80 with ties: counts stay exact integers (no overflow), p matches scipy's normal approximation
    closely for a mild effect, and a clear effect is tiny."""
    rng = np.random.default_rng(1)
    d = np.round(rng.normal(0.2, 1.0, 80), 1)
    d = d[d != 0]
    ours = wilcoxon(d)[0]
    approx = scipy.stats.wilcoxon(d, method="approx").pvalue
    assert abs(ours - approx) < 0.01
    assert wilcoxon(np.arange(1, 81))[0] == pytest.approx(2 / 2**80)


def test_median_with_infinities():
    """The estimate: -inf and +inf in the middle give 0, one infinite middle value wins, NaN is left out."""
    assert median([1, 2, math.inf, math.inf]) == math.inf
    assert median([-math.inf, math.inf]) == 0.0
    assert median([1.0, math.nan, 3.0]) == 2.0 and math.isnan(median([math.nan]))


def test_mcnemar_exact():
    """Discordant 6 vs 0: p = 2/64; 5 vs 0: 2/32 (5 blocks cannot reach 0.05); 7 vs 2: 92/512 as scipy's
    binomial test; concordant pairs do not count."""
    yes, no = [True] * 6, [False] * 6
    assert mcnemar(yes, no) == (pytest.approx(2 / 64), 0, 6)
    assert mcnemar(no[:5] + [True] * 4, yes[:5] + [True] * 4) == (pytest.approx(2 / 32), 5, 0)
    a = [True] * 7 + [False] * 2 + [True, False]
    b = [False] * 7 + [True] * 2 + [True, False]
    assert mcnemar(a, b) == (pytest.approx(92 / 512), 2, 7)
    assert mcnemar(a, b)[0] == pytest.approx(scipy.stats.binomtest(2, 9).pvalue)
    assert mcnemar([True, False], [True, False]) == (1.0, 0, 0)
    with pytest.raises(ValueError, match="paired"):
        mcnemar([True], [True, False])


def test_holm_worked_example():
    """p = (0.01, 0.04, 0.03, 0.005): x4, x3, x2, x1 along the sorted order, made monotone: (0.03, 0.06,
    0.06, 0.02); capped at 1."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([]) == [] and holm([0.02]) == [0.02]


def part(p: float, estimate: float, name: str = "x") -> Part:
    return Part(name, "wilcoxon", p, 6, estimate)


def test_claim_p_intersection_union_and_bonferroni():
    """All parts for: the largest p; any part against: parts x its smallest p; mixed without a part against
    (a zero median): no direction; refute-only never gets a p for."""
    assert claim_p([part(0.01, 1), part(0.03, 2)]) == (0.03, "for")
    assert claim_p([part(0.01, 1), part(0.02, -2), part(0.3, -1)]) == (pytest.approx(0.06), "against")
    assert claim_p([part(0.01, 1), part(0.5, 0)]) == (1.0, None)
    assert claim_p([part(0.01, 1)], refute_only=True) == (1.0, None)
    assert claim_p([part(0.01, -1)], refute_only=True) == (0.01, "against")
    assert claim_p([part(0.6, -1), part(0.6, -2)]) == (1.0, None)  # 2 x 0.6 capped at 1


def test_decide_verdicts_over_the_family():
    """Holm over the testable claims only: (a) for at p 0.001 -> reproduced, (b) against at 2 x 0.002 ->
    refuted, (c) not testable (left out), (d) refute-only and not refuted -> not testable; a weak claim
    stays inconclusive; each part's adjusted p is the family's with it in its claim's place."""
    a = Claim("a", "A", [part(0.001, 1.0, "a1")])
    b = Claim("b", "B", [part(0.002, -1.0, "b1"), part(0.5, 1.0, "b2")])
    c = Claim("c", "C", [], testable=False, reason="no spike at this scale")
    d = Claim("d", "D", [part(0.01, 1.0, "d1")], refute_only=True, reason="steady part not testable")
    e = Claim("e", "E", [part(0.2, 1.0, "e1")])
    decide([a, b, c, d, e])
    # family p: a 0.001, b 0.004, d 1, e 0.2 -> Holm: 0.004, 0.012, 1, 0.4
    assert [x.p_adjusted for x in (a, b, d, e)] == pytest.approx([0.004, 0.012, 1.0, 0.4])
    verdicts = [x.verdict for x in (a, b, c, d, e)]
    assert verdicts == [REPRODUCED, REFUTED, NOT_TESTABLE, NOT_TESTABLE, INCONCLUSIVE]
    assert c.why == "no spike at this scale" and math.isnan(c.p_adjusted)
    assert b.parts[0].p_adjusted == pytest.approx(0.012)  # the deciding part shows the claim's adjusted p
    assert b.parts[1].p_adjusted == pytest.approx(1.0)  # 0.5 in b's place: Holm gives min(1, 3 x 0.5) = 1
    assert "b1 points against" in b.why and "disagree" not in e.why


def test_significant_alone_is_not_enough_after_holm():
    """Four claims at p = 0.02 each: every one is below 0.05 alone, none after Holm (4 x 0.02 = 0.08)."""
    claims = [Claim(k, k, [part(0.02, 1.0)]) for k in "abcd"]
    decide(claims)
    assert all(c.verdict == INCONCLUSIVE and c.p_adjusted == pytest.approx(0.08) for c in claims)


def brute_force_tail(d: list[float], upper: bool) -> float:
    """One-sided exact Wilcoxon p by listing every sign flip of the signed average ranks."""
    used = np.array([x for x in d if x != 0 and not math.isnan(x)])
    if not len(used):
        return 1.0
    ranks = scipy.stats.rankdata(np.abs(used))
    observed = ranks[used > 0].sum()
    sums = np.array([sum(r for r, s in zip(ranks, signs) if s)
                     for signs in itertools.product((0, 1), repeat=len(used))])
    hits = (sums >= observed - 1e-9) if upper else (sums <= observed + 1e-9)
    return hits.sum() / len(sums)


def test_one_sided_tails_equal_an_enumeration_of_every_sign_flip():
    """The one-sided exact tails (ties, zeros, NaN and infinities included) are what listing all 2^n sign
    flips gives, and without ties scipy's exact one-sided test; the two tails of one sample overlap in
    exactly the observed sum, so they add to more than 1."""
    rng = np.random.default_rng(2)
    for n in range(1, 11):
        for _ in range(5):
            d = list(rng.choice([-3, -2, -1, 0, 1, 2, 3, -math.inf, math.inf, math.nan], n))
            assert wilcoxon_greater(d)[0] == pytest.approx(brute_force_tail(d, upper=True), rel=1e-12), d
            assert wilcoxon_less(d)[0] == pytest.approx(brute_force_tail(d, upper=False), rel=1e-12), d
    for n in range(1, 14):
        d = rng.normal(0.2, 1.0, n)
        for alternative, fn in (("greater", wilcoxon_greater), ("less", wilcoxon_less)):
            exact = scipy.stats.wilcoxon(d, alternative=alternative, method="exact").pvalue
            assert fn(d)[0] == pytest.approx(exact, rel=1e-12, abs=0)
        assert wilcoxon_greater(d)[0] + wilcoxon_less(d)[0] > 1.0
    assert wilcoxon_greater([1, 2, 3]) == (pytest.approx(1 / 8), 3) and wilcoxon_less([0.0, math.nan]) == (1.0, 0)


def test_tost_equivalent_only_when_every_difference_sits_well_inside_the_margin():
    """n = 8 differences all well inside +-0.1: p_lo = p_hi = 1/256 (every shifted difference on one side);
    one of them (0.5) outside: p_hi = 25/256 (d - 0.1 has one positive, the largest rank: 25 of the 256
    subsets of 1..8 sum to <= 8), not equivalent at 0.05; +-inf never equivalent; NaN dropped; a margin of 0
    refused."""
    inside = [0.01, -0.02, 0.03, 0.0, -0.01, 0.02, 0.005, -0.015]
    assert tost(inside, 0.1) == (pytest.approx(1 / 256), pytest.approx(1 / 256), pytest.approx(1 / 256))
    one_out = inside[:-1] + [0.5]
    p, p_lo, p_hi = tost(one_out, 0.1)
    assert p_lo == pytest.approx(1 / 256) and p == p_hi == pytest.approx(25 / 256)
    assert p_hi == pytest.approx(brute_force_tail([x - 0.1 for x in one_out], upper=False))
    assert tost(inside[:-1] + [math.inf], 0.1)[0] == pytest.approx(brute_force_tail(
        [x - 0.1 for x in inside[:-1]] + [math.inf], upper=False))
    assert tost([math.inf] * 8, 0.1)[0] == 1.0 and tost([-math.inf] * 8, 0.1)[0] == 1.0
    assert tost(inside + [math.nan], 0.1) == tost(inside, 0.1)
    assert tost([0.1, 0.1], 0.1)[2] == 1.0  # zeros after the shift are dropped: nothing left below
    with pytest.raises(ValueError, match="margin"):
        tost(inside, 0.0)


def test_four_verdicts_absent_reproduced_refuted_inconclusive():
    """Over one family: a claim whose every part sits inside its margin is absent; a large effect is
    reproduced; a large reversed one refuted; a noisy one inconclusive and says it was not shown absent; a
    binary part cannot make its claim absent; the equivalence family is Holm-adjusted on its own; a tiny but
    consistent difference inside the margin is absent and says the difference is significant too."""
    inside = [0.01, -0.02, 0.03, 0.004, -0.01, 0.02, 0.005, -0.015]
    big = [1.0, 1.1, 0.9, 1.2, 0.8, 1.3, 1.05, 0.95]
    noisy = [1.0, -1.1, 0.9, -1.2, 0.8, 1.3, -1.05, 0.95]
    tiny = [0.001 * (i + 1) for i in range(8)]
    claims = [MarginClaim("a", "A", [MarginPart.paired("a1", inside, 0.1), MarginPart.paired("a2", inside, 0.1)]),
              MarginClaim("b", "B", [MarginPart.paired("b1", big, 0.1)]),
              MarginClaim("c", "C", [MarginPart.paired("c1", [-x for x in big], 0.1)]),
              MarginClaim("d", "D", [MarginPart.paired("d1", noisy, 0.1)]),
              MarginClaim("e", "E", [MarginPart.paired("e1", inside, 0.1),
                                     MarginPart.binary("e2", [False] * 8, [False] * 8)]),
              MarginClaim("f", "F", [MarginPart.paired("f1", tiny, 0.1)]),
              MarginClaim("g", "G", [], testable=False, reason="too few blocks")]
    decide_margins(claims)
    verdicts = {c.key: c.verdict for c in claims}
    assert verdicts == {"a": ABSENT, "b": REPRODUCED, "c": REFUTED, "d": INCONCLUSIVE, "e": INCONCLUSIVE,
                        "f": ABSENT, "g": NOT_TESTABLE}
    by = {c.key: c for c in claims}
    # equivalence family of the six testable: a, f at 1/256 (and e's 1 because of its binary part, b, c, d 1)
    assert by["a"].p_tost == pytest.approx(1 / 256) and by["a"].p_tost_adjusted == pytest.approx(6 / 256)
    assert by["e"].p_tost == 1.0 and claim_p_tost(by["e"].parts) == 1.0
    assert "not shown absent" in by["d"].why and "a difference smaller than the margin" in by["f"].why
    assert "a difference smaller" not in by["a"].why and math.isnan(by["g"].p_tost_adjusted)
    assert by["a"].parts[0].p_tost_adjusted == pytest.approx(6 / 256) and by["b"].parts[0].p_tost == 1.0
