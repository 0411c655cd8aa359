"""Learning-rate sensitivity sweep: which normalization scheme trains well over a wide range of lrs.

    musiclm-stab sweep --schemes pre post deepnorm relax --lrs 1e-3 1e-2 1e-1 1 --steps 120

For each scheme and learning rate the tiny model (recipes/tiny.yaml unless --recipe) trains for
``--steps`` updates, *in this process* through ``train.Trainer`` (one accelerate state per run, reset
between runs: no launcher start-up per run). Its final loss is the mean training loss of the last
``--last`` logged steps. The LR sensitivity of a scheme (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities") is

    E_lr[ min(final_loss(lr), initial_loss) ] - min_lr final_loss(lr)

over the lr grid, where initial_loss is the run's loss at initialization (its step-1 loss: logged
before the first update, the same at every lr of a scheme since init and first batch are seeded). A
run whose final loss is non-finite, or above its initial loss, is *diverged* and counted at the cap,
initial_loss. Outputs in --out: ``lr_sensitivity.png``/``.pdf`` (final loss vs lr, one line per
scheme), ``sweep.json`` and ``sweep.csv`` (one row per run), and the run directories under ``runs/``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from musiclm_stab.config import NORM_SCHEMES, Config, ConfigError, load_config
from musiclm_stab.experiments.launch import RECIPES, add_job_options, as_overrides, default_data, run_state

DEFAULT_RECIPE = RECIPES / "tiny.yaml"
# Defaults: the sweep of docs/STUDY.md (~18 min of training on 2 shared cores, bf16 given by --set there).
DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0)
DEFAULT_SCHEMES = ("pre", "post", "deepnorm", "relax")
DEFAULT_STEPS = 120
DEFAULT_LAST = 10
# Settings of every sweep run, after the recipe and before --set: short crops for speed, a log row per
# step (the initial loss is step 1's), one checkpoint at the end.
SWEEP_SETTINGS = ("--data.crop_seconds=2.0", "--train.log_every=1", "--train.keep_checkpoints=1")

TIMING_FILE = "sweep_seconds.json"  # in each run directory: the run's training wall time, kept for reuse

# Sweep scheme names beyond the plain norm schemes: variants with an orthogonal switch set.
SCHEME_VARIANTS: dict[str, tuple[str, ...]] = {
    "relax": ("--model.norm_scheme=pre", "--model.attention=relax"),
    "math": ("--model.norm_scheme=pre", "--model.attention=math"),  # relax's explicit path, unrelaxed
    "qknorm": ("--model.norm_scheme=pre", "--model.qk_norm=true"),
}


def scheme_overrides(scheme: str) -> list[str]:
    """Overrides that select a sweep scheme: a norm scheme (pre, post, ...) or a variant (relax, qknorm)."""
    if scheme in SCHEME_VARIANTS:
        return list(SCHEME_VARIANTS[scheme])
    if scheme in NORM_SCHEMES:
        return [f"--model.norm_scheme={scheme}"]
    raise ConfigError(
        f"scheme {scheme!r} is not valid; choose one of: {', '.join((*NORM_SCHEMES, *SCHEME_VARIANTS))}"
    )


def scheme_label(cfg: dict) -> str:
    """Legend text of a scheme: the study's run label without its ``Run N`` part (and with "Math Attn."
    for the explicit attention path, which the study's labels do not name)."""
    from musiclm_stab.analysis.plot import run_label

    parts = [p for p in run_label(cfg).split(" | ") if not p.startswith("Run ")]
    if (cfg.get("model") or {}).get("attention") == "math":
        parts.insert(1, "Math Attn.")
    return " | ".join(parts)


