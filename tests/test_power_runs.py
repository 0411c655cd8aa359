"""The learning study's power by simulated runs (analysis/power_runs.py; its rates: analysis/power_rates.py): its
runs are what read_run makes of their run directories and go through the analysis's own code, its rates are the
instability archive's, and a table reproduces from its seed."""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from archives import unpack

from musiclm_stab.analysis import failures, learning, learning_params, power_rates, power_runs
from musiclm_stab.analysis.claims import _plain
from musiclm_stab.analysis.decide import NOT_TESTABLE, REPRODUCED
from musiclm_stab.analysis.runs import read_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def short(monkeypatch):
    """A 60-step horizon for arm claims (the design's H is a placeholder; the simulation follows it)."""
    for where in (learning_params, learning):  # the simulated configs' horizon, and learning_role's
        monkeypatch.setattr(where, "H", 60)


def test_simulated_runs_are_what_read_run_makes_of_their_directories(tmp_path, short):
    """Every run of a simulated study (both arms; nothing planted, and M2's surviving fp32 run), written as a run
    directory (config.yaml, metrics.jsonl with a min_loss_scale event where it diverged) and read back by
    read_run, has the same endpoints through learning_run as the run held in memory, and the analysis of the
    runs read back is the in-memory one's."""
    for effect in (power_runs.NULL, "M2"):
        runs = power_runs.simulate(power_runs.DEFAULT_RATES, 2, 0, effect=effect)
        metrics = {}
        for r in runs:
            assert learning.learning_role(power_runs.config_of(r.role, r.seed)) == (r.arm, r.role)
            planted = effect if r.role in power_runs.PLANTED.get(effect, ()) else power_runs.NULL
            metrics[(r.role, r.seed)] = power_runs.study_run(power_runs.DEFAULT_RATES, r.role, r.seed, 0, 0, planted)
        root = tmp_path / effect
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a row read_run would skip is a defect of the writer
            back = [read_run(power_runs.write_run(m, root)) for m in metrics.values()]
        again, ignored = learning.learning_runs(back, power_runs.UNIGRAM)
        assert not ignored and len(again) == len(runs) == 24
        mine = {(r.role, r.seed): r for r in runs}
        for r in again:
            expected = {**_plain(mine[(r.role, r.seed)]), "path": None}
            assert {**_plain(r), "path": None} == expected, (effect, r.role, r.seed)
        assert _plain(learning.analyse(again)["claims"]) == _plain(learning.analyse(runs)["claims"])
        kinds = {r.role: r.kind for r in runs if r.seed == 0}
        assert kinds["m_fp16"] == "diverged" and kinds["m_fp32"] == ("none" if effect == "M2" else "diverged")
        assert all(kinds[role] == "none" for role in power_runs.CLAIM_ROLES)


def test_a_tiny_power_table_reproduces_from_its_seed_and_finds_clear_effects(short):
    """Two simulated studies at 8 seeds: the table is the same computed again from its seed; DeepNorm's gradient
    norm 0.3 ln lower and a warmup that prevents the Pre-LN failure are reproduced in both; with nothing
    planted no claim or check is reproduced; a study of 6 seeds is the first 6 blocks of the same runs."""
    table = power_runs.power_table(power_runs.DEFAULT_RATES, [8, 6], 2, base_seed=5)
    assert table == power_runs.power_table(power_runs.DEFAULT_RATES, [6, 8], 2, base_seed=5)
    assert table["seeds"] == [6, 8] and table["null_runs"]["learned_share"] == 1.0
    for effect, key in (("b", "b"), ("M1", "M1"), ("control 0.5", "control")):
        found = "detects" if key == "control" else REPRODUCED
        assert power_runs.share(table, effect, 8, key, [found]) == 1.0, effect
    assert all(power_runs.share(table, power_runs.NULL, 8, k, [REPRODUCED]) == 0 for k in power_runs.KEYS)
    md = power_runs.markdown(table)
    assert "| b: DeepNorm ln grad norm 0.3 lower (b reproduced) |" in md and "### The null study" in md


def test_the_default_rates_are_measured_on_the_instability_archive(tmp_path):
    """DEFAULT_RATES are what measure_rates finds on the instability study's archive (the runs at the calibration
    rates 3e-3 and 1e-2 and the Pre-LN failures at 1e-1): 72 calibration runs in 12 blocks, 24 failure steps."""
    wanted = ("_lr3e-3_", "_lr1e-2_", "_lr1e-1_")
    unpack(REPO / "docs" / "instability_cpu" / "runs.tar.xz", tmp_path,
           lambda name: name.startswith("instability_cpu/") and any(w in name for w in wanted))
    measured = asdict(power_rates.measure_rates([tmp_path / "instability_cpu"]))
    default = asdict(power_runs.DEFAULT_RATES)
    measured.pop("source"), default.pop("source")
    assert measured.pop("pre_ln_failure_steps") == default.pop("pre_ln_failure_steps")
    assert measured == pytest.approx(default, rel=1e-12)
    assert (measured["runs"], measured["blocks"], len(power_runs.DEFAULT_RATES.pre_ln_failure_steps)) == (72, 12, 24)


