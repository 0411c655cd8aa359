"""Spawned worker processes, and the one thing that breaks them when a script calls the package.

The tokenizer's encoders, make-weights' encoder frames and the study's probes run in processes started by
multiprocessing's "spawn" (fork, after torch has started threads, can deadlock). A spawned process is a fresh
interpreter that imports the parent's main module again, as ``__mp_main__``, so that what was defined there
can be found. A script run as a file (``python example.py``, ``python -m pkg.script``) is therefore run again
in every worker, from its top, unless its work sits under ``if __name__ == "__main__":`` (Python's documented
idiom for spawn). Without the guard each worker redid the script (the README's example: every worker started
its own tokenizing, found the output locked, and the run died after 22 s in a storm of 132 lines of worker
tracebacks). ``spawn_would_rerun`` sees that case before any process starts, from the call stack and the
script's source, so that the caller can do its work in this process instead (the in-process paths give the
same results: the tokenizer's codes, the weights file and the probes do not depend on the worker count) and
say in one line how to get the workers back: ``workers_for``.
"""

from __future__ import annotations

import ast
import inspect
import sys
import warnings
from pathlib import Path
from types import FrameType

GUARD = 'if __name__ == "__main__":'


def spawn_would_rerun() -> str | None:
    """``"file:line"`` of the main script's top-level statement that led to this call when a spawned process
    would run that statement again (it is outside ``if __name__ == "__main__":``); None when spawning is safe.

    Safe: an interpreter whose main module is not imported again by spawn (``python -c``, the REPL, a
    notebook, a package's ``__main__``: the same rules as multiprocessing.spawn), a call that does not come
    from the script's top level (a thread, a callback), or a call under the guard. A script whose source
    cannot be read counts as unguarded: doing the work here is always correct, only slower."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:  # python -m NAME: spawn imports NAME again, unless it is a package's __main__
        if spec_name == "__main__" or spec_name.endswith(".__main__"):
            return None
    else:
        path = getattr(main, "__file__", None)
        if path is None or Path(path).stem == "ipython":  # -c, the REPL, notebooks: nothing to import again
            return None
    frame = _top_level_frame(vars(main))
    if frame is None:
        return None
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    try:
        tree = ast.parse(Path(frame.f_code.co_filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return where
    return None if _under_main_guard(tree, frame.f_lineno) else where


def workers_for(what: str, workers: int) -> int:
    """``workers`` processes for ``what`` when spawning them is safe, else 0 (this process), with one warning
    that names the script's line and the fix (see ``spawn_would_rerun``)."""
    if workers <= 0:
        return workers
    where = spawn_would_rerun()
    if where is None:
        return workers
    file, _, line = where.rpartition(":")
    warnings.warn_explicit(
        f"{what} runs in this process instead of {workers} worker processes: this script calls it outside "
        f"`{GUARD}`, and each spawned worker would run the script again; put the script's work under that "
        "guard to use the workers", UserWarning, file, int(line))
    return 0


def _top_level_frame(main_globals: dict) -> FrameType | None:
    """The frame running the main script's module-level code, if this call came from it."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _under_main_guard(tree: ast.Module, line: int) -> bool:
    """Whether ``line`` lies in the body of an ``if __name__ == "__main__":`` block of the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno):
                return True
    return False
