"""The one-command study: launch lines for the cluster, the CPU and GPU plans (seeds, data order), and the
GPU study script run for real at tiny size on CPU."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from proc import run_group

from musiclm_stab.analysis.plot import run_label
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.data.codes_file import read_codes
from musiclm_stab.data.tokenized import codes_sha256
from musiclm_stab.experiments.launch import same_config
from musiclm_stab.experiments.study import carry_study, cli_main, run_study
from musiclm_stab.experiments.study_plan import (
    CONTROL,
    CONTROL_BASE,
    CPU_OVERLAYS,
    INSTABILITY_GRIDS,
    LR_GRIDS,
    SCALE_OVERLAYS,
    STUDY_RECIPES,
    figure_runs,
    lr_tag,
    merge_overrides,
    plan_study,
    recipe_path,
)
from musiclm_stab.experiments.study_probes import probed_already
from musiclm_stab.host import machine
from musiclm_stab.training.loss_scaler import EXIT_DIVERGED

REPO = Path(__file__).resolve().parent.parent

LABELS = [
    "Pre-Norm | Gradient Clip=10 | Run 1",
    "Pre-Norm | Gradient Clip=1 | Run 2",
    "Post-Norm | DeepNorm | Gradient Clip=1",
    "Pre-Norm | Attn. Relax | Gradient Clip=1",
]
FIGURES = ["loss.png", "grad_norm.png", "musical_mlm_loss.png", "acoustic_mlm_loss_cb0.png"]
EXTRA = ["acoustic_mlm_loss_codebooks.png", "grad_norm_log.png", "max_attn_logit.png", "max_attn_logit_layers.png",
         "eval.png"]


# The tiny model and batches the end-to-end study tests run
TINY = ["model.size=tiny", "model.cqt_bins=84", "model.cqt_bins_per_octave=12", "train.log_every=1",
        "data.batch_size=2", "data.crop_seconds=2.0", "data.eval_fraction=0.3", "data.num_workers=0"]


def test_full_print_only_lines_are_the_recipes(tmp_path, capsys):
    """--scale full --print-only prints one valid launch line per recipe and lr of the grid (legend order within
    an lr), the QK-norm control at the two top rates, then the plot line (the figure lr's four runs) and the
    claims line (every run)."""
    runs = tmp_path / "runs"
    assert cli_main(["--scale", "full", "--print-only", "--runs", str(runs), "--data", "/data/tokens"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    grid = LR_GRIDS["full"]
    expected = [(stem, lr) for lr in grid for stem in
                [*STUDY_RECIPES, *([CONTROL] if lr in sorted(grid)[-2:] else [])]]
    assert len(lines) == len(expected) + 2 == 16
    names = []
    for line, (stem, lr) in zip(lines, expected):
        argv = shlex.split(line)
        assert argv[:2] == ["accelerate", "launch"] and argv[2].endswith("recipes/pretrain.py")
        recipe = CONTROL_BASE if stem == CONTROL else stem
        assert argv[3] == "--config" and Path(argv[4]).name == f"{recipe}.yaml"
        cfg = load_config(argv[4], argv[5:])  # exactly what recipes/pretrain.py would parse
        assert (cfg.model.size, cfg.train.mixed_precision, cfg.train.fp16_mode, cfg.train.stop_at) == (
            "large", "fp16", "fairseq", 100_000)
        assert (cfg.optim.lr, cfg.model.qk_norm) == (lr, stem == CONTROL)
        assert (cfg.train.name, cfg.train.output_dir, cfg.data.path) == (
            f"{stem}_{lr_tag(lr)}_s0", str(runs), "/data/tokens")
        if stem != CONTROL:
            assert run_label(cfg.to_dict()) == LABELS[STUDY_RECIPES.index(stem)]
        names.append(cfg.train.name)
    plot = shlex.split(lines[-2])
    assert plot[:2] == ["musiclm-stab", "plot"]
    assert plot[2:6] == [str(runs / f"{stem}_lr4.5e-3_s0") for stem in STUDY_RECIPES]
    assert plot[6:8] == ["--out", str(runs / "study_figures")] and "--bands" in plot and "--extra" in plot
    claims = shlex.split(lines[-1])
    assert claims[:3] == ["python", "-m", "musiclm_stab.analysis.claims"]
    assert claims[3:-2] == [str(runs / n) for n in names] and claims[-2:] == ["--out", str(runs / "study_figures")]


def test_recipe_headers_show_the_tiny_twin_overlay_command():
    """Each study recipe's header shows the command that layers the tiny-twin overlay on it."""
    for stem in STUDY_RECIPES:
        text = recipe_path(stem).read_text()
        assert f"--config recipes/{stem}.yaml --config recipes/overlays/tiny.yaml" in text
        assert CPU_OVERLAYS[0].name == "tiny.yaml" and all(p.is_file() for p in CPU_OVERLAYS)


@pytest.fixture(scope="module")
def cpu_plan():
    """The committed CPU study's plan (``study --scale cpu`` on the hours256 corpus, as docs/study_cpu/ ran it),
    planned once for this module's tests, and each run's resolved config (each plan_study validates every
    run's config, and every config is read from its recipe files again: a second or more per ten runs)."""
    study = plan_study("cpu", "runs", data="work/hours256_tokens")
    return study, [run.config() for run in study.runs]


def test_cpu_plan_seeds_order_and_settings(cpu_plan, tmp_path):
    """CPU scale: 4 configurations x 3 lrs x 3 seeds plus the QK-norm control at the 2 top lrs, legends kept,
    the chosen regime in emulated fairseq fp16, seeds as train.seed, the data order paired by seed (default),
    shared, or independent per run; pilots' seeds from --first-seed."""
    study, configs = cpu_plan
    runs_dir = Path("runs")
    grid = LR_GRIDS["cpu"]
    per_seed = [(stem, lr) for lr in grid for stem in [*STUDY_RECIPES, *([CONTROL] if lr in grid[1:] else [])]]
    assert study.figures_dir == runs_dir / "study_cpu" / "figures" and len(study.runs) == 3 * len(per_seed) == 42
    assert study.figure_lr == grid[1] and len(figure_runs(study)) == 12
    for i, (run, cfg) in enumerate(zip(study.runs, configs, strict=True)):
        seed, (stem, lr) = i // len(per_seed), per_seed[i % len(per_seed)]
        assert (run.stem, run.lr, run.seed) == (stem, lr, seed)
        keys = [o.split("=", 1)[0] for o in run.overrides]
        assert len(keys) == len(set(keys))  # merged: one value per setting
        m = cfg.model.resolved()
        assert (m.size, m.num_layers, m.width, m.qk_norm) == ("tiny", 8, 128, stem == CONTROL)
        assert (cfg.train.mixed_precision, cfg.train.fp16_mode, cfg.train.fp16_impl) == ("fp16", "fairseq", "auto")
        assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.max_steps, cfg.data.crop_seconds) == (
            lr, 160, 2400, 2.0)
        assert (cfg.train.eval_every, cfg.train.diagnostics_every, cfg.data.eval_fraction) == (200, 100, 0.15)
        assert (cfg.train.fp16_scale_window, cfg.train.checkpoint_every) == (32, 400)  # MERT-330M's window
        assert cfg.run_dir == runs_dir / "study_cpu" / f"{stem}_tiny_{lr_tag(lr)}_s{seed}"
        assert (cfg.train.seed, cfg.data.order_seed, cfg.data_order_seed) == (seed, None, seed)
        if stem != CONTROL:
            assert cfg.data.path == "work/hours256_tokens" and run_label(cfg.to_dict()) == LABELS[STUDY_RECIPES.index(stem)]
    assert study.runs[0].configs[1:] == list(CPU_OVERLAYS)
    # the other orders over the whole grid, read from each run's overrides (reading 2 x 57 configs would add
    # seconds, not proof); that config() applies them is checked on the last run of each
    for order in ("shared", "independent"):
        runs = plan_study("cpu", tmp_path, data="x", order=order).runs
        seeds = [next(int(o.split("=")[1]) for o in r.overrides if o.startswith("--data.order_seed=")) for r in runs]
        assert len(runs) == len(study.runs) and {r.seed for r in runs} == {0, 1, 2}
        assert runs[-1].config().data_order_seed == seeds[-1]
        if order == "shared":
            assert set(seeds) == {0}
        else:
            assert len(set(seeds)) == len(runs)  # every run its own order
    pilot = plan_study("cpu", tmp_path, data="x", seeds=1, first_seed=100, lrs=(0.02,), control=False)
    assert [(r.seed, r.lr, r.stem) for r in pilot.runs] == [(100, 0.02, s) for s in STUDY_RECIPES]
    assert pilot.runs[0].config().run_dir.name == f"{STUDY_RECIPES[0]}_tiny_lr2e-2_s100"
    short = plan_study("cpu", tmp_path, data="x", steps=30, seeds=1, lrs=grid[:1], control=False).runs[2].config()
    assert (short.train.max_steps, short.optim.warmup_steps, short.train.checkpoint_every) == (30, 3, 30)
    assert (short.train.eval_every, short.train.diagnostics_every) == (5, 5)  # a multiple of log_every 5
    assert merge_overrides(["--a.b=1", "--c.d=2", "--a.b=3"]) == ["--a.b=3", "--c.d=2"]
    with pytest.raises(ConfigError, match="model.norm_scheme"):
        plan_study("cpu", tmp_path, data="x", extra=["model.norm_scheme=nope"])
    with pytest.raises(ValueError, match="learning rates must be > 0"):
        plan_study("cpu", tmp_path, data="x", lrs=(0.01, 0.0))


