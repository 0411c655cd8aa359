"""The study's four claims, tested on run directories: a statistic per claim, fixed before looking.

    python -m musiclm_stab.analysis.claims RUN_DIR [RUN_DIR ...] --out DIR   # claims.md + claims.json

The claims (read from the study's figures; docs/STUDY.md, "The claims and their statistics"):

  (a) Pre-Norm with clip 10 converges faster early than with clip 1.
  (b) Post-Norm with DeepNorm keeps the lowest gradient norm throughout.
  (c) Post-Norm/DeepNorm shows a transient loss spike and recovers.
  (d) Pre-Norm with attention relax converges more slowly, but steadily.

Runs are sorted into configurations, paired by seed and measured by analysis/claim_stats.py (the
statistics' definitions are there).

Verdicts, the same rule for every paired statistic d_s (oriented so that d_s > 0 is what the claim says):
with n seeds, t = mean(d) / (sd(d) / sqrt(n)); **reproduced** when every d_s > 0 and t >= T_CRIT (the
one-sided 5% point of Student's t with n - 1 degrees of freedom; 2.92 for 3 seeds), **refuted** when
every d_s < 0 and t <= -T_CRIT (the opposite holds), else **inconclusive**. Spike counts are not
averaged: (c) is reproduced when DeepNorm has a recovered spike event at every seed and more events than
every other configuration at that seed, refuted when DeepNorm has no event at any seed.
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

from musiclm_stab.analysis.claim_stats import (
    K_SPIKE,
    ROLE_TITLES,
    ROLES,
    SPIKE_WINDOW,
    Paired,
    SpikeEvent,
    early_loss,
    final_eval,
    median_grad_norm,
    peak_grad_norm,
    probe_score,
    role_of,
    run_seed,
    spike_events,
)
from musiclm_stab.analysis.runs import RunMetrics, read_run


@dataclass
class ClaimResult:
    claim: str  # "a" .. "d"
    text: str  # the claim
    statistic: str  # what was computed
    values: dict[str, list[float]]  # role -> one value per seed (seed order)
    paired: str  # the paired difference, in words and numbers
    verdict: str
    why: str
    secondary: list[str] = field(default_factory=list)  # further numbers, one line each


def by_role(runs: Sequence[RunMetrics]) -> dict[str, dict[int, RunMetrics]]:
    """{role: {seed: run}} of the runs that are one of the study's configurations."""
    out: dict[str, dict[int, RunMetrics]] = {role: {} for role in ROLES}
    for run in runs:
        role = role_of(run.config)
        if role is None:
            continue
        seed = run_seed(run.config)
        if seed in out[role]:
            raise ValueError(f"runs {out[role][seed].path} and {run.path} are both {role} at train.seed={seed}")
        out[role][seed] = run
    return out


def _per_seed(table: dict[str, dict[int, RunMetrics]], fn) -> dict[str, dict[int, float]]:
    return {role: {seed: fn(run) for seed, run in sorted(runs.items())} for role, runs in table.items()}


def _paired(values: dict[str, dict[int, float]], fn) -> Paired:
    """d_s = fn({role: value at seed s}) for every seed all four configurations have."""
    seeds = sorted(set.intersection(*(set(v) for v in values.values()))) if values else []
    return Paired({s: float(fn({role: values[role][s] for role in values})) for s in seeds})


def _spread(values: Sequence[float], fmt: str = "{:.3g}") -> str:
    v = np.array([x for x in values if math.isfinite(x)])
    if not len(v):
        return "n/a"
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(v.mean())} [{fmt.format(v.min())}, {fmt.format(v.max())}]"


