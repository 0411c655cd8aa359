"""The learning study's analysis (analysis/learning.py): roles from the plan's configs, own spikes, the positive
control, the four verdicts of the claims and the mechanism checks, and the command on run directories."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from musiclm_stab.analysis import learning, learning_params, learning_report
from musiclm_stab.analysis.decide import ABSENT, INCONCLUSIVE, NOT_TESTABLE, REFUTED, REPRODUCED
from musiclm_stab.analysis.learning import (
    CLAIMS,
    DOC_BEGIN,
    DOC_END,
    MECHANISM,
    LearningRun,
    arm_blocks,
    claims_of,
    cli_main,
    control_of,
    control_score,
    learning_role,
    mark_own_spikes,
    mechanism_of,
)
from musiclm_stab.analysis.sweep_report import lr_text
from musiclm_stab.config import load_config

REPO = Path(__file__).resolve().parents[1]
CPU = [REPO / "recipes" / "overlays" / f for f in ("tiny.yaml", "study_cpu.yaml", "instability_cpu.yaml")]
RECIPE = {"clip10": "study_prenorm_clip10_run1", "clip1": "study_prenorm_clip1_run2",
          "deepnorm": "study_postnorm_deepnorm_clip1", "relax": "study_prenorm_attnrelax_clip1",
          "post": "study_postnorm_clip1"}
UNIGRAM = 9.3
CLAIM_ROLES = ("clip10", "clip1", "deepnorm", "relax", "pre_nw", "post_w", "post_nw")


def config(stem: str, *overrides: str) -> dict:
    """A run's config as the plan makes it: the recipe, the cpu overlays, the instability overlay, overrides."""
    return load_config([REPO / "recipes" / f"{RECIPE[stem]}.yaml", *CPU], list(overrides)).to_dict()


def claims_config(stem: str, *overrides: str, warmup: bool = True) -> dict:
    return config(stem, f"--optim.lr={learning_params.L}", f"--train.max_steps={learning_params.H}",
                  f"--optim.warmup_steps={round(0.08 * learning_params.H) if warmup else 0}", *overrides)


def mech_config(stem: str, *overrides: str) -> dict:
    return config(stem, f"--optim.lr={learning_params.MECH_LR}", f"--train.max_steps={learning_params.MECH_STEPS}",
                  *overrides)


