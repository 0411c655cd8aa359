"""The learning study's calibration rule (analysis/horizon.py) on calibration run directories: H, L and
DELTA_EARLY as docs/STUDY.md fixes them, the fallback when no rate reaches the margin, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from archives import unpack

from musiclm_stab.analysis.horizon import choose_horizon, cli_main
from musiclm_stab.config import load_config

REPO = Path(__file__).resolve().parents[1]
CPU = [REPO / "recipes" / "overlays" / f for f in ("tiny.yaml", "study_cpu.yaml", "instability_cpu.yaml")]
RECIPE = {"clip1": "study_prenorm_clip1_run2", "deepnorm": "study_postnorm_deepnorm_clip1"}
UNIGRAM = 9.3
STEPS = 1000


def write_run(root: Path, role: str, lr: float, below: dict[int, float], *, early: float = 80.0,
              last: int = STEPS, diverges_at: int | None = None, dead_from: int | None = None) -> Path:
    """A calibration run as the command in docs/STUDY.md makes it (the recipe, the cpu overlays, its
    overrides), its training loss ``early`` bits over the first 250 steps and 60 after, and its held-out cb0
    ``below[step]`` bits from the unigram level at the steps given (0 at the others); from step ``dead_from`` its
    frontend's output 1e-3 of its first RMS (a dead input)."""
    cfg = load_config([REPO / "recipes" / f"{RECIPE[role]}.yaml", *CPU],
                      [f"--optim.lr={lr}", f"--train.max_steps={STEPS}", "--optim.warmup_steps=80",
                       "--train.eval_every=100", "--train.seed=300"]).to_dict()
    run_dir = root / f"{role}_lr{lr:g}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for t in range(1, last + 1):
        if diverges_at is not None and t >= diverges_at:
            rows.append({"step": t, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 7})
            break
        row = {"step": t, "loss": early if t <= 250 else 60.0, "acoustic_mlm_loss/cb0": 9.5, "grad_norm": 1.0,
               "grad_clipped": 1.0, "features_pen": 0.1 * (1e-6 if dead_from and t >= dead_from else 1.0),
               "loss_scale": 64.0, "overflow_step": 0}
        if t % 100 == 0:
            row["eval/acoustic_mlm_loss/cb0"] = UNIGRAM + below.get(t, 0.0)
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def falling(per_100: float, start: int = 100) -> dict[int, float]:
    """Held-out cb0 from the unigram level: 0 before ``start``, then ``per_100`` bits lower per 100 steps."""
    return {s: -per_100 * max(0, (s - start) // 100) for s in range(100, STEPS + 1, 100)}


def test_h_is_the_first_step_where_both_runs_of_a_rate_are_two_tenths_below(tmp_path):
    """At 3e-3 Pre-LN is 0.2 below from step 500, DeepNorm only from 700: that rate's H is 700 (both); at 1e-2
    both are from 600: H = 600, L = 1e-2; DELTA_EARLY is 1% of the Pre-LN run's mean loss over steps 1..150."""
    write_run(tmp_path, "clip1", 3e-3, falling(0.06))  # -0.18 at 400, -0.24 at 500
    write_run(tmp_path, "deepnorm", 3e-3, falling(0.035))  # -0.175 at 600, -0.21 at 700
    write_run(tmp_path, "clip1", 1e-2, falling(0.045), early=90.0)  # -0.18 at 500, -0.225 at 600
    write_run(tmp_path, "deepnorm", 1e-2, falling(0.11, start=400))  # -0.11 at 500, -0.22 at 600
    h = choose_horizon([tmp_path], UNIGRAM)
    assert (h.H, h.L, h.reached) == (600, 1e-2, True)
    assert h.first_h == {"3e-3": 700, "1e-2": 600}
    assert h.early_loss == pytest.approx(90.0) and h.delta_early == pytest.approx(0.9)
    assert h.below["clip1 1e-2"][600] == pytest.approx(-0.225)


def test_a_tie_goes_to_the_lower_rate_and_h_starts_at_200(tmp_path):
    """Both rates reach -0.2 at step 300: L is the lower, 3e-3. Runs already below at step 100 still get
    H = 200 (the rule's range starts there)."""
    early = {s: -0.5 for s in range(100, STEPS + 1, 100)}
    write_run(tmp_path, "clip1", 3e-3, early)
    write_run(tmp_path, "deepnorm", 3e-3, falling(0.11))  # -0.11 at 200, -0.22 at 300
    write_run(tmp_path, "clip1", 1e-2, early)
    write_run(tmp_path, "deepnorm", 1e-2, falling(0.11))
    h = choose_horizon([tmp_path], UNIGRAM)
    assert (h.H, h.L) == (300, 3e-3)
    tmp2 = tmp_path / "again"
    for role in ("clip1", "deepnorm"):
        for lr in (3e-3, 1e-2):
            write_run(tmp2, role, lr, early)
    assert choose_horizon([tmp2], UNIGRAM).H == 200


def test_no_rate_reaching_the_margin_gives_1000_at_the_rate_that_ends_lower(tmp_path):
    """DeepNorm never reaches -0.2 at either rate; at 1e-2 the Pre-LN run diverged at step 650 (it ends at
    +inf): H = 1000 at 3e-3, not reached; DELTA_EARLY from the Pre-LN run at 3e-3 over steps 1..250."""
    write_run(tmp_path, "clip1", 3e-3, falling(0.05))
    write_run(tmp_path, "deepnorm", 3e-3, falling(0.01))
    write_run(tmp_path, "clip1", 1e-2, falling(0.1), diverges_at=650)
    write_run(tmp_path, "deepnorm", 1e-2, falling(0.02))
    h = choose_horizon([tmp_path], UNIGRAM)
    assert (h.H, h.L, h.reached) == (1000, 3e-3, False)
    assert h.first_h == {"3e-3": None, "1e-2": None} and math.isinf(h.ends["1e-2"])
    assert 600 in h.below["clip1 1e-2"] and 700 not in h.below["clip1 1e-2"]  # no evaluation after the failure
    assert h.delta_early == pytest.approx(0.8)


def test_the_rule_waits_for_all_four_runs_and_the_command(tmp_path, capsys):
    """Missing or unfinished runs are refused by name (exit 2); with all four the command prints the table and
    the choice and writes every number to --json (infinities as text)."""
    write_run(tmp_path, "clip1", 3e-3, falling(0.06))  # -0.24 at 500
    write_run(tmp_path, "deepnorm", 3e-3, falling(0.06))
    write_run(tmp_path, "clip1", 1e-2, falling(0.06), last=750)
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM)]) == 2
    assert "missing: deepnorm at lr 1e-2" in capsys.readouterr().err
    write_run(tmp_path, "deepnorm", 1e-2, falling(0.06))
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM)]) == 2
    assert "still running: clip1 at lr 1e-2 (at step 750 of 1000)" in capsys.readouterr().err
    (tmp_path / "clip1_lr0.01").rename(tmp_path.parent / "aside")
    write_run(tmp_path, "clip1", 1e-2, falling(0.01), diverges_at=400)
    out = tmp_path.parent / "h.json"
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "**H = 500, L = 3e-3, DELTA_EARLY = 0.800 bits**" in text
    assert "| Pre-Norm clip 1, lr 3e-3 | +0.000 | -0.060 |" in text
    saved = json.loads(out.read_text())
    assert (saved["H"], saved["L"], saved["ends"]["1e-2"]) == (500, 3e-3, "inf")


