"""The study's plan: its four configurations (recipes/study_*.yaml) with each scale's overlays, its
learning-rate grid, seeds and data orders, and the QK-norm positive control at the top rates, as run
directories and launch lines; ``musiclm-stab study`` (experiments/study.py) runs it. The scales, grids,
seeds and orders are described there.

Two designs (``DESIGNS``). ``claims``: the seed claims' study as run at cpu and gpu scale (docs/STUDY.md,
its sections 1-2). ``instability``: the instability study (docs/STUDY.md, "The instability study"): the four
configurations, the QK-Norm control and plain Post-Norm (the positive control) at every rate of a grid that
crosses the failure boundary, more seeds and shorter runs, with its own overlay on each scale
(``INSTABILITY_OVERLAYS``); its ``arm`` ``schemes`` holds the conv frontend at its own lr (optim.frontend_lr)
so that the transformer fails first, ``mert-frontend`` trains it at the run's lr as MERT does. ``learning``: the
learning study (docs/STUDY.md, "The learning study"): the seed claims judged at a horizon where the models learn,
with a positive control of warmup x Pre/Post-LN and mechanism checks, its runs named by role
(``LEARNING_ROLES``), each arm at its own rate and horizon (``learning_study``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from musiclm_stab.analysis.sweep_report import lr_text
from musiclm_stab.config.loading import load_config
from musiclm_stab.config.sections import Config
from musiclm_stab.experiments.launch import RECIPES, as_overrides, launch_command, shown

# The study's runs in legend order: colour i of analysis/style.COLOURS is run i (blue, orange, green, pink).
STUDY_RECIPES = (
    "study_prenorm_clip10_run1",
    "study_prenorm_clip1_run2",
    "study_postnorm_deepnorm_clip1",
    "study_prenorm_attnrelax_clip1",
)
# The positive control: Pre-Norm clip 1 with QK-norm (which bounds the attention logits; Wortsman et al. 2023),
# run at the grid's highest CONTROL_LRS rates only, where the plain runs may diverge.
CONTROL = "study_prenorm_qknorm_clip1"
CONTROL_BASE = "study_prenorm_clip1_run2"
CONTROL_OVERRIDES = ("--model.qk_norm=true", "--train.run=1")
CONTROL_LRS = 2
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
# The corpus `study` makes when --data is not given, as (build-corpus preset, tracks): at cpu scale all 256
# tracks of the `hours` preset (6.4 h of five styles, 38 held-out tracks; pilots on 48 chorales and on the first
# 128 tracks ended short of "learns": docs/STUDY.md), the default corpus at gpu scale.
STUDY_DATA: dict[str, tuple[str, int]] = {"cpu": ("hours", 256), "gpu": ("default", 24)}
# Peak learning rates of each scale's grid, calm to divergent (the figures' lr is FIGURE_LR of each): cpu
# chosen by pilot runs of other seeds (docs/STUDY.md); gpu and full: MERT-330M's 1.5e-3 and 3x, 10x it.
LR_GRIDS: dict[str, tuple[float, ...]] = {"cpu": (1e-3, 3e-3, 1e-2), "gpu": (1.5e-3, 4.5e-3, 1.5e-2),
                                          "full": (1.5e-3, 4.5e-3, 1.5e-2)}
FIGURE_LR_INDEX = 1  # the seed figures draw each configuration at the grid's second-lowest lr (fixed before the runs)
DEFAULT_JOBS = {"cpu": 2, "gpu": 1, "full": 1}
# The figures draw window means over this share of a run's steps (fairseq's log rows: it logs the mean over
# every log_interval updates; 100 windows per run).
WINDOW_SHARE = 0.01
ORDERS = ("paired", "shared", "independent")

DESIGNS = ("claims", "instability", "learning")
POST = "study_postnorm_clip1"  # plain Post-Norm at clip 1: the instability study's positive control
INSTABILITY_STEMS = (*STUDY_RECIPES, CONTROL, POST)
INSTABILITY_OVERLAYS: dict[str, Path] = {"cpu": OVERLAYS / "instability_cpu.yaml",
                                         "gpu": OVERLAYS / "instability_gpu.yaml"}
INSTABILITY_NAMES = {"cpu": "instability_cpu", "gpu": "instability_gpu"}
# The instability study's grids cross the failure boundary in half-decade steps, at least two rates past the
# first divergence (cpu: pilots of seeds 200+, docs/STUDY.md: Pre-Norm diverged at 1e-1, every scheme at 3e-1;
# gpu: the H200's measured boundary, four of five configurations at the floor at 1.5e-2 by step 39). Its seeds
# are the power simulation's choice (analysis/power.py: 6 is the fewest at which a failure at one rate in every
# seed can reach p < 0.05); the gpu arm's 2 are what fits a lease.
INSTABILITY_GRIDS: dict[str, tuple[float, ...]] = {"cpu": (3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
                                                   "gpu": (4.5e-3, 1.5e-2, 4.5e-2)}
INSTABILITY_SEEDS = {"cpu": 6, "gpu": 2}
INSTABILITY_FIGURE_LR_INDEX = 2  # the seed figures draw the grid's third rate (cpu 3e-2: every pilot trained)
ARMS = ("schemes", "mert-frontend")
ARM_OVERRIDES = {"schemes": (), "mert-frontend": ("--optim.frontend_lr=null",)}
ARM_SUFFIX = {"schemes": "", "mert-frontend": "_mert_frontend"}


# The learning study (docs/STUDY.md, "The learning study"). Two arms in one folder, the mechanism arm first (short
# runs), then the claims arm seed by seed. Each role: (arm, recipe, its own overrides, its runs' name). Its rates,
# horizons, depths and margin are its pre-registration's (analysis/learning_params.py: one place): the claims arm
# at L for H steps with MERT's warmup share; its control, the 2 x 2 of warmup x Pre/Post-LN (Xiong et al. 2020),
# ``clip1`` (Pre-LN with warmup) and three more, at CONTROL_LR with CONTROL_LAYERS; the mechanism arm at MECH_LR
# for MECH_STEPS without warmup (the instability study's regime). Its folder at cpu scale only (no GPU has
# measured it).
LEARNING = "learning"
LEARNING_NAMES = {"cpu": "learning_cpu"}
LEARNING_OVERLAYS: dict[str, Path] = {"cpu": OVERLAYS / "learning_cpu.yaml"}
MECHANISM_OVERLAYS: dict[str, Path] = {"cpu": OVERLAYS / "learning_mechanism_cpu.yaml"}
LEARNING_SEEDS = {"cpu": 8}
NO_WARMUP = "--optim.warmup_steps=0"
LEARNING_ROLES: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    # the mechanism arm
    "m_fp16": ("mechanism", "study_prenorm_clip1_run2", (), "mech_prenorm_clip1_fp16"),
    "m_warmup": ("mechanism", "study_prenorm_clip1_run2", ("--optim.warmup_steps=30",), "mech_prenorm_clip1_warmup30"),
    "m_fp32": ("mechanism", "study_prenorm_clip1_run2", ("--train.mixed_precision=no",), "mech_prenorm_clip1_fp32"),
    "m_post10": ("mechanism", POST, ("--optim.clip_grad=10.0",), "mech_postnorm_clip10_math"),
    "m_post10_relax": ("mechanism", POST, ("--optim.clip_grad=10.0", "--model.attention=relax"),
                       "mech_postnorm_clip10_relax"),
    # the claims arm: the seed figures' four, then the control's three others
    "clip10": ("claims", "study_prenorm_clip10_run1", (), "study_prenorm_clip10_run1"),
    "clip1": ("claims", "study_prenorm_clip1_run2", (), "study_prenorm_clip1_run2"),
    "deepnorm": ("claims", "study_postnorm_deepnorm_clip1", (), "study_postnorm_deepnorm_clip1"),
    "relax": ("claims", "study_prenorm_attnrelax_clip1", (), "study_prenorm_attnrelax_clip1"),
    "pre_nw": ("claims", "study_prenorm_clip1_run2", (NO_WARMUP,), "control_prenorm_clip1_nowarmup"),
    "post_w": ("claims", POST, (), "control_postnorm_clip1_warmup"),
    "post_nw": ("claims", POST, (NO_WARMUP,), "control_postnorm_clip1_nowarmup"),
}
FIGURE_ROLES = ("clip10", "clip1", "deepnorm", "relax")  # the seed figures' four, in legend order
CONTROL_ROLES = ("clip1", "pre_nw", "post_w", "post_nw")


def default_name(scale: str, design: str = "claims", arm: str = "schemes") -> str:
    """The study's folder under --runs at cpu or gpu scale ("" at full scale: the runs folder itself)."""
    if design == LEARNING:
        return LEARNING_NAMES.get(scale, "")
    if design == "instability":
        return INSTABILITY_NAMES.get(scale, "") + ARM_SUFFIX[arm] if scale in INSTABILITY_NAMES else ""
    return DEFAULT_NAMES.get(scale, "")


