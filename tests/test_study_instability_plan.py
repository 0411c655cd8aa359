"""The instability design of the study's plan (experiments/study_plan.py): its six configurations at every rate
of its grid, overlays, arms and folder names, and how its runs read as roles (analysis/instability.py)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from archives import by_name, unpack

from musiclm_stab.analysis.instability import ROLES6, role6
from musiclm_stab.experiments.study import cli_main
from musiclm_stab.experiments.study_plan import (
    INSTABILITY_GRIDS,
    INSTABILITY_OVERLAYS,
    INSTABILITY_SEEDS,
    INSTABILITY_STEMS,
    claims_command,
    figure_runs,
    plan_study,
)

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "instability_cpu"
DATA = "/work/v3work/hours256_tokens"  # the path the carried runs trained on (recorded in each config.yaml)


@pytest.fixture(scope="module")
def registered(tmp_path_factory) -> dict:
    """The registered instability plan, planned once for this module's tests (each plan_study validates every
    run's config, and every config is read from its recipe files again: seconds per hundred runs): arm ->
    its Study (arm schemes at the design's seeds, arm mert-frontend at seed 0)."""
    runs = tmp_path_factory.mktemp("planned")
    return {"schemes": plan_study("cpu", runs, data=DATA, design="instability"),  # the arm's and seeds' defaults
            "mert-frontend": plan_study("cpu", runs, data=DATA, design="instability", arm="mert-frontend", seeds=1)}


@pytest.fixture(scope="module")
def plan_configs(registered) -> dict:
    """Each registered run's resolved config, by (its folder, its name)."""
    configs = (r.config() for study in registered.values() for r in study.runs)
    return {(cfg.run_dir.parent.name, cfg.run_dir.name): cfg for cfg in configs}


def test_instability_plan_runs_six_configurations_at_every_rate(registered, tmp_path):
    """Every rate and seed has the six configurations (the QK-Norm and Post-Norm controls at every rate, not only
    the top two), each run's config is its role, with the instability overlay after the cpu scale's (no warmup,
    the frontend at its own lr, step-by-step rows, one evaluation at the end); the figures draw the six at the
    grid's second rate; the claims line is the instability analysis."""
    study = plan_study("cpu", tmp_path, data="work/hours256_tokens", design="instability", seeds=2, lrs=(1e-3, 1e-1))
    assert study.figures_dir == tmp_path / "instability_cpu" / "figures" and len(study.runs) == 6 * 2 * 2
    for lr in (1e-3, 1e-1):
        for seed in (0, 1):
            here = [r for r in study.runs if (r.lr, r.seed) == (lr, seed)]
            assert [r.stem for r in here] == list(INSTABILITY_STEMS)
            assert [role6(r.config().to_dict()) for r in here] == list(ROLES6)
    cfg = study.runs[0].config()
    assert study.runs[0].configs[-1] == INSTABILITY_OVERLAYS["cpu"]
    assert (cfg.optim.warmup_steps, cfg.optim.frontend_lr, cfg.train.log_every) == (0, 1e-3, 1)
    assert cfg.train.eval_every == cfg.train.max_steps and cfg.train.diagnostics_every == 5
    assert {r.lr for r in figure_runs(study)} == {1e-1} and len(figure_runs(study)) == 6 * 2
    assert claims_command(study)[:3] == ["python", "-m", "musiclm_stab.analysis.instability"]
    default = registered["schemes"]  # plan_study("cpu", ..., design="instability"): the grid's and seeds' defaults
    assert default.lrs == INSTABILITY_GRIDS["cpu"] and default.seeds == list(range(INSTABILITY_SEEDS["cpu"]))


def test_instability_arms_steps_and_refusals(tmp_path, capsys):
    """The mert-frontend arm trains the frontend at the run's lr, in a folder of its own; --steps keeps the
    overlay's warmup and diagnostics and evaluates once, at the end; the full scale and an arm of the claims
    design are refused; --print-only prints the instability launch lines."""
    mert = plan_study("cpu", tmp_path, data="x", design="instability", seeds=1, lrs=(3e-2,), arm="mert-frontend")
    assert mert.figures_dir.parent.name == "instability_cpu_mert_frontend"
    assert mert.arm == "mert-frontend"  # run_study describes it (instability.write_failures), decides nothing
    assert all(r.config().optim.frontend_lr is None for r in mert.runs)
    short = plan_study("cpu", tmp_path, data="x", design="instability", seeds=1, lrs=(3e-2,), steps=40).runs[0].config()
    assert (short.train.max_steps, short.train.eval_every, short.train.diagnostics_every, short.optim.warmup_steps) == (
        40, 40, 5, 0)
    with pytest.raises(ValueError, match="instability design runs at scale"):
        plan_study("full", tmp_path, design="instability")
    with pytest.raises(ValueError, match="instability design's"):
        plan_study("cpu", tmp_path, data="x", arm="mert-frontend")
    assert cli_main(["--design", "instability", "--print-only", "--runs", str(tmp_path), "--seeds", "1", "--lrs",
                     "1e-2", "--only", "study_postnorm_clip1"]) == 0
    lines = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if "launch" in x]
    assert len(lines) == 1 and "recipes/study_postnorm_clip1.yaml" in lines[0]
    assert "recipes/overlays/instability_cpu.yaml" in lines[0]
    saved = yaml.safe_load(yaml.safe_dump(mert.runs[0].config().to_dict()))
    assert saved["optim"]["frontend_lr"] is None