def test_the_committed_calibration_recomputes(tmp_path, capsys):
    """docs/learning_cpu/calibration.tar.xz (the four calibration runs' configs and metrics) gives again the
    committed horizon.md and horizon.json, and the values in analysis/learning_params.py."""
    from musiclm_stab.analysis import learning_params

    docs = REPO / "docs" / "learning_cpu"
    unpack(docs / "calibration.tar.xz", tmp_path)
    out = tmp_path / "horizon.json"
    assert cli_main([str(tmp_path), "--unigram", "9.287", "--json", str(out)]) == 0
    assert capsys.readouterr().out == (docs / "horizon.md").read_text()
    assert json.loads(out.read_text()) == json.loads((docs / "horizon.json").read_text())
    saved = json.loads(out.read_text())
    assert (learning_params.H, learning_params.L) == (saved["H"], saved["L"])
    assert learning_params.DELTA_EARLY == round(saved["delta_early"], 3)


def test_a_run_whose_input_is_dying_is_still_running(tmp_path):
    """DeepNorm at step 500 of 1000, its frontend below 1% of its first RMS since step 300: a dead input is judged
    at a run's end (it may recover), so the rule waits for it and names it."""
    for lr in (3e-3, 1e-2):
        write_run(tmp_path, "clip1", lr, falling(0.06))
    write_run(tmp_path, "deepnorm", 3e-3, falling(0.06))
    write_run(tmp_path, "deepnorm", 1e-2, {}, last=500, dead_from=300)
    with pytest.raises(ValueError, match=r"still running: deepnorm at lr 1e-2 \(at step 500 of 1000\)"):
        choose_horizon([tmp_path], UNIGRAM)
