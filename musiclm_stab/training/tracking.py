"""What the training loop logs, and where: the ``train.trackers`` (checked), the config as the trackers'
hyperparameters, and the per-interval counters and cross-process means of a metrics row."""

from __future__ import annotations

import time

import torch
from accelerate import Accelerator

from musiclm_stab.config.checks import ConfigError


def tracker_names(trackers: list[str]) -> list[str] | None:
    """accelerate's ``log_with`` for ``train.trackers``; a ConfigError naming any that is not installed
    (accelerate would silently leave it out)."""
    from accelerate.tracking import get_available_trackers

    if not trackers:
        return None
    installed = [str(t) for t in get_available_trackers()]
    if "all" in trackers:
        trackers = installed
    missing = [t for t in trackers if t not in installed]
    if missing:
        raise ConfigError(f"train.trackers: {', '.join(missing)} not installed (installed: "
                          f"{', '.join(installed) or 'none'}); install its package, or leave it out of "
                          "train.trackers")
    if "mlflow" in trackers:
        import mlflow

        uri = mlflow.get_tracking_uri()
        if uri.startswith("file:") or "://" not in uri:  # a folder: MLflow's file store
            raise ConfigError(f"train.trackers: mlflow's tracking URI {uri} is a file store, which cannot hold "
                              "both acoustic_mlm_loss and acoustic_mlm_loss/cb0 (a metric that is also a folder); "
                              "set MLFLOW_TRACKING_URI to a database (sqlite:///PATH/mlflow.db) or a server")
    return list(dict.fromkeys(trackers))


def flat_config(d: dict, prefix: str = "") -> dict:
    """Flatten the config for TensorBoard's hparams (scalars and strings only)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def new_interval() -> dict:
    """Counters of the steps since the last metrics row, and the clock they started at."""
    return {"steps": 0, "skipped": 0, "overflow": 0, "clipped": 0, "grad_norm": 0.0, "t0": time.perf_counter()}


def reduce_by_name(accelerator: Accelerator, values: dict[str, torch.Tensor], divide: float = 1.0
                   ) -> dict[str, float]:
    """Means over processes of named scalars (one all-reduce for all of them), divided by ``divide``."""
    names = sorted(values)  # every process holds the same names: the same order everywhere
    stacked = torch.stack([torch.as_tensor(values[n], dtype=torch.float32) for n in names]).to(accelerator.device)
    reduced = (accelerator.reduce(stacked, reduction="mean") / divide).tolist()
    return dict(zip(names, reduced))
