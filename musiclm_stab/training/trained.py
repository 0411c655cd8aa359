"""A trained model from a run directory or a checkpoint directory (for evaluation, export and features)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run
from musiclm_stab.config.sections import Config
from musiclm_stab.model import MusicMLM
from musiclm_stab.training.checkpoint import STATE_FILE, newest_valid, verify


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run_dir, checkpoint_dir) from a run directory (its newest intact checkpoint) or a checkpoint dir,
    which must be intact: every way of naming a checkpoint (evaluate, export, features, probe) checks
    its files against the sha256 in its manifest, and a damaged one named directly is refused (ConfigError
    naming the file), not loaded; a run directory skips a damaged one with a warning, as --resume does."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        ckpt = newest_valid(path)
        if ckpt is None:
            raise ConfigError(f"{path} has no complete checkpoint in {path / 'checkpoints'}")
        return path, ckpt
    if (path / STATE_FILE).is_file() and (path.parent.parent / "config.yaml").is_file():
        problem = verify(path)
        if problem is not None:
            raise ConfigError(f"checkpoint {path} is damaged: {problem}; it is not loaded (the run directory "
                              f"{path.parent.parent} names its newest intact checkpoint)")
        return path.parent.parent, path
    raise ConfigError(f"{path} is neither a run directory (with config.yaml) nor a complete checkpoint "
                      f"(with {STATE_FILE})")


def load_model(ckpt: Path, cfg: Config, device: str = "cpu") -> MusicMLM:
    """The model of checkpoint ``ckpt`` (of a run with config ``cfg``), in eval mode on ``device``."""
    model = MusicMLM(cfg.model)
    weights = ckpt / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{ckpt} has no model.safetensors")
    model.load_state_dict(load_file(str(weights), device="cpu"))
    return model.to(device).eval()


def load_checkpoint(path: str | Path) -> tuple[MusicMLM, Path, int | None]:
    """(model in eval mode on CPU, checkpoint dir, step) from a run directory or a checkpoint directory."""
    run_dir, ckpt = resolve_checkpoint(path)
    model = load_model(ckpt, config_from_run(run_dir), "cpu")
    state = ckpt / "trainer_state.json"  # the run-directory contract: written last, holds the step
    step = json.loads(state.read_text()).get("step") if state.is_file() else None
    return model, ckpt, step
