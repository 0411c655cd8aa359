"""Resuming a checkpoint exactly: refusals of the setting changes that --resume could not honour.

A checkpoint's data position (micro-batches consumed) indexes the rows of the data it was trained on, so
it is refused on other data: data tokenized with other EnCodec weights (the manifest's
``tokenizer_sha256``), or other rows (``data_fingerprint``: every row's id, i.e. track and start, and its
frame count, in order). The same rows under another ``data.path`` (a moved or copied folder, the same
audio tokenized again with the same weights and settings) are the same data and resume as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.sections import Config

DATA_POSITION_KEYS = (("data", "batch_size"), ("data", "crop_seconds"), ("data", "eval_fraction"),
                      ("data", "streaming"), ("data", "shuffle_buffer"), ("train", "grad_accum"), ("train", "seed"))
# data.order_seed is part of the data position too, compared by its effective value (check_resumable).
# torch's Optimizer.load_state_dict restores each param group's hyperparameters from the checkpoint (and the
# scheduler its base lr), so a change of these on --resume would be silently ignored: refused instead.
OPTIMIZER_STATE_KEYS = (("optim", "lr"), ("optim", "betas"), ("optim", "eps"), ("optim", "weight_decay"))
# A checkpoint's precision state (loss scaler, fp32 master weights) belongs to its fp16 mode.
PRECISION_KEYS = (("train", "mixed_precision"), ("train", "fp16_mode"))


def data_fingerprint(path: str | list[str]) -> str:
    """sha256 of the rows of the tokenized data at ``path`` as a data position indexes them: each row's id
    (track@start) and frame count, in the order the loader reads them. Reads only those two columns of
    the memory-mapped dataset."""
    from musiclm_stab.data.tokenized import load_tokenized

    rows, _ = load_tokenized(path)
    h = hashlib.sha256()
    for batch in rows.select_columns(["id", "num_frames"]).with_format("arrow").iter(batch_size=65536):
        h.update(json.dumps([batch["id"].to_pylist(), batch["num_frames"].to_pylist()]).encode())
    return h.hexdigest()


def _check_same_data(ckpt: Path, state: dict, then_path, now_path, data: dict) -> None:
    """ConfigError unless the data now (``data``: its tokenizer_sha256 and data_fingerprint) is the data of
    the checkpoint (its ``state``)."""
    advice = "set data.path back, or start a new run (another --train.name)"
    tok_then, tok_now = state.get("tokenizer_sha256"), data.get("tokenizer_sha256")
    if tok_then and tok_now and tok_then != tok_now:
        raise ConfigError(f"cannot resume {ckpt} with data.path={now_path}: the checkpoint was trained on "
                          f"data.path={then_path}, tokenized with other EnCodec weights (sha256 {tok_then} in "
                          f"the checkpoint, {tok_now} now), so the codes mean other things; {advice}")
    rows_then = state.get("data_fingerprint")
    if rows_then is None:  # written before checkpoints recorded it: only the path can be compared
        if then_path is not None and then_path != now_path:
            raise ConfigError(f"cannot resume {ckpt} with data.path={now_path}: the checkpoint was trained on "
                              f"data.path={then_path} and records no fingerprint of its rows (an older "
                              f"version), so the new data cannot be checked to be the same; {advice}")
    elif rows_then != data.get("data_fingerprint"):
        raise ConfigError(f"cannot resume {ckpt} with data.path={now_path}: its data position counts the rows "
                          f"of data.path={then_path}, and data.path={now_path} holds other rows (fingerprint "
                          f"{data.get('data_fingerprint')}, not {rows_then}); {advice}")


def check_resumable(ckpt: Path, state: dict, cfg: Config, num_processes: int, data: dict | None = None) -> None:
    """A ConfigError unless checkpoint ``ckpt`` (its trainer state ``state``) can be resumed exactly by
    ``num_processes`` processes under ``cfg``: same process count, data position and optimizer settings,
    and, given ``data`` ({"tokenizer_sha256", "data_fingerprint"} of cfg.data.path), the same data."""
    saved = state.get("num_processes", 1)
    if saved != num_processes:
        raise ConfigError(f"{ckpt} was written by {saved} process(es); resume it with {saved} (its data "
                          f"position and RNG states are per process), not {num_processes}")
    then, now = state.get("config") or {}, cfg.to_dict()
    if data is not None:
        _check_same_data(ckpt, state, then.get("data", {}).get("path"), now["data"]["path"], data)

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
