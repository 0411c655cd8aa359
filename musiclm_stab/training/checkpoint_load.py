"""Loading a checkpoint without running code from it.

A checkpoint directory may come from someone else (a shared run directory, a download), and the
manifest's hashes cannot vouch for it: they sit in the same directory. What it holds is therefore read
as data only:

- model weights: safetensors (no code by design);
- optimizer, scheduler, RNG states: accelerate loads them with ``torch.load`` and
  ``weights_only=True`` (tensors, numbers, strings, containers, and numpy's array reconstruction for the
  RNG states: torch's restricted unpickler, which refuses any other global and so any code);
- the trainer's registered objects: ``registered.json``, read with ``json`` (``registered.py``); a
  ``custom_checkpoint_N.pkl`` (accelerate's pickled objects, which it loads with ``weights_only=False``)
  is refused before anything is loaded.

accelerate swallows any error loading the RNG states ("Could not load random states") and goes on with
the current ones; that file is therefore loaded here first, the same way, so a refused or unreadable
one stops the resume instead of silently making it inexact.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.training import registered
from musiclm_stab.training.registered import Registered, RegisteredStateError


class CheckpointLoadError(ConfigError):
    """A checkpoint holds something that is not loaded (a pickle of code, a missing or unreadable file)."""


def _why(error: Exception) -> str:
    """The reason in torch's refusal ("Unsupported global: GLOBAL exec was not an allowed global by
    default."), without its advice on how to unpickle the file anyway."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    for advice in ("Please use", "Check the documentation"):
        text = text.split(advice, 1)[0]
    return " ".join(text.split()) or type(error).__name__


def _refused(ckpt: Path, name: str, error: Exception) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"cannot load checkpoint {ckpt}: {name} holds more than tensors and plain data, so it is refused "
        "without being unpickled (unpickling can run arbitrary code; was this directory made by this project?): "
        + _why(error))


def _first_refused(ckpt: Path) -> tuple[str, Exception] | None:
    """The first torch-format file of ``ckpt`` that accelerate's loader refuses (only called after a
    refusal, to name the file: torch's message does not)."""
    for path in sorted(ckpt.iterdir()):
        if path.suffix in (".bin", ".pt", ".pkl") and path.is_file():
            try:
                accelerate_load(path, map_location="cpu")
            except pickle.UnpicklingError as e:
                return path.name, e
    return None


def load(accelerator: Accelerator, ckpt: Path, objects: Registered) -> None:
    """Restore the accelerate state of ``ckpt`` and the registered ``objects`` from it, unpickling nothing
    but plain data (module docstring). Raises CheckpointLoadError naming the file otherwise."""
    ckpt = Path(ckpt)
    try:
        registered.check_loadable(ckpt)
    except RegisteredStateError as e:
        raise CheckpointLoadError(str(e)) from None
    rng = ckpt / f"{RNG_STATE_NAME}_{accelerator.process_index}.pkl"
    try:
        accelerate_load(rng, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise _refused(ckpt, rng.name, e) from None
    except (OSError, RuntimeError) as e:
        raise CheckpointLoadError(f"cannot load checkpoint {ckpt}: {rng.name} is unreadable: {e}") from e
    try:
        accelerator.load_state(str(ckpt))
    except pickle.UnpicklingError as e:
        culprit = _first_refused(ckpt)
        raise _refused(ckpt, culprit[0] if culprit else "a file", culprit[1] if culprit else e) from None
    try:
        registered.load(objects, ckpt)
    except RegisteredStateError as e:
        raise CheckpointLoadError(f"cannot load checkpoint {ckpt}: {e}") from None
