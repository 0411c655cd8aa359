"""The study's four claims, tested on its run directories by a rule fixed before the runs were read.

    python -m musiclm_stab.analysis.claims RUN_DIR_OR_FOLDER ... --out DIR [--doc MD] [--unigram BITS]

Runs are sorted into roles and blocks (lr, seed) and measured by analysis/claim_stats.py; a block is
*complete* when each of the four configurations has exactly one run in it, and only complete blocks are
used (the others are listed; two runs of one role in a block are an error). Each claim is made of parts,
paired comparisons over blocks oriented so that > 0 is what the claim says (analysis/decide.py tests
them exactly, combines them and decides over the family with Holm at 0.05):

  (a) Pre-Norm with clip 10 converges faster early than with clip 1. Part: early loss(clip 1) - early
      loss(clip 10), Wilcoxon, over the blocks where clip 1 clipped at least CLIP_SHARE_MIN = 20% of the
      early steps. Precondition: at least MIN_BLOCKS = 6 such blocks (the fewest with which an exact
      two-sided Wilcoxon can reach p < 0.05); else the two clip values train alike: not testable.
  (b) Post-Norm with DeepNorm keeps the lowest gradient norm throughout. Six parts, Wilcoxon, all blocks,
      for each c of clip 10, clip 1, relax: ln median grad norm(c) - ln median grad norm(DeepNorm), and
      ln peak ratio(c) - ln peak ratio(DeepNorm) (DeepNorm below each other one, by level and by shape).
  (c) Post-Norm/DeepNorm shows a transient loss spike and recovers. Per run: has a recovered spike event
      of the training loss. Three parts, McNemar over all blocks, DeepNorm against each c of clip 10,
      clip 1, relax (positive: DeepNorm has one more often). Precondition: some run of the four
      configurations has a recovered spike; else not testable (no transient spike at this scale).
  (d) Pre-Norm with Attn. Relax converges more slowly, but steadily. Parts, Wilcoxon: slower, early
      loss(relax) - early loss(clip 1) over all blocks; steady, instability(clip 1) - instability(relax)
      over the blocks at the two highest learning rates. Precondition of the steady part: clip 1 shows
      some instability there; without it (d) can be refuted by the slower part but not reproduced
      (it stays in the family as refute-only; not refuted: not testable at this scale).

Positive control (not a claim, not in the family): at the complete blocks where the QK-Norm run exists,
McNemar of diverged(clip 1) vs diverged(QK-Norm) and Wilcoxon of max attention logit(clip 1) - that of
QK-Norm, both oriented so that > 0 is what QK-Norm should prevent. The learning-rate grid, LR sensitivity
and "learns" are analysis/lr_grid.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.claim_stats import (
    CONTROL,
    ROLE_TITLES,
    ROLES,
    RunStats,
    probe_score,
    role_of,
    run_stats,
)
from musiclm_stab.analysis.decide import ALPHA, Claim, Part, decide
from musiclm_stab.analysis.lr_grid import grid_markdown, summarise_grid
from musiclm_stab.analysis.runs import RunMetrics, read_run
from musiclm_stab.analysis.study_record import run_codes_sha256
from musiclm_stab.analysis.sweep_report import lr_text

__all__ = ["CLIP_SHARE_MIN", "DOC_BEGIN", "DOC_END", "MIN_BLOCKS", "ROLES", "ROLE_TITLES", "Blocks",
           "analyse", "claims_of", "claims_table", "cli_main", "codes_lines", "codes_of_blocks", "control_of", "fill_doc",
           "find_run_dirs", "markdown", "probe_score", "read_runs", "role_of", "run_codes", "runs_by_block", "study_blocks", "to_json",
           "used_runs", "write_claims"]

CLIP_SHARE_MIN = 0.2
MIN_BLOCKS = 6
SHORT = {"clip10": "clip 10", "clip1": "clip 1", "deepnorm": "DeepNorm", "relax": "relax",
         "qknorm": "QK-Norm"}
Block = tuple[float, int]  # (lr, seed)


@dataclass
class Blocks:
    complete: dict[Block, dict[str, RunStats]]  # ascending (lr, seed); role -> run, the four ROLES
    control: dict[Block, RunStats] = field(default_factory=dict)  # QK-Norm runs at complete blocks
    incomplete: dict[Block, list[str]] = field(default_factory=dict)  # block -> the roles it has
    ignored: list[str] = field(default_factory=list)  # runs with no role

    def values(self, fn, role: str, blocks: Sequence[Block] | None = None) -> np.ndarray:
        """fn(run of ``role``) per block (``blocks``, or every complete block), as floats."""
        keys = self.complete if blocks is None else blocks
        return np.array([fn(self.complete[b][role]) for b in keys], dtype=np.float64)


class NoCompleteBlock(ValueError):
    """No (lr, seed) block holds a run of every configuration: nothing for the claims to compare."""


def runs_by_block(runs: Sequence) -> dict[Block, dict]:
    """{(lr, seed): {role: run}} of the runs that have a role (anything with ``role``, ``lr``, ``seed`` and
    ``path``), blocks ascending. ValueError naming both runs when a block has two runs of one role."""
    seen: dict[Block, dict] = {}
    for r in runs:
        if r.role is None:
            continue
        block = seen.setdefault((r.lr, r.seed), {})
        if r.role in block:
            raise ValueError(f"runs {block[r.role].path} and {r.path} are both {r.role} at lr {r.lr:g}, "
                             f"train.seed {r.seed}: one run per configuration and block")
        block[r.role] = r
    return dict(sorted(seen.items()))


def study_blocks(stats: Sequence[RunStats]) -> Blocks:
    """Sort runs into blocks (module docstring). Raises ValueError for two runs of one role in one block,
    and NoCompleteBlock (a ValueError) when no block is complete (naming what each block lacks)."""
    ignored = [s.path for s in stats if s.role is None]
    if ignored:
        warnings.warn(f"runs with none of the study's roles, ignored: {', '.join(ignored)}", stacklevel=2)
    seen = runs_by_block(stats)
    complete = {b: {r: runs[r] for r in ROLES} for b, runs in sorted(seen.items())
                if all(r in runs for r in ROLES)}
    incomplete = {b: [r for r in (*ROLES, CONTROL) if r in runs] for b, runs in sorted(seen.items())
                  if b not in complete}
    if not complete:
        lacks = "; ".join(f"lr {b[0]:g} seed {b[1]}: no {', '.join(r for r in ROLES if r not in have)}"
                          for b, have in incomplete.items()) or "no run has a role"
        raise NoCompleteBlock(f"no complete block (one run of each of {', '.join(ROLES)} at one lr and seed): "
                         f"{lacks}")
    control = {b: seen[b][CONTROL] for b in complete if CONTROL in seen[b]}
    return Blocks(complete, control, incomplete, ignored)


def _ln(values: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(values)  # 0 -> -inf, negative or NaN -> NaN (dropped by the test)


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return a - b  # inf - inf: NaN, an undefined difference


def claims_of(blocks: Blocks) -> list[Claim]:
    """The four claims with their parts and preconditions, decided (verdicts filled in)."""
    def early(role: str, at: Sequence[Block] | None = None) -> np.ndarray:
        return blocks.values(lambda s: s.early_loss, role, at)

    keys = list(blocks.complete)
    n = len(keys)

    # (a)
    share = blocks.values(lambda s: s.clip_share_early, "clip1")
    used = [b for b, x in zip(keys, share) if x >= CLIP_SHARE_MIN]
    a = Claim("a", "Pre-Norm with clip 10 converges faster early than with clip 1")
    if used:
        a.parts = [Part.paired("early loss (bits): clip 1 - clip 10",
                               _diff(early("clip1", used), early("clip10", used)))]
    clipped = "clip 1 logged no clip share"
    if np.isfinite(share).any():
        clipped = f"clip 1 clips {np.nanmedian(share) * 100:.0f}% of early steps (median over {n} blocks)"
    if len(used) < MIN_BLOCKS:
        a.testable = False
        a.reason = (f"{clipped}; {len(used)} blocks at >= {CLIP_SHARE_MIN:.0%}, {MIN_BLOCKS} needed: "
                    "the two clip values train alike")
    else:
        a.reason = f"{clipped}; {len(used)} of {n} blocks at >= {CLIP_SHARE_MIN:.0%} used"

    # (b)
    b = Claim("b", "Post-Norm with DeepNorm keeps the lowest gradient norm throughout")
    for what, fn in (("median grad norm", lambda s: s.median_grad_norm),
                     ("peak/median grad norm", lambda s: s.peak_ratio)):
        dn = _ln(blocks.values(fn, "deepnorm"))
        for c in ("clip10", "clip1", "relax"):
            d = _diff(_ln(blocks.values(fn, c)), dn)
            b.parts.append(Part.paired(f"ln {what}: {SHORT[c]} - DeepNorm", d))

    # (c)
    spiked = {r: [blocks.complete[k][r].has_recovered_spike for k in keys] for r in ROLES}
    c = Claim("c", "Post-Norm/DeepNorm shows a transient loss spike and recovers",
              [Part.binary(f"recovered loss spike: DeepNorm vs {SHORT[r]}", spiked["deepnorm"], spiked[r])
               for r in ("clip10", "clip1", "relax")])
    counts = ", ".join(f"{SHORT[r]} {sum(spiked[r])}" for r in ROLES)
    if not any(any(v) for v in spiked.values()):
        c.testable = False
        c.reason = f"no transient spike at this scale (runs with a recovered spike: {counts})"
    else:
        c.reason = f"runs with a recovered spike, of {n}: {counts}"

    # (d)
    top = sorted({lr for lr, _ in keys})[-2:]
    at_top = [k for k in keys if k[0] in top]
    unsteady = blocks.values(lambda s: s.instability.total, "clip1", at_top)
    relax = blocks.values(lambda s: s.instability.total, "relax", at_top)
    d = Claim("d", "Pre-Norm with Attn. Relax converges more slowly, but steadily",
              [Part.paired("slower: early loss (bits) relax - clip 1",
                           _diff(early("relax"), early("clip1")))])
    rates = ", ".join(lr_text(lr) for lr in top)
    if unsteady.sum() > 0:
        d.parts.append(Part.paired(f"steady: instability clip 1 - relax (lr {rates})",
                                   _diff(unsteady, relax)))
        d.reason = f"clip 1's instability at lr {rates}: {int(unsteady.sum())} in {len(at_top)} blocks"
    else:
        d.refute_only = True
        d.reason = f"clip 1 shows no instability at lr {rates}: the steady part is not testable"
    return decide([a, b, c, d])


def control_of(blocks: Blocks) -> dict | None:
    """The positive control's two comparisons at the blocks with a QK-Norm run (None: no such block)."""
    keys = list(blocks.control)
    if not keys:
        return None
    clip1 = [blocks.complete[k]["clip1"] for k in keys]
    qk = [blocks.control[k] for k in keys]
    logits = [np.array([s.max_attn_logit for s in runs]) for runs in (clip1, qk)]
    parts = [Part.binary("diverged: clip 1 vs QK-Norm", [s.diverged for s in clip1],
                         [s.diverged for s in qk]),
             Part.paired("max attention logit: clip 1 - QK-Norm", _diff(*logits))]
    return {"blocks": [list(k) for k in keys], "parts": parts}


