"""Removing and replacing on disk: the one place the package deletes anything, and all it may delete.

A research tool may refuse, stop or warn; it never removes what it did not make. Every removal in the
package goes through the functions below (``tests/test_removal.py`` checks that no other module calls
``rmtree``, ``unlink``, ``rmdir`` or ``os.remove``), and each checks what it is given before anything is
touched. All the package may remove:

1. **A temporary file or folder** (``discard_temporary``): a name of the shape the package gives what it is
   still writing (``.NAME.partial``, ``.NAME.<pid>.tmp``, ``.NAME.<pid>.part``, ``.tmp-NAME``, see
   ``TEMPORARY``). It never held anything complete: the writer's own partial write after a failure, or
   the debris of a killed run, which the next run of the same command clears.
2. **An output folder the package made** (``clear_output``, ``replace_output``): one whose marker file
   (``MARKER``, written when the folder is created) names the kind of output the command makes, or, for
   an output of an earlier version (written before markers), one its writer recognises precisely by its
   own files (``earlier_version``). ``tokenize --overwrite`` clears a tokenized dataset; ``export
   --overwrite`` replaces an export.
3. **Something the package made inside such an output, or inside a run's ``checkpoints/``**
   (``remove_own``, ``replace_output`` with ``inside``): strictly inside the folder the user named, and
   either that folder carries the marker or the caller recognises the thing by its own files (a
   ``features`` folder holds ``layer_NN.npy`` files only; a checkpoint is ``checkpoints/step_N`` with its
   manifest; a corpus's audio, labels and records by their names).

Whatever the command, never: a folder that holds a training run (``RUN_SIGNS``: ``config.yaml``,
``checkpoints/``, ``metrics.jsonl``, ``.train.lock``), a source being read or a folder holding one, the
folder the user named when only something inside it may go (so never a parent), a folder without the
marker or its writer's recognition, anything reached through a symbolic link (a link is never followed).
A refusal is ``Refused`` (a ValueError: the commands exit 2), naming the folder and the reason, before
anything is touched.

Where a thing of the package's own is in doubt (a damaged checkpoint: damaged by what?), it is moved
aside (``move_aside``): renamed to ``NAME.aside-<UTC time>`` beside it, and the caller says where.

Writing a file under a temporary name and renaming it over the name it is written for (every atomic
write of the package) is no removal: it replaces the earlier version of that one file, which the same
writer made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

from musiclm_stab.constants import __version__

MARKER = ".musiclm-stab-output"  # an output folder's marker: {"kind": ..., "made_by": ...}
KINDS = {  # the outputs a marker may name, as a refusal describes them
    "tokenized": "a tokenized dataset (musiclm-stab tokenize)",
    "features": "features (musiclm-stab features)",
    "export": "a HuBERT export (musiclm-stab export)",
}
# What makes a folder a training run (training/run_dir.py writes them; its lock is run_dir.LOCK_FILE).
RUN_SIGNS = ("config.yaml", "checkpoints", "metrics.jsonl", ".train.lock")
# The names the package gives what it is still writing (a file or a folder).
TEMPORARY = re.compile(r"^\.(tmp-.+|.+\.(partial|tmp|part))$")


class Refused(ValueError):
    """A removal the rules above do not allow; nothing was touched."""


def _located(path: Path) -> Path:
    """``path`` made absolute with the links of its parent folders resolved, but not its own: where the
    entry itself is (a symbolic link is judged as the link, never as what it points to)."""
    path = Path(path)
    if path.name in ("", ".", ".."):  # a name that is no entry of its own: the folder it refers to
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name  # links before a `..` resolved first, as the OS does


def is_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` lies strictly inside ``folder`` (never ``folder`` itself), links resolved but
    ``path``'s own."""
    return Path(os.path.realpath(folder)) in _located(Path(path)).parents


def same_name(name: str) -> str:
    """A name as a case-insensitive or normalizing file system (macOS, Windows) compares it."""
    return unicodedata.normalize("NFC", name).casefold()


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def run_signs(folder: str | Path) -> list[str]:
    """The names in ``folder`` that make it a training run's directory (RUN_SIGNS), in that order."""
    return [name for name in RUN_SIGNS if _exists(Path(folder) / name)]