def test_learning_role_reads_the_plans_configs():
    """The plan's configs (real recipes and overlays, the spec's overrides) read as their arm and role: the
    claims' four with warmup, the control's 2 x 2 (clip 1 is its Pre-LN with warmup), a deeper control with
    its depth in the role, its runs at 3L with the rate in the role, the five mechanism roles; anything else
    (QK-Norm, DeepNorm without warmup or deeper, relax at 3L, another rate or horizon, amp fp16, bf16, fp32
    with warmup, Post-Norm clip 1 or sdpa attention at the mechanism's rate) has none."""
    assert learning_role(claims_config("clip10")) == (CLAIMS, "clip10")
    assert learning_role(claims_config("clip1")) == (CLAIMS, "clip1")
    assert learning_role(claims_config("deepnorm")) == (CLAIMS, "deepnorm")
    assert learning_role(claims_config("relax")) == (CLAIMS, "relax")
    assert learning_role(claims_config("clip1", warmup=False)) == (CLAIMS, "pre_nw")
    assert learning_role(claims_config("post")) == (CLAIMS, "post_w")
    assert learning_role(claims_config("post", warmup=False)) == (CLAIMS, "post_nw")
    assert learning_role(claims_config("clip1", "--model.num_layers=24")) == (CLAIMS, "clip1_24L")
    assert learning_role(claims_config("post", "--model.num_layers=24", warmup=False)) == (CLAIMS, "post_nw_24L")
    three = f"--optim.lr={3 * learning_params.L}"  # the control's rule may run it at 3L (docs/STUDY.md)
    at3 = lr_text(3 * learning_params.L)
    assert learning_role(claims_config("clip1", three)) == (CLAIMS, f"clip1_lr{at3}")
    assert learning_role(claims_config("post", three, "--model.num_layers=24", warmup=False)) == (
        CLAIMS, f"post_nw_24L_lr{at3}")
    assert learning.control_roles(24, 3 * learning_params.L)["pre_w"] == f"clip1_24L_lr{at3}"
    assert learning_report.role_title("post_nw_24L_lr3e-2") == "Post-Norm, clip 1, no warmup (24L, lr3e-2)"
    assert learning_role(mech_config("clip1")) == (MECHANISM, "m_fp16")
    assert learning_role(mech_config("clip1", "--optim.warmup_steps=30")) == (MECHANISM, "m_warmup")
    assert learning_role(mech_config("clip1", "--train.mixed_precision=no")) == (MECHANISM, "m_fp32")
    assert learning_role(mech_config("post", "--optim.clip_grad=10", "--model.attention=math")) == (
        MECHANISM, "m_post10")
    assert learning_role(mech_config("post", "--optim.clip_grad=10", "--model.attention=relax")) == (
        MECHANISM, "m_post10_relax")
    base = {"claims": claims_config("clip1"), "deepnorm": claims_config("deepnorm"), "relax": claims_config("relax"),
            "mech": mech_config("clip1"),
            "post": mech_config("post")}
    for what, key, changes in (("claims", "model", {"qk_norm": True}),
                               ("claims", "optim", {"lr": 2 * learning_params.L}),
                               ("relax", "optim", {"lr": 3 * learning_params.L}),
                               ("claims", "train", {"max_steps": learning_params.H + 1}),
                               ("claims", "train", {"fp16_mode": "amp"}), ("claims", "train", {"mixed_precision": "bf16"}),
                               ("deepnorm", "optim", {"warmup_steps": 0}), ("deepnorm", "model", {"num_layers": 24}),
                               ("mech", "model", {"num_layers": 24}), ("post", "optim", {"clip_grad": 1.0}),
                               ("mech", "train", {"mixed_precision": "no"}), ("post", "model", {"attention": "sdpa"})):
        cfg = copy.deepcopy(base[what])
        cfg[key].update(changes)
        if what == "mech" and changes == {"mixed_precision": "no"}:
            cfg["optim"]["warmup_steps"] = 30  # fp32 with warmup: not in the design
        if what == "post" and "attention" in changes:
            cfg["optim"]["clip_grad"] = 10.0
        assert learning_role(cfg) is None, (what, changes)


def run(role: str, seed: int, arm: str = CLAIMS, *, early: float = 70.0, share: float = 0.7, grad: float = 2.0,
        final: float = 9.0, kind: str = "none", step: int | None = None, cap: float = 10.4,
        spikes: tuple[int, ...] = (), recovered: bool = True, cascades: int = 0, attn: float = 0.01,
        max_steps: int = 500, lr: float | None = None) -> LearningRun:
    """A run's endpoints as learning_run makes them (the fields the analysis reads)."""
    diverged = kind == "diverged"
    return LearningRun(
        path=f"{arm}/{role}_s{seed}", role=role, seed=seed,
        lr=lr if lr is not None else learning_params.L if arm == CLAIMS else learning_params.MECH_LR,
        precision="fp16 (fairseq)", kind=kind, kind_step=step, kind_why="", early_loss=early, clip_share_early=share,
        median_grad_norm=grad, recovered_spike=False, cascades=cascades, diverged=diverged,
        final_eval_cb0=math.nan if diverged else final, cap=cap, headroom={"attn_logit": attn}, arm=arm, layers=8,
        max_steps=max_steps,
        learned=arm == CLAIMS and kind == "none" and final <= UNIGRAM - learning_params.MARGIN_LEARNED,
        spike_steps=list(spikes), spike_recovered=[recovered] * len(spikes), spike_own=[True] * len(spikes))


