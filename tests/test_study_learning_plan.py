"""The learning study's plan (experiments/study_plan.py, design ``learning``; docs/STUDY.md, "The learning
study"): its two arms, their roles, rates, horizons and seeds, as run directories and configs."""

from __future__ import annotations

import pytest

from musiclm_stab.analysis import learning, learning_params
from musiclm_stab.analysis.learning import learning_role
from musiclm_stab.experiments import study_plan
from musiclm_stab.experiments.study_plan import (
    CONTROL_ROLES,
    FIGURE_ROLES,
    LEARNING_ROLES,
    figure_runs,
    plan_study,
)


def _plan(tmp_path, **kw):
    return plan_study("cpu", tmp_path, data="work/t", design="learning", **kw)


def test_the_mechanism_arm_comes_first_then_the_claims_arm_seed_by_seed(tmp_path):
    """8 seeds by default (LEARNING_SEEDS); at n seeds 12 n runs: the mechanism arm's 5 roles x n seeds at lr 1e-1
    for 120 steps first (short runs), then the claims arm's 7 roles x n seeds at L for the horizon, each seed's
    runs together; every name is distinct. (Two seeds here: a plan resolves every run's config.)"""
    assert study_plan.LEARNING_SEEDS["cpu"] == 8
    study = _plan(tmp_path, seeds=2)
    runs = study.runs
    mech = [r for r in runs if LEARNING_ROLES[r.stem][0] == "mechanism"]
    claims = [r for r in runs if LEARNING_ROLES[r.stem][0] == "claims"]
    assert len(mech) == 5 * 2 and len(claims) == 7 * 2 and runs == mech + claims
    assert [r.seed for r in claims] == sorted(r.seed for r in claims)
    assert {r.lr for r in mech} == {learning_params.MECH_LR} and {r.lr for r in claims} == {learning_params.L}
    names = [r.config().run_dir.name for r in runs]
    assert len(set(names)) == len(names)
    assert all(r.config().run_dir.parent == tmp_path / "learning_cpu" for r in runs)
    assert study.seeds == [0, 1] and study.stall_margin == 0.1


def test_each_role_is_the_configuration_it_names(tmp_path):
    """The roles' configs: the mechanism arm 120 steps without warmup (but m_warmup's 30 steps), fairseq fp16 (but
    m_fp32), Pre-LN clip 1 (the two Post-LN clip 10 roles: math and relax); the claims arm the seed figures' four
    with MERT's warmup share, and the control's three others (no warmup: optim.warmup_steps 0)."""
    study = _plan(tmp_path, seeds=1)
    cfg = {r.stem: r.config() for r in study.runs}
    for role in ("m_fp16", "m_warmup", "m_fp32", "m_post10", "m_post10_relax"):
        c = cfg[role]
        assert c.train.max_steps == 120 and c.optim.frontend_lr == 1e-3 and c.train.diagnostics_every == 5, role
        assert c.optim.warmup_steps == (30 if role == "m_warmup" else 0), role
        assert c.train.mixed_precision == ("no" if role == "m_fp32" else "fp16"), role
    assert (cfg["m_fp16"].model.norm_scheme, cfg["m_fp16"].optim.clip_grad) == ("pre", 1.0)
    assert (cfg["m_post10"].model.norm_scheme, cfg["m_post10"].optim.clip_grad, cfg["m_post10"].model.attention) == (
        "post", 10.0, "math")
    assert cfg["m_post10_relax"].model.attention == "relax"
    horizon = cfg["clip1"].train.max_steps
    assert horizon == learning_params.H
    for role in ("clip10", "clip1", "deepnorm", "relax", "pre_nw", "post_w", "post_nw"):
        c = cfg[role]
        assert c.train.max_steps == horizon and c.train.log_every == 1 and c.model.num_layers == 8, role
        assert c.optim.warmup_steps == (0 if role.endswith("_nw") else round(0.08 * horizon)), role
        assert c.train.fp16_mode == "fairseq" and c.optim.frontend_lr == 1e-3, role
    assert [cfg[r].model.norm_scheme for r in ("clip10", "clip1", "deepnorm", "relax", "pre_nw", "post_w", "post_nw")] \
        == ["pre", "pre", "deepnorm", "pre", "pre", "post", "post"]
    assert cfg["clip10"].optim.clip_grad == 10.0 and cfg["relax"].model.attention == "relax"


def test_the_figures_draw_the_claims_arm_s_four(tmp_path):
    """The seed figures draw the four configurations of the claims arm, every seed, at L."""
    study = _plan(tmp_path, seeds=2)
    shown = figure_runs(study)
    assert sorted({r.stem for r in shown}) == sorted(FIGURE_ROLES) and len(shown) == 4 * 2
    assert study.window == max(1, int(0.01 * shown[0].config().train.max_steps))


def test_every_run_of_the_plan_has_the_role_its_analysis_reads(tmp_path):
    """analysis/learning.py finds each planned run's arm and role from its config alone, as the plan named it."""
    for run in _plan(tmp_path, seeds=1).runs:
        assert learning_role(run.config().to_dict()) == (LEARNING_ROLES[run.stem][0], run.stem), run.stem