def test_the_command_refuses_what_it_cannot_use(tmp_path, capsys):
    """--rates naming a file that is not a rates file, and --measure on runs with none at the calibration rates,
    exit 2 with one line naming the reason; --studies 0 is a usage error."""
    bad = tmp_path / "rates.json"
    bad.write_text(json.dumps({"runs": 1}))
    assert power_runs.cli_main(["--out", str(tmp_path / "o"), "--rates", str(bad), "--studies", "1"]) == 2
    assert f"{bad}: not a rates file" in capsys.readouterr().err
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(json.dumps({"optim": {"lr": 0.5}, "train": {"seed": 0}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 80.0}) + "\n")
    assert power_runs.cli_main(["--out", str(tmp_path / "o"), "--measure", str(tmp_path / "runs")]) == 2
    assert "no run that did not fail at the calibration lrs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        power_runs.cli_main(["--out", str(tmp_path / "o"), "--studies", "0"])
    assert usage.value.code == 2 and not math.isnan(power_runs.DEFAULT_RATES.own_per_100)


# The tiny table of test_a_tiny_power_table... ([6, 8] seeds, 2 studies, base_seed 5, H = 60) with no dead-input
# scenario: sha256 of its counts and null-run numbers, json with sorted keys. First pinned before the scenario
# existed (ed93c9f); recomputed when the learning study's spike level became the trailing 25-step median and the
# simulated batch scatter came to grow with the fall (both fixed after the pilots, before the study's runs).
DEFAULT_SCENARIO = "4c73f64853c88a5b8232d3c1190799269bb5a48c0726c5208b0ee38e021a56eb"


def test_the_default_scenario_table_is_pinned_and_a_scenario_of_probability_0_is_it(short):
    """With no dead-input scenario, and with one of probability 0, the table's counts and null-run numbers are
    bit for bit the pinned ones: every run is the same run."""
    for dead in (None, {"deepnorm": (0.0, 20, 40)}):
        table = power_runs.power_table(power_runs.DEFAULT_RATES, [6, 8], 2, base_seed=5, dead=dead)
        old = {k: v for k, v in table["null_runs"].items() if k != "dead_input_share"}
        text = json.dumps({"counts": table["counts"], "null_runs": old}, sort_keys=True)
        assert hashlib.sha256(text.encode()).hexdigest() == DEFAULT_SCENARIO, dead


def test_a_dead_input_run_fails_by_dead_input_at_its_drawn_step(short):
    """A DeepNorm run whose frontend dies (probability 1, steps 20-40) is failed by the real analysis with kind
    "dead input" at its drawn step, did not learn, its frontend RMS below 1% of its first value from there to the
    end and its held-out cb0 from there within MARGIN_LEARNED of the unigram level; every other run, and the same
    run where it is planted into (common random numbers), is the run of the default scenario or dies alike."""
    dead = {"deepnorm": (1.0, 20, 40)}
    for effect in (power_runs.NULL, "b"):
        alive = power_runs.simulate(power_runs.DEFAULT_RATES, 3, 0, effect=effect)
        died = power_runs.simulate(power_runs.DEFAULT_RATES, 3, 0, effect=effect, dead=dead)
        for before, after in zip(alive, died):
            if after.role != "deepnorm":
                assert _plain(after) == _plain(before), (effect, after.role, after.seed)
                continue
            planted = effect if after.role in power_runs.PLANTED.get(effect, ()) else power_runs.NULL
            metrics = power_runs.study_run(power_runs.DEFAULT_RATES, after.role, after.seed, 0, 0, planted, dead=dead)
            step = power_runs.dead_input_at(dead, after.role, (0, 0, after.seed, power_runs.ROLE_KEYS[after.role]))
            assert 20 <= step <= 40 and (after.kind, after.kind_step, after.learned) == ("dead input", step, False)
            assert before.kind == "none" and before.learned
            steps, rms = failures.frontend_rms(metrics.in_unit("bits"))
            assert (rms[steps >= step] < failures.DEAD_SHARE * rms[0]).all() and (rms[steps < step] > 0.5 * rms[0]).all()
            evals, cb0 = metrics.metric(power_runs.EVAL_CB0)
            assert len(cb0[evals >= step]) and (abs(cb0[evals >= step] - power_runs.UNIGRAM) < learning_params.MARGIN_LEARNED).all()
        if effect == "b":
            steps_b = {r.seed: r.kind_step for r in died if r.role == "deepnorm"}
        else:
            steps_null = {r.seed: r.kind_step for r in died if r.role == "deepnorm"}
    assert steps_b == steps_null