def used_runs(blocks: Blocks) -> list[RunStats]:
    """The runs the grid, "learns" and the probes are of: those of the complete blocks, and the control."""
    return [s for runs in blocks.complete.values() for s in runs.values()] + list(blocks.control.values())


def run_codes(paths: Sequence[str | Path]) -> dict[str, str]:
    """The codes sha256 each run directory trained on, by its study folder's data.json (a run whose folder
    has none is left out), keyed by the path as given."""
    return {str(p): sha for p in paths if (sha := run_codes_sha256(p)) is not None}


def codes_of_blocks(blocks: Blocks, codes: dict[str, str]) -> dict[Block, list[str]]:
    """The codes (sha256, sorted) the runs of each complete block and its control trained on, where known."""
    out = {}
    for b, runs in blocks.complete.items():
        used = [*runs.values(), *([blocks.control[b]] if b in blocks.control else [])]
        out[b] = sorted({codes[s.path] for s in used if s.path in codes})
    return out


def analyse(stats: Sequence[RunStats], unigram_eval_cb0: float | None = None,
            codes: dict[str, str] | None = None) -> dict:
    """Everything claims.md shows, as one dict: blocks, the decided claims, the control, the grid, and, where
    ``codes`` (run path -> codes sha256, ``run_codes``) knows, the codes each block trained on."""
    blocks = study_blocks(stats)
    return {"blocks": blocks, "claims": claims_of(blocks), "control": control_of(blocks),
            "codes": codes_of_blocks(blocks, codes or {}), **summarise_grid(used_runs(blocks), unigram_eval_cb0)}


