"""The trainer run in the test's own process, as a launched process runs it (a helper of the tests, not
collected): a subprocess would spend most of its time importing torch again."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fresh_accelerate() -> Iterator[None]:
    """accelerate keeps process-wide singletons: reset them before and after the block (a run before it in this
    process set them up; one after it must not find them)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def trainer_here(argv: list[str], cwd: str | Path | None = None) -> int:
    """recipes/pretrain.py's main (what `accelerate launch` runs) with ``argv``, in this process: in ``cwd`` as
    the launch runs it, on one intra-op thread as the launched processes (OMP_NUM_THREADS=1, which the float
    results depend on), accelerate's state fresh around it. Its exit code."""
    from musiclm_stab.threads import one_thread
    from musiclm_stab.training.trainer import main

    with fresh_accelerate(), one_thread(), contextlib.chdir(cwd or os.getcwd()):
        return main(argv)
