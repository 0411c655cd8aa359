"""The learning study's carried runs (docs/learning_cpu/runs.tar.xz): what the study trained, in pieces, from the
worktree frozen at its pre-registration, carried without checkpoints (docs/STUDY.md, "Runs, in pieces")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from archives import by_name, unpack

from musiclm_stab.experiments.study_plan import LEARNING_ROLES, LEARNING_SEEDS, plan_study

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "learning_cpu"
DATA = "work/hours256_tokens"  # the path the study's runs trained on (recorded in each config.yaml)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    """The registered plan (its default seeds, both arms), planned once: run folder name -> resolved config."""
    study = plan_study("cpu", tmp_path_factory.mktemp("planned"), data=DATA, design="learning")
    return {r.config().run_dir.name: (r.stem, r.config()) for r in study.runs}


@pytest.fixture(scope="module")
def carried(tmp_path_factory) -> Path:
    """docs/learning_cpu/runs.tar.xz unpacked once for this module's tests."""
    root = tmp_path_factory.mktemp("carried")
    unpack(DOCS / "runs.tar.xz", root)
    return root


def test_the_carried_learning_runs_are_finished_runs_of_the_registered_plan(carried, planned):
    """Each carried run is a run of the registered plan (96: 5 mechanism and 7 claims roles at seeds 0-7) with
    exactly the plan's config, trained to its last step or ended by the loss-scale floor, timed; the folder's
    data.json names the codes the pilots trained on; nothing else is in the archive. The
    mechanism arm is in before any claims run (it ran first)."""
    from musiclm_stab.analysis.runs import read_run
    from musiclm_stab.experiments.launch import same_config

    assert len(planned) == (5 + 7) * LEARNING_SEEDS["cpu"] == 96
    assert [d.name for d in carried.iterdir()] == ["learning_cpu"]
    folder = carried / "learning_cpu"
    codes = json.loads((folder / "data.json").read_text())
    pilots = json.loads(_member(DOCS / "pilots.tar.xz", "learning_pilots/data.json"))
    assert codes == pilots == {"data": DATA, "codes_sha256": codes["codes_sha256"]}
    runs = sorted(d for d in folder.iterdir() if d.is_dir())
    assert sorted(f.name for f in folder.iterdir() if not f.is_dir()) == ["data.json"]
    assert runs and all(d.name in planned for d in runs)
    arm = {name: LEARNING_ROLES[stem][0] for name, (stem, _) in planned.items()}
    if any(arm[d.name] == "claims" for d in runs):
        assert sum(arm[d.name] == "mechanism" for d in runs) == 40
    for d in runs:
        assert sorted(f.name for f in d.iterdir()) == ["config.yaml", "metrics.jsonl", "study_time.json",
                                                       "tokenizer.json"], d
        timed = json.loads((d / "study_time.json").read_text())
        assert timed["wall_s"] > 0 and timed["jobs"] >= 1, d
        cfg = planned[d.name][1]
        assert same_config(d, cfg), d
        run = read_run(d)
        assert run.last_step == cfg.train.max_steps or run.diverged_at is not None, d


def test_the_carried_runs_are_listed_in_study_md(carried):
    """docs/STUDY.md's "Runs, in pieces" of the learning study ends with the number of runs the archive holds."""
    n = sum(d.is_dir() for d in (carried / "learning_cpu").iterdir())
    text = (REPO / "docs" / "STUDY.md").read_text().split("## The learning study (issue 55)", 1)[1]
    pieces = text.split("### Runs, in pieces", 1)[1].split("\n#", 1)[0]
    rows = [line for line in pieces.splitlines() if line.startswith("| 2026")]
    assert rows and f"{n} of 96" in rows[-1]