# ---------------------------------------------------------------------------------------------------
# Markdown and JSON


def _p(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g}"


def part_text(q: Part) -> str:
    adjusted = "" if math.isnan(q.p_adjusted) else f", adj. {_p(q.p_adjusted)}"
    if q.test == "mcnemar":  # named "what: A vs B"; n10 counts blocks where only A has it
        first, vs, second = q.name.rpartition(": ")[2].partition(" vs ")
        counts = f"only {first} {q.n10}, only {second} {q.n01}" if vs else f"n10 {q.n10}, n01 {q.n01}"
        return f"{q.name}: {counts} of {q.blocks} blocks, p {_p(q.p)}{adjusted}"
    return f"{q.name}: n {q.n} of {q.blocks}, median {q.estimate:+.3g}, p {_p(q.p)}{adjusted}"


def claims_table(claims: Sequence[Claim]) -> list[str]:
    """The claims table's lines: one row per decided claim, its parts, p, adjusted p, verdict and why."""
    lines = ["| claim | parts: n, median difference, p, adjusted p | claim p (direction) | adjusted p "
             "| verdict | why |", "|---|---|---|---|---|---|"]
    for c in claims:
        parts = "<br>".join(part_text(q) for q in c.parts) or "none"
        tested = c.testable and not math.isnan(c.p_adjusted)
        claim_p = f"{_p(c.p)} ({c.direction or 'none'})" if tested else "-"
        why = c.why if c.verdict == "not testable at this scale" or not c.reason else f"{c.why}; {c.reason}"
        lines.append(f"| ({c.key}) {c.text} | {parts} | {claim_p} | {_p(c.p_adjusted) if tested else '-'} "
                     f"| **{c.verdict}** | {why} |")
    return lines


