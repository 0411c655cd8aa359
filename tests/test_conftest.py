"""The shared session fixtures of conftest.py: built once, complete when used, a failed build never reused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import COMPLETE, built_once


def test_shared_fixtures_are_complete_builds(local_weights, tokenized_dataset):
    """Each session fixture's folder holds the complete marker, written after what its build made, and nothing
    in it changed since (by the tests that ran before this one, in any worker)."""
    for path, made in ((local_weights, "encodec_local.th"), (tokenized_dataset, "tokens")):
        folder = path.parent
        assert (folder / COMPLETE).is_file(), f"{folder} has no {COMPLETE}"
        assert path.name == made and path.exists()
        done = (folder / COMPLETE).stat().st_mtime_ns
        changed = [str(p) for p in folder.rglob("*") if p.stat().st_mtime_ns > done]
        assert not changed, f"changed after the fixture was built: {changed}"
    assert (tokenized_dataset / "tokenizer.json").is_file()  # the tokenizer's own mark of a finished output


def test_a_build_is_made_once_and_a_failed_one_is_made_again(tmp_path_factory):
    """built_once builds a folder once and reuses it; a build that raised leaves no marker, and the next
    call deletes what it left and builds again from an empty folder."""
    name = f"demo-{os.getpid()}"  # this process's own: xdist workers share the folder
    calls: list[list[str]] = []

    def build(folder: Path, fail: bool = False) -> None:
        calls.append(sorted(p.name for p in folder.iterdir()))
        (folder / "half.bin").write_bytes(b"x")
        if fail:
            raise OSError("killed half-way")
        (folder / "whole.bin").write_bytes(b"y")

    with pytest.raises(OSError, match="half-way"):
        built_once(tmp_path_factory, name, lambda f: build(f, fail=True))
    folder = built_once(tmp_path_factory, name, build)
    assert calls == [[], []]  # the second build started from an empty folder, not the failed one's debris
    assert built_once(tmp_path_factory, name, build) == folder and len(calls) == 2  # reused, not rebuilt
    assert sorted(p.name for p in folder.iterdir()) == [COMPLETE, "half.bin", "whole.bin"]