def recipe_path(stem: str) -> Path:
    return RECIPES / f"{stem}.yaml"


@dataclass
class StudyRun:
    """One of the study's runs: a recipe and the overrides that place and size it."""

    configs: list[Path]  # the recipe, then overlays
    overrides: list[str]
    stem: str = ""  # the recipe's name (CONTROL for the QK-norm control)
    seed: int = 0
    lr: float | None = None  # the run's peak lr (None: the recipe's)

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
    lrs: tuple[float, ...] = ()
    design: str = "claims"  # DESIGNS
    arm: str = "schemes"  # ARMS (the instability design's)

    @property
    def assesses_stalls(self) -> bool:
        """Whether its summary rows and figures find stalled runs: not in the instability design, at whose 120
        steps a healthy run ends at the unigram level too (its pilots: none below it), so a stall cannot be
        told from a run that learns; its analysis (analysis/instability.py) assesses none either."""
        return self.design != "instability"

    @property
    def stall_margin(self) -> float | None:
        """Bits below the unigram level a run must end not to be stalled: the learning study's margin of
        "learned" (analysis/learning_params.py MARGIN_LEARNED), else None (failures.STALL_MARGIN)."""
        if self.design != LEARNING:
            return None
        from musiclm_stab.analysis.learning_params import MARGIN_LEARNED

        return MARGIN_LEARNED

    def run_dirs(self) -> list[Path]:
        return [run.config().run_dir for run in self.runs]

    @property
    def figure_lr(self) -> float | None:
        """The lr the seed figures draw (FIGURE_LR_INDEX of the grid, the instability design's own; None: a
        study without a grid)."""
        if self.design == LEARNING:
            from musiclm_stab.analysis.learning_params import L

            return L
        index = INSTABILITY_FIGURE_LR_INDEX if self.design == "instability" else FIGURE_LR_INDEX
        return self.lrs[min(index, len(self.lrs) - 1)] if self.lrs else None

    @property
    def window(self) -> int:
        """Steps per window mean in the figures: a hundredth of the runs' length, at least one."""
        shown = [r for r in self.runs if r.lr == self.figure_lr] if self.design == LEARNING else []
        cfg = (shown or self.runs)[0].config()  # the learning study: its claims arm, which the figures draw
        return max(1, int(WINDOW_SHARE * min(cfg.train.max_steps, cfg.train.stop_at or cfg.train.max_steps)))


