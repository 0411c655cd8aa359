"""Resuming a checkpoint exactly: refusals of the setting changes that --resume could not honour."""

from __future__ import annotations

from pathlib import Path

from musiclm_stab.config import Config, ConfigError

DATA_POSITION_KEYS = (("data", "batch_size"), ("data", "crop_seconds"), ("data", "eval_fraction"),
                      ("data", "streaming"), ("data", "shuffle_buffer"), ("train", "grad_accum"), ("train", "seed"))
# data.order_seed is part of the data position too, compared by its effective value (check_resumable).
# torch's Optimizer.load_state_dict restores each param group's hyperparameters from the checkpoint (and the
# scheduler its base lr), so a change of these on --resume would be silently ignored: refused instead.
OPTIMIZER_STATE_KEYS = (("optim", "lr"), ("optim", "betas"), ("optim", "eps"), ("optim", "weight_decay"))
# A checkpoint's precision state (loss scaler, fp32 master weights) belongs to its fp16 mode.
PRECISION_KEYS = (("train", "mixed_precision"), ("train", "fp16_mode"))


def check_resumable(ckpt: Path, state: dict, cfg: Config, num_processes: int) -> None:
    """A ConfigError unless checkpoint ``ckpt`` (its trainer state ``state``) can be resumed exactly by
    ``num_processes`` processes under ``cfg``: same process count, data position and optimizer settings."""
    saved = state.get("num_processes", 1)
    if saved != num_processes:
        raise ConfigError(f"{ckpt} was written by {saved} process(es); resume it with {saved} (its data "
                          f"position and RNG states are per process), not {num_processes}")
    then, now = state.get("config") or {}, cfg.to_dict()

    def changed(keys) -> list[str]:
        return [f"{sec}.{key}: {then[sec][key]!r} in the checkpoint, {now[sec][key]!r} now"
                for sec, key in keys if key in then.get(sec, {}) and then[sec][key] != now[sec][key]]

    def order_seed(c: dict) -> int | None:
        seed = c.get("data", {}).get("order_seed")
        return c.get("train", {}).get("seed") if seed is None else seed

    moved = changed(DATA_POSITION_KEYS)
    if order_seed(then) != order_seed(now):
        moved.append(f"data.order_seed (null: train.seed): {order_seed(then)!r} in the checkpoint, "
                     f"{order_seed(now)!r} now")
    if moved:
        raise ConfigError(f"cannot resume {ckpt} exactly: settings that define its data position changed\n  "
                          + "\n  ".join(moved) + "\nset them back, or start a new run (another --train.name)")
    fp16 = "fp16" in (then.get("train", {}).get("mixed_precision"), now["train"]["mixed_precision"])
    if fp16 and (moved := changed(PRECISION_KEYS)):
        raise ConfigError(f"cannot resume {ckpt} in another fp16 setting: its loss scaler and (fairseq mode) fp32 "
                          "master weights belong to the precision it was written in\n  " + "\n  ".join(moved)
                          + "\nset them back, or start a new run (another --train.name)")
    if moved := changed(OPTIMIZER_STATE_KEYS):
        raise ConfigError(f"cannot resume {ckpt} with changed optimizer settings: the optimizer state "
                          "restores them from the checkpoint, so the change would be ignored\n  "
                          + "\n  ".join(moved) + "\nset them back, or start a new run (another --train.name)")
