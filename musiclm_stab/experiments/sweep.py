"""Learning-rate sensitivity sweep: which normalization scheme trains well over a wide range of lrs.

    musiclm-stab sweep --schemes pre post deepnorm relax --lrs 1e-3 1e-2 1e-1 1 --steps 120

For each scheme and learning rate the tiny model (the tiny recipe unless --recipe) trains for
``--steps`` updates, *in this process* through ``train.Trainer`` (one accelerate state per run, reset
between runs: no launcher start-up per run). Its final loss is the mean training loss of the last
``--last`` logged steps. The LR sensitivity of a scheme (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities") is

    E_lr[ min(final_loss(lr), initial_loss) ] - min_lr final_loss(lr)

over the lr grid, where initial_loss is the run's loss at initialization (its step-1 loss: logged
before the first update, the same at every lr of a scheme since init and first batch are seeded). A
run whose final loss is non-finite, or above its initial loss, is *diverged* and counted at the cap,
initial_loss. Outputs in --out: ``lr_sensitivity.png``/``.pdf`` (final loss vs lr, one line per
scheme), ``sweep.json`` and ``sweep.csv`` (one row per run; analysis/sweep_report.py), and the run
directories under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from musiclm_stab.analysis.sweep_report import (
    DEFAULT_LAST,
    SweepResult,
    format_table,
    lr_text,
    write_outputs,
)
from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import load_config
from musiclm_stab.config.model_section import NORM_SCHEMES
from musiclm_stab.config.sections import Config
from musiclm_stab.experiments.launch import (
    STUDY_RENDERER,
    add_job_options,
    as_overrides,
    default_data,
    run_state,
)

DEFAULT_RECIPE = "tiny"  # a packaged recipe, by name (config.recipe_file)
# Defaults: the sweep of docs/STUDY.md (~18 min of training on 2 shared cores, bf16 given by --set there).
DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0)
DEFAULT_SCHEMES = ("pre", "post", "deepnorm", "relax")
DEFAULT_STEPS = 120
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
        f"--train.name={scheme}_lr{lr_text(lr)}",
    ]
    if data is not None:
        overrides.append(f"--data.path={data}")
    cfg = load_config(recipe, [*overrides, *as_overrides(extra)])
    if cfg.train.log_every != 1:
        raise ConfigError("the sweep needs train.log_every=1: the initial loss (the cap) is step 1's")
    return cfg


def train_in_process(cfg: Config, resume: bool = False) -> Path:
    """Train one run here, with a fresh accelerate state (accelerate keeps one per process).

    ``_reset_state`` is private: accelerate has no public way to drop its process-wide state (its own tests
    call this), so pyproject.toml bounds accelerate below the first release not tested (1.17)."""
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
# Command line


def cli_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab sweep", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/STUDY.md (offline: musiclm-stab docs STUDY)")
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
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="base recipe: a packaged one by name or a YAML file "
                   "(default: tiny)")
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
        data = str(default_data(args.work, renderer=STUDY_RENDERER))  # the corpus of the sweep's documented results
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