def test_a_spike_shared_by_the_block_is_not_own():
    """A spike event starting within 3 steps of another role's event in the same block and arm is shared (the
    same hard batch); one in a single run is own, as is one 4 steps from the others', one matched only by a run
    of another block or of the other arm, or only by a run of the same role."""
    runs = [run("clip10", 0, spikes=(100, 250)), run("clip1", 0, spikes=(102,)), run("deepnorm", 0, spikes=(98, 300)),
            run("relax", 0, spikes=(104,)), run("clip10", 1, spikes=(300,)), run("m_fp16", 0, MECHANISM, spikes=(250,))]
    mark_own_spikes(runs)
    own = {(r.role, r.seed, r.arm): r.spike_own for r in runs}
    assert own[("clip10", 0, CLAIMS)] == [False, True] and own[("clip1", 0, CLAIMS)] == [False]
    assert own[("deepnorm", 0, CLAIMS)] == [False, True]
    assert own[("relax", 0, CLAIMS)] == [False]  # 104: within 3 of clip 1's 102
    assert own[("clip10", 1, CLAIMS)] == [True] and own[("m_fp16", 0, MECHANISM)] == [True]
    lone = [run("clip10", 0, spikes=(100,)), run("clip1", 0, spikes=(104,))]
    mark_own_spikes(lone)
    assert [r.spike_own for r in lone] == [[True], [True]]
    dn = runs[2]
    assert (dn.own_spikes, dn.shared_spikes, dn.own_recovered, dn.instability) == (1, 1, 1, 1.0)


def control_blocks(interaction: np.ndarray, noise: float, seed: int = 0) -> dict:
    """Eight blocks of the control's four runs, final held-out cb0 with block and run noise, ``interaction``
    (per block) added to Post-LN without warmup."""
    rng = np.random.default_rng(seed)
    runs = []
    for s in range(8):
        level = 9.0 + rng.normal(0, 0.05)
        for role in ("clip1", "pre_nw", "post_w", "post_nw"):
            extra = interaction[s] if role == "post_nw" else 0.0
            runs.append(run(role, s, final=level + extra + rng.normal(0, noise)))
    return arm_blocks(runs, CLAIMS)


def test_the_control_detects_a_planted_interaction_and_calls_none_absent():
    """Post-LN hurt 0.5 bits more by the missing warmup in every block: detected (8 positive of 8, p 2/256);
    nothing planted with run noise 0.1: not detected and not shown absent; nothing planted with run noise 0.005:
    not detected and absent (within +-0.1 bits); a diverged run is scored at its cap; the control's runs at 3L
    join their seed's block and are read when the control's rate is 3L."""
    planted = control_of(control_blocks(np.full(8, 0.5), 0.01))
    assert planted["detects"] and planted["part"].p == pytest.approx(2 / 256) and not planted["absent"]
    assert planted["cells"]["post_nw"] - planted["cells"]["post_w"] == pytest.approx(0.5, abs=0.02)
    noisy = control_of(control_blocks(np.zeros(8), 0.1))
    assert not noisy["detects"] and not noisy["absent"]
    quiet = control_of(control_blocks(np.zeros(8), 0.005))
    assert not quiet["detects"] and quiet["absent"] and quiet["part"].p_tost == pytest.approx(1 / 256)
    gone = run("post_nw", 0, kind="diverged", step=40, cap=10.4)
    assert control_score(gone) == 10.4 and control_score(run("post_nw", 0, final=9.1)) == 9.1
    blocks = control_blocks(np.zeros(8), 0.0)
    blocks[0]["post_nw"] = gone
    found = control_of(blocks)
    assert found["interaction"][0] == pytest.approx(10.4 - blocks[0]["post_w"].final_eval_cb0)
    assert found["failed"] == {"pre_w": 0, "pre_nw": 0, "post_w": 0, "post_nw": 1}
    at3 = learning.control_roles(8, 3 * learning_params.L)  # the control run at 3L: in its seed's block
    runs = [run(r, s, final=9.0 + 0.5 * (c == "post_nw"), lr=3 * learning_params.L)
            for s in range(8) for c, r in at3.items()]
    runs += [run(r, s) for s in range(8) for r in ("clip10", "clip1", "deepnorm", "relax")]
    blocks = arm_blocks(runs, CLAIMS)
    assert list(blocks) == list(range(8)) and len(blocks[0]) == 8
    assert control_of(blocks, 8, 3 * learning_params.L)["detects"] and not control_of(blocks)["seeds"]