def test_the_learning_result_recomputes_from_the_archive_and_is_quoted_as_it_is(carried, planned, tmp_path):
    """docs/learning_cpu/figures/ holds what the analysis decided from all 96 runs: claims.md and claims.json are
    what analysis.learning computes again from the archive, and docs/STUDY.md carries the table between its
    markers. Its result states the positive control's outcome (primary, then secondary) before the learned share
    and the claims, each claim's and mechanism check's verdict as claims.json has it, and the share that learned
    (issue 55: at least half of the claims runs that did not fail)."""
    from musiclm_stab.analysis.learning import DOC_BEGIN, DOC_END, write_claims

    figures = DOCS / "figures"
    claims = json.loads((figures / "claims.json").read_text())
    folder = carried / "learning_cpu"
    assert sorted(d.name for d in folder.iterdir() if d.is_dir()) == sorted(planned)  # all 96
    md, js = write_claims([folder], tmp_path / "again", claims["levels"]["unigram_eval_cb0"])
    assert md.read_text() == (figures / "claims.md").read_text()
    assert by_name(json.loads(js.read_text())) == by_name(claims)
    summary = json.loads((figures / "summary.json").read_text())
    assert sorted(r["run"] for r in summary) == sorted(planned)

    share = claims["learned_share"]
    assert share["learned"] >= share["of"] / 2
    study = (REPO / "docs" / "STUDY.md").read_text()
    table = study.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0]
    assert table.strip() == (figures / "claims.md").read_text().strip()
    result = study.split("## The learning study (issue 55)", 1)[1].split("### The result: all 96 runs", 1)[1]
    result = result.split(DOC_BEGIN, 1)[0]

    control = claims["control"]
    primary = ("**The positive control " + ("detects" if control["detects"] else "does not detect")
               + " the literature's effect")
    absent = "the effect is **absent at this scale**" if control["absent"] else "**inconclusive**"
    secondary = ("**detects** the literature's direction" if control["survival_detects"]
                 else "does not detect the literature's direction")
    learned = f"{share['learned']} of the claims arm's {share['of']} runs that neither diverged nor lost their input"
    order = [primary, absent, secondary, "**The models learn.**", learned, "**The claims**"]
    order += [f"- ({c['key']}) **{c['verdict']}**" for c in claims["claims"]]
    order += ["**The mechanism checks**"]
    order += [f"- ({c['key']}) **{c['verdict']}**" for c in claims["mechanism"]["checks"]]
    at = [result.find(phrase) for phrase in order]
    assert all(i >= 0 for i in at), [phrase for phrase, i in zip(order, at) if i < 0]
    assert at == sorted(at), "the result states the control first, then the learned share, claims and checks"

    # the front door quotes the same result
    verdicts = {c["key"]: c["verdict"] for c in claims["claims"] + claims["mechanism"]["checks"]}
    assert verdicts == {"a": "absent", "b": "not testable at this scale", "c": "inconclusive", "d": "inconclusive",
                        "M1": "reproduced", "M2": "reproduced", "M3": "inconclusive"}
    readme = " ".join((REPO / "README.md").read_text().split())
    quoted = [f"{share['learned']} of the {share['of']} claims runs that neither diverged nor lost their input",
              "primary endpoint (warmup × Pre/Post-LN in bits, Xiong et al.) "
              + ("**detects**" if control["detects"] else "**does not detect**"),
              "the secondary endpoint " + ("**detects**" if control["survival_detects"] else "does not detect"),
              f"p {control['survival']['p']:.2g})",
              "Claim (a) is **absent**", f"Holm-adjusted TOST p {claims['claims'][0]['p_tost_adjusted']:.3g})",
              "(b) is **not testable at this scale**", "(c) and (d) are **inconclusive**",
              "M1 and M2 **reproduced**", "(M3) is **inconclusive**"]
    assert [q for q in quoted if q not in readme] == []


def test_the_headline_numbers_follow_from_the_raw_metrics_by_scipy(carried):
    """Independently of the analysis's endpoints and tests: from the archive's metrics.jsonl alone, with
    scipy's exact Wilcoxon, the control's interaction (both plain Post-LN cells at their cap, the first logged
    codebook-0 loss, as they lost their input in every seed), claim (a)'s early-loss differences and M1/M2's
    steps survived give the numbers claims.json (and the text) state."""
    import functools

    import numpy as np
    from scipy.stats import wilcoxon

    folder = carried / "learning_cpu"
    claims = json.loads((DOCS / "figures" / "claims.json").read_text())

    @functools.cache
    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]

    def logged(name: str, key: str) -> list:
        return [(r["step"], r[key]) for r in rows(name) if key in r]

    def final_cb0(name: str) -> float:
        return logged(name, "eval/acoustic_mlm_loss/cb0")[-1][1]

    def early(name: str) -> float:  # the mean training loss over the first quarter of the 1000 steps
        return float(np.mean([v for step, v in logged(name, "loss") if step <= 250]))

    def tost(d: list, margin: float) -> float:
        d = np.asarray(d)
        return max(wilcoxon(d + margin, alternative="greater", method="exact").pvalue,
                   wilcoxon(d - margin, alternative="less", method="exact").pvalue)

    run = "{}_tiny_lr{}_s{}".format
    interaction, a, m1, m2 = [], [], [], []
    for s in range(8):
        post_w, post_nw = run("control_postnorm_clip1_warmup", "3e-3", s), run("control_postnorm_clip1_nowarmup",
                                                                                  "3e-3", s)
        pre_w, pre_nw = run("study_prenorm_clip1_run2", "3e-3", s), run("control_prenorm_clip1_nowarmup", "3e-3", s)
        cap = {name: logged(name, "acoustic_mlm_loss/cb0")[0][1] for name in (post_w, post_nw)}
        interaction.append((cap[post_nw] - cap[post_w]) - (final_cb0(pre_nw) - final_cb0(pre_w)))
        a.append(early(pre_w) - early(run("study_prenorm_clip10_run1", "3e-3", s)))
        last = {name: logged(name, "loss")[-1][0] for name in (
            run(f"mech_prenorm_clip1_{arm}", "1e-1", s) for arm in ("fp16", "warmup30", "fp32"))}
        fp16, warmup, fp32 = last.values()
        m1.append(warmup - fp16)
        m2.append(fp32 - fp16)
    control = claims["control"]["part"]
    assert control["estimate"] == pytest.approx(float(np.median(interaction)), abs=1e-9)
    assert control["p"] == pytest.approx(wilcoxon(interaction, method="exact").pvalue)
    assert control["p_tost"] == pytest.approx(tost(interaction, 0.1))
    (part,) = claims["claims"][0]["parts"]
    assert part["estimate"] == pytest.approx(float(np.median(a)), abs=1e-6)
    assert part["p"] == pytest.approx(wilcoxon(a, method="exact").pvalue)
    assert part["p_tost"] == pytest.approx(tost(a, 0.694))
    for check, d in zip(claims["mechanism"]["checks"], (m1, m2)):
        (part,) = check["parts"]
        assert (part["estimate"], part["p"]) == (np.median(d), pytest.approx(wilcoxon(d, method="exact").pvalue))


def _member(archive: Path, name: str) -> str:
    import tarfile

    with tarfile.open(archive) as tar:
        f = tar.extractfile(name)
        assert f is not None, name
        return f.read().decode()