def mark_output(folder: str | Path, kind: str) -> None:
    """Write the marker that makes ``folder`` an output of ``kind`` the package may later clear or replace
    (complete or absent: written under a temporary name and renamed)."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}: one of {', '.join(KINDS)}")
    marker = Path(folder) / MARKER
    if output_kind(folder) == kind:
        return
    tmp = marker.with_name(f"{MARKER}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"kind": kind, "made_by": f"musiclm-stab {__version__}"}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)


def output_kind(folder: str | Path) -> str | None:
    """The kind of output ``folder``'s marker names (KINDS); None without a readable marker."""
    marker = Path(folder) / MARKER
    try:
        if marker.is_symlink():
            return None
        kind = json.loads(marker.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def why_not_removable(
    folder: str | Path,
    kind: str | None = None,
    *,
    inside: str | Path | None = None,
    sources: Iterable[str | Path] = (),
    recognised: Callable[[Path], bool] | None = None,
) -> str | None:
    """None if ``folder`` may be removed, else why not (a clause: "it holds a training run (...)").

    ``kind``: the output kind its marker must name; ``recognised``: the caller's precise recognition of
    its own files where there is no marker (an earlier version's output, a checkpoint, a features folder);
    one of them must hold. ``inside``: the folder the user named, which ``folder`` must lie strictly inside.
    ``sources``: what the command reads; ``folder`` must neither be one, nor hold one.
    """
    folder = Path(folder)
    if folder.is_symlink():
        return f"it is a symbolic link (to {os.readlink(folder)}), which is never followed"
    if inside is not None and not is_inside(folder, inside):
        return f"it is not inside {inside}"
    where = Path(os.path.realpath(folder))
    for source in sources:
        for at in {_located(Path(source)), Path(os.path.realpath(source))}:  # the name given, and what it names
            if at == where:
                return f"it is the source {source}"
            if where in at.parents:
                return f"it holds the source {source}"
    signs = run_signs(folder)
    if signs:
        return f"it holds a training run ({', '.join(signs)})"
    found = output_kind(folder) if folder.is_dir() else None
    if kind is not None and found == kind:
        return None
    if recognised is not None and recognised(folder):
        return None
    if found is not None:
        return f"it holds {KINDS[found]}, not {KINDS.get(kind, 'what this command makes')}"
    if kind is not None:
        return f"it has no {MARKER} naming it {KINDS[kind]}: this command did not make it"
    return "it is not something this command made"


def check_removable(folder: str | Path, kind: str | None = None, **rules) -> None:
    """``Refused`` naming ``folder`` unless ``why_not_removable`` allows it (same arguments)."""
    why = why_not_removable(folder, kind, **rules)
    if why is not None:
        raise Refused(f"refusing to remove {folder}: {why}")


def _remove(path: Path) -> None:
    """Remove a file, a link (never its target) or a folder with what it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def discard_temporary(path: str | Path, *, ignore_errors: bool = False) -> None:
    """Remove a temporary file or folder (rule 1), if it is there. ``ignore_errors``: an OS error is
    ignored (cleaning up after a failure that is already being reported). A name not of the temporary
    shape is a programming error: ValueError, nothing removed."""
    path = Path(path)
    if not TEMPORARY.match(path.name):
        raise ValueError(f"{path}: not a temporary name ({TEMPORARY.pattern}); refusing to remove it")
    try:
        _remove(path)
    except OSError:
        if not ignore_errors:
            raise


def remove_own(path: str | Path, inside: str | Path, kind: str | None = None,
               recognised: Callable[[Path], bool] | None = None, sources: Iterable[str | Path] = ()) -> None:
    """Remove ``path``, a file or folder the package made inside the folder ``inside`` (rule 3): strictly
    inside it, and ``inside`` is marked as ``kind`` or ``recognised(path)`` holds. Refused otherwise."""
    path = Path(path)
    if not _exists(path):
        return
    if kind is not None and output_kind(inside) == kind:
        recognised = _everything  # what a marked output holds is the output's
    check_removable(path, None, inside=inside, sources=sources, recognised=recognised)
    _remove(path)


def _everything(_: Path) -> bool:
    return True


def clear_output(folder: str | Path, kind: str, *, keep: Iterable[str] = (), sources: Iterable[str | Path] = (),
                 earlier_version: Callable[[Path], bool] | None = None) -> None:
    """Remove what the output ``folder`` of ``kind`` holds (rule 2), but the names in ``keep`` (a lock the
    caller holds) and its marker; the folder stays. Refused (nothing removed) unless it may be removed."""
    folder = Path(folder)
    check_removable(folder, kind, sources=sources, recognised=earlier_version)
    for entry in folder.iterdir():
        if entry.name not in (*keep, MARKER):
            _remove(entry)


def replace_output(new: str | Path, folder: str | Path, kind: str | None = None, *,
                   inside: str | Path | None = None, sources: Iterable[str | Path] = (),
                   recognised: Callable[[Path], bool] | None = None) -> None:
    """Put the complete folder ``new`` (a temporary name, rule 1) in place of ``folder``; an existing
    ``folder`` (but an empty one) must be removable (rules 2 and 3: ``why_not_removable``'s arguments), else Refused and
    nothing is touched. The old folder is renamed to a temporary name first and removed once ``new`` is
    in place, so a failure in between leaves one of them under ``folder``'s name."""
    new, folder = Path(new), Path(folder)
    if not TEMPORARY.match(new.name):
        raise ValueError(f"{new}: not a temporary name ({TEMPORARY.pattern})")
    if not _exists(folder) or (folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())):
        os.replace(new, folder)  # over an empty folder too: nothing is lost
        return
    check_removable(folder, kind, inside=inside, sources=sources, recognised=recognised)
    old = folder.with_name(f".{folder.name}.{os.getpid()}.replaced.tmp")
    discard_temporary(old)
    os.replace(folder, old)
    try:
        os.replace(new, folder)
    except BaseException:
        os.replace(old, folder)
        raise
    discard_temporary(old)


def move_aside(path: str | Path) -> Path:
    """Rename ``path`` to ``NAME.aside-<UTC time>`` beside it (``-2``, ``-3`` ... if taken); returns the
    new path. For what the package made but will not delete: the caller says where it went."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}.aside-{stamp}"), 1
    while _exists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.aside-{stamp}-{n}")
    os.rename(path, aside)
    return aside


def move_tail_aside(path: str | Path, offset: int) -> Path | None:
    """Move the bytes of the file ``path`` from ``offset`` on to a new file ``NAME.aside-<UTC time>``
    beside it, then cut ``path`` there; returns the new file (None: nothing after ``offset``). The tail is
    on disk in its new file before ``path`` is cut."""
    path = Path(path)
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read()
    if not tail:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = path.with_name(f"{path.name}.aside-{stamp}"), 1
    while True:
        try:
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            break
        except FileExistsError:
            n += 1
            aside = path.with_name(f"{path.name}.aside-{stamp}-{n}")
    with os.fdopen(fd, "wb") as f:
        f.write(tail)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "r+b") as f:
        f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())
    return aside
