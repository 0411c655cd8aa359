"""The learning study's pilot rule for its positive control (analysis/pilot_rule.py) on pilot run directories:
each of the rule's four steps as docs/STUDY.md fixes them, the pilots it asks for next, a failed run scored at
its loss at initialisation, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from archives import unpack

from musiclm_stab.analysis import learning, learning_params
from musiclm_stab.analysis.pilot_rule import apply_rule, cli_main
from musiclm_stab.config import load_config

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = [REPO / "recipes" / "overlays" / f for f in ("tiny.yaml", "study_cpu.yaml", "learning_cpu.yaml")]
CELLS = {"pre_w": ("study_prenorm_clip1_run2", True), "pre_nw": ("study_prenorm_clip1_run2", False),
         "post_w": ("study_postnorm_clip1", True), "post_nw": ("study_postnorm_clip1", False)}
UNIGRAM = 9.3
STEPS = 40  # the horizon here (monkeypatched): the rule reads the configs' own
H_PLAN = learning_params.H  # the plan's horizon, the committed pilots'


@pytest.fixture(autouse=True)
def short_horizon(monkeypatch):
    for where in (learning_params, learning):  # the configs' horizon, and the one learning_role reads
        monkeypatch.setattr(where, "H", STEPS)


def write_cell(root: Path, cell: str, final: float, *, lr: float = learning_params.L, layers: int = 8,
               seed: int = 301, diverges_at: int | None = None, last: int = STEPS, dead_from: int | None = None) -> Path:
    """A pilot run of one control cell as the study's plan makes it (the recipe, the cpu and learning overlays,
    warmup or none), its held-out cb0 ``final`` bits at its last step (10.4 at step 1, its cap); from step
    ``dead_from`` its frontend's output 1e-3 of its first RMS (a dead input)."""
    stem, warm = CELLS[cell]
    overrides = [f"--optim.lr={lr}", f"--train.max_steps={STEPS}", f"--train.seed={seed}",
                 f"--model.num_layers={layers}", *([] if warm else ["--optim.warmup_steps=0"])]
    cfg = load_config([REPO / "recipes" / f"{stem}.yaml", *OVERLAYS], overrides).to_dict()
    run_dir = root / f"{cell}_{layers}L_lr{lr:g}_s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for t in range(1, last + 1):
        if diverges_at is not None and t >= diverges_at:
            rows.append({"step": t, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 7})
            break
        rows.append({"step": t, "loss": 84.0 - 0.1 * t, "acoustic_mlm_loss/cb0": 10.4 - 0.01 * t, "grad_norm": 2.0,
                     "grad_clipped": 1.0, "features_pen": 0.1 * (1e-6 if dead_from and t >= dead_from else 1.0),
                     "loss_scale": 64.0, "overflow_step": 0})
    if diverges_at is None and last == STEPS:
        rows[-1]["eval/acoustic_mlm_loss/cb0"] = final
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def write_setting(root: Path, interaction: float, **kw) -> None:
    """The four cells of one setting, Post-LN without warmup ``interaction`` bits worse than the others' pattern."""
    for cell, final in {"pre_w": 9.0, "pre_nw": 9.05, "post_w": 9.1, "post_nw": 9.15 + interaction}.items():
        write_cell(root, cell, final, **kw)


def test_step_1_chooses_the_claims_setting_at_a_tenth_of_a_bit(tmp_path):
    """(9.15 + 0.12 - 9.1) - (9.05 - 9.0) = 0.12 >= 0.1 at 8 layers and L: step 1, the control at 8 layers, L."""
    write_setting(tmp_path, 0.12)
    d = apply_rule([tmp_path], UNIGRAM)
    assert (d.step, d.layers, d.lr, d.no_sign) == (1, 8, learning_params.L, False)
    assert d.interactions == {"8 3e-3": pytest.approx(0.12)}
    assert d.cells["8 3e-3"]["post_nw"] == pytest.approx(9.27)


def test_below_the_margin_the_rule_asks_for_3l_then_chooses_it(tmp_path, capsys):
    """0.05 at L is not enough: the rule names the 3L pilots and chooses nothing (the command says so, exit 0);
    with them in at 0.2 bits, step 2 chooses 8 layers at 3L."""
    write_setting(tmp_path, 0.05)
    d = apply_rule([tmp_path], UNIGRAM)
    assert d.step is None and d.layers is None
    assert (d.needs["layers"], d.needs["lr"]) == (8, pytest.approx(3 * learning_params.L))
    assert d.needs["roles"]["post_nw"] == "post_nw_lr9e-3"
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM)]) == 0
    out = capsys.readouterr().out
    assert "Not chosen yet: the rule needs the pilots at 8 layers, lr 9e-3" in out
    assert "`--only clip1 pre_nw post_w post_nw --control-at 8:9e-3`" in out
    write_setting(tmp_path, 0.2, lr=3 * learning_params.L)
    d = apply_rule([tmp_path], UNIGRAM)
    assert (d.step, d.layers, d.lr) == (2, 8, pytest.approx(3 * learning_params.L))


