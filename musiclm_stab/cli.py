"""The `musiclm-stab` command: one subcommand per module, each owning its own arguments.

Training itself runs through ``accelerate launch recipes/pretrain.py``; everything else is here.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Each module exposes ``cli_main(argv) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "build-corpus": ("musiclm_stab.corpus.build", "render the default corpus of real music (offline)"),
    "make-weights": ("musiclm_stab.tokenizer.fit", "make local EnCodec weights with fitted codebooks"),
    "tokenize": ("musiclm_stab.tokenizer.cli", "tokenize audio into EnCodec codes, as an HF dataset"),
    "evaluate": ("musiclm_stab.analysis.evaluate", "held-out loss per codebook of a run or checkpoint"),
    "plot": ("musiclm_stab.analysis.plot", "the stability study's figures from run directories"),
    "probe": ("musiclm_stab.analysis.probe", "linear probes per layer (pitch, key, instrument) with labels from the scores"),
    "study": ("musiclm_stab.experiments.study", "the stability study: four configurations over seeds, figures and the claims table (cpu, gpu or full scale)"),
    "sweep": ("musiclm_stab.experiments.sweep", "learning-rate sensitivity sweep over norm schemes (Wortsman et al. 2023)"),
    "export": ("musiclm_stab.export.hubert", "export an encoder to transformers.HubertModel, verified layer by layer"),
    "features": ("musiclm_stab.export.feature_files", "75 Hz per-layer features of audio of any length (chunked), to .npy"),
    "quickstart": ("musiclm_stab.experiments.quickstart", "the main job: corpus, tokenize, pretrain, evaluate"),
}


def usage() -> str:
    lines = ["usage: musiclm-stab <command> [args...]", "", "commands:"]
    lines += [f"  {name:<14}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "training: accelerate launch recipes/pretrain.py --config recipes/tiny.yaml [--section.key=value ...]"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"musiclm-stab: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.cli_main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
