"""The one guarded way to remove (musiclm_stab/removal.py): no other module deletes; what it refuses (a run, a
source, a folder holding one, an unmarked folder, a link, anything outside the named folder) is left whole;
features' output names derived from any input names stay inside OUT, distinct (property tests)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musiclm_stab import removal
from musiclm_stab.export.feature_files import MANIFEST, MANIFEST_TMP, _output_names, _partial
from musiclm_stab.removal import (
    MARKER,
    Refused,
    clear_output,
    discard_temporary,
    is_inside,
    mark_output,
    move_aside,
    move_tail_aside,
    replace_output,
    same_name,
)
from musiclm_stab.training.run_dir import LOCK_FILE as RUN_LOCK

PACKAGE = Path(removal.__file__).parent
# Calls that delete: only removal.py makes them.
DELETING = {("shutil", "rmtree"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"), ("shutil", "move"),
            ("os", "removedirs")}


def _deleting_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        if node.func.attr in ("unlink", "rmdir", "rmtree") or (owner, node.func.attr) in DELETING:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_no_module_but_removal_deletes_anything():
    """No module of the package but removal.py calls rmtree, unlink, rmdir, os.remove or shutil.move: a
    reader sees in one place what the tool may delete."""
    found = [call for path in sorted(PACKAGE.rglob("*.py")) if path.name != "removal.py"
             for call in _deleting_calls(path)]
    assert found == []
    assert _deleting_calls(PACKAGE / "removal.py")  # the check itself sees calls where there are some


def test_the_run_signs_name_the_trainers_lock():
    """RUN_SIGNS holds the trainer's lock file by the name run_dir.py gives it."""
    assert RUN_LOCK in removal.RUN_SIGNS


def make_run_like(folder: Path) -> Path:
    """A folder with what makes a training run: config.yaml, checkpoints/step_2, metrics.jsonl."""
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000002" / "model.safetensors").write_bytes(b"weights")
    (folder / "config.yaml").write_text("model: {}\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


def listing(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def test_discard_temporary_removes_only_temporary_names(tmp_path):
    """A temporary file or folder goes; any other name is refused (ValueError) and stays."""
    (tmp_path / ".a.partial").mkdir()
    (tmp_path / ".a.partial" / "layer_00.npy").write_bytes(b"x")
    (tmp_path / ".b.123.tmp").write_text("x")
    (tmp_path / "results").write_text("keep")
    discard_temporary(tmp_path / ".a.partial")
    discard_temporary(tmp_path / ".b.123.tmp")
    discard_temporary(tmp_path / ".never.made.tmp")  # absent: nothing to do
    with pytest.raises(ValueError, match="not a temporary name"):
        discard_temporary(tmp_path / "results")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


@pytest.mark.parametrize("case", ["run", "run marked", "source", "holds source", "link", "unmarked", "other kind",
                                  "outside"])
def test_replacing_is_refused_and_touches_nothing(tmp_path, case):
    """An existing folder is replaced only if it is an output of the kind, marked, strictly inside the named
    folder where one is given, and neither a run, a source, a folder holding a source, nor a link: each
    refusal names why, and leaves both folders whole."""
    out = tmp_path / "out"
    target = out / "t"
    target.mkdir(parents=True)
    (target / "data").write_text("precious")
    kind, inside, sources, why = "export", None, [], ""
    if case.startswith("run"):
        make_run_like(target)
        if case == "run marked":
            mark_output(target, "export")
        why = "it holds a training run (config.yaml, checkpoints, metrics.jsonl)"
    elif case == "source":
        mark_output(target, "export")
        sources, why = [target], f"it is the source {target}"
    elif case == "holds source":
        mark_output(target, "export")
        sources, why = [target / "data"], f"it holds the source {target / 'data'}"
    elif case == "link":
        real = tmp_path / "real"
        real.mkdir()
        mark_output(real, "export")
        (real / "data").write_text("precious")
        target = out / "link"
        target.symlink_to(real)
        why = "it is a symbolic link"
    elif case == "unmarked":
        why = f"it has no {MARKER} naming it a HuBERT export"
    elif case == "other kind":
        mark_output(target, "tokenized")
        why = "it holds a tokenized dataset (musiclm-stab tokenize), not a HuBERT export"
    elif case == "outside":
        mark_output(target, "export")
        target, inside, why = out, out, f"it is not inside {out}"
    new = tmp_path / ".t.partial"
    new.mkdir()
    (new / "config.json").write_text("{}")
    before = listing(tmp_path)
    with pytest.raises(Refused, match="^" + re.escape(f"refusing to remove {target}: {why}")):
        replace_output(new, target, kind, inside=inside, sources=sources)
    assert listing(tmp_path) == before


def test_replacing_a_marked_output_and_an_empty_folder(tmp_path):
    """A marked output of the kind is replaced by the new folder (nothing else left beside it); an empty
    folder too, marked or not."""
    old, empty = tmp_path / "old", tmp_path / "empty"
    old.mkdir()
    empty.mkdir()
    mark_output(old, "export")
    (old / "config.json").write_text("old")
    for target in (old, empty):
        new = tmp_path / f".{target.name}.partial"
        new.mkdir()
        (new / "config.json").write_text("new")
        replace_output(new, target, "export")
        assert (target / "config.json").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "old"]


def test_clearing_keeps_the_lock_and_the_marker_and_refuses_what_holds_the_source(tmp_path):
    """clear_output empties a marked output but its lock and marker; an output holding the source (the
    audio being tokenized) is refused whole."""
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / "parts" / "u000000.arrow").write_bytes(b"rows")
    (out / ".tokenize.lock").write_text("pid")
    mark_output(out, "tokenized")
    (out / "audio").mkdir()
    (out / "audio" / "a.wav").write_bytes(b"RIFF")
    before = listing(out)
    with pytest.raises(Refused, match=re.escape(f"it holds the source {out / 'audio'}")):
        clear_output(out, "tokenized", keep=(".tokenize.lock",), sources=[out / "audio"])
    assert listing(out) == before
    clear_output(out, "tokenized", keep=(".tokenize.lock",), sources=[tmp_path / "elsewhere"])
    assert sorted(p.name for p in out.iterdir()) == [MARKER, ".tokenize.lock"]


