"""The study's plan: its four configurations (recipes/study_*.yaml) with each scale's overlays, seeds and
data orders, as run directories and launch lines; ``musiclm-stab study`` (experiments/study.py) runs it.
The scales, seeds and orders are described there."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from musiclm_stab.config import Config, load_config
from musiclm_stab.experiments.launch import RECIPES, as_overrides, launch_command, shown

# The study's runs in legend order: colour i of analysis/style.COLOURS is run i (blue, orange, green, pink).
STUDY_RECIPES = (
    "study_prenorm_clip10_run1",
    "study_prenorm_clip1_run2",
    "study_postnorm_deepnorm_clip1",
    "study_prenorm_attnrelax_clip1",
)
FULL_FIGURES = "study_figures"  # <runs>/study_figures for --scale full
SCALES = ("cpu", "gpu", "full")
OVERLAYS = RECIPES / "overlays"
# Each scale's overlays, layered after the recipe in this order (later files win).
SCALE_OVERLAYS: dict[str, tuple[Path, ...]] = {
    "cpu": (OVERLAYS / "tiny.yaml", OVERLAYS / "study_cpu.yaml"),
    "gpu": (OVERLAYS / "study_gpu.yaml",),
    "full": (),
}
CPU_OVERLAYS = SCALE_OVERLAYS["cpu"]
CPU_STUDY_NAME = "study_cpu"
DEFAULT_NAMES = {"cpu": CPU_STUDY_NAME, "gpu": "study_gpu"}
RUN_SUFFIX = {"cpu": "tiny", "gpu": "gpu"}
DEFAULT_SEEDS = {"cpu": 3, "gpu": 1, "full": 1}
DEFAULT_JOBS = {"cpu": 2, "gpu": 1, "full": 1}
# EMA smoothing of the figures (TensorBoard's debiased EMA): cpu logs every step of a noisy small batch,
# the others every 10 steps.
SMOOTH = {"cpu": 0.9, "gpu": 0.6, "full": 0.6}
ORDERS = ("paired", "shared", "independent")


def recipe_path(stem: str) -> Path:
    return RECIPES / f"{stem}.yaml"


@dataclass
class StudyRun:
    """One of the study's runs: a recipe and the overrides that place and size it."""

    configs: list[Path]  # the recipe, then overlays
    overrides: list[str]
    stem: str = ""  # the recipe's name
    seed: int = 0

    def config(self) -> Config:
        """The resolved, validated config this run trains with."""
        return load_config(self.configs, self.overrides)

    def command(self, accelerate: str = "accelerate", single_process: bool = True, resume: bool = False
                ) -> list[str]:
        return launch_command(self.configs, self.overrides, accelerate=accelerate, single_process=single_process,
                              resume=resume)


@dataclass
class Study:
    scale: str  # "cpu", "gpu" or "full"
    runs: list[StudyRun]
    figures_dir: Path
    order: str = "paired"
    seeds: list[int] = field(default_factory=lambda: [0])

    def run_dirs(self) -> list[Path]:
        return [run.config().run_dir for run in self.runs]

    @property
    def smooth(self) -> float:
        return SMOOTH[self.scale]


def order_overrides(order: str, seed: int, index: int) -> list[str]:
    """The data.order_seed of run ``index`` (legend order) at ``seed`` under ``order`` (see the docstring)."""
    if order == "paired":
        return []  # data.order_seed unset: train.seed, the same for every configuration at this seed
    if order == "shared":
        return ["--data.order_seed=0"]
    if order == "independent":
        return [f"--data.order_seed={1000 + 10 * seed + index}"]
    raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")


def plan_study(
    scale: str,
    runs_dir: str | Path = "runs",
    data: str | Path | None = None,
    steps: int | None = None,
    name: str | None = None,
    extra: list[str] | None = None,
    seeds: int | None = None,
    order: str = "paired",
) -> Study:
    """The runs of the study at ``scale``: the four configurations x ``seeds`` (the scale's default when None).

    ``data`` sets data.path (the recipes' own path is a placeholder), ``steps`` train.max_steps (with the
    warmup a tenth of it and the evaluation and diagnostics about every tenth of it, at cpu and gpu
    scale), ``extra`` (``section.key=value``) is applied last to every run.
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: choose one of {', '.join(SCALES)}")
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")
    n_seeds = DEFAULT_SEEDS[scale] if seeds is None else seeds
    if n_seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {n_seeds}")
    runs_dir = Path(runs_dir)
    out = runs_dir / (name or DEFAULT_NAMES[scale]) if scale != "full" else runs_dir
    runs = []
    for seed in range(n_seeds):
        for index, stem in enumerate(STUDY_RECIPES):
            configs = [recipe_path(stem), *SCALE_OVERLAYS[scale]]
            if scale == "full":
                run_name = stem if n_seeds == 1 else f"{stem}_s{seed}"
            else:
                run_name = f"{stem}_{RUN_SUFFIX[scale]}_s{seed}"
            overrides = [f"--train.name={run_name}", f"--train.output_dir={out}", f"--train.seed={seed}",
                         *order_overrides(order, seed, index)]
            if data is not None:
                overrides.append(f"--data.path={data}")
            if steps is not None:
                overrides.append(f"--train.max_steps={steps}")
                if scale != "full":
                    overrides += _short_run_overrides(configs, [*overrides, *as_overrides(extra or [])], steps)
            overrides += as_overrides(extra or [])
            runs.append(StudyRun(configs, merge_overrides(overrides), stem, seed))
    figures = out / "figures" if scale != "full" else runs_dir / FULL_FIGURES
    study = Study(scale, runs, figures, order, list(range(n_seeds)))
    for run in runs:
        run.config()  # fail now, before hours of training, if any override is wrong
    return study


def _short_run_overrides(configs: list[Path], overrides: list[str], steps: int) -> list[str]:
    """--steps at cpu/gpu scale: warmup a tenth of the run, one checkpoint at its end, evaluation and
    diagnostics about every tenth of it (a multiple of train.log_every, as the config requires)."""
    log_every = load_config(configs, overrides).train.log_every
    every = max(log_every, (steps // 10) // log_every * log_every)
    return [f"--optim.warmup_steps={max(1, steps // 10)}", f"--train.checkpoint_every={steps}",
            f"--train.eval_every={every}", f"--train.diagnostics_every={every}"]


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
        "--bands",
        "--extra",
        "--smooth",
        str(study.smooth),
    ]


def claims_command(study: Study) -> list[str]:
    return ["python", "-m", "musiclm_stab.analysis.claims",
            *(shown(d) for d in study.run_dirs()), "--out", shown(study.figures_dir)]