def test_gpu_plan_is_base_fp16_past_warmup(tmp_path):
    """GPU scale: the recipes + study_gpu.yaml at base size in fairseq fp16, 1000 steps past an 80-step warmup,
    at MERT-330M's lr and 3x, 10x it, the QK-norm control at the top two."""
    study = plan_study("gpu", tmp_path, data="/data/tokens")
    assert study.figures_dir == tmp_path / "study_gpu" / "figures" and len(study.runs) == 14
    assert [r.configs[1:] for r in study.runs] == [list(SCALE_OVERLAYS["gpu"])] * 14
    assert LR_GRIDS["gpu"] == (1.5e-3, 4.5e-3, 1.5e-2) and study.figure_lr == 4.5e-3
    for run in study.runs:
        cfg = run.config().resolved()
        assert (cfg.model.size, cfg.model.num_layers, cfg.train.mixed_precision) == ("base", 12, "fp16")
        assert (cfg.train.fp16_mode, cfg.optim.lr, cfg.model.qk_norm) == ("fairseq", run.lr, run.stem == CONTROL)
        assert (cfg.train.max_steps, cfg.optim.warmup_steps, cfg.train.fp16_scale_window) == (1000, 80, 32)
        m = cfg.model  # MERT-330M's regularization, as at the cpu scale
        assert (m.dropout, m.attention_dropout, m.feature_dropout, m.layerdrop, m.feature_grad_mult) == (0, 0, 0, 0, 1)
        assert cfg.data.mixup_max_seconds == 1.5
        assert cfg.train.eval_every and cfg.train.diagnostics_every
        assert cfg.run_dir == tmp_path / "study_gpu" / f"{run.stem}_gpu_{lr_tag(run.lr)}_s0"
    for run, label in zip(figure_runs(study), LABELS):
        assert run_label(run.config().to_dict()) == label