def test_move_aside_never_overwrites(tmp_path):
    """Moved aside twice in the same second: two names, both kept, the second numbered."""
    first = tmp_path / "step_2"
    first.mkdir()
    (first / "w").write_text("1")
    a = move_aside(first)
    first.mkdir()
    (first / "w").write_text("2")
    b = move_aside(first)
    assert a.name.startswith("step_2.aside-") and b.name.startswith(a.name) and a != b
    assert {(a / "w").read_text(), (b / "w").read_text()} == {"1", "2"} and not first.exists()


def test_move_tail_aside(tmp_path):
    """The bytes from an offset on go to a new file beside it; the file keeps the rest."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("row 1\nrow 2\nrow 3\n")
    aside = move_tail_aside(path, 6)
    assert path.read_text() == "row 1\n" and aside.read_text() == "row 2\nrow 3\n"
    assert aside.name.startswith("metrics.jsonl.aside-")
    assert move_tail_aside(path, 6) is None and path.read_text() == "row 1\n"


PARTS = st.text(alphabet=". é-_ab/\\Ü\u0301", min_size=1, max_size=6)  # dots, spaces, unicode, separators
NAMES = st.lists(st.lists(PARTS, min_size=1, max_size=3), min_size=1, max_size=8)


def _files(raw: list[list[str]], src: Path) -> list[Path]:
    """Paths of audio files under ``src`` from the generated parts: separators make subfolders (a folder's
    name is never empty, ``.`` or ``..``), the last part plus ``.wav`` the file's name (``..`` gives
    ``...wav``, ``.`` ``..wav``, nothing ``.wav``); no file also a folder of another."""
    files, folders = [], set()
    for parts in raw:
        pieces = "/".join(parts).split("/")
        rel = PurePosixPath(*[p for p in pieces[:-1] if p not in ("", ".", "..")], pieces[-1] + ".wav")
        if rel in files or rel in folders or any(f in rel.parents for f in files):
            continue
        files.append(rel)
        folders |= set(rel.parents)
    return [src / f for f in files]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(NAMES)
def test_output_names_stay_inside_out_and_never_meet(raw):
    """For input names of dots, spaces, unicode and separators: every output folder lies strictly inside
    OUT, has no empty, `.` or `..` part, is no reserved name (manifest, marker, a temporary folder), and no
    two inputs share an output (as a case-insensitive file system compares names) or nest in one another."""
    src, out = Path("/data/music"), Path("/data/out")
    files = _files(raw, src)
    names = _output_names(files, src)
    assert len(names) == len(files)
    keys = [same_name(n.as_posix()) for n in names]
    assert len(set(keys)) == len(keys)
    reserved = {same_name(r) for r in (MANIFEST, MANIFEST_TMP, MARKER)} | {same_name(_partial(n).as_posix())
                                                                         for n in names}
    for name in names:
        assert all(part not in ("", ".", "..") for part in name.as_posix().split("/"))
        assert is_inside(out / name, out) and os.path.normpath(out / name).startswith(f"{out}/")
        assert same_name(name.as_posix()) not in reserved
        assert not any(same_name(p.as_posix()) in keys for p in name.parents if p != Path("."))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["..", ".", "a", "b", " ", "é", "a.wav"]), min_size=1, max_size=6))
def test_is_inside_agrees_with_the_normalized_path(parts):
    """is_inside(OUT/parts, OUT) holds exactly when the normalized path lies strictly below OUT."""
    out = Path("/data/out")
    path = out.joinpath(*parts)
    expected = os.path.normpath(path).startswith(f"{out}/")
    assert is_inside(path, out) == expected
