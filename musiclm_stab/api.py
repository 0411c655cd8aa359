"""The Python API: the main verbs, for scripts and notebooks (reference: docs/API.md).

    import musiclm_stab as ms

    ms.tokenize("audio/", "work/tokens", weights="work/encodec_local.pt")   # audio -> EnCodec codes
    run = ms.train("tiny", {"train.max_steps": 200}, data="work/tokens")   # -> the run directory
    ms.evaluate(run)["eval/acoustic_mlm_loss/cb0"]                         # held-out loss per codebook
    encoder = ms.load_encoder(run)                                         # a run, checkpoint or export
    ms.features("song.wav", encoder, layers=[2]).layers[2]                 # [T, width] at 75 Hz
    ms.plot([run], "figures/")                                             # the study's figures

Each verb is the function that a ``musiclm-stab`` command (``musiclm-stab train`` for ``ms.train``)
runs, so a script and the command line give the same results and write the same files. The modules
behind a verb are imported when it is first called: ``import musiclm_stab`` stays light.

Recipes are named as under ``recipes/`` without ``.yaml`` (``"tiny"``, ``"study_prenorm_clip1_run2"``,
``"overlays/tiny"``) or given as paths to YAML files; they ship inside the package, so the names work
in an installed wheel as in a checkout. Settings are ``{"section.key": value}`` (or the command line's
``"section.key=value"`` strings), applied after the recipes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from musiclm_stab.config.sections import Config
    from musiclm_stab.export.features import FeatureModel, FrameFeatures
    from musiclm_stab.export.hubert import ExportResult
    from musiclm_stab.tokenizer.pipeline import TokenizeSummary

# Not ``config`` or ``export``: those are submodules, whose import sets musiclm_stab.config / .export.
__all__ = ["evaluate", "export_hubert", "features", "load_encoder", "make_config", "plot", "recipe", "recipes",
           "study", "tokenize", "train"]

PathLike = str | Path
Recipes = PathLike | Sequence[PathLike]
Settings = Mapping[str, Any] | Sequence[str] | None


def recipes() -> list[str]:
    """The names of the recipes that ship with the package (training recipes and overlays)."""
    from musiclm_stab.config.recipes import recipe_names

    return recipe_names()


def recipe(name: PathLike) -> Path:
    """The YAML file of a recipe: a path to an existing file, or the name of a packaged recipe (``"tiny"``,
    ``"overlays/tiny"``). Raises ConfigError naming the packaged recipes when it is neither."""
    from musiclm_stab.config.recipes import recipe_file

    return recipe_file(name)


def _overrides(settings: Settings) -> list[str]:
    from musiclm_stab.config.loading import setting_text

    if settings is None:
        return []
    if isinstance(settings, Mapping):
        return [f"{key}={setting_text(value)}" for key, value in settings.items()]
    return [str(s) for s in settings]


def _in_python_words(message: str) -> str:
    """A message of the command line in the words of a Python caller of ``ms.train``: ``resume=True`` for
    ``--resume``, the setting in ``settings`` for ``--train.name`` (or ``--train.name=x``)."""
    from musiclm_stab.config.sections import SETTING_NAME

    message = message.replace("the same command and --resume", "the same call with resume=True")
    message = re.sub(r"--resume\b", "resume=True", message)
    return re.sub(rf"--({SETTING_NAME}(?:=[^\s,;)]*[^\s,;).])?)", r'"\1" in settings', message)


def make_config(recipe: Recipes = "tiny", settings: Settings = None, *,
                data: PathLike | Sequence[PathLike] | None = None) -> Config:
    """The resolved run configuration: ``recipe`` (one, or several layered in order: a recipe then
    overlays), then ``data`` (data.path), then ``settings``; validated (ConfigError names a bad setting)."""
    from musiclm_stab.config.loading import load_config, setting_text

    names = [recipe] if isinstance(recipe, (str, Path)) else list(recipe)
    paths = data if isinstance(data, (str, Path)) else list(data or [])
    extra = [] if data is None else [f"data.path={setting_text(paths)}"]
    return load_config(names, [*extra, *_overrides(settings)])


def tokenize(src: PathLike, out_dir: PathLike, weights: PathLike | None = None, **options: Any) -> TokenizeSummary:
    """Tokenize a folder of audio, a manifest or an HF dataset into ``out_dir`` (``musiclm-stab tokenize``).

    ``weights``: None for the pretrained EnCodec model (needs the internet once), or a file made by
    ``musiclm-stab make-weights``. ``options``: those of ``musiclm_stab.tokenizer.pipeline.tokenize``
    (segment_seconds, workers, shard, streaming, ...); it resumes an unfinished ``out_dir``. Workers are
    spawned processes: a script (not a notebook) calls this under ``if __name__ == "__main__":``."""
    from musiclm_stab.tokenizer.pipeline import tokenize as _tokenize

    return _tokenize(src, out_dir, weights=weights, **options)


def train(recipe: Recipes | Config = "tiny", settings: Settings = None, *,
          data: PathLike | Sequence[PathLike] | None = None, resume: bool = False) -> Path:
    """Pretrain in this process and return the run directory (``train.output_dir``/``train.name``).

    ``recipe``, ``settings``, ``data``: as ``make_config`` (or a Config). The loop and the run directory are
    those of ``musiclm-stab train`` (metrics.jsonl, checkpoints, config.yaml), with a fresh accelerate state
    for each call, so a notebook may train several runs. ``resume``: continue from the newest complete
    checkpoint. Several processes or GPUs: ``musiclm-stab train`` with accelerate's options (docs/TRAINING.md).
    Errors name ``resume=True`` and the settings where the command line's would name its options.
    """
    from musiclm_stab.config.sections import Config
    from musiclm_stab.experiments.sweep import train_in_process

    if isinstance(recipe, Config) and (settings or data is not None):
        raise TypeError("train(Config, ...): settings and data go into the Config (musiclm_stab.config)")
    cfg = recipe if isinstance(recipe, Config) else make_config(recipe, settings, data=data)
    try:
        return train_in_process(cfg, resume=resume)
    except Exception as e:  # the trainer's own errors, said to a Python caller; the same exception goes on
        if type(e).__module__.startswith("musiclm_stab.") and e.args and isinstance(e.args[0], str):
            e.args = (_in_python_words(e.args[0]), *e.args[1:])
        raise


def evaluate(run: PathLike, data: PathLike | None = None, split: str = "eval", device: str | None = None,
             write: bool = True) -> dict[str, Any]:
    """Held-out loss per codebook of a run (its newest checkpoint) or a checkpoint directory
    (``musiclm-stab evaluate``): ``{"eval/acoustic_mlm_loss/cb0": ..., "step": ..., "unit": ...}``.
    ``device``: CUDA when there is one, unless given (as the command and the other verbs). Deterministic on
    one device; written unless ``write`` is False to RUN/eval/step_N.json (the held-out split of the run's own
    data), or to a record of its own for another split or data (step_N.train.json, ...)."""
    from musiclm_stab.analysis.evaluate import evaluate as _evaluate

    return _evaluate(run, data=data, split=split, device=device, write=write)


def load_encoder(path: PathLike, device: str | None = None) -> FeatureModel:
    """A trained encoder for features: a run directory (newest checkpoint), a checkpoint directory or an
    export (``musiclm-stab export``; needs transformers). ``device``: CUDA when there is one, unless given."""
    from musiclm_stab.export.features import load_feature_model

    return load_feature_model(path, device)


def features(audio: PathLike | torch.Tensor | np.ndarray, encoder: FeatureModel | PathLike, layers: Sequence[int] | None = None,
             chunk_seconds: float | None = None, device: str | None = None) -> FrameFeatures:
    """Per-layer features at 75 Hz of an audio file (any format ``tokenize`` reads, decoded to 24 kHz mono)
    or a waveform [S] at 24 kHz (``musiclm-stab features``): ``.layers[l]`` is a [T, width] tensor, T =
    ceil(S / 320). ``encoder``: from ``load_encoder``, or a path for it. ``layers``: 0 (the embeddings)
    .. N, None for all. Long audio is cut into overlapping windows of ``chunk_seconds`` and stitched."""
    from musiclm_stab.export.features import DEFAULT_CHUNK_SECONDS, extract_features

    return extract_features(audio, encoder, layers, chunk_seconds or DEFAULT_CHUNK_SECONDS, device=device)


def plot(runs: Sequence[PathLike], out_dir: PathLike, **options: Any) -> list[Path]:
    """The study's figures of ``runs`` (run directories) into ``out_dir`` (``musiclm-stab plot``); returns
    the files written. ``options``: those of ``musiclm_stab.analysis.plot.plot_runs`` (bands, extra,
    window, smooth, formats, unit, labels, ...)."""
    from musiclm_stab.analysis.plot import plot_runs

    return plot_runs(list(runs), out_dir, **options)


def study(scale: str = "cpu", *, runs: PathLike = "runs", data: PathLike | None = None, work: PathLike = "work",
          name: str | None = None, steps: int | None = None, seeds: int | None = None,
          lrs: Sequence[float] | None = None, settings: Settings = None, jobs: int | None = None,
          probe: bool = False) -> list[Path]:
    """The stability study (``musiclm-stab study``): the four configurations over the lr grid and seeds,
    plus the QK-norm control, each run through ``accelerate launch``; then its figures and claims table
    in RUNS/NAME/figures. Returns the files written. ``data``: tokenized data (default: the scale's corpus
    under ``work``, made when missing); ``steps``, ``seeds``, ``lrs``: instead of the scale's;
    ``settings``: applied last to every run; ``jobs``: runs at a time. Finished runs are reused, interrupted
    ones resumed (docs/STUDY.md)."""
    from musiclm_stab.experiments.launch import STUDY_RENDERER, default_data
    from musiclm_stab.experiments.study import run_study
    from musiclm_stab.experiments.study_plan import DEFAULT_JOBS, STUDY_DATA, plan_study

    if data is None and scale in STUDY_DATA:
        preset, tracks = STUDY_DATA[scale]
        data = default_data(work, tracks, preset, STUDY_RENDERER)
    plan = plan_study(scale, runs, data, steps, name, _overrides(settings), seeds,
                      lrs=None if lrs is None else tuple(lrs))
    return run_study(plan, threads=1 if scale == "cpu" else None, jobs=jobs or DEFAULT_JOBS[scale], probe=probe)


def export_hubert(run: PathLike, out_dir: PathLike, **options: Any) -> ExportResult:
    """The encoder of a run (newest checkpoint) or checkpoint as a ``transformers.HubertModel`` directory
    with its model card (README.md), verified layer by layer (``musiclm-stab export``; needs the ``export``
    extra). ``options``: those of ``musiclm_stab.export.hubert.export`` (audio, seconds, overwrite, license)."""
    from musiclm_stab.export.hubert import export as _export

    return _export(run, out_dir, **options)