@pytest.mark.slow
def test_gpu_study_script_runs_at_tiny_size_on_cpu(tokenized_dataset, tmp_path, monkeypatch, capsys):
    """benchmarks/study_gpu.sh, the GPU study's one script, runs the whole path at tiny size on CPU: 4 real
    runs through accelerate (2 at a time), the figures with bands and extras, the claims table, one archive."""
    out = tmp_path / "out"
    tiny = [*TINY, "train.mixed_precision=no"]
    # STUDY_GPU_WHEELS empty: this venv's packages, not the GPU machine's wheels that benchmarks/gpu_prep.sh or
    # study_gpu_wheels.sh may have left in .whl/ (built for its Python, 3.12)
    env = {**os.environ, "PYTHON": sys.executable, "STUDY_ALLOW_CPU": "1", "OMP_NUM_THREADS": "1",
           "STUDY_GPU_WHEELS": ""}
    proc = run_group(["bash", str(REPO / "benchmarks" / "study_gpu.sh"), str(out), "--steps", "2",
                      "--jobs", "2", "--lrs", "1e-3", "--no-control", "--data", str(tokenized_dataset), "--set", *tiny],
                     timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = tmp_path / "out" / "runs" / "study_gpu"
    for stem in STUDY_RECIPES:
        rows = [json.loads(x) for x in (root / f"{stem}_gpu_lr1e-3_s0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and "eval/loss" in rows[-1]
    assert sorted(p.name for p in (root / "figures").glob("*.png")) == sorted(FIGURES + EXTRA + ["lr_sensitivity.png"])
    summary = json.loads((root / "figures" / "summary.json").read_text())
    assert [r["label"] for r in summary] == LABELS and all(r["steps"] == 2 for r in summary)
    sha = codes_sha256(tokenized_dataset)  # one set of codes: recorded per run and block, no line in claims.md
    assert [r["codes_sha256"] for r in summary] == [sha] * 4
    assert [c["codes_sha256"] for c in json.loads((root / "figures" / "claims.json").read_text())["codes"]] == [[sha]]
    claims = (root / "figures" / "claims.md").read_text()
    assert "Codes the runs trained on" not in claims
    assert all(f"| ({c})" in claims for c in "abcd")
    with tarfile.open(out / "study_gpu.tar.gz") as tar:
        names = tar.getnames()
    assert "figures/claims.md" in names and f"{STUDY_RECIPES[2]}_gpu_lr1e-3_s0/metrics.jsonl" in names
    assert "data.json" in names and f"{STUDY_RECIPES[1]}_gpu_lr1e-3_s0/study_time.json" in names
    # each finished run records the wall time of its launch; the study's timing.json gathers them
    timing = json.loads((root / "figures" / "timing.json").read_text())
    assert sorted(timing["run_times"]) == sorted(timing["run_wall_s"]) == sorted(f"{s}_gpu_lr1e-3_s0" for s in STUDY_RECIPES)
    for name, record in timing["run_times"].items():
        assert record == {"wall_s": timing["run_wall_s"][name], "jobs": 2, "threads_per_run": None, "resumed": False,
                          "machine": machine()}
        assert json.loads((root / name / "study_time.json").read_text()) == record
    assert timing["run_wall_s_over_jobs"] == pytest.approx(sum(timing["run_wall_s"].values()) / 2, abs=0.2)
    assert "study exited with 0" in (out / "study_gpu.log").read_text()
    # Carried to another machine without checkpoints (study --carry-to), the runs are read there, not trained.
    assert cli_main(["--scale", "gpu", "--runs", str(tmp_path / "out" / "runs"),
                     "--carry-to", str(tmp_path / "there" / "study_gpu")]) == 0
    there = tmp_path / "there" / "study_gpu"
    assert (there / "data.json").read_bytes() == (root / "data.json").read_bytes()
    for name in timing["run_times"]:
        assert sorted(p.name for p in (there / name).iterdir()) == sorted(
            ["config.yaml", "metrics.jsonl", "tokenizer.json", "study_time.json"])
    # The same study again (an interrupted study is rerun this way): its finished runs are read, not launched.
    def no_launch(*args, **kwargs):
        raise AssertionError(f"a finished run was launched again: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    again = plan_study("gpu", tmp_path / "out" / "runs", tokenized_dataset, steps=2, extra=tiny, lrs=(1e-3,),
                       control=False)
    # formats=() in the study's calls here: its figures are built (plot_runs' make_figures), not rendered to files
    # again (seconds each time): the script's run above rendered and checked them
    resumed = f"{STUDY_RECIPES[0]}_gpu_lr1e-3_s0"  # as if finished by a launch that resumed it: named, since
    record = timing["run_times"][resumed]  # its earlier launches are not in the summed cost
    (root / resumed / "study_time.json").write_text(json.dumps({**record, "resumed": True}))
    run_study(again, jobs=2, formats=())
    assert capsys.readouterr().out.count("not launched again") == 4
    assert json.loads((root / "figures" / "summary.json").read_text()) == summary
    again_timing = json.loads((root / "figures" / "timing.json").read_text())  # nothing trained by this piece,
    assert again_timing["run_wall_s"] == {} and again_timing["run_times"] == {  # all timed
        **timing["run_times"], resumed: {**record, "resumed": True}}
    assert timing["runs_resumed"] == [] and again_timing["runs_resumed"] == [resumed]
    # An interrupted run is resumed from its newest intact checkpoint; with none, trained from the start.
    partial = root / f"{STUDY_RECIPES[1]}_gpu_lr1e-3_s0"
    metrics = (partial / "metrics.jsonl").read_text()
    (partial / "metrics.jsonl").write_text("".join(
        row for row in metrics.splitlines(keepends=True) if json.loads(row).get("step") != 2))
    for ckpt, said in (("step_00000002", "resuming it from step 2"),
                       (None, "no checkpoint in it: training it from the start")):
        if ckpt is None:
            shutil.rmtree(partial / "checkpoints")
        else:
            assert sorted(p.name for p in (partial / "checkpoints").iterdir()) == [ckpt]
        with pytest.raises(AssertionError, match="launched again"):
            run_study(again, jobs=1, formats=())
        assert f"config: {said})" in capsys.readouterr().out
    (partial / "metrics.jsonl").write_text(metrics)
    # The codes the runs trained on are recorded beside them; a piece of the study on other codes is refused.
    record = json.loads((root / "data.json").read_text())
    assert record["codes_sha256"] == codes_sha256(tokenized_dataset)
    (root / "data.json").write_text(json.dumps({**record, "codes_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="codes sha256") as refused:
        run_study(again, jobs=2, formats=())
    assert f"this one: {machine()['cpu']}, {machine()['cpu_capability']} kernels" in str(refused.value)
    (root / "data.json").write_text(json.dumps(record))
    # Same directories, another config: refused before anything is launched.
    with pytest.raises(ConfigError, match="another config"):
        run_study(plan_study("gpu", tmp_path / "out" / "runs", tokenized_dataset, steps=3, extra=tiny, lrs=(1e-3,),
                             control=False))
    # The carried runs, put where the study's --runs has them on the other machine: read, not trained.
    shutil.rmtree(root)
    shutil.copytree(there, root)
    capsys.readouterr()
    run_study(again, jobs=2, formats=())
    assert capsys.readouterr().out.count("not launched again") == 4
    assert json.loads((root / "figures" / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_a_run_that_diverges_under_accelerate_launch_is_a_result(tokenized_dataset, tmp_path, capsys):
    """A run stopped by fp16's loss-scale floor exits with EXIT_DIVERGED, which `accelerate launch` reports as 1:
    the study reads the run's metrics, records it as diverged and goes on (on the GPU this stopped a study)."""
    from musiclm_stab.analysis.runs import read_run

    # a loss scale of 2^24 (the largest allowed) overflows fp16 at once (the musical MSE's gradient is scale x
    # masked frames); halved once, it is at the floor. An overflowed update is no update (fairseq): the run
    # diverges before its first step, at step 0. One run: a launch that exits 1 either stops the study (raises
    # here) or is read as a result, and a second such run would take the same branch again.
    diverging = TINY + ["train.mixed_precision=fp16", f"train.fp16_init_scale={2**24}",
                        f"train.fp16_min_loss_scale={2**23}"]
    study = plan_study("gpu", tmp_path, tokenized_dataset, steps=3, extra=diverging, lrs=(1e-3,), control=False,
                       only=("study_prenorm_clip1_run2",))
    assert len(study.runs) == 1
    run_study(study, jobs=1, formats=("png",))  # drawn: a run that diverged at step 0 is a curve to draw too
    out = capsys.readouterr().out
    assert read_run(study.runs[0].config().run_dir).diverged_at == 0
    summary = json.loads((study.figures_dir / "summary.json").read_text())
    assert [r["diverged_at"] for r in summary] == [0], out[-2000:]


@pytest.mark.parametrize("status", [2, EXIT_DIVERGED])
def test_a_launch_that_fails_without_diverging_stops_the_study_and_its_other_runs(tokenized_dataset, tmp_path,
                                                                                  status):
    """A launch that exits with an error and no loss-scale floor in its metrics is not a result: the study stops
    the run training beside it (jobs 2) and raises the failed launch's error, leaving no process behind; so it
    does when the launch exits with the diverged status but left no run to read. The launcher here is a
    stand-in for `accelerate launch` (the failure of a real one is the trainer's business): it keeps the first
    run busy and fails the second at once."""
    import random

    study = plan_study("gpu", tmp_path / "runs", tokenized_dataset, steps=3, extra=TINY, lrs=(1e-3,), control=False,
                       only=("study_prenorm_clip10_run1", "study_prenorm_clip1_run2"))
    busy, failing = (run.config().run_dir.name for run in study.runs)
    wait = f"{600 + random.random():.6f}"  # a sleep no other process on this machine runs
    launcher = tmp_path / "launcher.sh"
    launcher.write_text(f'#!/bin/sh\ncase "$*" in *{busy}*) exec sleep {wait};; esac\nexit {status}\n')
    launcher.chmod(0o755)
    if status == EXIT_DIVERGED:
        with pytest.raises(FileNotFoundError, match=f"{failing} does not exist"):
            run_study(study, accelerate=str(launcher), jobs=2, formats=())
    else:
        with pytest.raises(subprocess.CalledProcessError) as failed:
            run_study(study, accelerate=str(launcher), jobs=2, formats=())
        assert failed.value.returncode == status and failing in " ".join(failed.value.cmd)
    left = subprocess.run(["pgrep", "-f", f"sleep {wait}"], capture_output=True, text=True)
    assert left.returncode == 1, left.stdout  # 1: no such process
    assert not (study.figures_dir / "summary.json").exists()  # nothing drawn or decided from an incomplete study


@pytest.mark.slow
def test_gpu_study_script_stops_at_its_deadline_and_archives_what_it_has(tokenized_dataset, tmp_path):
    """STUDY_GPU_DEADLINE_S (a lease shorter than the study): the study and its runs are stopped, the runs
    checkpoint and end, and the archive holds what was written; no run is left running."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "STUDY_ALLOW_CPU": "1", "OMP_NUM_THREADS": "1",
           "STUDY_GPU_WHEELS": "", "STUDY_GPU_DEADLINE_S": "40"}
    proc = run_group(["bash", str(REPO / "benchmarks" / "study_gpu.sh"), str(out), "--steps", "100000", "--lrs",
                      "1e-3", "--no-control", "--only", "study_prenorm_clip1_run2", "--data", str(tokenized_dataset),
                      "--set", *TINY, "train.mixed_precision=no"], timeout=300, env=env)
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "study stopped at the deadline of 40 s" in (out / "study_gpu.log").read_text()
    with tarfile.open(out / "study_gpu.tar.gz") as tar:
        assert "data.json" in tar.getnames()
    left = subprocess.run(["pgrep", "-f", "--", f"--train.output_dir={out}/runs"], capture_output=True, text=True)
    assert left.returncode == 1 and left.stdout == "", (left.returncode, left.stdout, left.stderr)  # 1: none


def test_machine_names_the_cpu_and_the_kernels_in_use():
    """study_time.json's "machine": the CPU's name, the core count and torch's CPU kernel set, which
    ATEN_CPU_CAPABILITY changes (and with it float32 results: a study in pieces must know where each run ran)."""
    here = machine()
    assert isinstance(here["cpu"], str) and here["cpu"] and here["cpu_count"] == os.cpu_count()
    assert here["gpu"] is None or isinstance(here["gpu"], str)
    code = "import json; from musiclm_stab.host import machine; print(json.dumps(machine()))"
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}).stdout)
    assert there == {**here, "cpu_capability": "DEFAULT"}


def test_a_run_carried_to_another_folder_is_the_same_run_there(tmp_path):
    """same_config compares what a run trained with, not where it trained: a config.yaml written under one
    --runs folder (train.output_dir) is the plan's run in another one, so an unpacked archive of carried runs is
    read there, not refused; any other setting differing (here the lr) is still another config."""
    from musiclm_stab.experiments.launch import run_state

    # the plan's first run (the first seed, lr and configuration), planned without the 179 other runs
    first = {"data": "work/t", "design": "instability", "seeds": 1, "lrs": INSTABILITY_GRIDS["cpu"][:1]}
    made_at = plan_study("cpu", tmp_path / "where_it_trained", **first).runs[0].config()
    here = plan_study("cpu", tmp_path / "unpacked", **first).runs[0].config()
    assert made_at.train.output_dir != here.train.output_dir and made_at.run_dir.name == here.run_dir.name
    here.run_dir.mkdir(parents=True)
    (here.run_dir / "config.yaml").write_text(yaml.safe_dump(made_at.to_dict()))
    assert same_config(here.run_dir, here) and run_state(here) == "partial"  # the plan's run, no metrics yet
    other = made_at.to_dict()
    other["optim"]["lr"] *= 2
    (here.run_dir / "config.yaml").write_text(yaml.safe_dump(other))
    assert not same_config(here.run_dir, here) and run_state(here) == "other"


def test_carry_copies_finished_runs_without_checkpoints_and_refuses_a_mismatch(tmp_path, capsys):
    """carry_study: the finished runs (with study_time.json) and their probe, not checkpoints or an unfinished
    run; refused, with nothing copied, towards a study on other codes or over a run of another config."""
    here, dest = tmp_path / "here", tmp_path / "dest"
    for name, finished in (("a_s0", True), ("b_s0", True), ("c_s0", False)):
        run = here / name
        (run / "checkpoints" / "step_00000002").mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"train": {"name": name}}))
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        (run / "tokenizer.json").write_text("{}")
        if finished:
            (run / "study_time.json").write_text('{"wall_s": 1.0}')
    (here / "a_s0" / "probe").mkdir()
    (here / "a_s0" / "probe" / "probe.json").write_text("{}")
    (here / "a_s0" / "probe" / "features.pt").write_text("cache")
    with pytest.raises(ConfigError, match="no data.json"):
        carry_study(here, dest)
    (here / "data.json").write_text(json.dumps({"codes_sha256": "1" * 64}))
    dest.mkdir()
    (dest / "data.json").write_text(json.dumps({"codes_sha256": "2" * 64}))
    with pytest.raises(ConfigError, match="other codes"):
        carry_study(here, dest)
    (dest / "data.json").unlink()
    (dest / "b_s0").mkdir()
    (dest / "b_s0" / "config.yaml").write_text(yaml.safe_dump({"train": {"name": "other"}}))
    with pytest.raises(ConfigError, match="another config"):
        carry_study(here, dest)
    assert sorted(p.name for p in dest.rglob("*")) == ["b_s0", "config.yaml"]  # nothing copied
    shutil.rmtree(dest / "b_s0")
    assert carry_study(here, dest) == [dest / "a_s0", dest / "b_s0"]
    assert "not finished, left: c_s0" in capsys.readouterr().out
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(
        ["data.json", "a_s0/probe/probe.json", *(f"{r}/{f}" for r in ("a_s0", "b_s0") for f in
                                                 ("config.yaml", "metrics.jsonl", "tokenizer.json", "study_time.json"))])
    assert carry_study(here, dest) == [dest / "a_s0", dest / "b_s0"]  # again: the same runs, overwritten
    # the same run at dest, trained in another folder (an unpacked archive carried on): the same run
    (dest / "b_s0" / "config.yaml").write_text(yaml.safe_dump({"train": {"name": "b_s0", "output_dir": "/elsewhere"}}))
    assert carry_study(here, dest) == [dest / "a_s0", dest / "b_s0"]
    (here / "b_s0" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="lacks tokenizer.json"):
        carry_study(here, dest)


def test_study_codes_restores_the_recorded_codes_before_training(other_machine_tokens, tmp_path, capsys,
                                                                 monkeypatch):
    """A piece of a study on a machine whose tokenizing gave other codes is refused, naming --codes; with
    --codes FILE (saved where the study's codes were made) the data gets those codes and the study goes on."""
    from musiclm_stab.experiments import study as study_module

    original, other = other_machine_tokens
    runs = tmp_path / "runs"
    (runs / "s").mkdir(parents=True)
    want = read_codes(original)["header"]["codes_sha256"]
    (runs / "s" / "data.json").write_text(json.dumps({"data": "elsewhere", "codes_sha256": want}))
    argv = ["--scale", "gpu", "--runs", str(runs), "--name", "s", "--data", str(other), "--lrs", "1e-3",
            "--no-control", "--set", "model.size=tiny"]
    assert cli_main(argv) == 2  # the real run_study: refused before training anything
    err = capsys.readouterr().err
    assert f"{other} has codes sha256 {codes_sha256(other)}" in err and "--codes FILE" in err
    assert not (runs / "s" / "figures").exists()
    called = []
    monkeypatch.setattr(study_module, "run_study", lambda study, **kw: called.append(codes_sha256(other)))
    assert cli_main([*argv, "--codes", str(tmp_path / "nowhere.npz.xz")]) == 2
    assert "nowhere.npz.xz" in capsys.readouterr().err and not called
    broken = tmp_path / "broken.npz.xz"
    broken.write_bytes(b"\xfd7zXZ\x00 cut short")
    assert cli_main(["--runs", str(runs), "--work", str(tmp_path / "w"), "--codes", str(broken)]) == 2
    assert f"{broken} is not a codes file" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # said before the data preparation, not after it
    assert cli_main([*argv, "--codes", str(original)]) == 0
    assert "3 of " in capsys.readouterr().out and called == [want]
    with pytest.raises(SystemExit):
        cli_main([*argv, "--codes", str(original), "--print-only"])
    assert "not with --print-only" in capsys.readouterr().err


def test_print_only_names_each_scale_s_corpus(tmp_path, capsys):
    """Without --data, the CPU study trains on the 256 tracks of the `hours` preset it makes under
    --work (38 held-out tracks of five styles), the GPU study on the default corpus."""
    for scale, folder in (("cpu", "hours256_tokens"), ("gpu", "default_corpus_tokens")):
        assert cli_main(["--scale", scale, "--print-only", "--runs", str(tmp_path), "--work", str(tmp_path / "w"),
                         "--lrs", "1e-3", "--no-control", "--seeds", "1"]) == 0
        launches = [a for a in map(shlex.split, capsys.readouterr().out.splitlines()) if "launch" in a[:3]]
        assert len(launches) == 4
        assert all(f"--data.path={tmp_path / 'w' / folder}" in argv for argv in launches), launches[0]


def test_print_only_into_a_closed_pipe_stops_quietly(tmp_path):
    """`study --print-only | head -1` (the launch lines are meant for other tools): when the reader has gone,
    a quiet stop with the shell's SIGPIPE status, not a BrokenPipeError traceback. The pipe's read end is
    closed before the command starts, so its first write fails whatever the timing."""
    for short in ([], ["--lrs", "1e-3", "--no-control", "--only", "study_prenorm_clip1_run2"]):  # the plan, one run
        read, write = os.pipe()
        os.close(read)
        try:
            proc = subprocess.run([sys.executable, "-m", "musiclm_stab.cli", "study", "--scale", "full", "--print-only",
                                   "--runs", str(tmp_path), *short], stdout=write, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO, timeout=120)
        finally:
            os.close(write)
        assert proc.stderr == "" and proc.returncode == 141, proc.stderr[-2000:]


def test_a_broken_pipe_other_than_stdout_is_an_error(monkeypatch):
    """Only stdout's closed reader is a quiet stop: a broken pipe to a worker or a subprocess is raised."""
    import types

    from musiclm_stab import cli

    def broken(argv):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setitem(cli.COMMANDS, "broken", ("a module", "help", "page"))
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: types.SimpleNamespace(cli_main=broken))
    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        cli.main(["broken"])


def test_probe_every_first_seed_needs_probe(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["--print-only", "--runs", str(tmp_path), "--probe-every-first-seed"])
    assert "--probe-every-first-seed needs --probe" in capsys.readouterr().err


def test_carried_study_runs_are_the_committed_regime_finished_and_complete(cpu_plan):
    """The CPU study is run in pieces on machines that do not keep their files: each finished run travels in
    docs/study_cpu/runs/ (config.yaml, metrics.jsonl, tokenizer.json, study_time.json). Each must be a run of the committed
    plan with exactly the plan's config, trained to its last step (or ended by the loss-scale floor), and
    the carried runs must be the whole plan: on a clean clone this fails if a carried run was not committed."""
    import re

    from musiclm_stab.analysis.runs import read_run

    carried = REPO / "docs" / "study_cpu" / "runs"
    planned = {cfg.run_dir.name: cfg for cfg in cpu_plan[1]}  # plan_study("cpu", "runs", data="work/hours256_tokens")
    dirs = sorted(d for d in carried.iterdir() if d.is_dir())
    assert re.fullmatch(r"[0-9a-f]{64}", json.loads((carried / "data.json").read_text())["codes_sha256"])
    for d in dirs:
        assert {"config.yaml", "metrics.jsonl", "tokenizer.json", "study_time.json"} <= {f.name for f in d.iterdir()}, d
        timed = json.loads((d / "study_time.json").read_text())  # the study's measured cost sums these
        assert timed["wall_s"] > 0 and timed["jobs"] in (1, 2) and timed["threads_per_run"] == 1, d
        cfg = planned[d.name]
        assert same_config(d, cfg), d  # its config.yaml, settings added since read back as the run had them
        run = read_run(d)
        assert run.last_step == cfg.train.max_steps or run.diverged_at is not None, d
        # the final study probes seed 0 of the figure lr and of the best cell, and checkpoints do not travel:
        # every carried first-seed run of the four configurations carries the study's probe of its last step
        if cfg.train.seed == 0 and not d.name.startswith(CONTROL):
            assert probed_already(d) is not None, f"{d}: no probe/probe.json of the study's probe at its last step"
    assert sorted(d.name for d in dirs) == sorted(planned), "the committed study is the whole plan"


def test_committed_cpu_study_is_the_whole_plan_and_quoted_as_it_is(cpu_plan, tmp_path):
    """docs/study_cpu/figures/ holds what `study --scale cpu --probe` drew from the 42 carried runs: claims.json
    read every run, summary.json gives each run its lr, precision, fp16 mode and the held-out unigram level it
    is judged against; the carried runs give the committed claims.md again; docs/STUDY.md carries that table as
    generated and, with the README, quotes the learns line and the verdicts from claims.json."""
    from musiclm_stab.analysis.claims import DOC_BEGIN, DOC_END, write_claims

    figures = REPO / "docs" / "study_cpu" / "figures"
    planned = {cfg.run_dir.name for cfg in cpu_plan[1]}  # plan_study("cpu", "runs", data="work/hours256_tokens")
    claims = json.loads((figures / "claims.json").read_text())
    assert sorted(Path(d).name for d in claims["run_dirs"]) == sorted(planned)
    summary = json.loads((figures / "summary.json").read_text())
    assert sorted(r["run"] for r in summary) == sorted(planned)
    for r in summary:
        assert r["lr"] > 0 and r["precision"] == "fp16" and r["fp16_mode"] == "fairseq", r["run"]
        assert 9.0 < r["unigram_eval_cb0"] < 9.5, r["run"]
        assert r["diverged_at"] is not None or r["final_eval_cb0"] < r["unigram_eval_cb0"] + 1, r["run"]
    unigram = claims["learns"]["eval"]["unigram_eval_cb0"]
    again, _ = write_claims([REPO / "docs" / "study_cpu" / "runs"], tmp_path, unigram)
    assert again.read_text() == (figures / "claims.md").read_text()
    text = (REPO / "docs" / "STUDY.md").read_text()
    table = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0]
    assert table.strip() == (figures / "claims.md").read_text().strip()
    learns = claims["learns"]
    assert f"{learns['eval']['eval_cb0']:.3f} bits, {learns['eval']['below_unigram']:.3f} below" in text
    for c in claims["claims"]:
        assert f"({c['key']}) {c['verdict']}" in text, c["key"]
    readme = " ".join((REPO / "README.md").read_text().split())  # the front door quotes the same result
    assert f"{learns['eval']['below_unigram']:.3f} bits below the held-out unigram" in readme
    verdicts = [c["verdict"] for c in claims["claims"]]
    assert verdicts == ["refuted", "inconclusive", "inconclusive", "inconclusive"]
    assert f"Holm-adjusted p {claims['claims'][0]['p_adjusted']:.3g})" in readme
    assert "Claim (a) is **refuted**" in readme and "Claims (b), (c), (d) are **inconclusive**" in readme


def test_committed_gpu_study_is_the_gpu_plan_at_400_steps_and_quoted_as_it_is():
    """docs/study_gpu/ holds the one GPU study run so far (docs/STUDY.md, section 2): each run is the gpu
    plan's run at --steps 400 with exactly that config, finished or diverged, and the text quotes its
    learns line and verdicts from the committed claims.json."""
    from musiclm_stab.analysis.runs import read_run

    docs = REPO / "docs" / "study_gpu"
    # It ran before the overlay took MERT-330M's regularization: base size's MERT-95M values (declared there)
    mert95m = ["model.dropout=0.1", "model.attention_dropout=0.1", "model.feature_dropout=0.1", "model.layerdrop=0.05",
               "model.feature_grad_mult=0.1", "data.mixup_max_seconds=1.0"]
    planned = {r.config().run_dir.name: r.config() for r in plan_study(
        "gpu", "/tmp/sg/runs", data="/tmp/sg/work/default_corpus_tokens", steps=400, extra=mert95m,
        lrs=(1.5e-2, 4.5e-3, 1.5e-3)).runs}
    dirs = sorted(d for d in (docs / "runs").iterdir() if d.is_dir())
    assert sorted(d.name for d in dirs) == sorted(planned)
    for d in dirs:
        assert same_config(d, planned[d.name]), d
        run = read_run(d)
        assert run.last_step == 400 or run.diverged_at is not None, d
    claims = json.loads((docs / "figures" / "claims.json").read_text())
    text = (REPO / "docs" / "STUDY.md").read_text()
    learns = claims["learns"]["eval"]
    assert claims["learns"]["verdict"] == "no"
    assert f"{learns['eval_cb0']:.3f} bits, {learns['below_unigram']:.3f} below" in text
    assert f"unigram level ({learns['unigram_eval_cb0']:.3f}" in text
    verdicts = [c["verdict"] for c in claims["claims"]]
    assert verdicts == ["not testable at this scale", "inconclusive", "inconclusive", "inconclusive"]
    assert "(a) not testable" in text and "(b), (c), (d) inconclusive" in text
    diverged = sorted(r["run"] for r in json.loads((docs / "figures" / "summary.json").read_text())
                      if r["diverged_at"] is not None)
    assert diverged == sorted(f"{stem}_gpu_lr1.5e-2_s0" for stem in STUDY_RECIPES[1:] + (CONTROL,))


def test_the_committed_study_codes_are_those_the_study_goes_on_with():
    """data/study_cpu_codes.npz.xz (what `study --codes` puts into a machine's tokenizing) holds the codes
    docs/study_cpu/runs/data.json says the study's runs train on, and its arrays hash to them; the runs
    trained before the declared switch are carried ones, under the earlier codes."""
    import numpy as np

    from musiclm_stab.data.tokenized import sha256_of_codes
    from musiclm_stab.experiments.study_codes import codes_of

    record = json.loads((REPO / "docs" / "study_cpu" / "runs" / "data.json").read_text())
    saved = read_codes(REPO / "data" / "study_cpu_codes.npz.xz")
    assert saved["header"]["codes_sha256"] == record["codes_sha256"]
    ends = np.cumsum(np.prod(saved["shape"], axis=1))
    rows = ((track, saved["codes"][lo:hi].reshape(shape)) for track, shape, lo, hi in
            zip(saved["track"], saved["shape"], np.r_[0, ends[:-1]], ends))
    assert sha256_of_codes(rows) == record["codes_sha256"]
    carried = {d.name for d in (REPO / "docs" / "study_cpu" / "runs").iterdir() if d.is_dir()}
    earlier = [name for e in record.get("earlier_codes", []) for name in e["runs"]]
    assert set(earlier) <= carried and len(earlier) == len(set(earlier))
    assert all(codes_of(record, name) != record["codes_sha256"] for name in earlier)


def test_only_keeps_some_configurations_as_the_whole_plan_has_them(tmp_path, capsys):
    """--only: a piece smaller than a block (two seed-0 runs and their probes fit a sitting where four do
    not) trains those configurations' runs under the names, seeds and overrides of the whole plan."""
    kept = (STUDY_RECIPES[0], STUDY_RECIPES[2], CONTROL)
    whole = plan_study("cpu", tmp_path, data="work/hours256_tokens", first_seed=0, seeds=1)
    part = plan_study("cpu", tmp_path, data="work/hours256_tokens", first_seed=0, seeds=1, only=kept)
    assert [(r.stem, r.overrides) for r in part.runs] == [(r.stem, r.overrides) for r in whole.runs if r.stem in kept]
    assert {r.stem for r in part.runs} == set(kept) and part.lrs == whole.lrs
    with pytest.raises(ValueError, match="no run of the plan"):
        plan_study("cpu", tmp_path, data="x", lrs=(1e-3,), control=False, only=(CONTROL,))
    with pytest.raises(ValueError, match="study_prenorm_clip5"):
        plan_study("cpu", tmp_path, data="x", only=("study_prenorm_clip5",))
    argv = ["--print-only", "--runs", str(tmp_path), "--lrs", "1e-3", "--no-control", "--seeds", "1"]
    assert cli_main([*argv, "--only", STUDY_RECIPES[1]]) == 0
    launches = [a for a in map(shlex.split, capsys.readouterr().out.splitlines()) if "launch" in a[:3]]
    assert len(launches) == 1 and f"recipes/{STUDY_RECIPES[1]}.yaml" in launches[0]
    with pytest.raises(SystemExit):
        cli_main([*argv, "--only", CONTROL])
    assert "no run of the plan" in capsys.readouterr().err
