"""What the model learned: linear probes per layer on frozen features, with exact labels from the scores.

    musiclm-stab probe RUN [RUN ...] [--layers 0 1 2] [--tasks pitch key instrument] [--labels CORPUS]
                       [--folds 4] [--seed 0] [--frame-stride N] [--baselines random_init cqt codes prior]
                       [--l2 0.1 0.01 0.001 0.0001] [--no-cache] [--out DIR]

For each run: features of its data from the newest checkpoint (every layer, or the chosen ones) and of
the baselines (probe_data.py: the same architecture at random init, log CQT, one-hot EnCodec codes, no
features), then a linear probe per feature set, layer and task (probe_fit.py), cross-validated over
tracks so that no piece is on both sides. Tasks, with the labels the corpus builder wrote
(corpus/labels.py, data/README.md):

  pitch       frames (every 13th by default, 5.8 Hz)  which MIDI pitches sound: multi-label over the pitches
                                                     of the corpus; mAP, micro-F1 at 0.5
  key         segments (mean of their frames)        the piece's key (music21 analysis), 24 classes;
                                                     accuracy, MIREX score, track accuracy
  instrument  segments (mean of their frames)        GM family of the top voice's program, 16 classes;
                                                     accuracy, track accuracy

Results go to ``RUN/probe/probe.json`` (with 95% bootstrap intervals over tracks, and for the model the
paired difference to its random init per layer and task) and the figure to ``RUN/figures/probe.png``;
several runs also get one figure together (``--out``). Deterministic given the seed (fold assignment,
random-init weights, bootstrap); no other randomness.

The API (what ``study`` calls):

    probe_run(run_dir, *, tasks=TASKS, layers=None, baselines=BASELINES, labels=None, data=None, folds=4,
              seed=0, frame_stride=None, use_cache=True, progress=True, write=True, l2_grid=L2_GRID) -> dict
        one run; writes RUN/probe/probe.json (with ``write``) and returns the same dict:
        result["results"][features][str(layer)][task] -> {metric: value, "ci95": {metric: [lo, hi]}, ...}
    probe_runs(run_dirs, **kwargs) -> list[dict]                     probe_run for each run
    read_probe(run_dir) -> dict                                      what probe_run wrote
    best_layer(result, task="pitch", features="model") -> (score, layer)   the one-number summary
    summary(result) -> {task: {...}}                                 best layers of every feature set
    probe_figure.save_probe_figure(results: list[dict], path) -> Path      one line per run, in order
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from musiclm_stab.analysis.probe_data import (
    BASELINES,
    FeatureSet,
    ProbeData,
    describe_items,
    feature_sets,
    folds_of_tracks,
    load_probe_data,
)
from musiclm_stab.analysis.probe_fit import (
    L2_GRID,
    Task,
    bootstrap_draws,
    bootstrap_interval,
    class_scorer,
    cross_validate,
    pitch_metrics,
)
from musiclm_stab.analysis.runs import run_label
from musiclm_stab.config.checks import ConfigError
from musiclm_stab.corpus.labels import GM_FAMILIES, KEY_NAMES
from musiclm_stab.spawned import workers_for
from musiclm_stab.threads import one_thread
from musiclm_stab.training.trained import resolve_checkpoint

TASKS = ("pitch", "key", "instrument")
PRIMARY = {"pitch": "map", "key": "accuracy", "instrument": "accuracy"}  # the figure's and summary's metric
METRIC_TEXT = {"map": "mAP", "f1": "F1", "accuracy": "accuracy", "mirex": "MIREX score",
               "track_accuracy": "track accuracy"}
RESULTS_FILE = "probe.json"


def _task_items(name: str, data: ProbeData, fs: FeatureSet, layer: int):
    """(x, y, item_track, Task) of a task on a feature set's layer."""
    if name == "pitch":
        return (fs.frames[layer], torch.from_numpy(data.pitch.astype(np.float32)), data.frame_track,
                Task("pitch", "multilabel", len(data.pitch_space)))
    labels = data.key if name == "key" else data.instrument
    y = labels[data.row_track]
    keep = np.flatnonzero(y >= 0)  # tracks without a key label are left out of the key task
    return (fs.segments[layer][torch.from_numpy(keep)], torch.from_numpy(y[keep]), data.row_track[keep],
            Task(name, "multiclass", len(KEY_NAMES) if name == "key" else len(GM_FAMILIES)))


