"""The whole stability study in one command: four training runs, one after another, then its four figures.

    musiclm-stab study --scale cpu               # the four runs at tiny size on CPU (~20 min on 2 cores)
    musiclm-stab study --scale full --print-only # the four `accelerate launch` lines and the plot line

``--scale full`` runs each study recipe (recipes/study_*.yaml) as written: run directories
``<runs>/<recipe name>``, figures in ``<runs>/study_figures``. ``--scale cpu`` runs the same four
configurations at tiny size: each recipe's *tiny twin* (the override line in the recipe's header
comment, read from there) plus the CPU-scale settings below, on the default corpus (built, weighed and
tokenized by quickstart's stages when missing), into ``<runs>/<name>/`` with figures in
``<runs>/<name>/figures``. Every run goes through the real ``accelerate launch recipes/pretrain.py``.

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

import yaml

from musiclm_stab.config import Config, ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
PRETRAIN = RECIPES / "pretrain.py"

# The study's runs in legend order: colour i of plot.COLOURS is run i (blue, orange, green, pink).
STUDY_RECIPES = (
    "study_prenorm_clip10_run1",
    "study_prenorm_clip1_run2",
    "study_postnorm_deepnorm_clip1",
    "study_prenorm_attnrelax_clip1",
)
FULL_FIGURES = "study_figures"  # <runs>/study_figures for --scale full

# CPU scale: applied after each recipe's tiny-twin overrides (later overrides win). Measured on the
# shared 2-core machine (docs/STUDY.md): 2 s crops and one thread keep a step near 0.3 s, and the study
# takes ~10 min. At the twins' lr of 1e-3 the tiny runs show no grad-norm spike (docs/STUDY.md, sweep);
# at a peak lr of 3e-2 they part ways right after warmup: loss and grad-norm spikes in some runs, at
# different steps and heights, none in others.
CPU_SCALE = (
    "--data.crop_seconds=2.0",
    "--optim.lr=3e-2",
    "--optim.warmup_steps=40",
    "--train.max_steps=400",
    "--train.checkpoint_every=400",
    "--train.keep_checkpoints=1",
)
CPU_STUDY_NAME = "study_cpu"
TWIN_MARK = "--model.size=tiny"  # how the tiny-twin line in a recipe's header is recognised


def recipe_path(stem: str) -> Path:
    return RECIPES / f"{stem}.yaml"


def tiny_twin_overrides(recipe: str | Path) -> list[str]:
    """The ``--section.key=value`` overrides of the tiny-twin command in a recipe's header comment.

    The header holds one comment line ``#   accelerate launch recipes/pretrain.py --config <recipe>
    --model.size=tiny ...``; that line is the single place the twin is defined.
    """
    path = Path(recipe)
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#") and TWIN_MARK in ln]
    if len(lines) != 1:
        raise ConfigError(
            f"{path}: expected one tiny-twin command ('# accelerate launch ... {TWIN_MARK} ...') "
            f"in the header comment, found {len(lines)}"
        )
    argv = shlex.split(lines[0].lstrip("# "))
    overrides = [a for a in argv if a.startswith("--") and "=" in a]
    if TWIN_MARK not in overrides:
        raise ConfigError(f"{path}: the tiny-twin line has no {TWIN_MARK} override")
    return overrides


@dataclass
class StudyRun:
    """One of the study's runs: a recipe and the overrides that place and size it."""

    recipe: Path
    overrides: list[str]

    def config(self) -> Config:
        """The resolved, validated config this run trains with."""
        return load_config(self.recipe, self.overrides)

    def command(self, accelerate: str = "accelerate", launch_args: tuple[str, ...] = ()) -> list[str]:
        return [
            accelerate,
            "launch",
            *launch_args,
            _shown(PRETRAIN),
            "--config",
            _shown(self.recipe),
            *self.overrides,
        ]


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
    """The four runs of the study at ``scale`` ("cpu": tiny twins + CPU_SCALE; "full": the recipes).

    ``data`` sets data.path (the recipes' own path is a placeholder), ``steps`` train.max_steps, and
    ``extra`` (``section.key=value``) is applied last to every run.
    """
    if scale not in ("cpu", "full"):
        raise ValueError(f"scale={scale!r}: choose cpu or full")
    runs_dir = Path(runs_dir)
    out = runs_dir / name if scale == "cpu" else runs_dir
    runs = []
    for stem in STUDY_RECIPES:
        recipe = recipe_path(stem)
        overrides = [*tiny_twin_overrides(recipe), *CPU_SCALE] if scale == "cpu" else []
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
        overrides += [e if e.startswith("--") else f"--{e}" for e in extra or []]
        runs.append(StudyRun(recipe, merge_overrides(overrides)))
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


