"""The whole stability study in one command: four training runs, one after another, then its four figures.

    musiclm-stab study --scale cpu               # the four runs at tiny size on CPU (~10 min on 2 cores)
    musiclm-stab study --scale full --print-only # the four `accelerate launch` lines and the plot line

``--scale full`` runs each study recipe (recipes/study_*.yaml) as written: run directories
``<runs>/<recipe name>``, figures in ``<runs>/study_figures``. ``--scale cpu`` runs the same four
configurations at tiny size: each recipe with the overlays recipes/overlays/tiny.yaml (its *tiny twin*)
and recipes/overlays/study_cpu.yaml layered on top, on the default corpus (made when missing), into
``<runs>/<name>/`` with figures in ``<runs>/<name>/figures``. Every run goes through the real
``accelerate launch recipes/pretrain.py``.

An existing run directory with the same resolved config is resumed (``--resume``; a finished run
returns at once), so an interrupted study continues where it stopped; one with another config is an
error, never overwritten.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from musiclm_stab.config import Config, ConfigError, load_config
from musiclm_stab.experiments.launch import (
    RECIPES,
    accelerate_executable,
    add_job_options,
    as_overrides,
    default_data,
    launch_command,
    run_state,
    shown,
)

# The study's runs in legend order: colour i of plot.COLOURS is run i (blue, orange, green, pink).
STUDY_RECIPES = (
    "study_prenorm_clip10_run1",
    "study_prenorm_clip1_run2",
    "study_postnorm_deepnorm_clip1",
    "study_prenorm_attnrelax_clip1",
)
FULL_FIGURES = "study_figures"  # <runs>/study_figures for --scale full

CPU_STUDY_NAME = "study_cpu"
# CPU scale: each recipe's tiny twin, then the CPU study's settings (later files win).
CPU_OVERLAYS = (RECIPES / "overlays" / "tiny.yaml", RECIPES / "overlays" / "study_cpu.yaml")


def recipe_path(stem: str) -> Path:
    return RECIPES / f"{stem}.yaml"


@dataclass
class StudyRun:
    """One of the study's runs: a recipe and the overrides that place and size it."""

    configs: list[Path]  # the recipe, then overlays
    overrides: list[str]

    def config(self) -> Config:
        """The resolved, validated config this run trains with."""
        return load_config(self.configs, self.overrides)

    def command(self, accelerate: str = "accelerate", single_process: bool = True, resume: bool = False
                ) -> list[str]:
        return launch_command(self.configs, self.overrides, accelerate=accelerate, single_process=single_process,
                              resume=resume)


@dataclass
class Study:
    scale: str  # "cpu" or "full"
    runs: list[StudyRun]
    figures_dir: Path

    def run_dirs(self) -> list[Path]:
        return [run.config().run_dir for run in self.runs]


def plan_study(
    scale: str,
    runs_dir: str | Path = "runs",
    data: str | Path | None = None,
    steps: int | None = None,
    name: str = CPU_STUDY_NAME,
    extra: list[str] | None = None,
) -> Study:
    """The four runs of the study at ``scale`` ("cpu": the recipes + CPU_OVERLAYS; "full": the recipes).

    ``data`` sets data.path (the recipes' own path is a placeholder), ``steps`` train.max_steps, and
    ``extra`` (``section.key=value``) is applied last to every run.
    """
    if scale not in ("cpu", "full"):
        raise ValueError(f"scale={scale!r}: choose cpu or full")
    runs_dir = Path(runs_dir)
    out = runs_dir / name if scale == "cpu" else runs_dir
    runs = []
    for stem in STUDY_RECIPES:
        configs = [recipe_path(stem), *(CPU_OVERLAYS if scale == "cpu" else ())]
        overrides = [f"--train.name={stem}_tiny"] if scale == "cpu" else []
        overrides.append(f"--train.output_dir={out}")
        if data is not None:
            overrides.append(f"--data.path={data}")
        if steps is not None:
            overrides.append(f"--train.max_steps={steps}")
            if scale == "cpu":  # keep the CPU warmup a tenth of the run, and the one checkpoint at its end
                overrides += [
                    f"--optim.warmup_steps={max(1, steps // 10)}",
                    f"--train.checkpoint_every={steps}",
                ]
        overrides += as_overrides(extra or [])
        runs.append(StudyRun(configs, merge_overrides(overrides)))
    study = Study(scale, runs, out / "figures" if scale == "cpu" else runs_dir / FULL_FIGURES)
    for run in runs:
        run.config()  # fail now, before hours of training, if any override is wrong
    return study


def merge_overrides(overrides: list[str]) -> list[str]:
    """One ``--key=value`` per setting: a later value replaces an earlier one in its place.

    load_config applies overrides in order, so the merged list resolves to the same config; it only
    keeps printed launch lines readable.
    """
    merged: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0]
        merged[key] = item
    return list(merged.values())


def plot_command(study: Study) -> list[str]:
    return [
        "musiclm-stab",
        "plot",
        *(shown(d) for d in study.run_dirs()),
        "--out",
        shown(study.figures_dir),
    ]


