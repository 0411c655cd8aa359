"""What the jobs share: the default data, launching a training run, and a run directory's state.

    default_data(work)            the default corpus, EnCodec weights and tokens under ``work`` (reused when there)
    launch_command(configs, ...)  the ``accelerate launch recipes/pretrain.py`` command line of one run
    run_state(cfg)                new / done / partial / other: may a job start, resume, reuse or must it refuse
    add_job_options(parser)       the options every job takes (--work, --data, --set, --threads)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run
from musiclm_stab.config.recipes import PACKAGED_RECIPES
from musiclm_stab.config.sections import Config
from musiclm_stab.corpus.render import DEFAULT_RENDERER

# The recipes and the training entry point ship inside the package (config.PACKAGED_RECIPES: package data), so
# the jobs find them in an installed wheel too. A checkout has one more name for that folder, the symlink
# recipes -> musiclm_stab/recipes at its root; commands are shown with it there, as the docs write them.
_CHECKOUT_LINK = PACKAGED_RECIPES.parent.parent / "recipes"
RECIPES = _CHECKOUT_LINK if _CHECKOUT_LINK.resolve() == PACKAGED_RECIPES else PACKAGED_RECIPES
PRETRAIN = RECIPES / "pretrain.py"
DEFAULT_NUM_TRACKS = 24
# The studies' and the sweep's corpora: their committed codes (data/study_cpu_codes.npz.xz) and results are of
# the audio tinysoundfont rendered, and local weights are fitted on that audio.
STUDY_RENDERER = "tinysoundfont"


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


# ---------------------------------------------------------------------------------------------------
# The default data


def ensure_weights(corpus_dir: Path, work: Path, name: str = "encodec_local_seed0.pt") -> tuple[str | None, str | None]:
    """(weights file or None for the pretrained model, note for the data's metadata); local weights are
    ``work/name``, fitted on ``corpus_dir`` when missing."""
    from musiclm_stab.tokenizer.fit import make_local_weights
    from musiclm_stab.tokenizer.weights import WeightsUnavailable, load_encodec

    try:
        load_encodec(None)
        print("using the pretrained EnCodec 24 kHz model")
        return None, None
    except WeightsUnavailable as e:
        reason = str(e).splitlines()[0]
    local = work / name
    note = ("local weights made by `musiclm-stab make-weights` (random encoder, codebooks fitted by seeded "
            f"k-means on the default corpus) because the pretrained model could not be had: {reason}")
    print("*" * 78)
    print("The pretrained EnCodec weights could not be downloaded (no internet?).")
    print(f"Using LOCAL weights instead: {local}")
    print("They are recorded in the tokenized data's metadata (tokenizer.json: weights, weights_sha256, weights_note).")
    print("*" * 78, flush=True)
    if not local.exists():
        files = sorted(p for p in corpus_dir.iterdir() if p.suffix in (".flac", ".wav"))
        make_local_weights(files, local, seed=0, max_seconds=600)
    return str(local), note


def ensure_tokens(corpus_dir: Path, out: Path, weights: str | None, note: str | None) -> Path:
    """``corpus_dir`` tokenized into ``out`` with ``weights``, unless it already is."""
    from musiclm_stab.tokenizer.pipeline import tokenize
    from musiclm_stab.tokenizer.weights import load_encodec

    meta = out / "tokenizer.json"
    if meta.exists():
        _, info = load_encodec(weights)
        if json.loads(meta.read_text()).get("weights_sha256") == info["weights_sha256"]:
            print(f"reusing tokenized data in {out}")
            return out
        print(f"{out} was tokenized with other weights: tokenizing again")
        print(tokenize(corpus_dir, out, weights=weights, weights_note=note, overwrite=True))  # its own output only
        return out
    print(tokenize(corpus_dir, out, weights=weights, weights_note=note))
    return out


def _suffix(renderer: str) -> str:
    """The corpora of the renderer tinysoundfont keep the names they had before there was a choice."""
    return "" if renderer == "tinysoundfont" else f"_{renderer}"


def data_name(num_tracks: int = DEFAULT_NUM_TRACKS, preset: str = "default",
              renderer: str = DEFAULT_RENDERER) -> str:
    """The corpus folder's name under ``work``: ``default_corpus`` (the default 24 chorales),
    ``chorales{n}`` (another number of chorales) or ``{preset}{n}`` (the first n tracks of a preset), then
    ``_sampler`` when the package's own renderer made it (tinysoundfont's corpora, the studies', keep the
    plain names); its tokens are in ``{name}_tokens``."""
    if preset != "default":
        return f"{preset}{num_tracks}{_suffix(renderer)}"
    return ("default_corpus" if num_tracks == DEFAULT_NUM_TRACKS else f"chorales{num_tracks}") + _suffix(renderer)


def default_data(work: str | Path, num_tracks: int = DEFAULT_NUM_TRACKS, preset: str = "default",
                 renderer: str = DEFAULT_RENDERER) -> Path:
    """A corpus (``num_tracks`` Bach chorales, or the first ``num_tracks`` of ``preset``, rendered with
    ``renderer``), its EnCodec weights and its tokens under ``work``, each made only when missing; returns the
    tokenized folder (``{data_name(...)}_tokens``). The weights are fitted on the 24-track default corpus's
    first 600 s (of the same renderer) whatever the corpus, so every corpus of a renderer shares them. The
    studies and the sweep use STUDY_RENDERER: their committed codes and results are of its audio."""
    from musiclm_stab.corpus.build import build_corpus

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    name = data_name(num_tracks, preset, renderer)
    what = f"{num_tracks} Bach chorales" if preset == "default" else f"the first {num_tracks} tracks of the {preset} preset"
    banner(f"data 1/3: corpus ({what} rendered with a General MIDI soundfont by {renderer})")
    corpus_dir = work / name
    build_corpus(corpus_dir, num_tracks=num_tracks, seed=0, preset=preset, renderer=renderer)
    banner("data 2/3: EnCodec weights")
    weights_corpus = work / data_name(DEFAULT_NUM_TRACKS, "default", renderer)
    if name != weights_corpus.name:  # the same weights as the default corpus's: its first 24 tracks
        build_corpus(weights_corpus, num_tracks=DEFAULT_NUM_TRACKS, seed=0, renderer=renderer)
    weights, note = ensure_weights(weights_corpus, work, f"encodec_local_seed0{_suffix(renderer)}.pt")
    banner("data 3/3: tokenize")
    return ensure_tokens(corpus_dir, work / f"{name}_tokens", weights, note)


# ---------------------------------------------------------------------------------------------------
# Launching a run


def accelerate_executable() -> str | list[str]:
    """The ``accelerate`` beside this Python (a venv's), else this Python running accelerate's command line:
    never another interpreter's ``accelerate`` on PATH, whose launch would train with that interpreter's
    packages (e.g. a wheel installed into a venv whose scripts are not on PATH)."""
    local = Path(sys.executable).with_name("accelerate")
    return str(local) if local.exists() else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def shown(path: str | Path) -> str:
    """A path as a person would type it here: relative to the working directory when under it (symlinks
    kept: a checkout's ``recipes/...`` stays ``recipes/...``)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def launch_command(configs: Sequence[str | Path], overrides: Sequence[str] = (), *,
                   accelerate: str | Sequence[str] = "accelerate", single_process: bool = True,
                   resume: bool = False) -> list[str]:
    """``accelerate launch recipes/pretrain.py --config C ... --section.key=value ...``.

    ``accelerate``: the command that runs accelerate (a path, or argv words: accelerate_executable).
    ``single_process``: one process without an accelerate config file (precision comes from the run's
    config: ``--mixed_precision no`` is accelerate's "not asked", training/precision.py); else the machine's
    own ``accelerate config`` decides (a cluster)."""
    launch = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"] if single_process else []
    head = [accelerate] if isinstance(accelerate, str) else list(accelerate)
    cmd = [*head, "launch", *launch, shown(PRETRAIN)]
    for config in configs:
        cmd += ["--config", shown(config)]
    return [*cmd, *overrides, *(["--resume"] if resume else [])]


def same_config(run_dir: Path, cfg: Config) -> bool:
    """Whether the run in ``run_dir`` has ``cfg``: its config.yaml read back as the run had it (settings added
    since the run was made take the value that means what the run did: ``config_from_run``), compared
    setting for setting, except ``train.output_dir``: the folder that held the run when it trained, not what
    it trained with, so a run carried to another folder or machine is still the same run there. An unreadable
    config.yaml is another config."""
    try:
        return trained_with(config_from_run(run_dir).to_dict()) == trained_with(cfg.to_dict())
    except ConfigError:
        return False


def trained_with(config: dict) -> dict:
    """A run's settings (a config as a dict) less ``train.output_dir``, the folder the run was in when it
    trained: what tells two runs apart wherever they are carried."""
    train = {k: v for k, v in (config.get("train") or {}).items() if k != "output_dir"}
    return {**config, "train": train}


def run_state(cfg: Config) -> str:
    """What ``cfg.run_dir`` holds: ``new`` (nothing), ``done`` (this config, trained to its last step, or
    ended by fp16's loss-scale floor: diverged, a result), ``partial`` (this config, interrupted: resume it) or
    ``other`` (another config: never overwritten)."""
    from musiclm_stab.analysis.runs import read_run

    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file():
        return "new"
    if not same_config(cfg.run_dir, cfg):
        return "other"
    if not (cfg.run_dir / "metrics.jsonl").is_file():
        return "partial"
    last = min(cfg.train.max_steps, cfg.train.stop_at or cfg.train.max_steps)
    run = read_run(cfg.run_dir)
    return "done" if run.last_step == last or getattr(run, "diverged_at", None) is not None else "partial"


def add_job_options(p: argparse.ArgumentParser, threads_help: str = "") -> None:
    """--work, --data, --set and --threads, the same for every job."""
    p.add_argument("--data", help="tokenized dataset (default: the default corpus under --work, made if missing)")
    p.add_argument("--work", default="work", help="without --data: folder for the corpus, weights and tokens")
    p.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE", dest="extra",
                   help="further overrides for every run (e.g. data.batch_size=2 train.mixed_precision=bf16)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per run (default 1: on 2 shared cores a tiny step took 0.45 s with one "
                   f"thread, 2.6 s with two); 0 leaves it as it is{threads_help}")


def as_overrides(extra: Sequence[str]) -> list[str]:
    """``section.key=value`` items of --set as ``--section.key=value`` overrides."""
    return [e if e.startswith("--") else f"--{e}" for e in extra]