def test_a_dead_deepnorm_leaves_claim_b_not_testable_and_the_table_says_so(tmp_path, short, capsys):
    """--dead deepnorm=1.0:20:40: the table's json and markdown state the scenario; every DeepNorm run dies, so 6
    of 7 claims runs learn and (b), which needs the four learned, is not testable in every study, which the
    markdown's null table says; bad --dead values exit 2 with one line naming the value and the reason."""
    out = tmp_path / "o"
    assert power_runs.cli_main(["--out", str(out), "--studies", "2", "--seeds", "3", "--dead", "deepnorm=1.0:20:40"]) == 0
    table = json.loads((out / "power_runs.json").read_text())
    assert table["scenario"] == {"dead_input": {"deepnorm": [1.0, 20, 40]}}
    assert table["null_runs"]["learned_share"] == pytest.approx(6 / 7)
    assert table["null_runs"]["dead_input_share"] == pytest.approx(1 / 7)
    assert power_runs.share(table, power_runs.NULL, 3, "b", [NOT_TESTABLE]) == 1.0
    md = (out / "power_runs.md").read_text()
    assert "| b not testable at this scale | 100% |" in md
    assert "DeepNorm's frontend dies (dead input) in 100% of its runs, at a step drawn from 20-40" in md
    capsys.readouterr()
    for bad, why in (("deepnorm=1.5:20:40", "probability"), ("nosuch=1:20:40", "role"), ("deepnorm=1:40:20", "steps"),
                     ("deepnorm=1:20:61", "steps"), ("deepnorm=1:20", "ROLE=P:FIRST:LAST")):
        assert power_runs.cli_main(["--out", str(out), "--studies", "1", "--seeds", "1", "--dead", bad]) == 2, bad
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err and bad in err, (bad, err)


