"""The `musiclm-stab` command (also ``python -m musiclm_stab``): one subcommand per module, each owning its own
arguments. ``train`` runs the trainer under ``accelerate launch`` (experiments/train.py); ``docs`` prints the
reference pages that ship with the package.
"""

from __future__ import annotations

import importlib
import os
import select
import sys

from musiclm_stab.constants import __version__

# subcommand -> (module, one-line help, reference page). Each module exposes ``cli_main(argv) -> int``, and its
# parser's --help ends with "Reference: <the same page>" (tests/test_docs.py keeps the two in step).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("musiclm_stab.experiments.train",
              "pretrain under accelerate launch: recipes by name, every setting as --section.key=value",
              "docs/TRAINING.md"),
    "build-corpus": ("musiclm_stab.corpus.build", "render the default corpus of real music (offline)",
                     "docs/TOKENIZING.md"),
    "make-weights": ("musiclm_stab.tokenizer.fit", "make local EnCodec weights with fitted codebooks",
                     "docs/TOKENIZING.md"),
    "tokenize": ("musiclm_stab.tokenizer.cli", "tokenize audio into EnCodec codes, as an HF dataset",
                 "docs/TOKENIZING.md"),
    "codes": ("musiclm_stab.data.codes_file",
              "save a tokenized dataset's codes to one file, or restore them into another machine's tokenizing",
              "docs/TOKENIZING.md"),
    "evaluate": ("musiclm_stab.analysis.evaluate", "held-out loss per codebook of a run or checkpoint",
                 "docs/TRAINING.md"),
    "plot": ("musiclm_stab.analysis.plot", "the stability study's figures from run directories", "docs/TRAINING.md"),
    "probe": ("musiclm_stab.analysis.probe",
              "linear probes per layer (pitch, key, instrument) with labels from the scores", "docs/PROBES.md"),
    "study": ("musiclm_stab.experiments.study",
              "the stability study: four configurations over seeds, figures and the claims table "
              "(cpu, gpu or full scale)", "docs/STUDY.md"),
    "sweep": ("musiclm_stab.experiments.sweep",
              "learning-rate sensitivity sweep over norm schemes (Wortsman et al. 2023)", "docs/STUDY.md"),
    "export": ("musiclm_stab.export.hubert", "export an encoder to transformers.HubertModel, verified layer by layer",
               "docs/EXPORT.md"),
    "features": ("musiclm_stab.export.feature_files",
                 "75 Hz per-layer features of audio of any length (chunked), to .npy", "docs/EXPORT.md"),
    "quickstart": ("musiclm_stab.experiments.quickstart", "the main job: corpus, tokenize, pretrain, evaluate",
                   "README.md"),
    "docs": ("musiclm_stab.reference", "print a reference page (README, TRAINING, ...) or list them, offline",
             "README.md"),
}


def usage() -> str:
    """The top-level help: what the project is, each command in one line with its reference page."""
    lines = ["usage: musiclm-stab [--version] <command> [args...]", "",
             "Pretrain music masked-LMs (MERT-style) and study their training stability. Start at README.md "
             "(musiclm-stab docs README).", "", "commands:"]
    lines += [f"  {name:<14}{help_} ({page})" for name, (_, help_, page) in COMMANDS.items()]
    lines += ["", "training: musiclm-stab train --config tiny --data.path=work/tokens [--section.key=value ...]",
              "          musiclm-stab train --help lists every setting (docs/TRAINING.md)",
              "", "Each command's --help says what it does and names its reference page; musiclm-stab docs PAGE "
              "prints one."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"musiclm-stab {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"musiclm-stab: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from musiclm_stab.corpus.render import MissingPackage

    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        status = int(module.cli_main(argv[1:]) or 0)
        sys.stdout.flush()  # output shorter than the buffer is written here, not at exit, where a failure is noise
        return status
    except MissingPackage as e:  # an optional package the job needs (the corpus builder's): one line, no traceback
        print(f"musiclm-stab {argv[0]}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise  # another pipe (a worker, a subprocess): a real error
        # stdout's reader went away (`study --print-only | head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits
        return 141  # 128 + SIGPIPE, what the shell reports for such a command


def _reader_gone(stream) -> bool:
    """Whether ``stream`` is a pipe whose reading end is closed (poll reports an error on its writing end)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll on this platform
        return False


if __name__ == "__main__":
    sys.exit(main())