def summarize(run_dir: Path, last: int = 10) -> dict:
    """Numbers for the progress report: final loss (mean of the last ``last`` logged), grad-norm range."""
    from musiclm_stab.analysis.plot import read_run

    run = read_run(run_dir)
    out = {"label": run.label, "steps": run.last_step, "skipped_steps": int(len(run.skipped_steps))}
    for key, metric in (("loss", "loss"), ("musical", "musical_mlm_loss"), ("cb0", "acoustic_mlm_loss/cb0")):
        series = run.metric(metric)
        out[f"first_{key}"] = float(series[1][0]) if series else math.nan
        out[f"final_{key}"] = float(series[1][-last:].mean()) if series else math.nan
    norms = run.metric("grad_norm")
    out["grad_norm_min"] = float(norms[1].min()) if norms else math.nan
    out["grad_norm_max"] = float(norms[1].max()) if norms else math.nan
    out["grad_norm_max_step"] = int(norms[0][norms[1].argmax()]) if norms else None
    out["grad_norm_final"] = float(norms[1][-last:].mean()) if norms else math.nan
    return out


def format_summary(rows: list[dict]) -> str:
    head = (
        f"{'run':<44} {'steps':>5} {'loss first->final':>19} {'musical':>8} {'cb0':>7} "
        f"{'grad norm min..max@step (final)':>33} {'skipped':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:<44} {r['steps'] or 0:>5} {r['first_loss']:>8.3f} -> {r['final_loss']:>7.3f} "
            f"{r['final_musical']:>8.4f} {r['final_cb0']:>7.3f} "
            f"{r['grad_norm_min']:>9.2f} ..{r['grad_norm_max']:>7.2f}@{r['grad_norm_max_step'] or 0:<5} "
            f"({r['grad_norm_final']:>6.2f}) "
            f"{r['skipped_steps']:>7}"
        )
    return "\n".join(lines)


def run_study(study: Study, accelerate: str | None = None, threads: int | None = None) -> list[Path]:
    """Train the study's runs one after another through ``accelerate launch``, then draw the figures.

    ``threads`` sets OMP_NUM_THREADS of the runs (None: leave the environment as it is). Returns the
    written figure files. Progress: a banner per run, the trainer's step bar, and after each
    run its final numbers, the elapsed time and an estimate of the time left.
    """
    from musiclm_stab.analysis.plot import plot_runs, run_label

    accelerate = accelerate or accelerate_executable()
    for run in study.runs:  # refuse before training anything
        if run_state(run.config()) == "other":
            raise ConfigError(
                f"{run.config().run_dir} holds a run with another config; remove it or choose "
                f"another --runs / --name"
            )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0, rows = time.time(), []
    n = len(study.runs)
    for i, run in enumerate(study.runs):
        cfg = run.config()
        print(f"\n=== study run {i + 1}/{n}: {run_label(cfg.to_dict())} -> {cfg.run_dir}", flush=True)
        resume = run_state(cfg) != "new"
        if resume:
            print("(this run directory exists with the same config: resuming it)")
        cmd = run.command(accelerate, single_process=study.scale == "cpu", resume=resume)
        print(shlex.join(cmd), flush=True)
        started = time.time()
        subprocess.run(cmd, check=True, env=env)
        rows.append(summarize(cfg.run_dir))
        r, took = rows[-1], time.time() - started
        left = (time.time() - t0) / (i + 1) * (n - i - 1)
        print(
            f"--- run {i + 1}/{n} done in {took:.0f} s: loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}, "
            f"grad norm {r['grad_norm_min']:.2f}..{r['grad_norm_max']:.2f}; "
            f"about {left / 60:.1f} min left",
            flush=True,
        )
    print(f"\n=== figures -> {study.figures_dir}", flush=True)
    written = plot_runs(study.run_dirs(), study.figures_dir)
    (study.figures_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(format_summary(rows))
    print(f"\nstudy done in {(time.time() - t0) / 60:.1f} min. Figures:")
    for path in written:
        if path.suffix == ".png":
            print(f"  {path}")
    return written


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab study", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scale",
        choices=("cpu", "full"),
        default="cpu",
        help="cpu: the four runs at tiny size on CPU (default); full: the recipes as written",
    )
    p.add_argument(
        "--print-only",
        action="store_true",
        help="print the accelerate launch lines and the plot line (for a cluster), run nothing",
    )
    p.add_argument("--steps", type=int, help="train.max_steps of every run (default: the scale's)")
    p.add_argument("--runs", default="runs", help="folder for run directories (default: runs)")
    p.add_argument("--name", default=CPU_STUDY_NAME, help="cpu scale: the study's folder under --runs")
    add_job_options(p, "; cpu scale only")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")

    data = args.data
    if data is None and args.scale == "cpu" and not args.print_only:
        data = str(default_data(args.work))
    elif data is None and args.scale == "cpu":
        data = str(Path(args.work) / "default_corpus_tokens")
    try:
        study = plan_study(args.scale, args.runs, data, args.steps, args.name, args.extra)
        if args.print_only:
            env = f"OMP_NUM_THREADS={args.threads} " if args.scale == "cpu" and args.threads > 0 else ""
            for run in study.runs:
                print(env + shlex.join(run.command(single_process=args.scale == "cpu")))
            print(shlex.join(plot_command(study)))
            return 0
        run_study(study, threads=args.threads if args.scale == "cpu" and args.threads > 0 else None)
    except ConfigError as e:
        print(f"musiclm-stab study: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"musiclm-stab study: a run failed (exit {e.returncode}): {shlex.join(e.cmd)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