@pytest.mark.parametrize("layers, rate", [(24, 1), (8, 3)])
def test_a_control_moved_by_its_rule_runs_there_beside_the_claims_clip1(tmp_path, monkeypatch, layers, rate):
    """When the pilots' rule sends the control to 24 layers or to 3L, its four roles run there (Pre-LN with warmup
    as a run of its own), the claims arm's clip 1 stays at 8 layers and L, and the analysis reads the control's
    four from their configs at that setting."""
    lr = rate * learning_params.L
    monkeypatch.setattr(learning_params, "CONTROL_LAYERS", layers)
    monkeypatch.setattr(learning_params, "CONTROL_LR", lr)
    study = _plan(tmp_path, seeds=1, only=CONTROL_ROLES)
    got = sorted((r.stem, r.config().model.num_layers, r.lr) for r in study.runs)
    assert got == sorted([("clip1", 8, learning_params.L), ("clip1", layers, lr), ("post_nw", layers, lr),
                          ("post_w", layers, lr), ("pre_nw", layers, lr)])
    assert len({r.config().run_dir.name for r in study.runs}) == 5
    cells = learning.control_roles(layers, lr)
    roles = {learning_role(r.config().to_dict())[1] for r in study.runs}
    assert set(cells.values()) <= roles


def test_only_names_roles(tmp_path):
    """--only takes the learning study's roles and refuses anything else, naming the roles."""
    assert {r.stem for r in _plan(tmp_path, seeds=1, only=("m_fp32",)).runs} == {"m_fp32"}
    with pytest.raises(ValueError, match="roles are m_fp16"):
        _plan(tmp_path, only=("study_prenorm_clip1_run2",))


def test_the_command_line_s_only_takes_the_learning_roles(tmp_path, capsys):
    """`study --design learning --only ROLE ...` plans those roles (the pilots' command: the control's four
    first); a recipe name there, or a role in another design, is refused with the design's names."""
    from musiclm_stab.experiments.study import cli_main

    argv = ["--design", "learning", "--scale", "cpu", "--print-only", "--seeds", "1", "--first-seed", "301",
            "--runs", str(tmp_path), "--data", str(tmp_path / "tokens")]
    assert cli_main([*argv, "--only", "clip1", "pre_nw", "post_w", "post_nw"]) == 0
    launches = [line for line in capsys.readouterr().out.splitlines() if "accelerate launch" in line]
    names = sorted(line.split("--train.name=")[1].split()[0] for line in launches)
    assert names == sorted(["study_prenorm_clip1_run2_tiny_lr3e-3_s301", "control_prenorm_clip1_nowarmup_tiny_lr3e-3_s301",
                            "control_postnorm_clip1_warmup_tiny_lr3e-3_s301",
                            "control_postnorm_clip1_nowarmup_tiny_lr3e-3_s301"])
    for wrong, design in (("study_prenorm_clip1_run2", "learning"), ("clip1", "instability")):
        with pytest.raises(SystemExit):
            cli_main(["--design", design, *argv[2:], "--only", wrong])
        assert f"--only {wrong}: the {design} design's names are" in capsys.readouterr().err


def test_control_at_plans_the_controls_pilots_where_the_rule_asks(tmp_path, capsys):
    """`--control-at 8:9e-3` (the pilots' rule's step 2) plans the control's four at 3L beside the claims' clip 1
    at L, as a rule-moved control runs; a rate other than L or 3L, a malformed value, or the option in another
    design is refused."""
    from musiclm_stab.experiments.study import cli_main

    argv = ["--design", "learning", "--scale", "cpu", "--print-only", "--seeds", "1", "--first-seed", "301",
            "--runs", str(tmp_path), "--data", str(tmp_path / "tokens"), "--only", *CONTROL_ROLES]
    assert cli_main([*argv, "--control-at", "8:9e-3"]) == 0
    launches = [line for line in capsys.readouterr().out.splitlines() if "accelerate launch" in line]
    names = sorted(line.split("--train.name=")[1].split()[0] for line in launches)
    assert names == sorted(["study_prenorm_clip1_run2_tiny_lr3e-3_s301", "study_prenorm_clip1_run2_tiny_lr9e-3_s301",
                            "control_prenorm_clip1_nowarmup_tiny_lr9e-3_s301",
                            "control_postnorm_clip1_warmup_tiny_lr9e-3_s301",
                            "control_postnorm_clip1_nowarmup_tiny_lr9e-3_s301"])
    study = _plan(tmp_path, seeds=1, only=CONTROL_ROLES, control_at=(24, learning_params.L))
    assert sorted((r.stem, r.config().model.num_layers) for r in study.runs) == [
        ("clip1", 8), ("clip1", 24), ("post_nw", 24), ("post_w", 24), ("pre_nw", 24)]
    with pytest.raises(ValueError, match=r"its lr is one of 0.003, 0.009 \(L, 3L\)"):
        _plan(tmp_path, seeds=1, control_at=(8, 1e-2))
    with pytest.raises(ValueError, match="control_at is the learning design's"):
        plan_study("cpu", tmp_path, data="work/t", control_at=(8, 3e-3))
    with pytest.raises(SystemExit):
        cli_main([*argv, "--control-at", "24"])
    assert "'24': give LAYERS:LR, e.g. 24:3e-3" in capsys.readouterr().err