def order_overrides(order: str, seed: int, index: int) -> list[str]:
    """The data.order_seed of run ``index`` (its place in the plan) at ``seed`` under ``order`` (see study.py)."""
    if order == "paired":
        return []  # data.order_seed unset: train.seed, the same for every configuration and lr at this seed
    if order == "shared":
        return ["--data.order_seed=0"]
    if order == "independent":
        return [f"--data.order_seed={1000 + 100 * seed + index}"]
    raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")


def lr_tag(lr: float) -> str:
    """An lr as run directories name it: 0.003 -> "lr3e-3", 0.0015 -> "lr1.5e-3" (as the sweep names its runs)."""
    return f"lr{lr_text(lr)}"


def plan_study(
    scale: str,
    runs_dir: str | Path = "runs",
    data: str | Path | None = None,
    steps: int | None = None,
    name: str | None = None,
    extra: list[str] | None = None,
    seeds: int | None = None,
    order: str = "paired",
    lrs: tuple[float, ...] | None = None,
    first_seed: int = 0,
    control: bool = True,
    only: tuple[str, ...] | None = None,
    design: str = "claims",
    arm: str = "schemes",
    control_at: tuple[int, float] | None = None,
) -> Study:
    """The runs of the study at ``scale``: the four configurations x the lr grid x ``seeds`` seeds from
    ``first_seed`` (the scale's defaults when None; pilots use seeds the study does not), plus the QK-norm
    control at the grid's top CONTROL_LRS rates (``control``).

    ``lrs`` sets the grid (LR_GRIDS[scale] when None; empty: the recipes' own lr, no grid). ``data`` sets
    data.path (the recipes' own path is a placeholder), ``steps`` train.max_steps (with the warmup a tenth of
    it and the evaluation and diagnostics about every tenth of it, at cpu and gpu scale), ``extra``
    (``section.key=value``) is applied last to every run. ``only`` (recipe names of STUDY_RECIPES and CONTROL)
    keeps the runs of those configurations, as the whole plan has them: a piece of a study smaller than a block.
    ``design`` and ``arm``: module docstring (the instability design at cpu and gpu scale: its six
    configurations at every rate of its grid, its seeds, overlays and folder name; ``control`` does not apply).
    ``control_at`` (layers, lr): the learning design's positive control there (learning_study).
    """
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: choose one of {', '.join(SCALES)}")
    if design not in DESIGNS:
        raise ValueError(f"design={design!r}: choose one of {', '.join(DESIGNS)}")
    if design == LEARNING:
        return learning_study(scale, runs_dir, data, name, extra, seeds, first_seed, only, control_at)
    if control_at is not None:
        raise ValueError("control_at is the learning design's (its positive control's depth and rate)")
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: choose one of {', '.join(ARMS)}")
    instability = design == "instability"
    if instability and scale not in INSTABILITY_OVERLAYS:
        raise ValueError(f"the instability design runs at scale {' or '.join(INSTABILITY_OVERLAYS)}, not {scale}")
    if arm != "schemes" and not instability:
        raise ValueError(f"arm={arm!r} is the instability design's")
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")
    n_seeds = (INSTABILITY_SEEDS[scale] if instability else DEFAULT_SEEDS[scale]) if seeds is None else seeds
    if n_seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {n_seeds}")
    grid = tuple((INSTABILITY_GRIDS[scale] if instability else LR_GRIDS[scale]) if lrs is None else lrs)
    if any(not lr > 0 for lr in grid):
        raise ValueError(f"learning rates must be > 0, got {grid}")
    known = INSTABILITY_STEMS if instability else (*STUDY_RECIPES, CONTROL)
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise ValueError(f"only={unknown}: the study's configurations are {', '.join(known)}")
    runs_dir = Path(runs_dir)
    out = runs_dir / (name or default_name(scale, design, arm)) if scale != "full" else runs_dir
    top = sorted(grid) if instability else sorted(grid)[-CONTROL_LRS:] if control else []
    design_overlays = [INSTABILITY_OVERLAYS[scale]] if instability else []
    runs = []
    for seed in range(first_seed, first_seed + n_seeds):
        for lr in grid or (None,):
            members = [(stem, recipe_path(stem), []) for stem in STUDY_RECIPES]
            if lr in top:
                members.append((CONTROL, recipe_path(CONTROL_BASE), list(CONTROL_OVERRIDES)))
            if instability:
                members.append((POST, recipe_path(POST), []))
            for stem, recipe, own in members:
                own = [*own, *ARM_OVERRIDES[arm]]
                configs = [recipe, *SCALE_OVERLAYS[scale], *design_overlays]
                parts = [stem] + ([RUN_SUFFIX[scale]] if scale != "full" else []) + (
                    [lr_tag(lr)] if lr is not None else []) + ([f"s{seed}"] if scale != "full" or n_seeds > 1 or grid
                                                               else [])
                overrides = [f"--train.name={'_'.join(parts)}", f"--train.output_dir={out}", f"--train.seed={seed}",
                             *own, *order_overrides(order, seed, len(runs))]
                if lr is not None:
                    overrides.append(f"--optim.lr={lr}")
                if data is not None:
                    overrides.append(f"--data.path={data}")
                if steps is not None:
                    overrides.append(f"--train.max_steps={steps}")
                    if instability:  # its overlay's warmup and diagnostics stay: one evaluation, at the end
                        overrides += [f"--train.eval_every={steps}", f"--train.checkpoint_every={steps}"]
                    elif scale != "full":
                        overrides += _short_run_overrides(configs, [*overrides, *as_overrides(extra or [])], steps)
                overrides += as_overrides(extra or [])
                runs.append(StudyRun(configs, merge_overrides(overrides), stem, seed, lr))
    if only is not None:
        runs = [run for run in runs if run.stem in only]
        if not runs:
            raise ValueError(f"only={list(only)}: no run of the plan is of these configurations (the control runs "
                             f"at the grid's top {CONTROL_LRS} rates only)")
    figures = out / "figures" if scale != "full" else runs_dir / FULL_FIGURES
    study = Study(scale, runs, figures, order, list(range(first_seed, first_seed + n_seeds)), grid, design, arm)
    for run in runs:
        run.config()  # fail now, before hours of training, if any override is wrong
    return study