def evaluate_claims(runs: Sequence[RunMetrics]) -> list[ClaimResult]:
    """The four claims on ``runs`` (read in bits). Needs every configuration at one seed at least."""
    table = by_role(runs)
    missing = [role for role in ROLES if not table[role]]
    if missing:
        raise ValueError(f"no run of the configuration(s) {', '.join(missing)}: the claims need all four")
    results = []

    # (a) clip 10 faster early than clip 1
    early = {m: _per_seed(table, lambda r, m=m: early_loss(r, m))
             for m in ("loss", "musical_mlm_loss", "acoustic_mlm_loss/cb0")}
    pa = _paired(early["loss"], lambda v: v["clip1"] - v["clip10"])
    sec = []
    for m in ("musical_mlm_loss", "acoustic_mlm_loss/cb0"):
        p = _paired(early[m], lambda v: v["clip1"] - v["clip10"])
        sec.append(f"{m}: early mean clip 1 - clip 10 = {p.text()} -> {p.verdict()}")
    results.append(ClaimResult(
        "a", "Pre-Norm with clip 10 converges faster early than with clip 1",
        "early: mean training loss (bits) over steps 1..2W; d = early(clip 1) - early(clip 10)",
        {r: list(v.values()) for r, v in early["loss"].items()}, pa.text(), pa.verdict(),
        _why_a(pa), sec))

    # (b) DeepNorm lowest gradient norm throughout
    gn = _per_seed(table, median_grad_norm)
    gn_warm = _per_seed(table, lambda r: median_grad_norm(r, after_warmup=False))
    pb = _paired(gn, lambda v: math.log(min(v[r] for r in ROLES if r != "deepnorm")) - math.log(v["deepnorm"]))
    pb_warm = _paired(gn_warm, lambda v: math.log(min(v[r] for r in ROLES if r != "deepnorm"))
                      - math.log(v["deepnorm"]))
    peaks = _per_seed(table, lambda r: peak_grad_norm(r)[0])
    sec = [f"median during warmup: d = {pb_warm.text()} -> {pb_warm.verdict()}",
           "peak after W/2 (mean [min, max] over seeds): "
           + "; ".join(f"{ROLE_TITLES[r]} {_spread(list(peaks[r].values()))}" for r in ROLES)]
    results.append(ClaimResult(
        "b", "Post-Norm with DeepNorm keeps the lowest gradient norm throughout",
        "gnorm: median gradient norm after W; d = ln(lowest other gnorm) - ln(gnorm(DeepNorm))",
        {r: list(v.values()) for r, v in gn.items()}, pb.text(), pb.verdict(), _why_b(pb), sec))

    # (c) DeepNorm transient spike, recovered
    events = {role: {seed: spike_events(run) for seed, run in runs.items()} for role, runs in table.items()}
    counts = {role: {s: float(len(e)) for s, e in ev.items()} for role, ev in events.items()}
    vc, why_c = _verdict_c(events)
    sec = []
    for m in ("musical_mlm_loss", "acoustic_mlm_loss/cb0"):
        n = {role: [len(spike_events(run, m)) for _, run in sorted(runs.items())] for role, runs in table.items()}
        sec.append(f"{m} spike events per seed: " + "; ".join(f"{ROLE_TITLES[r]} {n[r]}" for r in ROLES))
    dn_events = [f"seed {s}: " + (", ".join(f"step {e.step} x{e.ratio:.2f} "
                                            + (f"recovered by {e.recovered_at}" if e.recovered_at else "not recovered")
                                            for e in ev) or "none")
                 for s, ev in sorted(events["deepnorm"].items())]
    sec.append("DeepNorm's events: " + "; ".join(dn_events))
    results.append(ClaimResult(
        "c", "Post-Norm/DeepNorm shows a transient loss spike and recovers",
        f"events: training-loss spikes above {K_SPIKE} x the running median of {SPIKE_WINDOW} steps, per seed",
        {r: list(v.values()) for r, v in counts.items()},
        "DeepNorm events minus the most of any other configuration, per seed: "
        + ", ".join(f"{counts['deepnorm'][s] - max(counts[r][s] for r in ROLES if r != 'deepnorm'):+.0f}"
                    for s in sorted(counts["deepnorm"]) if all(s in counts[r] for r in ROLES)),
        vc, why_c, sec))

    # (d) relax slower but steady
    pd = _paired(early["loss"], lambda v: v["relax"] - v["clip1"])
    relax_events = [len(e) for _, e in sorted(events["relax"].items())]
    steady = all(n == 0 for n in relax_events)
    if pd.verdict() == "reproduced" and steady:
        vd, why_d = "reproduced", "slower early at every seed (significant) and no spike event"
    elif pd.verdict() == "refuted" or sum(n > 0 for n in relax_events) >= 2:
        vd = "refuted"
        why_d = ("faster early than Pre-Norm clip 1 at every seed" if pd.verdict() == "refuted"
                 else f"spike events at {sum(n > 0 for n in relax_events)} seeds")
    else:
        vd = "inconclusive"
        why_d = ("no significant early difference to Pre-Norm clip 1"
                 + ("" if steady else f"; spike events per seed {relax_events}"))
    results.append(ClaimResult(
        "d", "Pre-Norm with Attn. Relax converges more slowly but steadily",
        "early (as (a)); d = early(relax) - early(clip 1); steady: no spike event (as (c))",
        {r: list(v.values()) for r, v in early["loss"].items()}, pd.text(), vd, why_d,
        [f"relax spike events per seed: {relax_events}"]))
    return results


