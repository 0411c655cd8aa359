"""Taking the encoder elsewhere.

    hubert.py         writing an export: a plain transformers.HubertModel checkpoint, verified layer by layer
    exported.py       using one: the padding it needs (pad_for_export), its heads, its losses
    features.py       75 Hz per-layer features of audio of any length, chunked, from a run or an export
    feature_files.py  the same for a folder of audio, to .npy files (musiclm-stab features)

``musiclm_stab.export.pad_for_export``, ``.export`` and ``.extract_features`` are the names a user imports;
they are loaded on first use, so that reading an export never imports the writer (or transformers).
"""

from __future__ import annotations

import importlib

_NAMES = {"pad_for_export": "exported", "load_heads": "exported", "mlm_losses": "exported", "export": "hubert",
          "extract_features": "features", "load_feature_model": "features"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