def learning_study(scale: str, runs_dir: str | Path = "runs", data: str | Path | None = None, name: str | None = None,
                   extra: list[str] | None = None, seeds: int | None = None, first_seed: int = 0,
                   only: tuple[str, ...] | None = None, control_at: tuple[int, float] | None = None) -> Study:
    """The learning study's runs (``LEARNING_ROLES``; a run's ``stem`` is its role): the mechanism arm's seeds
    first, then the claims arm's, seed by seed; ``only`` keeps the runs of these roles. Every run of a seed sees
    the same batches (data.order_seed unset: train.seed). The positive control runs at ``control_at`` (layers,
    lr; default learning_params' CONTROL_LAYERS and CONTROL_LR): its pilots at the settings the pilots' rule
    asks for (docs/STUDY.md "Pilots"), the lr one of CONTROL_LRS."""
    if scale not in LEARNING_OVERLAYS:
        raise ValueError(f"the learning design runs at scale {' or '.join(LEARNING_OVERLAYS)}, not {scale}")
    unknown = sorted(set(only or ()) - set(LEARNING_ROLES))
    if unknown:
        raise ValueError(f"only={unknown}: the learning study's roles are {', '.join(LEARNING_ROLES)}")
    n_seeds = LEARNING_SEEDS[scale] if seeds is None else seeds
    if n_seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {n_seeds}")
    from musiclm_stab.analysis import learning_params as rules

    out = Path(runs_dir) / (name or default_name(scale, LEARNING))
    seed_list = list(range(first_seed, first_seed + n_seeds))
    base = (rules.CLAIMS_LAYERS, rules.L)  # the claims arm's depth and rate
    control = (rules.CONTROL_LAYERS, rules.CONTROL_LR) if control_at is None else (int(control_at[0]), float(control_at[1]))
    if control[0] < 1 or not any(math.isclose(control[1], lr) for lr in rules.CONTROL_LRS):
        raise ValueError(f"the control at {control[0]} layers, lr {control[1]:g}: its lr is one of "
                         f"{', '.join(f'{lr:g}' for lr in rules.CONTROL_LRS)} (L, 3L), its layers at least 1")
    runs = []
    for arm, overlay, steps in (("mechanism", MECHANISM_OVERLAYS[scale], rules.MECH_STEPS),
                                ("claims", LEARNING_OVERLAYS[scale], rules.H)):
        for seed in seed_list:
            for role, (role_arm, stem, own, title) in LEARNING_ROLES.items():
                if role_arm != arm or (only is not None and role not in only):
                    continue
                if arm == "mechanism":
                    settings = [(rules.CLAIMS_LAYERS, rules.MECH_LR)]
                elif role not in CONTROL_ROLES or control == base:
                    settings = [base]
                else:  # the control elsewhere: its Pre-LN with warmup a run of its own, the claims' clip1 stays
                    settings = [base, control] if role == "clip1" else [control]
                for layers, lr in settings:
                    parts = [title, *([f"{layers}layers"] if layers != rules.CLAIMS_LAYERS else []),
                             RUN_SUFFIX[scale], lr_tag(lr), f"s{seed}"]
                    overrides = [f"--train.name={'_'.join(parts)}", f"--train.output_dir={out}",
                                 f"--train.seed={seed}", f"--optim.lr={lr}", f"--train.max_steps={steps}", *own]
                    if layers != rules.CLAIMS_LAYERS:
                        overrides.append(f"--model.num_layers={layers}")
                    if data is not None:
                        overrides.append(f"--data.path={data}")
                    overrides += as_overrides(extra or [])
                    configs = [recipe_path(stem), *SCALE_OVERLAYS[scale], overlay]
                    runs.append(StudyRun(configs, merge_overrides(overrides), role, seed, lr))
    if not runs:
        raise ValueError(f"only={list(only or ())}: no run of the plan")
    study = Study(scale, runs, out / "figures", "paired", seed_list, (), LEARNING)
    for run in runs:
        run.config()  # fail now, before hours of training, if any override is wrong
    return study


