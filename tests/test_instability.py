"""The instability study's analysis (analysis/instability.py) on simulated studies and on run directories,
and its power simulation (analysis/power.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from musiclm_stab.analysis import power
from musiclm_stab.analysis.decide import NOT_TESTABLE, REFUTED, REPRODUCED
from musiclm_stab.analysis.instability import (
    DOC_BEGIN,
    DOC_END,
    POST,
    ROLES6,
    claims_of,
    cli_main,
    controls_of,
    endpoints,
    role6,
)
from musiclm_stab.analysis.runs import read_run
from musiclm_stab.config import load_config, save_config

REPO = Path(__file__).resolve().parents[1]


def simulated(effect: str, seeds: int = 6, lrs: int = 5, seed: int = 0):
    return power.simulate(seeds, lrs, effect, np.random.default_rng(seed))


def test_positive_control_detects_post_norm_failing_where_pre_norm_trains():
    """Plain Post-Norm failing at the highest rate where the others learn, in all 6 seeds: the control
    detects it (6 discordant blocks, p 0.031); in 3 of 6 seeds (p 0.25), or with nothing planted, it does not."""
    found = controls_of(simulated("control"))
    assert found["detects"] and found["positive"].n10 == 6 and found["positive"].n01 == 0
    assert found["positive"].p == pytest.approx(2 / 64)
    assert not controls_of(simulated("control 3 of 6"))["detects"]
    assert not controls_of(simulated(power.NULL))["detects"]


def test_claims_reproduced_when_planted_and_not_testable_when_their_blocks_fail():
    """Each claim is reproduced when its effect is planted at 6 seeds; (a) and (b) use only blocks where no
    run of theirs failed (a diverged run's early loss or gradient is no evidence), so with every block
    failed they are not testable; a reversed (a) is refuted."""
    for effect, key in (("a: 0.3 bits", "a"), ("b: 0.3 ln", "b"), ("d: 0.3 bits + 1 cascade", "d")):
        verdicts = {c.key: c.verdict for c in claims_of(simulated(effect))}
        assert verdicts[key] == REPRODUCED, (effect, verdicts)
    blocks = simulated(power.NULL)
    for runs in blocks.complete.values():
        runs["clip10"].early_loss = runs["clip1"].early_loss + 0.3  # clip 10 slower: against (a)
    assert {c.key: c.verdict for c in claims_of(blocks)}["a"] == REFUTED
    for runs in blocks.complete.values():
        for run in runs.values():
            run.kind = "dead input"
    verdicts = {c.key: c.verdict for c in claims_of(blocks)}
    assert verdicts["a"] == NOT_TESTABLE and verdicts["b"] == NOT_TESTABLE


def test_power_cells_are_seeded_alone_and_the_null_decides_rarely():
    """A power cell recomputed alone (its own generator) gives the same shares; with nothing planted the
    control never detects and a claim is rarely reproduced (1 of 20 simulated studies here, for (a))."""
    a = power.cell(4, 5, power.NULL, 20, index=3)
    assert a == power.cell(4, 5, power.NULL, 20, index=3)
    assert a["shares"]["control"] == 0 and all(a["shares"][k] <= 0.05 for k in "abcd")
    planted = power.cell(6, 5, "control", 5, index=1)
    assert planted["power"] == 1.0


def write_run(root: Path, role: str, lr: float, seed: int, rows: list[dict]) -> Path:
    overrides = {"clip10": [], "clip1": ["--optim.clip_grad=1"], "deepnorm": ["--optim.clip_grad=1",
                 "--model.norm_scheme=deepnorm"], "relax": ["--optim.clip_grad=1", "--model.attention=relax"],
                 "qknorm": ["--optim.clip_grad=1", "--model.qk_norm=true"],
                 POST: ["--optim.clip_grad=1", "--model.norm_scheme=post"]}[role]
    cfg = load_config("recipes/tiny.yaml", [*overrides, f"--optim.lr={lr}", f"--train.seed={seed}",
                                            "--train.max_steps=40", "--train.mixed_precision=fp16"])
    run_dir = root / f"{role}_lr{lr:g}_s{seed}"
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def rows_of(rng: np.random.Generator, *, dies: bool = False, diverges_at: int | None = None) -> list[dict]:
    out = []
    for t in range(1, 41):
        if diverges_at is not None and t >= diverges_at:
            out.append({"step": t, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 20})
            break
        pen = 0.1 if not dies or t < 20 else 1e-9
        out.append({"step": t, "loss": 80 - 10 * (1 - math.exp(-t / 10)) + rng.normal(0, 0.05),
                    "acoustic_mlm_loss/cb0": 10.3 - 0.02 * t, "grad_norm": 2.0 + rng.normal(0, 0.1),
                    "grad_clipped": 1.0, "features_pen": pen, "loss_scale": 64.0, "overflow_step": 0,
                    "diag/max_attn_logit/layer0": 50.0, "diag/headroom/residual/layer0": 0.01})
    if diverges_at is None:
        out[-1]["eval/acoustic_mlm_loss/cb0"] = 9.0
    return out


def test_endpoints_of_run_directories_and_the_claims_files(tmp_path):
    """Run directories of the six configurations at two rates and three seeds: plain Post-Norm dead at the
    higher rate, clip 1 diverged in one block. Endpoints read the role (Post-Norm's own), failure kind and
    step, the cap (the first logged cb0) and the headroom; the CLI writes claims.md with the controls first
    and fills the doc's markers."""
    rng = np.random.default_rng(0)
    root = tmp_path / "runs"
    for lr in (1e-3, 3e-3):
        for seed in range(3):
            for role in ROLES6:
                rows = rows_of(rng, dies=role == POST and lr == 3e-3,
                               diverges_at=25 if (role, lr, seed) == ("clip1", 3e-3, 0) else None)
                write_run(root, role, lr, seed, rows)
    dead = endpoints(read_run(root / "post_lr0.003_s1"), unigram_eval_cb0=9.3)
    assert (dead.role, dead.kind, dead.kind_step) == (POST, "dead input", 20)
    assert dead.cap == pytest.approx(10.28) and dead.headroom["attn_logit"] == pytest.approx(50 / 65504)
    assert dead.headroom["residual"] == 0.01
    gone = endpoints(read_run(root / "clip1_lr0.003_s0"), unigram_eval_cb0=9.3)
    assert gone.kind == "diverged" and gone.kind_step == 25 and gone.instability == math.inf
    assert role6(yaml.safe_load((root / "post_lr0.001_s0" / "config.yaml").read_text())) == POST
    doc = tmp_path / "STUDY.md"
    doc.write_text(f"before\n{DOC_BEGIN}\nold\n{DOC_END}\nafter\n")
    assert cli_main([str(root), "--out", str(tmp_path / "out"), "--unigram", "9.3", "--doc", str(doc)]) == 0
    md = (tmp_path / "out" / "claims.md").read_text()
    assert md.startswith("### The controls")
    # block (3e-3, 0): both failed, concordant
    assert "failed: Post-Norm vs clip 1: only Post-Norm 2, only clip 1 0 of 6 blocks" in md
    assert md in doc.read_text() and doc.read_text().endswith(f"{DOC_END}\nafter\n")
    saved = json.loads((tmp_path / "out" / "claims.json").read_text())
    kinds = {(r["role"], r["lr"], r["seed"]): r["kind"] for r in saved["runs"]}
    assert kinds[(POST, 0.003, 2)] == "dead input" and kinds[("clip1", 0.003, 0)] == "diverged"
    assert cli_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), "--unigram", "9.3"]) == 2