def _scorer(name: str, logits: torch.Tensor, y: torch.Tensor, item_track: np.ndarray):
    """``metric(items, groups) -> scores`` of a task's out-of-fold logits on the items given by index
    (``bootstrap_draws``' form, whole tracks per group; an item listed twice counts twice)."""
    if name != "pitch":
        return class_scorer(logits, y, item_track, key=name == "key")
    order = torch.argsort(logits, dim=0, descending=True, stable=True)  # once: resamples reweight items

    def metric(items, groups):
        return pitch_metrics(logits, y, torch.bincount(torch.from_numpy(items), minlength=len(y)), order)
    return metric


def _score(name: str, logits: torch.Tensor, y: torch.Tensor, item_track: np.ndarray, seed: int
           ) -> tuple[dict, list[float]]:
    """The task's scores with their 95% intervals, and the primary metric's resampled values (the paired
    difference to another feature set's probe of the same items subtracts them draw by draw)."""
    metric = _scorer(name, logits, y, item_track)
    out = metric(np.arange(len(y)), item_track)
    draws = bootstrap_draws(metric, item_track, seed)
    out["ci95"] = {m: bootstrap_interval(v) for m, v in draws.items()}
    return out, draws[PRIMARY[name]]


def probe_features(data: ProbeData, sets: dict[str, FeatureSet], tasks: Sequence[str], folds: int, seed: int,
                   progress: bool = True, l2_grid: Sequence[float] = L2_GRID) -> tuple[dict, list[list[str]]]:
    """{feature set: {layer (str): {task: scores}}} and the tracks of each fold."""
    fold_idx = folds_of_tracks(len(data.tracks), folds, seed)
    jobs = [(n, layer, t) for n, fs in sets.items() for layer in fs.frames for t in tasks]
    results: dict = {}
    kept: dict = {}  # (name, layer, task) -> the primary metric's resampled values, of model and random init
    with one_thread():
        for n, layer, t in tqdm(jobs, desc="probes", unit="probe", disable=not progress):
            draws = _probe_one(data, sets, n, layer, t, fold_idx, seed, results, tuple(l2_grid))
            if n in ("model", "random_init"):
                kept[n, layer, t] = draws
        for (n, layer, t), draws in kept.items():
            other = kept.get(("random_init", layer, t))
            if n == "model" and other is not None:
                scores = results[n][str(layer)][t], results["random_init"][str(layer)][t]
                results[n][str(layer)][t]["vs_random_init"] = paired_difference(t, scores, (draws, other))
    return results, [[data.tracks[i] for i in f] for f in fold_idx]


def paired_difference(name: str, scores: tuple[dict, dict], draws: tuple[list[float], list[float]]) -> dict:
    """The primary metric of the first probe's scores minus that of the second's, on the same items, with a
    95% interval from resampling the tracks (the same draws for both, ``_score``'s resampled values, so the
    interval is of the difference itself, narrower than the two separate intervals suggest): {"diff",
    "ci95": [lo, hi], "share_above_zero" (of the resamples)}."""
    metric = PRIMARY[name]
    diffs = [a - b for a, b in zip(*draws, strict=True)]
    return {"metric": metric, "diff": scores[0][metric] - scores[1][metric], "ci95": bootstrap_interval(diffs),
            "share_above_zero": float(np.mean(np.array(diffs) > 0))}


def _probe_one(data: ProbeData, sets: dict[str, FeatureSet], n: str, layer: int, t: str,
               fold_idx: list[np.ndarray], seed: int, results: dict, l2_grid: tuple[float, ...] = L2_GRID
               ) -> list[float]:
    """Cross-validate one probe and put its scores into ``results[n][str(layer)][t]``; return its primary
    metric's resampled values (``_score``)."""
    x, y, item_track, task = _task_items(t, data, sets[n], layer)
    codes_dim = sets[n].codes_dim if t == "pitch" else 0  # segments of codes are dense histograms
    logits, l2 = cross_validate(x, y, item_track, fold_idx, task, codes_dim, l2_grid)
    scores, draws = _score(t, logits, y, item_track, seed)
    scores.update(l2=l2, items=len(y), tracks=len(np.unique(item_track)))
    results.setdefault(n, {}).setdefault(str(layer), {})[t] = scores
    return draws