def test_the_controls_survival_interaction_sees_warmup_postpone_post_lns_failure():
    """The control's secondary endpoint, the interaction of the steps survived: plain Post-LN losing its input at
    step 170 + s without warmup and 400 + s with it, Pre-LN surviving the horizon with and without: detected
    (+230 steps in each of 8 blocks, p 2/256), while the primary, both Post-LN cells at the cap, is not; both
    Post-LN runs dying at the same step: absent within +-10 steps; claims.md says both."""
    runs = []
    for s in range(8):
        runs += [run("clip1", s), run("pre_nw", s), run("post_w", s, kind="dead input", step=400 + s),
                 run("post_nw", s, kind="dead input", step=170 + s)]
    found = control_of(arm_blocks(runs, CLAIMS))
    assert found["survival_detects"] and not found["survival_absent"] and not found["detects"]
    assert found["survival"].estimate == 230 and found["survival"].p == pytest.approx(2 / 256)
    assert found["survived"] == {"pre_w": 500, "pre_nw": 500, "post_w": 403.5, "post_nw": 173.5}
    text = "\n".join(learning_report.control_markdown(found))
    assert "warmup postpones Post-LN's failure more than Pre-LN's (**detected**)" in text
    same = [run(r.role, r.seed, kind=r.kind, step=170 + r.seed) if r.role == "post_w" else r for r in runs]
    tied = control_of(arm_blocks(same, CLAIMS))
    assert tied["survival_absent"] and not tied["survival_detects"] and tied["survival"].estimate == 0
    assert "(**absent**, within +-10 steps)" in "\n".join(learning_report.control_markdown(tied))


def claims_blocks(seed: int = 0, **plant) -> dict:
    """Eight blocks of the four with small run noise (every claim's parts well inside their margins), and the
    planted effects: ``early`` / ``grad`` / ``own`` / ``cascades`` {role: shift} (grad: in ln)."""
    rng = np.random.default_rng(seed)
    runs = []
    for s in range(8):
        base_early, base_grad = 70 + rng.normal(0, 1), rng.normal(0.7, 0.2)
        for k, role in enumerate(("clip10", "clip1", "deepnorm", "relax")):
            own = plant.get("own", {}).get(role, 0)
            runs.append(run(role, s, early=base_early + rng.normal(0, 0.05) + plant.get("early", {}).get(role, 0.0),
                            grad=math.exp(base_grad + rng.normal(0, 0.02) + plant.get("grad", {}).get(role, 0.0)),
                            spikes=tuple(100 + 50 * k + 10 * i for i in range(own)),  # apart: own
                            cascades=plant.get("cascades", {}).get(role, 0),
                            share=plant.get("share", 0.7) if role == "clip1" else 0.0))
    return arm_blocks(runs, CLAIMS)


def verdicts(blocks: dict) -> dict[str, str]:
    return {c.key: c.verdict for c in claims_of(blocks)}


def test_each_claim_is_reproduced_refuted_or_absent_as_planted():
    """Nothing planted (small noise): all four absent; (a) clip 10 2 bits faster early: reproduced, 2 bits slower:
    refuted; (b) DeepNorm's gradient norm 0.5 ln below each: reproduced; (c) DeepNorm 2 own recovered spikes a
    run: reproduced; the others 2 each: inconclusive, as the design has it (3 parts against x Holm over 4 x the
    least p of 8 blocks, 2/256, is 0.094: a three-part claim cannot be refuted at 8 seeds); (d) relax 2 bits slower and clip 1 two cascades more: reproduced;
    only slower: inconclusive (the steadier part within its margin, the slower outside)."""
    assert verdicts(claims_blocks()) == {"a": ABSENT, "b": ABSENT, "c": ABSENT, "d": ABSENT}
    assert verdicts(claims_blocks(early={"clip10": -2.0}))["a"] == REPRODUCED
    assert verdicts(claims_blocks(early={"clip10": 2.0}))["a"] == REFUTED
    assert verdicts(claims_blocks(grad={"deepnorm": -0.5}))["b"] == REPRODUCED
    assert verdicts(claims_blocks(own={"deepnorm": 2}))["c"] == REPRODUCED
    reversed_c = {c.key: c for c in claims_of(claims_blocks(own={"clip10": 2, "clip1": 2, "relax": 2}))}["c"]
    assert reversed_c.verdict == INCONCLUSIVE and reversed_c.p_adjusted == pytest.approx(12 * 2 / 256)
    assert verdicts(claims_blocks(early={"relax": 2.0}, cascades={"clip1": 2}))["d"] == REPRODUCED
    assert verdicts(claims_blocks(early={"relax": 2.0}))["d"] == INCONCLUSIVE