def _why_a(p: Paired) -> str:
    v = p.verdict()
    if v == "reproduced":
        return "clip 10 lower early loss at every seed, significant"
    if v == "refuted":
        return "clip 1 lower early loss at every seed, significant"
    return "the difference changes sign over seeds or is small against its spread"


def _why_b(p: Paired) -> str:
    v = p.verdict()
    if v == "reproduced":
        return "DeepNorm's median after warmup is the lowest at every seed, significant"
    if v == "refuted":
        return "some other configuration's median is lower than DeepNorm's at every seed, significant"
    return "DeepNorm is not the lowest at every seed, or not by a margin beyond the seed spread"


def _verdict_c(events: dict[str, dict[int, list[SpikeEvent]]]) -> tuple[str, str]:
    seeds = sorted(set.intersection(*(set(v) for v in events.values())))
    dn = events["deepnorm"]
    if not any(dn[s] for s in seeds):
        return "refuted", "no DeepNorm spike event at any seed"
    holds = [any(e.recovered_at is not None for e in dn[s])
             and len(dn[s]) > max(len(events[r][s]) for r in ROLES if r != "deepnorm") for s in seeds]
    if all(holds):
        return "reproduced", "a recovered DeepNorm spike at every seed, and more events than any other configuration"
    return "inconclusive", f"the DeepNorm pattern holds at {sum(holds)} of {len(seeds)} seeds"


# ---------------------------------------------------------------------------------------------------
# Tables


def outcome_rows(runs: Sequence[RunMetrics]) -> list[tuple[str, list[str]]]:
    """Further numbers per configuration (mean [min, max] over seeds): where each run ended."""
    table = by_role(runs)
    rows = [
        ("final held-out loss (bits)", lambda r: final_eval(r, "eval/loss")),
        ("final held-out codebook-0 CE (bits)", lambda r: final_eval(r, "eval/acoustic_mlm_loss/cb0")),
        ("final held-out musical MLM loss", lambda r: final_eval(r, "eval/musical_mlm_loss")),
        ("training loss, mean of the last 10% (bits)", lambda r: _last_mean(r, "loss")),
        ("steps clipped (share)", lambda r: _last_mean(r, "grad_clipped", share=1.0)),
        ("skipped steps (non-finite)", lambda r: float(len(r.skipped_steps))),
        ("largest attention logit (any layer, any step)", _max_logit),
        ("probe: best-layer pitch mAP", probe_score),
    ]
    out = []
    for name, fn in rows:
        values = [[fn(run) for _, run in sorted(table[role].items())] for role in ROLES]
        if all(not any(math.isfinite(x) for x in v) for v in values):
            continue  # not measured (no eval, no probe, no diagnostics)
        out.append((name, [_spread(v) for v in values]))
    return out


