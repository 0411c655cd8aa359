"""Reading run directories: legend text from the resolved config, metrics rows from metrics.jsonl.

Losses are read in the unit asked for (bits by default, the study's): each run's ``train.loss_unit`` says
what its metrics.jsonl holds, and a run made before that setting existed logged nats
(``config.SETTINGS_BEFORE_THEY_EXISTED``); the loss series are converted when read
(``model.objective.is_loss_metric`` says which metrics are losses).

Problems with the files are warnings (``PlotWarning``), not crashes: figures must still be drawn.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from musiclm_stab.config.loading import SETTINGS_BEFORE_THEY_EXISTED
from musiclm_stab.config.sections import LOSS_UNITS
from musiclm_stab.model.norm_schemes import LEGEND
from musiclm_stab.model.objective import is_loss_metric, unit_factor

ADAPTIVE_CLIP = {"zclip": "ZClip", "autoclip": "AutoClip"}


class PlotWarning(UserWarning):
    """A run directory has a problem the figures can live with (missing/malformed rows, no metric)."""


def plot_warning(message: str, sink: list[str] | None = None) -> None:
    if sink is not None:
        sink.append(message)
    warnings.warn(message, PlotWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------
# Legend text


def _format_clip(clip: Any) -> str:
    """10.0 -> "10", 0.5 -> "0.5", 1e-05 -> "1e-05" (shortest exact float text, no trailing ".0")."""
    text = repr(float(clip))
    return text[:-2] if text.endswith(".0") else text


def run_label(cfg: dict) -> str:
    """Legend text in the study's form, e.g. ``Post-Norm | DeepNorm | Gradient Clip=1``.

    ``train.label`` wins when set. Otherwise: base norm, then modifiers (DeepNorm, Attn. Relax,
    QK-Norm, RMSNorm, ZClip/AutoClip, in that order), then the clip value, then ``Run N`` only for a
    numbered run (``train.run``, which the study's recipes set) without modifiers: the study tells its two
    plain Pre-Norm runs apart by number, and a run of the tiny recipe is no study run.
    """
    model, optim, train = (cfg.get(k) or {} for k in ("model", "optim", "train"))
    label = train.get("label")
    if label is not None and str(label).strip():
        return str(label)
    scheme = model.get("norm_scheme", "pre")
    # An unknown scheme (a newer config) is shown as written rather than refused: plots must not crash.
    base, modifier = LEGEND.get(scheme, (str(scheme), None))
    parts, modifiers = [base], [modifier] if modifier else []
    if model.get("attention") == "relax":
        modifiers.append("Attn. Relax")
    if model.get("qk_norm"):
        modifiers.append("QK-Norm")
    if model.get("norm_type") == "rmsnorm":
        modifiers.append("RMSNorm")
    if optim.get("clip_mode") in ADAPTIVE_CLIP:
        modifiers.append(ADAPTIVE_CLIP[optim["clip_mode"]])
    parts += modifiers
    parts.append(f"Gradient Clip={_format_clip(optim.get('clip_grad', 10.0))}")
    if not modifiers and train.get("run") is not None:
        parts.append(f"Run {train['run']}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Reading a run directory


@dataclass
class Rollback:
    step: int  # step at which the loss-spike guard fired
    to_step: int | None  # step it rolled back to
    reason: str = ""


@dataclass
class RunMetrics:
    """One run directory, read back. Every series is sorted by step, one finite value per step."""

    name: str  # run directory name
    path: Path
    label: str  # legend text (run_label of the config)
    config: dict
    series: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # metric -> (steps, values)
    skipped_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rollbacks: list[Rollback] = field(default_factory=list)
    # First step of the kept history at which fp16's loss scale hit its floor (a ``min_loss_scale`` event):
    # the run diverged there and its metrics stop. None: no such event.
    diverged_at: int | None = None
    # The overflowed updates that event records (``overflow_step``: those since the last metrics row, the
    # last of them the one that reached the floor); 0 without one. They are in no metrics row.
    final_overflows: int = 0
    # metric -> steps at which it was logged non-finite (left out of ``series``; the spike rule needs them)
    nonfinite: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    unit: str = "bits"  # unit of the loss series as held here
    logged_unit: str = "bits"  # unit the run logged its losses in (its train.loss_unit)

    def in_unit(self, unit: str) -> RunMetrics:
        """This run with its loss series in ``unit`` (bits or nats); itself when they already are."""
        if unit == self.unit:
            return self
        factor = unit_factor(self.unit, unit)
        series = {k: (s, v * factor if is_loss_metric(k) else v) for k, (s, v) in self.series.items()}
        return replace(self, series=series, unit=unit)

    @property
    def last_step(self) -> int | None:
        """Last logged step (any metric), None for a run with no metric rows."""
        ends = [int(s[-1]) for s, _ in self.series.values() if len(s)]
        return max(ends) if ends else None

    def metric(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(steps, values) of one metric, None when the run never logged a finite value of it."""
        return self.series.get(name)


def _as_step(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value >= 0 else None


def _read_rows(path: Path, notes: list[str]) -> tuple[list[dict], list[Rollback], int | None, int]:
    """Metric rows (the final history only, ascending steps), rollback events, and the step of the first
    ``min_loss_scale`` event of that history (None without one) with the overflowed updates it records, of a
    metrics.jsonl."""
    rows: dict[int, dict] = {}  # step -> row; insertion order is ascending step
    rollbacks: list[Rollback] = []
    diverged_at: int | None = None
    final_overflows = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)  # Python's json reads NaN / Infinity as the trainer writes them
            except json.JSONDecodeError as e:
                plot_warning(f"{path}:{lineno}: malformed line skipped ({e.msg})", notes)
                continue
            step = _as_step(row.get("step")) if isinstance(row, dict) else None
            if step is None:
                plot_warning(
                    f"{path}:{lineno}: line skipped: not an object with a non-negative integer 'step'", notes
                )
                continue
            if "event" in row:
                if row["event"] == "rollback":
                    rb = Rollback(step, _as_step(row.get("to_step")), str(row.get("reason", "")))
                    if all((r.step, r.to_step) != (rb.step, rb.to_step) for r in rollbacks):
                        rollbacks.append(rb)
                elif row["event"] == "min_loss_scale" and diverged_at is None:
                    diverged_at = step
                    count = row.get("overflow_step")
                    final_overflows = int(count) if _is_number(count) and math.isfinite(count) else 0
                continue
            if diverged_at is not None and step < diverged_at:
                diverged_at, final_overflows = None, 0  # logging restarted before the event (a resume)
            # A step at or before the last one means logging restarted there (a resume from a
            # checkpoint, or a rollback): the later rows win, and rows of the abandoned branch from
            # that step on are dropped, so the curve shows the history the final model followed.
            while rows and next(reversed(rows)) >= step:
                rows.popitem()
            rows[step] = row
    return list(rows.values()), rollbacks, diverged_at, final_overflows


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bools included: flags such as grad_clipped may be true/false


def logged_unit(cfg: dict) -> str:
    """The unit a run's metrics.jsonl holds its losses in, from its config (dict of config.yaml)."""
    train = cfg.get("train") or {}
    return str(train.get("loss_unit", SETTINGS_BEFORE_THEY_EXISTED["train"]["loss_unit"]))


def read_run(run_dir: str | Path, unit: str = "bits") -> RunMetrics:
    """Read ``config.yaml`` and ``metrics.jsonl`` of one run directory, losses in ``unit`` (bits or nats).

    Raises FileNotFoundError naming the path when the directory or its config is missing. Problems in
    the metrics file (missing, empty, malformed lines) are PlotWarnings, also kept in ``.warnings``.
    Non-finite values are left out of the series; steps with a non-finite loss or grad norm, and
    steps logged with ``skipped_step`` > 0 (a 0/1 flag, or a count when a row covers several
    steps), are in ``skipped_steps``; every metric's non-finite steps are in ``nonfinite``. fp16
    grad-scaler overflows (``overflow_step``) are not marked: they are the scaler's routine calibration,
    not instability. A ``min_loss_scale`` event (fp16's loss scale at its floor: the run diverged) sets
    ``diverged_at``, and the overflows it records ``final_overflows``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {path} does not exist")
    cfg_path = path / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} is not a run directory: {cfg_path} is missing")
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{cfg_path} is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a mapping of sections (data/model/optim/train)")
    if unit not in LOSS_UNITS:
        raise ValueError(f"loss unit {unit!r} is not valid; choose one of: {', '.join(LOSS_UNITS)}")
    logged = logged_unit(cfg)
    if logged not in LOSS_UNITS:
        raise ValueError(f"{cfg_path}: train.loss_unit={logged!r} is not one of: {', '.join(LOSS_UNITS)}")
    run = RunMetrics(name=path.resolve().name, path=path, label=run_label(cfg), config=cfg, unit=logged,
                     logged_unit=logged)

    metrics_path = path / "metrics.jsonl"
    if not metrics_path.is_file():
        plot_warning(f"{metrics_path} is missing: run {run.name!r} has no lines in any figure", run.warnings)
        return run.in_unit(unit)
    rows, run.rollbacks, run.diverged_at, run.final_overflows = _read_rows(metrics_path, run.warnings)
    if not rows:
        plot_warning(f"{metrics_path} has no metric rows: run {run.name!r} has no lines in any figure", run.warnings)
        return run.in_unit(unit)

    points: dict[str, tuple[list[int], list[float]]] = {}
    bad: dict[str, list[int]] = {}
    skipped: list[int] = []
    for row in rows:
        step = int(row["step"])
        nonfinite = False
        for key, value in row.items():
            if key == "step" or not _is_number(value):
                continue
            value = float(value)
            if not math.isfinite(value):
                nonfinite = nonfinite or key in ("loss", "grad_norm")
                bad.setdefault(key, []).append(step)
                continue
            steps, values = points.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
        flag = row.get("skipped_step")
        if nonfinite or (_is_number(flag) and flag > 0):
            skipped.append(step)
    run.series = {
        k: (np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64)) for k, (s, v) in points.items()
    }
    run.skipped_steps = np.asarray(skipped, dtype=np.int64)
    run.nonfinite = {k: np.asarray(v, dtype=np.int64) for k, v in bad.items()}
    return run.in_unit(unit)


# ---------------------------------------------------------------------------------------------------
# Drawing
