"""The whole stability study in one command: the four configurations over seeds, figures and the claims table.

    musiclm-stab study --scale cpu               # 4 configurations x 3 seeds at CPU size (docs/STUDY.md)
    musiclm-stab study --scale gpu               # 4 configurations at base size, fp16, on one CUDA GPU
    musiclm-stab study --scale full --print-only # the `accelerate launch` lines, the plot and claims lines

``--scale full`` runs each study recipe (recipes/study_*.yaml) as written: run directories
``<runs>/<recipe name>`` (``_s<seed>`` appended with several seeds), figures in ``<runs>/study_figures``.
``--scale cpu`` and ``--scale gpu`` run the same four configurations smaller: each recipe with the scale's
overlays layered on top (SCALE_OVERLAYS: cpu = recipes/overlays/tiny.yaml, the *tiny twin*, then
recipes/overlays/study_cpu.yaml; gpu = recipes/overlays/study_gpu.yaml), on the default corpus (made when
missing), into ``<runs>/<name>/<recipe>_<scale>_s<seed>`` with figures, ``claims.md`` and ``summary.json``
in ``<runs>/<name>/figures``. Every run goes through the real ``accelerate launch`` of the trainer.

Seeds and data order (``--seeds N`` runs seeds 0..N-1 as ``train.seed``; ``--order``):
  paired       (default) the runs of one seed share a data order (``data.order_seed`` unset = train.seed)
               and the seeds differ: a difference between two configurations at one seed is not moved
               by which batches came when (the claims' paired tests), and the spread over seeds covers
               both the init and the data order.
  shared       every run sees one order (``data.order_seed=0``): seeds differ only in init and dropout.
  independent  every run its own order (``data.order_seed`` = 1000 + 10 x seed + configuration).

``--jobs N`` trains N runs at a time (cpu scale default 2, one torch thread each: on 2 cores this beats
one run with two threads); each run's output then goes to ``<runs>/<name>/logs/<run>.log``.

An existing run directory with the same resolved config is resumed (``--resume``) or, when it already
reached its last step (or diverged), only read, so an interrupted study continues where it stopped; one
with another config is an error, never overwritten.

The plan (configurations, overlays, seeds, data orders, launch lines) is experiments/study_plan.py; this
module runs it, probes it (experiments/study_probes.py) and writes the figures, the claims table and the timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import yaml

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.experiments.launch import (
    STUDY_RENDERER,
    accelerate_executable,
    add_job_options,
    data_name,
    default_data,
    run_state,
    trained_with,
)
from musiclm_stab.experiments.study_codes import (
    DATA_RECORD,
    RUN_TIME_FILE,
    check_study_data,
    merge_records,
    read_record,
    run_codes_sha256,
    switch_codes,
)
from musiclm_stab.experiments.study_plan import (
    ARMS,
    CONTROL,
    DEFAULT_JOBS,
    DESIGNS,
    INSTABILITY_STEMS,
    LEARNING,
    LEARNING_ROLES,
    ORDERS,
    SCALES,
    STUDY_DATA,
    Study,
    claims_command,
    default_name,
    figure_runs,
    plan_study,
    plot_command,
)
from musiclm_stab.experiments.study_probes import probe_study
from musiclm_stab.host import machine
from musiclm_stab.training.loss_scaler import EXIT_DIVERGED


def summarize(run_dir: Path, last: int = 10, unigram_eval_cb0: float = math.nan, stalls: bool = True,
              stall_margin: float | None = None) -> dict:
    """One run's row of summary.json and the progress report: its lr, precision and seed; final losses
    (training: mean of the last ``last`` logged; held-out: the last evaluation) beside the held-out unigram
    level it is judged against; grad-norm range; skipped and overflowed updates (a divergence's own
    included) and spike cascades; divergence; its failure kind and step (analysis/failures.py: none,
    diverged, dead input, stalled) and the largest fp16 headroom of each place logged; the sha256 of the
    codes it trained on (by the study folder's data.json; None without one). ``stalls`` False: no run is
    found stalled (the instability design does not assess stalls: docs/STUDY.md); ``stall_margin``: bits below the
    unigram level a run must end not to be stalled (None: failures.STALL_MARGIN)."""
    from musiclm_stab.analysis.failures import STALL_MARGIN, cascades, failure
    from musiclm_stab.analysis.instability import headroom_of
    from musiclm_stab.analysis.plot import read_run

    run = read_run(run_dir)
    found = failure(run.in_unit("bits"), unigram_eval_cb0 if stalls and math.isfinite(unigram_eval_cb0) else None,
                    STALL_MARGIN if stall_margin is None else stall_margin)
    train, optim = run.config.get("train") or {}, run.config.get("optim") or {}
    out = {"label": run.label, "run": run.name, "seed": train.get("seed"), "lr": optim.get("lr"),
           "precision": train.get("mixed_precision"),
           "fp16_mode": train.get("fp16_mode") if train.get("mixed_precision") == "fp16" else None,
           "steps": run.last_step, "skipped_steps": int(len(run.skipped_steps)),
           "diverged_at": getattr(run, "diverged_at", None), "unigram_eval_cb0": unigram_eval_cb0,
           "codes_sha256": run_codes_sha256(run_dir)}
    overflow = run.metric("overflow_step")
    out["overflow_steps"] = (int(overflow[1].sum()) if overflow else 0) + run.final_overflows
    out["cascades"] = len(cascades(run))
    out["failure"], out["failure_step"] = found.kind, found.step
    out["headroom"] = {place: (v if math.isfinite(v) else str(v)) for place, v in headroom_of(run).items()}
    for key, metric in (("loss", "loss"), ("musical", "musical_mlm_loss"), ("cb0", "acoustic_mlm_loss/cb0"),
                        ("eval_loss", "eval/loss"), ("eval_cb0", "eval/acoustic_mlm_loss/cb0")):
        series = run.metric(metric)
        out[f"first_{key}"] = float(series[1][0]) if series else math.nan
        out[f"final_{key}"] = float(series[1][-last:].mean()) if series and not key.startswith("eval") else (
            float(series[1][-1]) if series else math.nan)
    norms = run.metric("grad_norm")
    out["grad_norm_min"] = float(norms[1].min()) if norms else math.nan
    out["grad_norm_max"] = float(norms[1].max()) if norms else math.nan
    out["grad_norm_max_step"] = int(norms[0][norms[1].argmax()]) if norms else None
    out["grad_norm_final"] = float(norms[1][-last:].mean()) if norms else math.nan
    return out


def format_summary(rows: list[dict]) -> str:
    head = (
        f"{'run':<44} {'lr':>7} {'seed':>4} {'steps':>5} {'loss first->final':>19} {'cb0':>7} {'eval cb0':>8} "
        f"{'(unigram)':>9} {'grad norm min..max@step (final)':>33} {'overflow':>8} {'failure':>16}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:<44} {r.get('lr') or 0:>7.2g} {r.get('seed') or 0:>4} {r['steps'] or 0:>5} "
            f"{r['first_loss']:>8.3f} -> {r['final_loss']:>7.3f} {r['final_cb0']:>7.3f} {r['final_eval_cb0']:>8.3f} "
            f"{r['unigram_eval_cb0']:>9.3f} "
            f"{r['grad_norm_min']:>9.2f} ..{r['grad_norm_max']:>7.2f}@{r['grad_norm_max_step'] or 0:<5} "
            f"({r['grad_norm_final']:>6.2f}) {r['overflow_steps']:>8} {_failure_text(r):>16}"
        )
    return "\n".join(lines)


def _failure_text(row: dict) -> str:
    kind, step = row.get("failure", "none"), row.get("failure_step")
    return "-" if kind == "none" else kind if step is None else f"{kind}@{step}"


def run_times(run_dirs: list[Path]) -> dict[str, dict]:
    """Each run's RUN/study_time.json (the wall time of the launch that finished it, with the jobs beside it),
    by run name, for the runs that have one: a study run in pieces sums its cost from these."""
    return {d.name: json.loads((d / RUN_TIME_FILE).read_text()) for d in run_dirs if (d / RUN_TIME_FILE).is_file()}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


CARRIED = ("config.yaml", "metrics.jsonl", "tokenizer.json", RUN_TIME_FILE)


def carry_study(folder: Path, dest: Path) -> list[Path]:
    """Copy the study's finished runs in ``folder`` to ``dest`` without their checkpoints, for another machine
    to go on with the study (docs/STUDY.md, "In pieces"): each run's ``CARRIED`` files and its probe
    (probe/probe.json), and the codes record data.json. A finished run is one the study wrote
    RUN/study_time.json for (trained to its last step, or diverged); the others are left and named. Refused
    (ConfigError), before anything is copied: a ``folder`` without data.json, a ``dest`` whose data.json
    records other codes (or another history of earlier codes: study_codes.merge_records), a run at ``dest``
    of the same name with another config, a finished run lacking a file. Returns the run directories written
    at ``dest``."""
    ours = read_record(folder)
    if ours is None:
        raise ConfigError(f"{folder} has no {DATA_RECORD}: not the folder of a study whose runs were trained")
    record = merge_records(ours, read_record(dest), dest / DATA_RECORD)
    runs = sorted(d for d in folder.iterdir() if (d / "config.yaml").is_file())
    finished = [d for d in runs if (d / RUN_TIME_FILE).is_file()]
    for d in finished:
        missing = [name for name in CARRIED if not (d / name).is_file()]
        if missing:
            raise ConfigError(f"{d} is finished but lacks {', '.join(missing)}")
        other = dest / d.name / "config.yaml"
        if other.is_file() and (trained_with(yaml.safe_load(other.read_text()) or {})
                                != trained_with(yaml.safe_load((d / "config.yaml").read_text()) or {})):
            raise ConfigError(f"{other.parent} holds a run with another config than {d}: not overwritten")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / DATA_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    for d in finished:
        (dest / d.name).mkdir(exist_ok=True)
        for name in CARRIED:
            shutil.copyfile(d / name, dest / d.name / name)
        probe = d / "probe" / "probe.json"
        if probe.is_file():
            (dest / d.name / "probe").mkdir(exist_ok=True)
            shutil.copyfile(probe, dest / d.name / "probe" / "probe.json")
    left = [d.name for d in runs if d not in finished]
    print(f"carried {len(finished)} finished runs of {folder} and its {DATA_RECORD} to {dest}"
          + (f"; not finished, left: {', '.join(left)}" if left else ""))
    return [dest / d.name for d in finished]


def _diverged(run_dir: Path) -> bool:
    """Whether the run's metrics record fp16's loss-scale floor (a min_loss_scale event)."""
    from musiclm_stab.analysis.runs import read_run

    try:
        return (run_dir / "metrics.jsonl").is_file() and read_run(run_dir).diverged_at is not None
    except (OSError, ValueError):  # unreadable metrics: the launch's failure is what to report
        return False


def run_study(study: Study, accelerate: str | None = None, threads: int | None = None, jobs: int = 1,
              formats: tuple[str, ...] = ("png", "pdf"), probe: bool = False,
              probe_every_first_seed: bool = False) -> list[Path]:
    """Train the study's runs through ``accelerate launch``, ``jobs`` at a time, then draw the figures
    (seed bands, every codebook, attention logits, held-out curves) and write the claims table.

    ``threads`` sets OMP_NUM_THREADS of the runs (None: leave the environment as it is). Returns the
    written files. Progress: a banner per run; with ``jobs`` 1 the trainer's own output, else one log file
    per run; after each run its final numbers and an estimate of the time left. ``timing.json`` records the
    wall time of each run and of the whole study, and the CPU time of the runs. Each finished run also
    gets RUN/study_time.json (its launch's wall time, the jobs and threads it ran with, whether it resumed
    from a checkpoint, the ``machine``), which travels with the run; ``timing.json`` gathers these of every
    run of the study (``run_times``) and sums wall time / jobs over them (``run_wall_s_over_jobs``): the
    training time of a study run in pieces, where each piece alone times only the runs it trained.
    ``probe``: ``probe_study`` before the figures, so the claims table has the best-layer pitch mAP of seed 0
    of each configuration; needs the corpus's labels.jsonl. ``probe_every_first_seed``: the probes'
    ``every_first_seed``.
    """
    from musiclm_stab.analysis.unigram import unigram_eval_loss

    accelerate = accelerate or accelerate_executable()
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    configs = [run.config() for run in study.runs]
    for cfg in configs:  # refuse before training anything
        if run_state(cfg) == "other":
            raise ConfigError(
                f"{cfg.run_dir} holds a run with another config; remove it or choose another --runs / --name"
            )
    check_study_data(study.figures_dir.parent, configs[0].data.path)
    # the level every run's held-out codebook-0 loss is judged against (the same data, split and masks)
    unigram = unigram_eval_loss(configs[0])["unigram_eval_cb0"]
    print(f"held-out unigram level (codebook 0, training split's frequencies): {unigram:.3f} bits", flush=True)
    t0 = time.time()
    rows, walls, train_wall, train_cpu = _train_runs(study, configs, accelerate, threads, jobs, unigram)

    run_dirs = [cfg.run_dir for cfg in configs]
    t_probe = time.time()
    written = [probe_study(study, jobs=jobs, every_first_seed=probe_every_first_seed)] if probe else []
    probe_wall = time.time() - t_probe
    written += _figures_and_claims(study, run_dirs, [rows[i] for i in range(len(configs))], unigram, formats)
    timing = {"scale": study.scale, "runs": len(configs), "jobs": jobs, "threads_per_run": threads,
              "train_wall_s": round(train_wall, 1), "train_cpu_s": round(train_cpu, 1),
              "probe_wall_s": round(probe_wall, 1) if probe else None,
              "total_wall_s": round(time.time() - t0, 1), "run_wall_s": {k: round(v, 1) for k, v in walls.items()}}
    # every run's own record, also of runs trained by earlier pieces (here or on another machine)
    timing["run_times"] = every = run_times(run_dirs)
    timing["runs_timed"] = len(every)
    timing["run_wall_s_over_jobs"] = round(sum(r["wall_s"] / r["jobs"] for r in every.values()), 1)
    # a resumed run's record is the launch that finished it: the launches before it are not in the sum
    timing["runs_resumed"] = sorted(name for name, r in every.items() if r.get("resumed"))
    (study.figures_dir / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(f"\nstudy done in {(time.time() - t0) / 60:.1f} min (training {train_wall / 60:.1f} min wall, "
          f"{train_cpu / 60:.1f} min CPU). Figures:")
    for path in written:
        if path.suffix in (".png", ".md"):
            print(f"  {path}")
    return written


def _train_runs(study: Study, configs: list, accelerate: str, threads: int | None, jobs: int,
                unigram: float) -> tuple[dict[int, dict], dict[str, float], float, float]:
    """Launch the study's runs ``jobs`` at a time (a finished run is read, one with the same config resumed);
    return each run's summary by index, the wall time of each run launched here, and the wall and CPU time of
    the launches. A launch that fails without diverging raises CalledProcessError; on any error the launches
    still running are stopped first."""
    from musiclm_stab.analysis.plot import run_label
    from musiclm_stab.training.checkpoint import checkpoint_step, newest_valid

    stalls, margin = study.assesses_stalls, study.stall_margin
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    t0, cpu0 = time.time(), _children_cpu_s()
    n = len(study.runs)
    rows: dict[int, dict] = {}
    walls: dict[str, float] = {}
    resumed: dict[int, bool] = {}
    host = machine()
    logs = study.figures_dir.parent / "logs"
    pending = list(range(n))
    active: dict[int, tuple[subprocess.Popen, float, object]] = {}

    def start(i: int) -> None:
        run, cfg = study.runs[i], configs[i]
        print(f"\n=== study run {i + 1}/{n}: {run_label(cfg.to_dict())} (seed {run.seed}) -> {cfg.run_dir}",
              flush=True)
        state = run_state(cfg)
        if state == "done":  # trained to its last step, or diverged: read, not launched again
            print("(this run directory holds the finished run: not launched again)", flush=True)
            rows[i] = summarize(cfg.run_dir, unigram_eval_cb0=unigram, stalls=stalls, stall_margin=margin)
            return
        resume = state != "new"  # the trainer resumes from the newest intact checkpoint, if there is one
        ckpt = newest_valid(cfg.run_dir) if resume else None
        resumed[i] = ckpt is not None
        if resume:
            print("(this run directory exists with the same config: "
                  + (f"resuming it from step {checkpoint_step(ckpt)})" if ckpt else "no checkpoint in it: "
                     "training it from the start)"))
        cmd = run.command(accelerate, single_process=study.scale != "full", resume=resume)
        print(shlex.join(cmd), flush=True)
        if jobs == 1:
            active[i] = (subprocess.Popen(cmd, env=env), time.time(), None)
        else:
            logs.mkdir(parents=True, exist_ok=True)
            log = (logs / f"{cfg.run_dir.name}.log").open("w")
            print(f"(output: {log.name})", flush=True)
            active[i] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.time(), log)

    def finish(i: int, proc: subprocess.Popen, started: float, log) -> None:
        if log is not None:
            log.close()
        # A diverged run (fp16 loss scale at its floor) is a result. recipes/pretrain.py exits with EXIT_DIVERGED, but
        # `accelerate launch` turns any failure of its child into exit 1: the run's metrics say whether it diverged.
        if proc.returncode not in (0, EXIT_DIVERGED) and not _diverged(configs[i].run_dir):
            raise subprocess.CalledProcessError(proc.returncode, proc.args)
        cfg = configs[i]
        rows[i] = r = summarize(cfg.run_dir, unigram_eval_cb0=unigram, stalls=stalls, stall_margin=margin)
        walls[cfg.run_dir.name] = took = time.time() - started
        record = {"wall_s": round(took, 1), "jobs": jobs, "threads_per_run": threads, "resumed": resumed[i],
                  "machine": host}
        (cfg.run_dir / RUN_TIME_FILE).write_text(json.dumps(record) + "\n")
        done = len(rows)
        left = (time.time() - t0) / len(walls) * (n - done)  # at the pace of the runs trained here
        print(
            f"--- run {i + 1}/{n} ({cfg.run_dir.name}) done in {took:.0f} s: loss {r['first_loss']:.3f} -> "
            f"{r['final_loss']:.3f}, grad norm {r['grad_norm_min']:.2f}..{r['grad_norm_max']:.2f}; "
            f"{done}/{n} done, about {left / 60:.1f} min left",
            flush=True,
        )

    try:
        while pending or active:
            while pending and len(active) < jobs:
                start(pending.pop(0))
            if jobs == 1:
                for proc, _, _ in active.values():
                    proc.wait()
            else:
                time.sleep(0.5)
            for i in list(active):
                proc, started, log = active[i]
                if proc.poll() is not None:
                    del active[i]
                    finish(i, proc, started, log)
    finally:  # a launch failed, or reading a run did: stop the others, the study is incomplete anyway
        for proc, _, log in active.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            if log is not None:
                log.close()
    return rows, walls, time.time() - t0, _children_cpu_s() - cpu0


def _figures_and_claims(study: Study, run_dirs: list[Path], summary: list[dict], unigram: float,
                        formats: tuple[str, ...]) -> list[Path]:
    """The study's figures, summary.json and its design's claims table (or, for an arm outside the claims, its
    description) in ``study.figures_dir``; the written files."""
    from musiclm_stab.analysis.lr_figure import save_lr_figure
    from musiclm_stab.analysis.plot import plot_runs

    stalls, margin = study.assesses_stalls, study.stall_margin
    print(f"\n=== figures and claims -> {study.figures_dir}", flush=True)
    shown_runs = [run.config().run_dir for run in figure_runs(study)] or run_dirs
    written = plot_runs(shown_runs, study.figures_dir, window=study.window, bands=True, extra=True, formats=formats,
                        unigram_eval_cb0=unigram if stalls else None,
                        **({"stall_margin": margin} if margin is not None else {}))
    if study.lrs:
        written += save_lr_figure(run_dirs, study.figures_dir, unigram_eval_cb0=unigram, formats=formats, stalls=stalls)
    (study.figures_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary))
    try:
        md, js = _claims_writer(study)(run_dirs, study.figures_dir, unigram_eval_cb0=unigram)
        written += [md, js]
        print("\n" + md.read_text())
    except ValueError as e:  # e.g. a study of fewer configurations: figures without the claims table
        warnings.warn(f"no claims table: {e}", stacklevel=3)
    return written


def _claims_writer(study: Study):
    """The analysis that decides (or, for an arm outside the claims, describes) the study's design."""
    if study.design == "instability":
        from musiclm_stab.analysis.instability import write_claims, write_failures

        return write_claims if study.arm == "schemes" else write_failures
    if study.design == "learning":
        from musiclm_stab.analysis.learning import write_claims

        return write_claims
    from musiclm_stab.analysis.claims import write_claims

    return write_claims


def _layers_lr(text: str) -> tuple[int, float]:
    """--control-at LAYERS:LR, e.g. 24:3e-3."""
    try:
        layers, lr = text.split(":")
        return int(layers), float(lr)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LAYERS:LR, e.g. 24:3e-3") from None


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab study", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md (offline: musiclm-stab docs STUDY)")
    p.add_argument(
        "--scale",
        choices=SCALES,
        default="cpu",
        help="cpu: CPU size, 3 seeds (default); gpu: base size on one CUDA GPU; full: the recipes as written",
    )
    p.add_argument(
        "--print-only",
        action="store_true",
        help="print the accelerate launch lines and the plot and claims lines (for a cluster), run nothing",
    )
    p.add_argument("--steps", type=int, help="train.max_steps of every run (default: the scale's)")
    p.add_argument("--seeds", type=int, help="seeds per configuration and lr (default: cpu 3, gpu 1, full 1)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds are first-seed .. first-seed + seeds - 1 (default 0; pilot runs use others, e.g. 100)")
    p.add_argument("--lrs", type=float, nargs="*",
                   help="the peak learning rates of the grid (default: the scale's, study_plan.LR_GRIDS; none: the recipes')")
    p.add_argument("--no-control", action="store_true", help="without the QK-norm control at the top rates")
    p.add_argument("--design", choices=DESIGNS, default="claims",
                   help="claims: the seed claims' study (default); instability: the instability study, its six "
                        "configurations at every rate of a grid that crosses the failure boundary (docs/STUDY.md)")
    p.add_argument("--arm", choices=ARMS, default="schemes",
                   help="instability design: schemes (default) holds the conv frontend at its own lr, "
                        "mert-frontend trains it at the run's lr as MERT does")
    p.add_argument("--only", nargs="+", metavar="RECIPE",
                   help="train only the runs of these configurations (recipe names: " + ", ".join(INSTABILITY_STEMS)
                        + "; the control: " + CONTROL + "; the learning design: its roles, "
                        + ", ".join(LEARNING_ROLES) + "), named as in the whole study: a piece smaller than a "
                        "block, e.g. two seed-0 runs with their probes")
    p.add_argument("--control-at", metavar="LAYERS:LR", type=_layers_lr,
                   help="learning design: its positive control at this depth and rate (default: learning_params' "
                        "CONTROL_LAYERS and CONTROL_LR), for the control's pilots (docs/STUDY.md \"Pilots\")")
    p.add_argument("--order", choices=ORDERS, default="paired",
                   help="data order across runs (default paired: one order per seed, shared by its runs)")
    p.add_argument("--jobs", type=int,
                   help="runs trained, and with --probe probed, at a time (default: cpu 2, else 1)")
    p.add_argument("--probe", action="store_true",
                   help="linear pitch probes of seed 0 of each configuration (figure probe.png and a column of the claims "
                        "table; needs the corpus's labels)")
    p.add_argument("--probe-every-first-seed", action="store_true",
                   help="with --probe, also probe the first seed of every other (configuration, lr) trained: for a "
                        "study in pieces whose checkpoints do not travel, so the best cell, known at the end, has its probe")
    p.add_argument("--runs", default="runs", help="folder for run directories (default: runs)")
    p.add_argument("--name", help="cpu/gpu scale: the study's folder under --runs (default study_cpu / study_gpu)")
    p.add_argument("--carry-to", metavar="DEST",
                   help="train nothing: copy the study's finished runs without their checkpoints (config, metrics, "
                        "tokenizer record, study_time.json, probe) and its data.json to DEST, for another machine")
    p.add_argument("--switch-codes", metavar="WHY",
                   help="train nothing: declare that the study goes on with the codes of its data (--data, or the "
                        "scale's), other than those its finished runs trained on, for the reason WHY (a deviation: "
                        "its data.json keeps the earlier codes and their runs; docs/STUDY.md)")
    p.add_argument("--codes", metavar="FILE",
                   help="before training, put the codes of FILE (`musiclm-stab codes save`) into the study's tokenized "
                        "data (same corpus and weights, tokenized on this machine): for runs of one study trained on "
                        "machines whose float32 tokenizing gives other codes")
    add_job_options(p, "; cpu scale only")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs must be >= 1")
    only_names = list(LEARNING_ROLES) if args.design == LEARNING else INSTABILITY_STEMS
    unknown = [name for name in args.only or () if name not in only_names]
    if unknown:
        p.error(f"--only {' '.join(unknown)}: the {args.design} design's names are {', '.join(only_names)}")
    if args.probe_every_first_seed and not args.probe:
        p.error("--probe-every-first-seed needs --probe")
    if args.codes and (args.print_only or args.carry_to is not None):
        p.error("--codes restores codes before training: not with --print-only (run `musiclm-stab codes restore "
                "DATA FILE` before the launch lines) or --carry-to")
    if args.codes and args.scale == "full" and args.data is None:
        p.error("--codes needs the data it goes into: --data TOKENS")
    if args.switch_codes is not None and (args.codes or args.print_only or args.carry_to is not None):
        p.error("--switch-codes trains nothing: not with --codes, --print-only or --carry-to")
    if (args.carry_to is not None or args.switch_codes is not None) and args.scale == "full":
        p.error("--carry-to, --switch-codes: the cpu and gpu scales' studies only")
    if args.codes:  # a missing or broken file is said now, not after the data preparation (~26 min at cpu scale)
        from musiclm_stab.data.codes_file import read_codes

        try:
            read_codes(args.codes)
        except (ValueError, FileNotFoundError) as e:
            print(f"musiclm-stab study: error: {e}", file=sys.stderr)
            return 2

    folder = Path(args.runs) / (args.name or default_name(args.scale, args.design, args.arm))
    if args.switch_codes is not None:
        preset, tracks = STUDY_DATA[args.scale]
        data = args.data or Path(args.work) / f"{data_name(tracks, preset)}_tokens"
        try:
            new = switch_codes(folder, data, args.switch_codes)
        except (ConfigError, FileNotFoundError, ValueError) as e:
            print(f"musiclm-stab study: error: {e}", file=sys.stderr)
            return 2
        was = new["earlier_codes"][-1]
        print(f"{folder / DATA_RECORD}: the study goes on with the codes of {data} ({new['codes_sha256']}); "
              f"{len(was['runs'])} finished runs trained on {was['codes_sha256']}, kept in earlier_codes")
        return 0
    if args.carry_to is not None:
        try:
            carry_study(folder, Path(args.carry_to))
        except ConfigError as e:
            print(f"musiclm-stab study: error: {e}", file=sys.stderr)
            return 2
        return 0
    data = args.data
    if data is None and args.scale != "full":
        preset, tracks = STUDY_DATA[args.scale]
        data = str(default_data(args.work, tracks, preset, STUDY_RENDERER) if not args.print_only else
                   Path(args.work) / f"{data_name(tracks, preset, STUDY_RENDERER)}_tokens")
    if args.codes:
        from musiclm_stab.data.codes_file import describe, restore_codes

        try:
            print(f"{data}: {describe(restore_codes(data, args.codes))} ({args.codes})", flush=True)
        except (ValueError, FileNotFoundError) as e:  # a codes file that is missing, broken or does not fit
            print(f"musiclm-stab study: error: {e}", file=sys.stderr)
            return 2
    try:
        try:
            study = plan_study(args.scale, args.runs, data, args.steps, args.name, args.extra, args.seeds,
                               args.order, lrs=None if args.lrs is None else tuple(args.lrs),
                               first_seed=args.first_seed, control=not args.no_control,
                               only=None if args.only is None else tuple(args.only), design=args.design,
                               arm=args.arm, control_at=args.control_at)
        except ValueError as e:  # a plan that asks for nothing (--only the control without its rates)
            p.error(str(e))
        threads = args.threads if args.scale == "cpu" and args.threads > 0 else None
        if args.print_only:
            env = f"OMP_NUM_THREADS={threads} " if threads else ""
            for run in study.runs:
                print(env + shlex.join(run.command(single_process=args.scale != "full")))
            print(shlex.join(plot_command(study)))
            print(shlex.join(claims_command(study)))
            return 0
        run_study(study, threads=threads, jobs=args.jobs or DEFAULT_JOBS[args.scale], probe=args.probe,
                  probe_every_first_seed=args.probe_every_first_seed)
    except ConfigError as e:
        print(f"musiclm-stab study: error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"musiclm-stab study: a run failed (exit {e.returncode}): {shlex.join(e.cmd)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