def _last_mean(run: RunMetrics, metric: str, share: float = 0.1) -> float:
    series = run.metric(metric)
    if series is None:
        return math.nan
    values = series[1]
    return float(values[-max(1, int(len(values) * share)):].mean())


def _max_logit(run: RunMetrics) -> float:
    values = [v.max() for k, (_, v) in run.series.items() if k.startswith("diag/max_attn_logit/layer")]
    return float(max(values)) if values else math.nan


def markdown(results: Sequence[ClaimResult], outcomes: Sequence[tuple[str, list[str]]] = ()) -> str:
    """The claims table (and the outcome table) as markdown."""
    head = "| claim | statistic | " + " | ".join(ROLE_TITLES[r] for r in ROLES) + " | paired difference | verdict | why |"
    lines = [head, "|" + "---|" * (len(ROLES) + 5)]
    for r in results:
        cells = [_spread(r.values.get(role, [])) for role in ROLES]
        lines.append(f"| ({r.claim}) {r.text} | {r.statistic} | " + " | ".join(cells)
                     + f" | {r.paired} | **{r.verdict}** | {r.why} |")
    lines.append("")
    lines.append("Values: mean [min, max] over seeds. Further numbers:")
    lines.append("")
    for r in results:
        for s in r.secondary:
            lines.append(f"- ({r.claim}) {s}")
    if outcomes:
        lines += ["", "| where the runs ended | " + " | ".join(ROLE_TITLES[r] for r in ROLES) + " |",
                  "|" + "---|" * (len(ROLES) + 1)]
        for name, cells in outcomes:
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_claims(run_dirs: Sequence[str | Path | RunMetrics], out_dir: str | Path) -> tuple[Path, Path]:
    """Test the claims on ``run_dirs``; write ``claims.md`` and ``claims.json`` into ``out_dir``."""
    runs = [r.in_unit("bits") if isinstance(r, RunMetrics) else read_run(r, "bits") for r in run_dirs]
    results = evaluate_claims(runs)
    outcomes = outcome_rows(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "claims.md", out / "claims.json"
    md.write_text(markdown(results, outcomes))
    js.write_text(json.dumps({
        "runs": [str(r.path) for r in runs],
        "claims": [{"claim": r.claim, "text": r.text, "statistic": r.statistic,
                    "values": {k: [None if not math.isfinite(x) else x for x in v] for k, v in r.values.items()},
                    "paired": r.paired, "verdict": r.verdict, "why": r.why, "secondary": r.secondary}
                   for r in results],
        "outcomes": {name: dict(zip(ROLES, cells)) for name, cells in outcomes},
    }, indent=2) + "\n")
    return md, js


DOC_BEGIN = "<!-- claims table: generated by `python -m musiclm_stab.analysis.claims ... --doc`; do not edit -->"
DOC_END = "<!-- end of the generated claims table -->"


def fill_doc(doc: str | Path, table: str) -> Path:
    """Put ``table`` (claims.md's text) between DOC_BEGIN and DOC_END of ``doc`` (both must be there)."""
    doc = Path(doc)
    text = doc.read_text()
    if DOC_BEGIN not in text or DOC_END not in text:
        raise ValueError(f"{doc} has no generated-table markers ({DOC_BEGIN!r} ... {DOC_END!r})")
    head, rest = text.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    doc.write_text(f"{head}{DOC_BEGIN}\n{table.rstrip()}\n{DOC_END}{tail}")
    return doc


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.claims", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for claims.md and claims.json")
    p.add_argument("--doc", metavar="MD", help="also put the table into this file, between its markers")
    args = p.parse_args(argv)
    try:
        md, _ = write_claims(args.run_dirs, args.out)
        if args.doc:
            fill_doc(args.doc, md.read_text())
    except (FileNotFoundError, ValueError) as e:
        print(f"claims: error: {e}", file=sys.stderr)
        return 2
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