@pytest.fixture(scope="module")
def carried(tmp_path_factory) -> Path:
    """docs/instability_cpu/runs.tar.xz unpacked once for this module's tests."""
    root = tmp_path_factory.mktemp("carried")
    unpack(DOCS / "runs.tar.xz", root)
    return root


@pytest.fixture(scope="module")
def carried_runs(carried) -> dict:
    """Each folder of the archive's runs, read once (analysis.claims.read_runs: the run directories found
    under it, in order, losses in bits, as write_claims and write_failures read a folder): folder -> RunMetrics.
    The analyses only read a RunMetrics, so the tests share them."""
    from musiclm_stab.analysis.claims import read_runs

    return {d.name: read_runs([d]) for d in sorted(carried.iterdir()) if d.is_dir()}


def test_the_carried_instability_runs_are_finished_runs_of_the_registered_plan(carried, carried_runs,
                                                                               plan_configs):
    """docs/instability_cpu/runs.tar.xz carries the study's finished runs as they come in (it runs in pieces):
    each is a run of the registered plan (arm schemes in instability_cpu/, arm mert-frontend at seed 0 in
    instability_cpu_mert_frontend/) with exactly the plan's config, trained to its last step or ended by the
    loss-scale floor, timed, each folder on the codes its data.json names; nothing else is in it."""
    from musiclm_stab.experiments.launch import same_config

    planned = plan_configs
    assert len(planned) == 180 + 30
    folders = {d.name for d in carried.iterdir()}
    assert "instability_cpu" in folders and folders <= {"instability_cpu", "instability_cpu_mert_frontend"}
    runs = []
    for folder in sorted(folders):
        assert re.fullmatch(r"[0-9a-f]{64}", json.loads((carried / folder / "data.json").read_text())["codes_sha256"])
        runs += [d for d in sorted((carried / folder).iterdir()) if d.is_dir()]
    assert runs and all((d.parent.name, d.name) in planned for d in runs)
    read = {r.path: r for folder in carried_runs.values() for r in folder}  # each run as read_run reads it
    assert sorted(read) == sorted(runs)
    for d in runs:
        assert sorted(f.name for f in d.iterdir()) == ["config.yaml", "metrics.jsonl", "study_time.json",
                                                       "tokenizer.json"], d
        assert json.loads((d / "study_time.json").read_text())["wall_s"] > 0, d
        cfg = planned[(d.parent.name, d.name)]
        assert same_config(d, cfg), d
        run = read[d]
        assert run.last_step == cfg.train.max_steps or run.diverged_at is not None, d