def test_claims_not_testable_without_their_blocks_and_relax_said_idle():
    """(a) needs clip 1 clipping >= 20% of its early steps in 6 blocks; (a), (b) and (d)-slower need 6 blocks
    where their runs learned (3 of 8 DeepNorm runs that did not learn leave (b) 5); (d) says relax equals plain
    attention when no attention logit reached 0.1 of fp16's range."""
    assert verdicts(claims_blocks(share=0.1))["a"] == NOT_TESTABLE
    blocks = claims_blocks()
    for s in range(3):
        blocks[s]["deepnorm"].learned = False
    found = {c.key: c for c in claims_of(blocks)}
    assert found["b"].verdict == NOT_TESTABLE and "5 of 8 blocks" in found["b"].why
    assert found["a"].verdict == ABSENT and "relax equals plain attention" in found["d"].reason
    for s in range(3):
        blocks[s]["relax"].learned = False
    assert {c.key: c.verdict for c in claims_of(blocks)}["d"] == NOT_TESTABLE


def test_mechanism_checks_reproduced_absent_refuted():
    """M1: m_fp16 diverging at steps 20-55 while m_warmup trains all 120 steps: reproduced; M2: m_fp32 failing
    within 2 steps of m_fp16: absent; M3: relax failing at 30-65 where math trains: refuted; McNemar of failed
    beside each, not decided."""
    runs = []
    for s in range(8):
        at = 20 + 5 * s
        runs += [run("m_fp16", s, MECHANISM, kind="diverged", step=at, max_steps=120),
                 run("m_warmup", s, MECHANISM, max_steps=120),
                 run("m_fp32", s, MECHANISM, kind="diverged", step=at + (2 if s % 2 else -1), max_steps=120),
                 run("m_post10", s, MECHANISM, max_steps=120),
                 run("m_post10_relax", s, MECHANISM, kind="diverged", step=at + 10, max_steps=120)]
    found = mechanism_of(arm_blocks(runs, MECHANISM))
    assert [c.verdict for c in found["checks"]] == [REPRODUCED, ABSENT, REFUTED]
    m1 = found["mcnemar"]["M1"]
    assert (m1.n10, m1.n01) == (8, 0)
    assert found["mcnemar"]["M2"].p == 1.0


def rows_of(rng: np.random.Generator, steps: int, *, spikes: tuple[int, ...] = (), diverges_at: int | None = None,
            final: float = 9.0) -> list[dict]:
    """Metrics rows as the trainer writes them (every step; diagnostics every 5 steps; one evaluation at the
    end), the loss falling from 84 bits, each of ``spikes`` a one-step jump of 10 bits."""
    out = []
    for t in range(1, steps + 1):
        if diverges_at is not None and t >= diverges_at:
            out.append({"step": t, "event": "min_loss_scale", "loss_scale": 1e-4, "overflow_step": 7})
            break
        row = {"step": t, "loss": 84 - 12 * (1 - math.exp(-t / 10)) + rng.normal(0, 0.05) + 10 * (t in spikes),
               "acoustic_mlm_loss/cb0": 10.4 - 0.02 * t, "grad_norm": 2.0 + rng.normal(0, 0.1), "grad_clipped": 1.0,
               "features_pen": 0.1, "loss_scale": 64.0, "overflow_step": 0}
        if t % 5 == 0:
            row.update({"diag/max_attn_logit/layer0": 50.0 * t, "diag/headroom/residual/layer0": 0.02 * t,
                        "diag/headroom/residual/layer1": 0.01 * t, "diag/headroom/frontend": 1e-4})
        out.append(row)
    if diverges_at is None:
        out[-1]["eval/acoustic_mlm_loss/cb0"] = final
    return out