def test_measuring_runs_without_a_block_of_two_is_refused_by_name(tmp_path, short, capsys):
    """--measure on runs whose every block (lr, seed) has one run that did not fail (the learning calibration:
    DeepNorm lost its input at both rates) exits 2 saying the run-to-run noise needs two runs of one block."""
    for seed in (0, 1):
        power_runs.write_run(power_runs.study_run(power_runs.DEFAULT_RATES, "clip1", seed, 0), tmp_path / "runs")
    assert power_runs.cli_main(["--out", str(tmp_path / "o"), "--measure", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "a run's own noise needs a block (lr, seed) with two runs that did not fail" in err
    assert "2 blocks of one run" in err


def test_post_ln_dying_later_with_warmup_is_what_the_controls_survival_interaction_detects(tmp_path, short):
    """--dead post_nw=1:10:20 --dead post_w=1:35:50: both plain Post-LN cells sit at the cap, so the control's
    primary (bits) cannot detect, while its secondary (steps survived) detects in every study of 8 seeds, and
    the markdown's null table says so."""
    out = tmp_path / "o"
    argv = ["--out", str(out), "--studies", "2", "--seeds", "8", "--dead", "post_nw=1:10:20", "--dead", "post_w=1:35:50"]
    assert power_runs.cli_main(argv) == 0
    table = json.loads((out / "power_runs.json").read_text())
    assert power_runs.share(table, power_runs.NULL, 8, "control survival", ["detects"]) == 1.0
    assert power_runs.share(table, power_runs.NULL, 8, "control", ["detects"]) == 0.0
    assert power_runs.share(table, "control 0.5", 8, "control", ["detects"]) == 0.0  # planted on a capped cell
    assert "| the control's secondary (steps survived) detects" in (out / "power_runs.md").read_text()
    assert "| 100.0% |" in (out / "power_runs.md").read_text()


def test_rates_measured_on_one_block_of_several_configurations_take_its_spread_as_run_noise(tmp_path, short):
    """The learning pilots' case: Pre-LN clip 1 with and without warmup in one block (seed 0; the study's roles
    tell them apart, where role6 would read both as clip 1) and clip 1 alone in another: the endpoints' run SD is
    the SD across the first block's two configurations, and the block SD, which no two blocks can give, equals
    it."""
    runs = [power_runs.study_run(power_runs.DEFAULT_RATES, role, seed, 0) for role, seed in
            (("clip1", 0), ("pre_nw", 0), ("clip1", 1))]
    for r in runs:
        power_runs.write_run(r, tmp_path / "runs")
    rates = power_rates.measure_rates([tmp_path / "runs"], calibration_lrs=[learning_params.L])
    assert (rates.runs, rates.blocks) == (3, 2)
    ends = {r.role: r for r in learning.learning_runs(runs, power_runs.UNIGRAM)[0] if r.seed == 0}
    expected = abs(ends["clip1"].early_loss - ends["pre_nw"].early_loss) / math.sqrt(2)
    assert rates.early_run_sd == pytest.approx(expected) and rates.early_block_sd == rates.early_run_sd
    lngrad = abs(math.log(ends["clip1"].median_grad_norm / ends["pre_nw"].median_grad_norm)) / math.sqrt(2)
    assert rates.lngrad_run_sd == pytest.approx(lngrad) and rates.lngrad_block_sd == rates.lngrad_run_sd


def test_the_simulated_batch_scatter_grows_with_the_fall():
    """At initialisation every batch costs about L0, so the simulated per-step scatter grows with the share of the
    fall made: with the learning pilots' numbers (L0 84.6, end 64.9 bits, tau 43 steps, batch and run SD 2.76 and
    1.76) the scatter about a 9-step mean over steps 5-20 is under half of that from step 500 on, where it is
    the SD of the two noises together, as in the pilots (1.0 and 2.6-3.2 bits)."""
    from dataclasses import replace

    rates = replace(power_runs.DEFAULT_RATES, l0=84.6, loss_end=64.9, tau=43.0, batch_sd=2.76, run_sd=1.76,
                    shared_share=0.0, spikes_per_100=0.0)
    early, late = [], []
    for seed in range(4):
        loss = power_runs.study_run(rates, "clip1", seed, 0).series["loss"][1]
        resid = loss - np.convolve(loss, np.ones(9) / 9, mode="same")
        early.append(resid[4:20]), late.append(resid[500:990])
    sd = lambda parts: float(np.std(np.concatenate(parts)))  # noqa: E731
    assert sd(early) < 0.5 * sd(late)
    assert sd(late) == pytest.approx(math.hypot(2.76, 1.76) * math.sqrt(8 / 9), rel=0.1)


def test_the_committed_rates_and_power_recompute_from_the_archives(tmp_path):
    """docs/learning_cpu/rates.json is what --measure finds on the committed archives (the pilots of the claims
    arm's schedule at L and the mechanism pilots, the calibration, the instability study's runs at 1e-1), and both
    power tables (power/: the pilots' dead-input scenario, power_alive/: none), committed with it before the
    study's runs, were drawn from those rates at the design's L, H and DELTA_EARLY."""
    docs = REPO / "docs" / "learning_cpu"
    unpack(docs / "pilots.tar.xz", tmp_path)
    unpack(docs / "calibration.tar.xz", tmp_path)
    unpack(REPO / "docs" / "instability_cpu" / "runs.tar.xz", tmp_path,
           lambda name: name.startswith("instability_cpu/") and "_lr1e-1_" in name)
    pilots = tmp_path / "learning_pilots"  # the claims arm's schedule at L, 8 layers, and the mechanism pilots
    four = ("prenorm_clip1_run2", "prenorm_clip10_run1", "prenorm_attnrelax_clip1", "postnorm_deepnorm_clip1")
    folders = [*(pilots / f"study_{r}_tiny_lr3e-3_s301" for r in four), *sorted(pilots.glob("mech_*")),
               tmp_path / "learning_calibration", tmp_path / "instability_cpu"]
    measured = asdict(power_rates.measure_rates(folders, calibration_lrs=[learning_params.L],
                                                spike_smooth=learning_params.SPIKE_SMOOTH))
    committed = json.loads((docs / "rates.json").read_text())
    measured.pop("source"), committed.pop("source")
    measured_steps = measured.pop("pre_ln_failure_steps")
    assert measured_steps == committed.pop("pre_ln_failure_steps")
    assert measured == pytest.approx(committed, rel=1e-9)
    design = {"L": learning_params.L, "H": learning_params.H, "DELTA_EARLY": learning_params.DELTA_EARLY,
              "MECH_STEPS": learning_params.MECH_STEPS}
    for scenario in ("power", "power_alive", "power_same"):
        table = json.loads((docs / scenario / "power_runs.json").read_text())
        rates = {k: v for k, v in table["rates"].items() if k != "source"}
        assert rates.pop("pre_ln_failure_steps") == measured_steps
        assert rates == pytest.approx(committed, rel=1e-12)
        assert {k: table["design"][k] for k in design} == design