def test_describe_writes_failures_of_every_run_and_decides_nothing(tmp_path):
    """--describe (the mert-frontend arm: one seed, outside the claims) writes failures.md/json with every
    run of the six configurations, complete blocks or not, its dead and diverged runs by kind and step, and
    no controls or claims; --describe with --doc is refused."""
    rng = np.random.default_rng(1)
    root = tmp_path / "mert"
    for lr in (1e-3, 3e-3):
        for role in ROLES6:
            if (role, lr) == ("relax", 3e-3):
                continue  # an incomplete block is described too
            write_run(root, role, lr, 0, rows_of(rng, dies=lr == 3e-3 and role != "deepnorm",
                                                 diverges_at=12 if (role, lr) == ("deepnorm", 3e-3) else None))
    assert cli_main([str(root), "--out", str(tmp_path / "out"), "--unigram", "9.3", "--describe"]) == 0
    md = (tmp_path / "out" / "failures.md").read_text()
    assert "nothing here is decided" in md and "### Failures by configuration and learning rate" in md
    assert "controls" not in md and "Holm" not in md and not (tmp_path / "out" / "claims.md").exists()
    assert "| Post-Norm, clip 1 | 3e-3 | 0 of 1 | 0 | 1 (20) |" in md
    assert "| Post-Norm DeepNorm, clip 1 | 3e-3 | 0 of 1 | 1 (12) | 0 |" in md
    saved = json.loads((tmp_path / "out" / "failures.json").read_text())
    kinds = {(r["role"], r["lr"]): r["kind"] for r in saved["runs"]}
    assert len(kinds) == 11 and ("relax", 0.003) not in kinds
    assert kinds[(POST, 0.003)] == "dead input" and kinds[("clip10", 0.001)] == "none"
    assert saved["configurations"]["relax"]["largest_lr_that_learns"] == 0.001
    assert saved["configurations"]["deepnorm"]["largest_lr_that_learns"] == 0.001
    with pytest.raises(SystemExit) as refused:
        cli_main([str(root), "--out", str(tmp_path / "x"), "--describe", "--doc", str(tmp_path / "d.md")])
    assert refused.value.code == 2


def test_committed_power_table_recomputes():
    """docs/instability_cpu/power.json (the design's power, committed before its runs) is what the simulation
    gives again: the 6-seed cells recomputed alone from their own generators, and the table's markdown."""
    saved = json.loads((REPO / "docs" / "instability_cpu" / "power.json").read_text())
    for row in (r for r in saved if r["seeds"] == 6):
        assert power.cell(row["seeds"], row["lrs"], row["effect"], row["studies"], row["index"]) == row, row["effect"]
    assert power.markdown(saved) == (REPO / "docs" / "instability_cpu" / "power.md").read_text()