@pytest.mark.parametrize("deep, step, layers", [(0.3, 3, 24), (0.02, 4, 8)])
def test_24_layers_at_the_rate_with_the_larger_interaction_else_no_sign(tmp_path, deep, step, layers):
    """L gives 0.06, 3L 0.04: 24 layers are piloted at L (the larger); 0.3 there chooses 24 layers (step 3), 0.02
    leaves 8 layers at L and says the pilots showed no sign of the effect (step 4)."""
    write_setting(tmp_path, 0.06)
    write_setting(tmp_path, 0.04, lr=3 * learning_params.L)
    d = apply_rule([tmp_path], UNIGRAM)
    assert d.step is None and (d.needs["layers"], d.needs["lr"]) == (24, learning_params.L)
    write_setting(tmp_path, deep, layers=24)
    d = apply_rule([tmp_path], UNIGRAM)
    assert (d.step, d.layers, d.lr, d.no_sign) == (step, layers, learning_params.L, step == 4)
    assert set(d.interactions) == {"8 3e-3", "8 9e-3", "24 3e-3"}


def test_a_setting_piloted_before_the_one_the_rule_reads_first_is_shown(tmp_path, capsys):
    """The 24-layer four at 3L in, the four at L not (pilots run in another order, or lost and run again): the
    table shows the 24-layer setting and its interaction, and the rule still asks for the four at L (before: "No
    pilot of the positive control is in yet" over runs that were in)."""
    write_setting(tmp_path, 0.05, layers=24, lr=3 * learning_params.L)
    d = apply_rule([tmp_path], UNIGRAM)
    assert d.step is None and (d.needs["layers"], d.needs["lr"]) == (8, learning_params.L)
    assert d.interactions == {"24 9e-3": pytest.approx(0.05)} and d.seed == 301
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM)]) == 0
    out = capsys.readouterr().out
    assert "No pilot" not in out and "| 24 | 9e-3 | -0.300 | -0.250 | -0.200 | -0.100 | +0.050 |" in out, out
    assert "Not chosen yet: the rule needs the pilots at 8 layers, lr 3e-3" in out


def test_a_failed_run_is_scored_at_its_loss_at_initialisation(tmp_path, capsys):
    """Post-LN without warmup diverging at step 12 scores its cap, 10.39 bits (its first cb0): the interaction is
    (10.39 - 9.1) - 0.05 = 1.24, step 1, and the table marks the cell failed."""
    for cell, final in {"pre_w": 9.0, "pre_nw": 9.05, "post_w": 9.1}.items():
        write_cell(tmp_path, cell, final)
    write_cell(tmp_path, "post_nw", 0.0, diverges_at=12)
    d = apply_rule([tmp_path], UNIGRAM)
    assert d.step == 1 and d.interactions["8 3e-3"] == pytest.approx(1.24)
    assert d.failed["8 3e-3"]["post_nw"] == 1
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM), "--json", str(tmp_path / "rule.json")]) == 0
    assert "+1.090 (failed)" in capsys.readouterr().out
    assert json.loads((tmp_path / "rule.json").read_text())["layers"] == 8


def test_a_run_still_going_or_two_blocks_are_refused(tmp_path, capsys):
    """A pilot at step 30 of 40, its input dead so far (a dead input is judged at the run's end: it may recover):
    the rule refuses and names it (exit 2); pilots of two seeds are refused too."""
    write_setting(tmp_path / "a", 0.2)
    write_cell(tmp_path / "a", "post_w", 9.1, lr=3 * learning_params.L, last=30, dead_from=10)
    with pytest.raises(ValueError, match=r"still running: .*post_w_8L_lr0.009_s301 \(at step 30 of 40\)"):
        apply_rule([tmp_path / "a"], UNIGRAM)
    assert cli_main([str(tmp_path / "a"), "--unigram", str(UNIGRAM)]) == 2
    assert "pilot_rule: error: the rule is applied when" in capsys.readouterr().err
    write_setting(tmp_path / "b", 0.2)
    write_setting(tmp_path / "b", 0.2, seed=302)
    with pytest.raises(ValueError, match=r"one block \(seed\); these runs are of seeds \[301, 302\]"):
        apply_rule([tmp_path / "b"], UNIGRAM)


def test_runs_without_a_control_pilot_name_the_first_pilots_and_no_seed(tmp_path, capsys):
    """A folder whose runs are none of the control's (here one at lr 5e-2, in no arm): no block, so no seed to
    name; the rule asks for the four pilots at L and prints no empty table."""
    write_cell(tmp_path, "pre_w", 9.0, lr=0.05)
    d = apply_rule([tmp_path], UNIGRAM)
    assert (d.step, d.seed, d.cells) == (None, None, {})
    assert (d.needs["layers"], d.needs["lr"]) == (8, learning_params.L)
    assert cli_main([str(tmp_path), "--unigram", str(UNIGRAM)]) == 0
    out = capsys.readouterr().out
    assert "seed" not in out and "| layers |" not in out
    assert out.startswith("No pilot of the positive control is in yet. Not chosen yet: the rule needs the pilots at "
                          "8 layers, lr 3e-3"), out


def test_the_committed_pilots_recompute(tmp_path, capsys, monkeypatch):
    """docs/learning_cpu/pilots.tar.xz (the pilots carried so far: configs and metrics) gives again the committed
    pilot_rule.md and pilot_rule.json beside it."""
    for where in (learning_params, learning):  # the pilots' own horizon, not this module's short one
        monkeypatch.setattr(where, "H", H_PLAN)
    docs = REPO / "docs" / "learning_cpu"
    unpack(docs / "pilots.tar.xz", tmp_path)
    out = tmp_path / "pilot_rule.json"
    assert cli_main([str(tmp_path), "--unigram", "9.287", "--json", str(out)]) == 0
    assert capsys.readouterr().out == (docs / "pilot_rule.md").read_text()
    assert json.loads(out.read_text()) == json.loads((docs / "pilot_rule.json").read_text())