def markdown(result: dict) -> str:
    """claims.md: the claims table (one row per claim), the blocks, the control and the grid tables."""
    lines = claims_table(result["claims"])
    blocks: Blocks = result["blocks"]
    lines += ["", f"Family: the testable claims, Holm-adjusted at {ALPHA}. Differences are paired within a "
              "block (lr, seed); a part's median difference > 0 (McNemar: the first more often) is what the "
              "claim says.", "", f"Complete blocks ({len(blocks.complete)}): " + "; ".join(
                  f"lr {lr_text(lr)}, seeds {', '.join(str(s) for x, s in blocks.complete if x == lr)}"
                  for lr in sorted({x for x, _ in blocks.complete})) + "."]
    if blocks.incomplete:
        lines.append("Incomplete blocks, not used: " + "; ".join(
            f"lr {lr_text(lr)} seed {s} ({', '.join(have) or 'nothing'})"
            for (lr, s), have in blocks.incomplete.items()) + ".")
    if blocks.ignored:
        lines.append("Runs with none of the study's roles, ignored: " + ", ".join(blocks.ignored) + ".")
    lines += codes_lines(result.get("codes") or {})
    control = result["control"]
    lines += ["", "### Positive control (QK-Norm)", ""]
    if control is None:
        lines.append("No QK-Norm run at a complete block: not run.")
    else:
        lines.append(f"At {len(control['blocks'])} blocks (> 0: clip 1 diverges more / has larger attention "
                     "logits, what QK-Norm should prevent; p not adjusted, not part of the family):")
        lines += [f"- {part_text(q)}" for q in control["parts"]]
    lines += ["", *grid_markdown(result)]
    return "\n".join(lines) + "\n"


def codes_lines(codes: dict[Block, list[str]]) -> list[str]:
    """A line naming the blocks of each set of codes, when the runs trained on more than one (a declared
    deviation, docs/STUDY.md); nothing otherwise."""
    if len({sha for shas in codes.values() for sha in shas}) < 2:
        return []
    groups: dict[str, list[Block]] = {}
    for b, shas in codes.items():
        groups.setdefault(" and ".join(f"`{sha[:8]}…`" for sha in shas) or "unknown codes", []).append(b)
    return ["Codes the runs trained on (data.json; more than one set, a declared deviation): " + "; ".join(
        f"{what}: " + ", ".join(f"lr {lr_text(lr)} seed {s}" for lr, s in bs) for what, bs in groups.items()) + "."]