def launch_args_for(scale: str) -> tuple[str, ...]:
    """``accelerate launch`` options: CPU runs one process without an accelerate config file (precision
    comes from the run's config); full scale takes the cluster's own ``accelerate config``."""
    if scale == "cpu":
        return (
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        )
    return ()


def plot_command(study: Study) -> list[str]:
    return [
        "musiclm-stab",
        "plot",
        *(_shown(d) for d in study.run_dirs()),
        "--out",
        _shown(study.figures_dir),
    ]


def _shown(path: Path) -> str:
    """A path as a person would type it here: relative to the working directory when under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _same_config(run: StudyRun) -> bool | None:
    """None: no run directory yet; True: it holds this very config (resume it); False: another one."""
    cfg = run.config()
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return None
    return yaml.safe_load(saved.read_text()) == yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def summarize(run_dir: Path, last: int = 10) -> dict:
    """Numbers for the progress report: final loss (mean of the last ``last`` logged), grad-norm range."""
    from musiclm_stab.plot import read_run

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
    from musiclm_stab.plot import plot_runs, run_label

    if accelerate is None:
        local = Path(sys.executable).with_name("accelerate")
        accelerate = str(local) if local.exists() else "accelerate"
    launch_args = launch_args_for(study.scale)
    for run in study.runs:  # refuse before training anything
        if _same_config(run) is False:
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
        cmd = run.command(accelerate, launch_args)
        if _same_config(run):
            cmd.append("--resume")
            print("(this run directory exists with the same config: resuming it)")
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


def prepare_default_tokens(work: Path) -> Path:
    """The default corpus's tokenized data under ``work``, made by quickstart's stages when missing."""
    from musiclm_stab.corpus import build_corpus
    from musiclm_stab.quickstart import ensure_tokens, ensure_weights

    print(f"\n=== default corpus, EnCodec weights and tokens under {work} (reused when there)", flush=True)
    corpus_dir = work / "default_corpus"
    build_corpus(corpus_dir, seed=0)  # quickstart's corpus (its default track count)
    weights, note = ensure_weights(corpus_dir, work)
    return ensure_tokens(corpus_dir, work / "default_corpus_tokens", weights, note)


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
    p.add_argument(
        "--data",
        help="tokenized dataset (default: cpu: the default corpus under --work; "
        "full: the recipes' data.path)",
    )
    p.add_argument(
        "--work", default="work", help="cpu scale without --data: folder for corpus, weights, tokens"
    )
    p.add_argument("--name", default=CPU_STUDY_NAME, help="cpu scale: the study's folder under --runs")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="extra",
        help="further overrides for every run (e.g. data.batch_size=2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="cpu scale: OMP_NUM_THREADS of each run (default 1: on 2 shared cores a tiny step "
        "took 0.45 s with one thread, 2.6 s with two); 0 leaves it unset",
    )
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")

    data = args.data
    if data is None and args.scale == "cpu" and not args.print_only:
        data = str(prepare_default_tokens(Path(args.work)))
    elif data is None and args.scale == "cpu":
        data = str(Path(args.work) / "default_corpus_tokens")
    try:
        study = plan_study(args.scale, args.runs, data, args.steps, args.name, args.extra)
        if args.print_only:
            env = f"OMP_NUM_THREADS={args.threads} " if args.scale == "cpu" and args.threads > 0 else ""
            for run in study.runs:
                print(env + shlex.join(run.command(launch_args=launch_args_for(args.scale))))
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