def write_run(root: Path, name: str, cfg: dict, rows: list[dict]) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_the_command_on_run_directories(tmp_path, monkeypatch):
    """Run directories of one block (a 40-step horizon here): the seven roles of arm claims with a hard batch at
    step 25 in every run and an own spike of DeepNorm's at 31, one that stalled (0.05 bits below the unigram
    level), one Pre-LN m_fp16 run diverging at step 23, and a run with no role. claims.md has the control first,
    then the claims, the mechanism checks (the failure's place: the residual stream at 0.4 at step 20) and the
    roles; claims.json the endpoints; --doc fills the markers; a missing folder exits 2; --unigram is required."""
    for where in (learning_params, learning):  # the configs' horizon, and the one learning_role reads
        monkeypatch.setattr(where, "H", 40)
    rng = np.random.default_rng(0)
    root = tmp_path / "runs"
    stems = {"clip10": ("clip10", True), "clip1": ("clip1", True), "deepnorm": ("deepnorm", True),
             "relax": ("relax", True), "pre_nw": ("clip1", False), "post_w": ("post", True),
             "post_nw": ("post", False)}
    for role, (stem, warm) in stems.items():
        cfg = claims_config(stem, "--train.seed=0", warmup=warm)
        spikes = (25, 31) if role == "deepnorm" else (25,)
        write_run(root / "claims", role, cfg, rows_of(rng, 40, spikes=spikes, final=9.25 if role == "relax" else 9.0))
    write_run(root / "mech", "m_fp16", mech_config("clip1", "--train.seed=0"), rows_of(rng, 120, diverges_at=23))
    write_run(root / "other", "qknorm", claims_config("clip1", "--model.qk_norm=true"), rows_of(rng, 40))
    doc = tmp_path / "STUDY.md"
    doc.write_text(f"before\n{DOC_BEGIN}\nold\n{DOC_END}\nafter\n")
    out = tmp_path / "out"
    assert cli_main([str(root), "--out", str(out), "--unigram", str(UNIGRAM), "--doc", str(doc)]) == 0
    md = (out / "claims.md").read_text()
    heads = [md.index(h) for h in ("### The positive control", "### The claims", "### The mechanism checks",
                                   "### Runs by role")]
    assert heads == sorted(heads) and heads[0] == 0
    assert "seed 0 diverged at 23 (residual 0.4 at step 20)" in md
    assert "Arm claims: 6 of 7 runs that neither diverged nor lost their input learned" in md
    assert "ignored: 1 (claims.json lists them)" in md
    assert md in doc.read_text() and doc.read_text().endswith(f"{DOC_END}\nafter\n")
    saved = json.loads((out / "claims.json").read_text())
    runs = {r["role"]: r for r in saved["runs"]}
    assert (runs["deepnorm"]["own_spikes"], runs["deepnorm"]["shared_spikes"], runs["deepnorm"]["own_recovered"]) == (
        1, 1, 1)
    assert all((r["own_spikes"], r["shared_spikes"]) == (0, 1) for k, r in runs.items() if k not in ("deepnorm", "m_fp16"))
    assert runs["relax"]["kind"] == "stalled" and runs["relax"]["failed"] and not runs["relax"]["learned"]
    assert runs["m_fp16"]["survived"] == 23 and runs["m_fp16"]["failure_headroom"]["residual"] == pytest.approx(0.4)
    assert runs["clip1"]["survived"] == 40 and runs["clip1"]["learned"]
    assert saved["ignored"] == [str(root / "other" / "qknorm")]
    assert cli_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), "--unigram", "9.3"]) == 2
    with pytest.raises(SystemExit) as refused:
        cli_main([str(root), "--out", str(tmp_path / "x")])
    assert refused.value.code == 2


def test_the_parameters_live_in_learning_params_and_learning_hands_them_on():
    """Each pre-registered parameter is analysis/learning_params.py's (the one file the pre-registration fixes),
    and ``from musiclm_stab.analysis.learning import L`` (or any other of them) gives the same value."""
    names = {n for n in vars(learning_params) if n.isupper()}
    assert {"L", "H", "DELTA_EARLY", "CONTROL_LAYERS", "CONTROL_LR", "MARGIN_LEARNED", "MECH_CHECKS"} <= names
    assert {n: getattr(learning, n) for n in names} == {n: getattr(learning_params, n) for n in names}
    assert names <= set(learning.__all__)


def test_the_documented_command_runs_as_a_module():
    """``python -m musiclm_stab.analysis.learning``, the command its docstring documents, still runs its command
    line now that its tables are learning_report.py's."""
    done = subprocess.run([sys.executable, "-m", "musiclm_stab.analysis.learning", "--help"], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m musiclm_stab.analysis.learning") and "--control-lr" in done.stdout
