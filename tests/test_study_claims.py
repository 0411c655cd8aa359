"""The claims table (analysis/claims.py): configurations recognised, statistics as defined, verdicts by the rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from musiclm_stab.analysis.claim_stats import ROLES, early_loss, median_grad_norm, role_of, spike_events
from musiclm_stab.analysis.claims import DOC_BEGIN, DOC_END, evaluate_claims, fill_doc, markdown, write_claims
from musiclm_stab.analysis.runs import read_run
from musiclm_stab.config import Config, load_config, save_config
from musiclm_stab.experiments.study_plan import CPU_OVERLAYS, STUDY_RECIPES, recipe_path

# (role, overrides) of the four configurations, as the study recipes set them
CONFIGS = {
    "clip10": {"optim.clip_grad": 10.0, "train.run": 1},
    "clip1": {"optim.clip_grad": 1.0, "train.run": 2},
    "deepnorm": {"model.norm_scheme": "deepnorm", "optim.clip_grad": 1.0},
    "relax": {"model.attention": "relax", "optim.clip_grad": 1.0},
}
STEPS, WARMUP = 100, 10


def config(role: str, seed: int) -> Config:
    cfg = Config()
    for dotted, value in {**CONFIGS[role], "train.seed": seed, "train.max_steps": STEPS,
                          "optim.warmup_steps": WARMUP}.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg.validate()


def write(root: Path, role: str, seed: int, loss: np.ndarray, grad: np.ndarray) -> Path:
    """A run directory with one row per step 1..STEPS: ``loss`` and ``grad`` per step, the other losses
    derived from the loss so that every figure metric exists."""
    run_dir = root / f"{role}_s{seed}"
    run_dir.mkdir(parents=True)
    save_config(config(role, seed), run_dir / "config.yaml")
    lines = []
    for i, step in enumerate(range(1, STEPS + 1)):
        row = {"step": step, "loss": float(loss[i]), "grad_norm": float(grad[i]), "grad_clipped": 0,
               "musical_mlm_loss": float(loss[i]) / 100, "acoustic_mlm_loss/cb0": float(loss[i]) / 8}
        lines.append(__import__("json").dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def base_loss(seed: int) -> np.ndarray:
    """A decaying loss with seeded noise of +-1% (no step near the 1.5x spike threshold)."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, STEPS + 1)
    return (60 + 25 * np.exp(-t / 15)) * (1 + 0.01 * rng.uniform(-1, 1, STEPS))


def study(root: Path, *, early_gap: dict[int, float], dn_spike: bool = True, dn_grad: float = 0.5,
          relax_gap: dict[int, float] | None = None) -> list[Path]:
    """3 seeds x 4 configurations. clip 1's early loss is clip 10's + early_gap[seed] (over steps 1..2W);
    DeepNorm's gradient norm is ``dn_grad`` (the others 1.0, 1.2, 1.4) and it spikes (2x at step 50,
    back at step 55) when ``dn_spike``; relax is clip 1 + relax_gap[seed] early."""
    dirs = []
    for seed in range(3):
        loss = base_loss(seed)
        early = np.arange(1, STEPS + 1) <= 2 * WARMUP
        for role in ROLES:
            curve = loss.copy()
            if role in ("clip1", "relax"):
                curve[early] += early_gap[seed]
            if role == "relax" and relax_gap is not None:
                curve[early] += relax_gap[seed]
            grad = np.full(STEPS, {"clip10": 1.0, "clip1": 1.2, "deepnorm": dn_grad, "relax": 1.4}[role])
            if role == "deepnorm" and dn_spike:
                curve[49:54] *= 2.0  # steps 50-54
            dirs.append(write(root, role, seed, curve, grad))
    return dirs


def by_claim(results) -> dict[str, object]:
    return {r.claim: r for r in results}


def test_role_of_the_study_recipes_at_cpu_scale():
    """Each study recipe, with the CPU overlays, is recognised as its configuration."""
    roles = [role_of(load_config([recipe_path(stem), *CPU_OVERLAYS]).to_dict()) for stem in STUDY_RECIPES]
    assert roles == list(ROLES)
    other = load_config([recipe_path(STUDY_RECIPES[0]), *CPU_OVERLAYS], ["--model.qk_norm=true"])
    assert role_of(other.to_dict()) is None