def _plain(x):
    """JSON-safe: NaN -> null, +-inf -> "inf"/"-inf", dataclasses and tuples opened up."""
    if isinstance(x, float) or isinstance(x, np.floating):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf") if math.isinf(x) else float(x)
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    if isinstance(x, dict):
        return {(lr_text(k) if isinstance(k, float) else str(k)): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(vars(x))
    return x


def to_json(result: dict) -> dict:
    blocks: Blocks = result["blocks"]
    out = {k: _plain(v) for k, v in result.items() if k != "blocks"}
    out["alpha"] = ALPHA
    out["codes"] = [{"lr": lr, "seed": s, "codes_sha256": shas} for (lr, s), shas in result["codes"].items()]
    out["blocks"] = {"complete": [list(b) for b in blocks.complete],
                     "incomplete": [{"lr": lr, "seed": s, "roles": have}
                                    for (lr, s), have in blocks.incomplete.items()],
                     "ignored": blocks.ignored}
    used = [st for runs in blocks.complete.values() for st in runs.values()] + list(blocks.control.values())
    out["runs"] = [{**_plain(st), "instability_total": st.instability.total} for st in used]
    return out


# ---------------------------------------------------------------------------------------------------
# Files and the command line


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Each path is a run directory (has config.yaml) or a folder searched for run directories (config.yaml
    and metrics.jsonl; not below a run directory). FileNotFoundError names a path with none."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "config.yaml").is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise FileNotFoundError(f"{p} does not exist")
        below = []
        for root, dirs, files in os.walk(p):
            if "config.yaml" in files and "metrics.jsonl" in files:
                below.append(Path(root))
                dirs.clear()
            dirs.sort()
        if not below:
            raise FileNotFoundError(f"{p} is neither a run directory nor a folder with one "
                                    "(config.yaml + metrics.jsonl)")
        found += sorted(below)
    return found


def read_runs(run_dirs: Sequence[str | Path | RunMetrics]) -> list[RunMetrics]:
    """``run_dirs`` (run directories, folders of them, or RunMetrics) as RunMetrics, losses in bits: the given
    RunMetrics as they are, then every run directory found under the paths (``find_run_dirs``)."""
    runs = [r for r in run_dirs if isinstance(r, RunMetrics)]
    return runs + [read_run(d, "bits") for d in find_run_dirs([r for r in run_dirs if not isinstance(r, RunMetrics)])]


def write_claims(run_dirs: Sequence[str | Path | RunMetrics], out_dir: str | Path,
                 unigram_eval_cb0: float | None = None) -> tuple[Path, Path]:
    """Test the claims on ``run_dirs`` (run directories, folders of them, or RunMetrics); write
    ``claims.md`` and ``claims.json`` (every number of the markdown; NaN as null, infinities as
    "inf"/"-inf") into ``out_dir``. ``unigram_eval_cb0``: the unigram level (bits) of the "learns" check."""
    runs = read_runs(run_dirs)
    result = analyse([run_stats(r) for r in runs], unigram_eval_cb0, run_codes([r.path for r in runs]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "claims.md", out / "claims.json"
    md.write_text(markdown(result))
    js.write_text(json.dumps({"run_dirs": [str(r.path) for r in runs], **to_json(result)}, indent=2) + "\n")
    return md, js


DOC_BEGIN = "<!-- claims table: generated by `python -m musiclm_stab.analysis.claims ... --doc`; do not edit -->"
DOC_END = "<!-- end of the generated claims table -->"


def fill_doc(doc: str | Path, table: str, begin: str = DOC_BEGIN, end: str = DOC_END) -> Path:
    """Put ``table`` (claims.md's text) between the markers ``begin`` and ``end`` of ``doc`` (both must be
    there; by default this module's, DOC_BEGIN and DOC_END)."""
    doc = Path(doc)
    text = doc.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{doc} has no generated-table markers ({begin!r} ... {end!r})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{table.rstrip()}\n{end}{tail}")
    return doc


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m musiclm_stab.analysis.claims",
                                description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md (offline: musiclm-stab docs STUDY)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories, or folders to search for them")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for claims.md and claims.json")
    p.add_argument("--doc", metavar="MD", help="also put the table into this file, between its markers")
    p.add_argument("--unigram", type=float, metavar="BITS",
                   help="held-out codebook-0 CE of the unigram model (bits), for the 'learns' check")
    args = p.parse_args(argv)
    try:
        md, _ = write_claims(args.run_dirs, args.out, args.unigram)
        if args.doc:
            fill_doc(args.doc, md.read_text())
    except (FileNotFoundError, ValueError) as e:
        print(f"claims: error: {e}", file=sys.stderr)
        return 2
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
