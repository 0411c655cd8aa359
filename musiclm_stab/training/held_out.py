"""Held-out metrics of a model: the loop shared by ``musiclm-stab evaluate`` and ``train.eval_every``.

Losses are averaged over the masked frames of all batches (a batch's means weighted by its masked frames),
so the result does not depend on how the batches are split across processes; the total ``loss`` is then
recomputed from its averaged parts (the objective is linear in them, in either unit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm

from musiclm_stab.config.model_section import ModelConfig
from musiclm_stab.model.objective import objective


def metric_names(num_codebooks: int) -> list[str]:
    """The names ``MLMOutput.metrics`` gives, in a fixed order (every process reduces them alike)."""
    return (["loss", "acoustic_mlm_loss", "musical_mlm_loss", "features_pen", "mask_fraction"]
            + [f"acoustic_mlm_loss/cb{k}" for k in range(num_codebooks)]
            + [f"acoustic_acc/cb{k}" for k in range(num_codebooks)])


@torch.no_grad()
def held_out_metrics(model: torch.nn.Module, batches: Iterable[dict], mcfg: ModelConfig, unit: str,
                     device: torch.device | str, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     progress: bool = False, forward_context: Callable[[], contextlib.AbstractContextManager] =
                     contextlib.nullcontext, cast_input: Callable[[torch.Tensor], torch.Tensor] = lambda wav: wav,
                     ) -> tuple[dict[str, float], int]:
    """({"eval/<metric>": mean over masked frames}, masked frames) of ``model`` on ``batches`` (dicts of
    wav/clean_wav [B, S], codes [B, K, T], mask [B, T], e.g. ``data.loader.held_out_loader``), losses in
    ``unit``. The model is called as it is: the caller puts it in eval mode. ``reduce_sum``: sums a float64
    tensor over processes (each process passing its own batches); every process gets the same result.
    ``forward_context`` and ``cast_input``: the run's precision (training/precision.py), around the model call
    only (the metrics are read outside it)."""
    names = metric_names(mcfg.num_codebooks)
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)  # metric * masked frames, then the frame count
    for batch in tqdm(batches, desc="evaluate", leave=False, disable=not progress):
        batch = {k: v.to(device) for k, v in batch.items()}
        with forward_context():
            out = model(cast_input(batch["wav"]), batch["clean_wav"], batch["codes"], batch["mask"])
        n = int(batch["mask"].sum())  # losses are means over masked frames: weight them back
        metrics = out.metrics(unit)
        if sorted(metrics) != sorted(names):
            raise RuntimeError(f"the model's metrics {sorted(metrics)} are not the expected {sorted(names)}")
        sums += torch.tensor([float(metrics[name]) * n for name in names] + [n], dtype=torch.float64)
    if reduce_sum is not None:
        sums = reduce_sum(sums.to(device)).cpu()
    frames = int(sums[-1])
    means = {name: float(total) / max(frames, 1) for name, total in zip(names, sums[:-1].tolist())
             if name not in ("loss", "mask_fraction")}
    means["loss"] = objective(means["acoustic_mlm_loss"], means["musical_mlm_loss"], means["features_pen"],
                              mcfg.musical_weight, mcfg.features_pen_weight)
    return {f"eval/{name}": value for name, value in sorted(means.items())}, frames