def test_statistics_as_defined(tmp_path):
    """early = mean loss over steps 1..2W; gnorm = median after W; a 2x spike is one recovered event."""
    loss = base_loss(0)
    grad = np.concatenate([np.full(WARMUP, 9.0), np.linspace(1.0, 3.0, STEPS - WARMUP)])
    spiky = loss.copy()
    spiky[49:54] *= 2.0
    run = read_run(write(tmp_path, "deepnorm", 0, spiky, grad))
    assert early_loss(run) == pytest.approx(spiky[: 2 * WARMUP].mean())  # Config() logs bits: read as is
    assert median_grad_norm(run) == pytest.approx(2.0)  # linspace(1, 3) over the 90 steps after W
    assert median_grad_norm(run, after_warmup=False) == pytest.approx(9.0)
    (event,) = spike_events(run)
    assert event.step == 50 and event.recovered_at == 55 and event.ratio == pytest.approx(2.0, rel=0.05)
    # 1.4x stays under the 1.5x threshold: no event (margin 0.1 x the level, far above the 1% noise).
    mild = loss.copy()
    mild[49:54] *= 1.4
    assert spike_events(read_run(write(tmp_path / "mild", "deepnorm", 0, mild, grad))) == []


def test_claims_reproduced(tmp_path):
    """Clip 10 lower early at every seed, DeepNorm lowest gradient norm and spiking: (a), (b), (c) reproduced."""
    dirs = study(tmp_path, early_gap={0: 2.0, 1: 2.5, 2: 3.0})
    results = by_claim(evaluate_claims([read_run(d) for d in dirs]))
    assert results["a"].verdict == "reproduced"
    assert results["b"].verdict == "reproduced"
    assert results["c"].verdict == "reproduced"
    # relax is clip 1 itself here (no gap): inconclusive, never reproduced.
    assert results["d"].verdict == "inconclusive"


def test_claims_refuted_and_inconclusive(tmp_path):
    """The opposite at every seed is refuted; a sign change over seeds is inconclusive; no spike refutes (c)."""
    dirs = study(tmp_path / "opposite", early_gap={0: -2.0, 1: -2.5, 2: -3.0}, dn_spike=False, dn_grad=5.0,
                 relax_gap={0: -1.0, 1: -1.2, 2: -1.4})
    results = by_claim(evaluate_claims([read_run(d) for d in dirs]))
    assert [results[c].verdict for c in "abcd"] == ["refuted", "refuted", "refuted", "refuted"]
    mixed = study(tmp_path / "mixed", early_gap={0: 2.0, 1: -2.0, 2: 1.0}, relax_gap={0: 1.0, 1: 1.1, 2: 1.2})
    results = by_claim(evaluate_claims([read_run(d) for d in mixed]))
    assert results["a"].verdict == "inconclusive"
    assert results["d"].verdict == "reproduced"  # slower at every seed, significant, and no spike


def test_write_claims_table_and_missing_configuration(tmp_path):
    """write_claims writes the markdown table (one row per claim, per-configuration spread); a missing
    configuration is a clear error."""
    dirs = study(tmp_path / "runs", early_gap={0: 2.0, 1: 2.5, 2: 3.0})
    md, js = write_claims(dirs, tmp_path / "out")
    text = md.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| (")]
    assert [row[:5] for row in rows] == ["| (a)", "| (b)", "| (c)", "| (d)"]
    assert "**reproduced**" in rows[0] and "mean [min, max] over seeds" in text
    assert '"verdict": "reproduced"' in js.read_text()
    assert markdown(evaluate_claims([read_run(d) for d in dirs])) in text
    with pytest.raises(ValueError, match="deepnorm"):
        write_claims([d for d in dirs if "deepnorm" not in d.name], tmp_path / "out2")
    # The doc's generated block is replaced, the text around it kept; a doc without markers is refused.
    doc = tmp_path / "STUDY.md"
    doc.write_text(f"before\n{DOC_BEGIN}\nold table\n{DOC_END}\nafter\n")
    fill_doc(doc, text)
    assert doc.read_text() == f"before\n{DOC_BEGIN}\n{text.rstrip()}\n{DOC_END}\nafter\n"
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        fill_doc(tmp_path / "plain.md", text)