def _lr_text(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+0", "e")


# ---------------------------------------------------------------------------------------------------
# Results and the sensitivity number


@dataclass
class SweepResult:
    """One (scheme, lr) run of the sweep."""

    scheme: str
    lr: float
    label: str  # legend text of the scheme
    initial_loss: float  # step-1 loss (before any update): the cap
    final_loss: float  # mean of the last `last` logged losses; nan if any of them is non-finite
    steps: int  # last logged step
    grad_norm_max: float  # largest finite pre-clip grad norm
    skipped_steps: int  # updates skipped for a non-finite gradient
    seconds: float  # wall time of the run's training (in-process Trainer, set-up included)
    run_dir: str
    peak_loss: float = math.nan  # largest finite logged loss: transient blow-ups the final loss hides
    steps_above_initial: int = 0  # logged steps with a loss above the initial loss (non-finite included)

    @property
    def diverged(self) -> bool:
        """Non-finite final loss, or a final loss above the initial loss."""
        return not math.isfinite(self.final_loss) or self.final_loss > self.initial_loss

    @property
    def capped_loss(self) -> float:
        """min(final loss, initial loss); a non-finite final loss counts as the initial loss."""
        return self.initial_loss if self.diverged else self.final_loss

    def row(self) -> dict:
        return {**asdict(self), "diverged": self.diverged, "capped_loss": self.capped_loss}


def lr_sensitivity(final_losses: Sequence[float], caps: Sequence[float]) -> float:
    """Wortsman et al.'s LR sensitivity: mean over the grid of min(loss, cap) minus the best loss.

    ``caps`` are the initial losses (one per lr; non-finite losses count as the cap). nan when no lr
    trained at all (every run capped), where "best" would be meaningless.
    """
    if len(final_losses) != len(caps) or not len(final_losses):
        raise ValueError("need one cap per final loss, and at least one run")
    capped = np.array([min(x, c) if math.isfinite(x) else c for x, c in zip(final_losses, caps)])
    trained = [x for x, c in zip(final_losses, caps) if math.isfinite(x) and x <= c]
    if not trained:
        return math.nan
    return float(np.mean(capped) - min(trained))


def sensitivities(results: Sequence[SweepResult]) -> dict[str, float]:
    """Scheme -> LR sensitivity, in the order the schemes first appear."""
    out: dict[str, float] = {}
    for scheme in dict.fromkeys(r.scheme for r in results):
        runs = [r for r in results if r.scheme == scheme]
        out[scheme] = lr_sensitivity([r.final_loss for r in runs], [r.initial_loss for r in runs])
    return out


# ---------------------------------------------------------------------------------------------------
# Running


def sweep_config(
    recipe: str | Path,
    scheme: str,
    lr: float,
    steps: int,
    out: Path,
    data: str | Path | None = None,
    extra: Sequence[str] = (),
) -> Config:
    """The resolved config of one sweep run, in ``<out>/runs/<scheme>_lr<lr>``."""
    overrides = [
        *SWEEP_SETTINGS,
        *scheme_overrides(scheme),
        f"--optim.lr={lr!r}",
        f"--train.max_steps={steps}",
        f"--optim.warmup_steps={max(1, steps // 10)}",
        f"--train.checkpoint_every={steps}",
        f"--train.output_dir={out / 'runs'}",
        f"--train.name={scheme}_lr{_lr_text(lr)}",
    ]
    if data is not None:
        overrides.append(f"--data.path={data}")
    cfg = load_config(recipe, [*overrides, *as_overrides(extra)])
    if cfg.train.log_every != 1:
        raise ConfigError("the sweep needs train.log_every=1: the initial loss (the cap) is step 1's")
    return cfg


def train_in_process(cfg: Config, resume: bool = False) -> Path:
    """Train one run here, with a fresh accelerate state (accelerate keeps one per process)."""
    from accelerate.state import AcceleratorState, GradientState

    from musiclm_stab.training.trainer import Trainer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return Trainer(cfg, resume=resume).run()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def read_result(cfg: Config, scheme: str, last: int = DEFAULT_LAST) -> SweepResult:
    """A run directory's sweep numbers (its metrics.jsonl, read as plots read it)."""
    from musiclm_stab.analysis.plot import read_run

    run = read_run(cfg.run_dir)
    loss = run.metric("loss")  # finite values only; a non-finite loss leaves its step out
    if loss is None or run.last_step is None:
        raise ValueError(f"{cfg.run_dir}: no finite loss logged")
    steps, values = loss
    initial = float(values[0]) if steps[0] == 1 else math.nan
    logged = set(range(1, run.last_step + 1, cfg.train.log_every)) | {run.last_step}
    tail = set(range(run.last_step - last + 1, run.last_step + 1))
    final = float(values[np.isin(steps, list(tail))].mean()) if tail <= set(steps.tolist()) else math.nan
    nonfinite = len(logged - set(steps.tolist()))
    norms = run.metric("grad_norm")
    timing = cfg.run_dir / TIMING_FILE
    seconds = json.loads(timing.read_text())["seconds"] if timing.is_file() else math.nan
    return SweepResult(
        scheme=scheme,
        lr=cfg.optim.lr,
        label=scheme_label(cfg.to_dict()),
        initial_loss=initial,
        final_loss=final,
        steps=run.last_step,
        grad_norm_max=float(norms[1].max()) if norms else math.nan,
        skipped_steps=int(len(run.skipped_steps)),
        seconds=seconds,
        run_dir=str(cfg.run_dir),
        peak_loss=float(values.max()),
        steps_above_initial=int((values > initial).sum()) + nonfinite,
    )


def run_sweep(
    schemes: Sequence[str],
    lrs: Sequence[float],
    steps: int,
    out: str | Path,
    recipe: str | Path = DEFAULT_RECIPE,
    data: str | Path | None = None,
    extra: Sequence[str] = (),
    last: int = DEFAULT_LAST,
) -> list[SweepResult]:
    """Train every (scheme, lr) pair in this process, one after another; returns their results.

    A run directory that already holds the same config trained to the end is read, not retrained.
    """
    if last < 1 or last > steps:
        raise ValueError(f"last={last}: must be between 1 and steps={steps}")
    out = Path(out)
    plan = [(s, lr, sweep_config(recipe, s, lr, steps, out, data, extra)) for s in schemes for lr in lrs]
    states = [run_state(cfg) for _, _, cfg in plan]
    for (_, _, cfg), state in zip(plan, states):  # refuse before training anything
        if state == "other":
            raise ConfigError(
                f"{cfg.run_dir} holds a run with another config; remove it or choose another --out"
            )
    results, t0, trained = [], time.time(), 0
    for i, ((scheme, lr, cfg), state) in enumerate(zip(plan, states)):
        tag = f"[{i + 1}/{len(plan)}] {scheme} lr={lr:g}"
        started = time.time()
        if state == "done":
            print(f"{tag}: reusing {cfg.run_dir}", flush=True)
        else:
            print(f"\n{tag}: training {steps} steps -> {cfg.run_dir}", flush=True)
            # An interrupted run starts over from its last checkpoint (or step 0); plots keep the later rows.
            train_in_process(cfg, resume=state == "partial")
            (cfg.run_dir / TIMING_FILE).write_text(
                json.dumps({"seconds": round(time.time() - started, 1)}) + "\n"
            )
            trained += 1
        result = read_result(cfg, scheme, last)
        results.append(result)
        to_train = sum(1 for st in states[i + 1 :] if st != "done")
        eta = (
            f"; about {(time.time() - t0) / trained * to_train / 60:.1f} min left"
            if trained and to_train
            else ""
        )
        print(
            f"{tag}: loss {result.initial_loss:.3f} -> {result.final_loss:.3f}"
            f"{' (DIVERGED: capped at the initial loss)' if result.diverged else ''}, "
            f"max grad norm {result.grad_norm_max:.3g}, {result.seconds:.0f} s{eta}",
            flush=True,
        )
    return results


# ---------------------------------------------------------------------------------------------------
# Outputs: figure, tables


def make_sweep_figure(results: Sequence[SweepResult], last: int = DEFAULT_LAST):
    """Final loss vs learning rate (log x), one line per scheme in plot.py's colour/marker order.

    Diverged runs are drawn at their cap (the initial loss) with an extra ``x``; each legend entry
    carries the scheme's LR sensitivity.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from musiclm_stab.analysis.style import COLOURS, FIGSIZE, MARKERS

    if not results:
        raise ValueError("no sweep results to plot")
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    sens = sensitivities(results)
    handles, any_diverged = [], False
    for i, scheme in enumerate(sens):
        runs = sorted((r for r in results if r.scheme == scheme), key=lambda r: r.lr)
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        lrs = [r.lr for r in runs]
        (line,) = ax.plot(
            lrs,
            [r.capped_loss for r in runs],
            color=colour,
            marker=marker,
            markersize=6,
            linewidth=1.4,
            label=f"{runs[0].label} (LR sens. {sens[scheme]:.3g})",
            gid=f"scheme:{scheme}",
        )
        handles.append(line)
        bad = [r for r in runs if r.diverged]
        if bad:
            any_diverged = True
            ax.plot(
                [r.lr for r in bad],
                [r.capped_loss for r in bad],
                linestyle="none",
                marker="x",
                markersize=11,
                markeredgewidth=2,
                color=colour,
                label="_nolegend_",
                gid=f"diverged:{scheme}",
            )
    if any_diverged:
        handles.append(
            Line2D(
                [],
                [],
                color="0.35",
                marker="x",
                markersize=9,
                linestyle="none",
                label="Diverged (capped at initial loss)",
            )
        )
    ax.set_xscale("log")
    ax.set_xlabel("Learning Rate")
    ax.set_ylabel(f"Final Loss (mean of last {last} steps)")
    ax.grid(True, which="both", alpha=0.3, linewidth=0.6)
    ax.legend(handles=handles, loc="best", fontsize=8, framealpha=0.9)
    return fig


def write_outputs(
    results: Sequence[SweepResult], out: str | Path, settings: dict, last: int = DEFAULT_LAST
) -> list[Path]:
    """sweep.json, sweep.csv, lr_sensitivity.png/.pdf in ``out``; returns the paths."""
    from musiclm_stab.analysis.style import PNG_DPI

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r.row() for r in results]
    sens = sensitivities(results)
    payload = {
        "settings": settings,
        "lr_sensitivity": sens,
        "cap": "initial loss (step 1, before any update) of each run",
        "final_loss": f"mean training loss of the last {last} logged steps",
        "results": rows,
    }
    (out / "sweep.json").write_text(json.dumps(payload, indent=2) + "\n")
    with (out / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig = make_sweep_figure(results, last)
    written = [out / "sweep.json", out / "sweep.csv"]
    for fmt in ("png", "pdf"):
        path = out / f"lr_sensitivity.{fmt}"
        fig.savefig(path, format=fmt, dpi=PNG_DPI if fmt == "png" else "figure")
        written.append(path)
    return written


def format_table(results: Sequence[SweepResult]) -> str:
    """Final loss per scheme and lr (``*`` = diverged, shown capped), best lr, LR sensitivity."""
    lrs = sorted({r.lr for r in results})
    sens = sensitivities(results)
    width = max(len(r.label) for r in results)
    head = (
        f"{'scheme':<{width}} "
        + " ".join(f"{'lr ' + f'{lr:g}':>11}" for lr in lrs)
        + f" {'best lr':>8} {'LR sens.':>9}"
    )
    lines = [head, "-" * len(head)]
    for scheme, value in sens.items():
        runs = {r.lr: r for r in results if r.scheme == scheme}
        cells = []
        for lr in lrs:
            r = runs.get(lr)
            cells.append(f"{'':>11}" if r is None else f"{r.capped_loss:>10.3f}{'*' if r.diverged else ' '}")
        ok = [r for r in runs.values() if not r.diverged]
        best = f"{min(ok, key=lambda r: r.final_loss).lr:g}" if ok else "-"
        label = next(iter(runs.values())).label
        lines.append(f"{label:<{width}} " + " ".join(cells) + f" {best:>8} {value:>9.3f}")
    lines.append("* diverged (non-finite, or above the initial loss): counted at the initial loss")
    lines += ["", "steps with a loss above the initial loss (transient blow-ups included) / peak loss"]
    for scheme in sens:
        runs = {r.lr: r for r in results if r.scheme == scheme}
        cells = [
            f"{'':>11}" if lr not in runs else f"{runs[lr].steps_above_initial:>3}/{runs[lr].peak_loss:>7.3g}"
            for lr in lrs
        ]
        lines.append(f"{next(iter(runs.values())).label:<{width}} " + " ".join(cells))
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab sweep", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--schemes",
        nargs="+",
        default=list(DEFAULT_SCHEMES),
        help=f"norm schemes ({', '.join(NORM_SCHEMES)}) or variants ({', '.join(SCHEME_VARIANTS)})",
    )
    p.add_argument("--lrs", nargs="+", type=float, default=list(DEFAULT_LRS), help="learning-rate grid")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="updates per run (warmup: a tenth)")
    p.add_argument("--last", type=int, default=DEFAULT_LAST, help="final loss = mean of this many last steps")
    p.add_argument("--out", default="runs/lr_sweep", help="folder for the figure, tables and run directories")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="base recipe (default: recipes/tiny.yaml)")
    add_job_options(p)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if any(lr <= 0 for lr in args.lrs):
        p.error("--lrs must be > 0")
    import torch

    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _sweep_main(args)
    finally:
        torch.set_num_threads(threads)


def _sweep_main(args: argparse.Namespace) -> int:
    t0 = time.time()
    data = args.data
    if data is None:
        data = str(default_data(args.work))
    try:
        results = run_sweep(
            args.schemes, args.lrs, args.steps, args.out, args.recipe, data, args.extra, args.last
        )
    except (ConfigError, ValueError) as e:
        print(f"musiclm-stab sweep: error: {e}", file=sys.stderr)
        return 2
    settings = {
        "schemes": args.schemes,
        "lrs": args.lrs,
        "steps": args.steps,
        "last": args.last,
        "recipe": args.recipe,
        "data": data,
        "set": args.extra,
        "threads": args.threads,
        "in_process": True,
        "wall_seconds_this_call": round(time.time() - t0, 1),
        "train_seconds_all_runs": round(sum(r.seconds for r in results), 1),
    }
    written = write_outputs(results, args.out, settings, args.last)
    print()
    print(format_table(results))
    print(f"\nsweep done in {(time.time() - t0) / 60:.1f} min")
    for path in written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
