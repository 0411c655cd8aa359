"""The trainer's own stateful objects in a checkpoint, as JSON: never a pickle.

accelerate's ``register_for_checkpointing`` stores such objects as ``custom_checkpoint_N.pkl`` and loads
them with ``torch.load(weights_only=False)``, i.e. by unpickling, which runs whatever code the file names:
resuming from a run directory someone else made could run theirs, and the manifest's hashes do not
help (they are in the same directory). So the trainer does not register them with accelerate. Their
``state_dict()`` (numbers, strings, lists and dicts of them) goes into ``registered.json`` in the
checkpoint, one entry per name, hashed by the manifest like every file, and is read back with ``json``.

An object to checkpoint needs ``state_dict()`` returning such plain data (``plain``: 0-d tensors and numpy
scalars become numbers, anything else is refused) and ``load_state_dict(state)``;
the trainer lists them, with their names, in ``Trainer.registered_objects``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator

REGISTERED_FILE = "registered.json"
# What accelerate's register_for_checkpointing writes: pickles, never loaded here.
_PICKLED = re.compile(r"^custom_checkpoint_\d+\.pkl$")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


Registered = Sequence[tuple[str, Stateful]]


class RegisteredStateError(ValueError):
    """A checkpoint's registered state cannot be loaded (missing, pickled, not JSON, names differ)."""


def refuse_pickled_objects(accelerator: Accelerator) -> None:
    """Objects registered with accelerate would be pickled into the checkpoint and unpickled on resume:
    refused (a programming error), so that no checkpoint of this project holds such a pickle."""
    if accelerator._custom_objects:
        names = ", ".join(type(o).__name__ for o in accelerator._custom_objects)
        raise ValueError(f"objects registered with accelerator.register_for_checkpointing ({names}) would be "
                         "pickled into the checkpoint; list them in Trainer.registered_objects instead (JSON)")


def plain(value: Any, where: str) -> Any:
    """``value`` as data that ``json`` writes and reads back unchanged: None, bool, int, float, str, lists
    (from lists or tuples) and dicts with str keys; a 0-d tensor or a numpy scalar becomes the Python number
    it holds (``.item()``: exact, a float32 or float16 value is a float64 value too). Anything else raises
    TypeError naming ``where`` (the object and key): json would refuse it, or silently change it (an int
    key becomes a str, a tensor of several values has no plain form that loads back as a tensor)."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):  # first: np.float64 is also a float
        if value.ndim != 0:
            raise TypeError(f"{where} is a {type(value).__name__} of shape {tuple(value.shape)}: registered "
                            "state must be plain data (a tensor or array of one 0-d value at most)")
        return plain(value.item(), where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where} has key {bad[0]!r} ({type(bad[0]).__name__}): registered state needs str "
                            "keys (JSON would turn it into a str and the state would not load back as it was)")
        return {k: plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"{where} is a {type(value).__name__}: registered state must be plain data (numbers, "
                    "strings, lists, dicts with str keys), stored as JSON and never pickled")


def to_json(objects: Registered) -> str:
    """The contents of ``registered.json``: {name: state_dict()}, taken now (a snapshot: the objects go on
    changing while a background write runs), converted by ``plain`` (TypeError for what is not data)."""
    names = [name for name, _ in objects]
    if len(set(names)) != len(names):
        raise ValueError(f"registered objects need distinct names, got {names}")
    state = {name: plain(obj.state_dict(), f"{name} ({type(obj).__name__}) state_dict()") for name, obj in objects}
    return json.dumps(state, indent=1) + "\n"


def write(objects: Registered, directory: Path) -> Path:
    path = Path(directory) / REGISTERED_FILE
    path.write_text(to_json(objects))
    return path


def check_loadable(ckpt: Path) -> None:
    """RegisteredStateError if ``ckpt`` holds pickled registered objects (``custom_checkpoint_N.pkl``: an
    older version of this project, or not this project at all). Called before anything of it is loaded:
    accelerate's load_state would unpickle such a file if objects were registered with it."""
    pickled = sorted(p.name for p in Path(ckpt).iterdir() if _PICKLED.match(p.name))
    if pickled:
        raise RegisteredStateError(
            f"cannot load checkpoint {ckpt}: it holds {', '.join(pickled)}, registered objects stored as "
            "pickles, which are never loaded (unpickling can run arbitrary code). Checkpoints of this version "
            f"keep them in {REGISTERED_FILE}; resume from one of those, or start a new run (another --train.name)")


def load(objects: Registered, ckpt: Path) -> None:
    """Restore every object from ``ckpt/registered.json``; the names must be exactly those saved."""
    path = Path(ckpt) / REGISTERED_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise RegisteredStateError(f"{path} is missing: the checkpoint has no state for "
                                   f"{', '.join(n for n, _ in objects)}") from None
    except ValueError as e:
        raise RegisteredStateError(f"{path} is not JSON: {e}") from e
    wanted = [name for name, _ in objects]
    if not isinstance(saved, dict) or sorted(saved) != sorted(wanted):
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise RegisteredStateError(f"{path} holds the state of {found}, this trainer checkpoints {sorted(wanted)}")
    for name, obj in objects:
        obj.load_state_dict(saved[name])