def test_the_instability_result_recomputes_from_the_archive_and_is_quoted_as_it_is(carried, carried_runs,
                                                                                    plan_configs, tmp_path):
    """docs/instability_cpu/figures/ holds what the study drew and decided from all 180 runs of arm schemes:
    claims.md and claims.json are what analysis.instability computes again from the archive; summary.json
    gives every run its failure kind and step (no stalls: the design assesses none), its fp16 headroom and
    its lr; docs/STUDY.md carries the table between its markers, states the positive control's outcome before
    the claims and each claim's verdict, and the README quotes them."""
    from musiclm_stab.analysis.failures import KINDS
    from musiclm_stab.analysis.instability import DOC_BEGIN, DOC_END, write_claims

    figures = DOCS / "figures"
    claims = json.loads((figures / "claims.json").read_text())
    planned = {name for folder, name in plan_configs if folder == "instability_cpu"}  # the plan's arm schemes
    assert len(planned) == 180 and sorted(Path(d).name for d in claims["run_dirs"]) == sorted(planned)
    # the runs of the archive's folder, as write_claims([carried / "instability_cpu"], ...) reads them
    runs = carried_runs["instability_cpu"]
    assert [r.path for r in runs] == sorted(d for d in (carried / "instability_cpu").iterdir() if d.is_dir())
    md, js = write_claims(runs, tmp_path / "again", claims["levels"]["unigram_eval_cb0"])
    assert md.read_text() == (figures / "claims.md").read_text()
    assert by_name(json.loads(js.read_text())) == by_name(claims)
    summary = json.loads((figures / "summary.json").read_text())
    assert sorted(r["run"] for r in summary) == sorted(planned)
    grid = set(INSTABILITY_GRIDS["cpu"])
    for r in summary:
        assert r["failure"] in KINDS and r["failure"] != "stalled" and r["lr"] in grid, r["run"]
        assert (r["failure_step"] is None) == (r["failure"] == "none"), r["run"]
        assert {"attn_logit", "residual", "frontend"} <= set(r["headroom"]) or r["failure"] == "diverged", r["run"]
    text = (REPO / "docs" / "STUDY.md").read_text()
    table = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0]
    assert table.strip() == (figures / "claims.md").read_text().strip()
    result = text.split("### The result: arm `schemes`, all 180 runs", 1)[1]
    detects = claims["controls"]["detects"]
    control = "**The positive control detects its effect.**" if detects else (
        "**The positive control does not detect its effect.**")
    assert result.index(control) < result.index(DOC_BEGIN) < result.index("**The claims**")
    for c in claims["claims"]:
        assert f"- ({c['key']}) **{c['verdict']}**" in result, c["key"]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert ("positive control **detects**" if detects else "positive control **does not detect**") in readme
    verdicts = {c["key"]: c["verdict"] for c in claims["claims"]}
    assert verdicts == {"a": "refuted", "b": "inconclusive", "c": "inconclusive", "d": "inconclusive"}
    assert "Claim (a) is **refuted** again" in readme and "(b), (c), (d) **inconclusive**" in readme
    # the count the README and STUDY.md give for (a) is the archive's: blocks where clip 1 was faster early, of
    # those (a) used (the table's "n 18 of 18" counts the blocks used, not their signs)
    by_block: dict = {}
    for r in claims["runs"]:
        by_block.setdefault((r["lr"], r["seed"]), {})[r["role"]] = r
    used = [b for b in by_block.values() if b["clip1"]["kind"] == b["clip10"]["kind"] == "none"
            and b["clip1"]["clip_share_early"] >= 0.2]
    faster = sum(b["clip1"]["early_loss"] < b["clip10"]["early_loss"] for b in used)
    assert f"clip 1 faster early in {faster} of {len(used)} blocks" in readme
    assert f"in {faster} of the {len(used)} blocks where neither failed" in " ".join(result.split())


def test_the_mert_frontend_arm_is_described_from_the_archive_and_quoted_as_it_is(carried, carried_runs, plan_configs,
                                                                                  tmp_path):
    """docs/instability_cpu/figures_mert_frontend/ describes all 30 runs of arm mert-frontend (seed 0, the
    frontend at the run's lr) without deciding anything: failures.md and failures.json are what
    analysis.instability --describe computes again from the archive, and docs/STUDY.md quotes its failures."""
    from musiclm_stab.analysis.instability import write_failures

    figures = DOCS / "figures_mert_frontend"
    described = json.loads((figures / "failures.json").read_text())
    planned = {name for folder, name in plan_configs if folder == "instability_cpu_mert_frontend"}
    assert len(planned) == 30 and sorted(Path(d).name for d in described["run_dirs"]) == sorted(planned)
    assert not (figures / "claims.md").exists() and not (figures / "claims.json").exists()
    runs = carried_runs["instability_cpu_mert_frontend"]  # as write_failures reads the archive's folder
    assert [r.path for r in runs] == sorted(d for d in (carried / "instability_cpu_mert_frontend").iterdir() if d.is_dir())
    md, _ = write_failures(runs, tmp_path / "again", described["levels"]["unigram_eval_cb0"])
    assert md.read_text() == (figures / "failures.md").read_text()
    text = (REPO / "docs" / "STUDY.md").read_text().split("### Arm `mert-frontend`: described, not decided", 1)[1]
    kinds = {}
    for r in described["runs"]:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    section = " ".join(text.split("###", 1)[0].split())
    for kind, n in kinds.items():
        assert f"{n} {kind}" in section, kind
