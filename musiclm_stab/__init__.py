"""musiclm_stab: pretraining MERT-style music masked-language models and studying their training stability.

The main verbs are importable from here (musiclm_stab/api.py; reference: docs/API.md):

    import musiclm_stab as ms

    run = ms.train("tiny", {"train.max_steps": 200}, data="work/tokens")
    ms.evaluate(run)["eval/acoustic_mlm_loss/cb0"]
    ms.features("song.wav", ms.load_encoder(run), layers=[2]).layers[2]

They are loaded on first use (PEP 562), so ``import musiclm_stab`` imports neither torch nor any submodule
but ``constants`` (the shared numbers, which every part of the package imports from there, never from here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The shared numbers and the version live on the ground floor (constants.py); the face re-exports them.
from musiclm_stab.constants import (
    CODEBOOK_SIZE,
    FRAME_RATE,
    HOP_LENGTH,
    NUM_CODEBOOKS,
    SAMPLE_RATE,
    __version__,
)

__all__ = ["CODEBOOK_SIZE", "FRAME_RATE", "HOP_LENGTH", "NUM_CODEBOOKS", "SAMPLE_RATE", "__version__",
           # the verbs (musiclm_stab.api.__all__)
           "evaluate", "export_hubert", "features", "load_encoder", "make_config", "plot", "recipe", "recipes",
           "study", "tokenize", "train"]
API = tuple(name for name in __all__ if name.islower() and not name.startswith("_"))

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads them
    from musiclm_stab.api import (
        evaluate,
        export_hubert,
        features,
        load_encoder,
        make_config,
        plot,
        recipe,
        recipes,
        study,
        tokenize,
        train,
    )


def __getattr__(name: str):
    if name in API:
        import importlib

        return getattr(importlib.import_module("musiclm_stab.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