def probe_run(run_dir: str | Path, *, tasks: Sequence[str] = TASKS, layers: Sequence[int] | None = None,
              baselines: Sequence[str] = BASELINES, labels: str | Path | None = None,
              data: str | list[str] | None = None, folds: int = 4, seed: int = 0, frame_stride: int | None = None,
              use_cache: bool = True, progress: bool = True, write: bool = True,
              l2_grid: Sequence[float] = L2_GRID) -> dict:
    """Probe one run (module docstring); returns the results and, with ``write``, writes RUN/probe/probe.json."""
    unknown = set(tasks) - set(TASKS)
    if unknown or not tasks:
        raise ConfigError(f"unknown tasks {sorted(unknown)}; choose from {list(TASKS)}")
    t0 = time.perf_counter()
    run_dir, ckpt = resolve_checkpoint(run_dir)
    items = load_probe_data(run_dir, labels, frame_stride, data)
    sets = feature_sets(run_dir, items, layers, baselines, seed, use_cache, progress)
    t1 = time.perf_counter()
    results, fold_tracks = probe_features(items, sets, tasks, folds, seed, progress, l2_grid)
    t2 = time.perf_counter()
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    state = json.loads((ckpt / "trainer_state.json").read_text()) if (ckpt / "trainer_state.json").is_file() else {}
    out = {
        "run": str(run_dir), "name": run_dir.name, "label": run_label(cfg), "checkpoint": str(ckpt),
        "step": state.get("step"), "data": items.data_path, "labels": str(items.labels_dir), "seed": seed,
        "tasks": list(tasks), "folds": folds, "fold_tracks": fold_tracks, "l2_grid": list(l2_grid),
        "items": describe_items(items), "primary": {t: PRIMARY[t] for t in tasks},
        "feature_sources": {n: fs.source for n, fs in sets.items()},
        "results": results,
        "seconds": {"features": round(t1 - t0, 1), "probes": round(t2 - t1, 1), "total": round(t2 - t0, 1)},
        "torch_threads": torch.get_num_threads(),
    }
    if write:
        path = run_dir / "probe" / RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def probe_runs(run_dirs: Sequence[str | Path], jobs: int = 1, **kwargs) -> list[dict]:
    """``probe_run`` for each run (the study's entry point), in order; same keyword arguments.

    ``jobs`` > 1: that many runs at a time, each in a spawned process (the probes fit on one thread, so
    two processes use two cores). Their own progress bars are off; with ``progress`` one bar over the runs
    stands in for them, its clock kept moving while they work, and a line is printed as each run ends."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(run_dirs) < 2 or workers_for("the probes", jobs) == 0:  # 0: spawn would rerun the script
        return [probe_run(r, **kwargs) for r in run_dirs]
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    shown = kwargs.get("progress", True)
    kwargs = {**kwargs, "progress": False}
    ctx = multiprocessing.get_context("spawn")  # torch has started threads here: no fork
    results: list[dict | None] = [None] * len(run_dirs)
    bar = tqdm(total=len(run_dirs), desc=f"probes ({min(jobs, len(run_dirs))} runs at a time)", unit="run",
               disable=not shown)
    with bar, ProcessPoolExecutor(min(jobs, len(run_dirs)), mp_context=ctx) as pool:
        futures = {pool.submit(probe_run, r, **kwargs): i for i, r in enumerate(run_dirs)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=30, return_when=FIRST_COMPLETED)
            bar.refresh()  # the elapsed time moves on while the workers are silent
            for f in finished:
                i = futures[f]
                results[i] = f.result()
                bar.update()
                bar.write(f"probed {run_dirs[i]} ({results[i]['seconds']['total']:.0f} s; "
                          f"{sum(r is not None for r in results)}/{len(run_dirs)} done)")
    return results


def read_probe(run_dir: str | Path) -> dict:
    """The results ``probe_run`` wrote for a run."""
    path = Path(run_dir) / "probe" / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `musiclm-stab probe {run_dir}` first")
    return json.loads(path.read_text())


def best_layer(result: dict, task: str = "pitch", features: str = "model") -> tuple[float, int]:
    """(score, layer): the primary metric of ``task`` at the best layer of a feature set (ties: the
    lowest layer). ``best_layer(read_probe(run))[0]`` is the run's one-number summary for the claims
    table (pitch mAP of its best layer)."""
    if task not in result["tasks"]:
        raise KeyError(f"{result['run']}: the probes ran tasks {result['tasks']}, not {task!r}")
    if features not in result["results"]:
        raise KeyError(f"{result['run']}: the probes ran features {list(result['results'])}, not {features!r}")
    metric = result["primary"][task]
    layer, value = max(((int(layer), r[task][metric]) for layer, r in result["results"][features].items()),
                       key=lambda lv: (lv[1], -lv[0]))
    return value, layer


def summary(result: dict) -> dict[str, dict]:
    """Per task, the primary metric of the run's best layer and of each baseline's best layer, and the
    paired difference model - random init at the model's best layer, e.g. {"pitch": {"metric": "map",
    "model": 0.61, "model_layer": 2, "random_init": 0.43, "random_init_layer": 0, ..., "vs_random_init":
    {"diff": 0.05, "ci95": [0.03, 0.07], ...}}} (the claims table's column)."""
    out: dict[str, dict] = {}
    for task in result["tasks"]:
        row: dict = {"metric": result["primary"][task]}
        for name in result["results"]:
            row[name], row[f"{name}_layer"] = best_layer(result, task, name)
        if "model" in result["results"]:
            paired = result["results"]["model"][str(row["model_layer"])][task].get("vs_random_init")
            if paired is not None:
                row["vs_random_init"] = paired
        out[task] = row
    return out


def format_table(result: dict) -> str:
    """The results as a text table: one row per feature set and layer, metric [95% interval] per task."""
    cols = [(t, m) for t in result["tasks"] for m in (("map", "f1") if t == "pitch" else
                                                      ("accuracy", "mirex") if t == "key" else ("accuracy",))]
    head = f"{'features':<12} {'layer':>5}  " + "  ".join(f"{t + ' ' + METRIC_TEXT[m]:<22}" for t, m in cols)
    lines = [f"{result['name']} (step {result['step']}): {result['items']['tracks']} tracks, "
             f"{result['folds']}-fold cross-validation over tracks, 95% intervals from a bootstrap over tracks",
             head]
    for name, by_layer in result["results"].items():
        for layer, r in by_layer.items():
            cells = []
            for t, m in cols:
                lo, hi = r[t]["ci95"][m]
                cells.append(f"{r[t][m]:.3f} [{lo:.3f}, {hi:.3f}]".ljust(22))
            lines.append(f"{name:<12} {layer:>5}  " + "  ".join(cells))
    for layer, r in result["results"].get("model", {}).items():
        paired = [(t, r[t]["vs_random_init"]) for t in result["tasks"] if "vs_random_init" in r[t]]
        if paired:
            lines.append(f"model - random_init, layer {layer} (paired over tracks): " + ", ".join(
                f"{t} {METRIC_TEXT[p['metric']]} {p['diff']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}]"
                for t, p in paired))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="musiclm-stab probe", description=__doc__.split("\n")[0],
                                epilog="Reference: docs/PROBES.md (offline: musiclm-stab docs PROBES)")
    p.add_argument("runs", nargs="+", help="run directories (their newest complete checkpoint is probed)")
    p.add_argument("--layers", type=int, nargs="+", help="hidden states 0..N to probe (default: all)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=BASELINES)
    p.add_argument("--labels", help="the corpus folder holding labels.jsonl (default: the data's source folder)")
    p.add_argument("--data", nargs="+", help="tokenized data (default: the run's data.path)")
    p.add_argument("--folds", type=int, default=4, help="folds of tracks (>= 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frame-stride", type=int, default=None,
                   help="probe every n-th frame for pitch (75/n Hz; default: at most 8,000 frames)")
    p.add_argument("--l2", type=float, nargs="+", default=list(L2_GRID),
                   help="L2 penalties to choose from per fold (one value: use it, no choosing; faster)")
    p.add_argument("--no-cache", action="store_true", help="extract features again and do not cache them")
    p.add_argument("--out", help="folder for the figure of all runs together (default: each run's figures/)")
    return p


def cli_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from musiclm_stab.analysis.probe_figure import save_probe_figure

    try:
        results = probe_runs(args.runs, tasks=args.tasks, layers=args.layers, baselines=args.baselines,
                             labels=args.labels, data=args.data[0] if args.data and len(args.data) == 1 else args.data,
                             folds=args.folds, seed=args.seed, frame_stride=args.frame_stride,
                             use_cache=not args.no_cache, l2_grid=args.l2)
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"musiclm-stab probe: {e}", file=sys.stderr)
        return 1
    for result in results:
        print(format_table(result))
        print(f"  {result['seconds']['total']:.0f} s (features {result['seconds']['features']:.0f} s, "
              f"probes {result['seconds']['probes']:.0f} s); results in {Path(result['run']) / 'probe' / RESULTS_FILE}")
    figures = [Path(args.out) / "probe.png"] if args.out else [Path(r["run"]) / "figures" / "probe.png" for r in results]
    if args.out:
        save_probe_figure(results, figures[0])
    else:
        for result, path in zip(results, figures):
            save_probe_figure([result], path)
    print("figure: " + ", ".join(str(f) for f in figures))
    return 0