def _short_run_overrides(configs: list[Path], overrides: list[str], steps: int) -> list[str]:
    """--steps at cpu/gpu scale: warmup a tenth of the run, one checkpoint at its end, evaluation and
    diagnostics about every tenth of it (a multiple of train.log_every, as the config requires)."""
    warmup = f"--optim.warmup_steps={max(1, steps // 10)}"  # before loading: the recipe's may outlast the run
    log_every = load_config(configs, [*overrides, warmup]).train.log_every
    every = max(log_every, (steps // 10) // log_every * log_every)
    return [warmup, f"--train.checkpoint_every={steps}", f"--train.eval_every={every}",
            f"--train.diagnostics_every={every}"]


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


def figure_runs(study: Study) -> list[StudyRun]:
    """The runs the seed figures draw: every seed of the four configurations at the study's figure lr (the
    instability design: its six)."""
    if study.design == LEARNING:  # the claims arm's four at 8 layers (a run's stem is its role there)
        return [r for r in study.runs if r.stem in FIGURE_ROLES and r.lr == study.figure_lr
                and r.config().model.num_layers == 8]
    shown = INSTABILITY_STEMS if study.design == "instability" else STUDY_RECIPES
    return [r for r in study.runs if r.stem in shown and r.lr == study.figure_lr]


def plot_command(study: Study) -> list[str]:
    return [
        "musiclm-stab",
        "plot",
        *(shown(run.config().run_dir) for run in figure_runs(study)),
        "--out",
        shown(study.figures_dir),
        "--bands",
        "--extra",
        "--window",
        str(study.window),
    ]


def claims_command(study: Study) -> list[str]:
    module = {"instability": "instability", LEARNING: "learning"}.get(study.design, "claims")
    return ["python", "-m", f"musiclm_stab.analysis.{module}",
            *(shown(d) for d in study.run_dirs()), "--out", shown(study.figures_dir)]
