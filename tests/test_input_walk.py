"""What the walk over an input folder cannot read is recorded, never dropped: a folder it cannot list, a
broken link, a link back up the tree; links to folders are followed, each folder once (tokenize,
make-weights; features in test_features.py)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import soundfile as sf
from permissions import locked_folder

from musiclm_stab.audio import AudioError, list_audio_files
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.tokenizer import fit
from musiclm_stab.tokenizer.pipeline import tokenize

SR = 24_000


@pytest.fixture
def tree(tmp_path, make_music):
    """src/ with a.wav, locked/b.wav (to be made unreadable), sub/c.flac, a link to a folder outside
    (ext -> ../outside, holding d.wav), a second link to sub, a link up the tree, a broken link and a
    link to itself."""
    src, outside = tmp_path / "src", tmp_path / "outside"
    for folder in (src / "locked", src / "sub", outside):
        folder.mkdir(parents=True)
    sf.write(src / "a.wav", make_music(1.0, seed=1), SR)
    sf.write(src / "locked" / "b.wav", make_music(1.0, seed=2), SR)
    sf.write(src / "sub" / "c.flac", make_music(1.0, seed=3), SR)
    sf.write(outside / "d.wav", make_music(1.0, seed=4), SR)
    (src / "ext").symlink_to(outside)
    (src / "sub_again").symlink_to(src / "sub")
    (src / "sub" / "up").symlink_to(src)
    (src / "gone").symlink_to(tmp_path / "nowhere")
    (src / "loop").symlink_to(src / "loop")
    return src


def test_the_walk_lists_linked_folders_once_and_records_what_it_cannot_read(tree):
    """Files under a linked folder are listed through the link; an unreadable folder (kind unreadable), a
    second path to a folder and a link up the tree (repeated_folder), a broken link (missing) and a link
    loop (unreadable) are recorded with their paths; without a list to record into, the first is raised
    (before: rglob left the locked folder and the linked one out, and recorded nothing)."""
    problems: list[AudioError] = []
    with locked_folder(tree / "locked"):
        files = list_audio_files(tree, problems)
        with pytest.raises(AudioError, match="/src/gone: broken symbolic link"):
            list_audio_files(tree)
        with pytest.raises(AudioError, match="/src/locked: cannot read the folder: Permission denied"):
            list_audio_files(tree / "locked", [])  # the folder asked for: an error, not a record
    assert [f.relative_to(tree).as_posix() for f in files] == ["a.wav", "ext/d.wav", "sub/c.flac"]
    got = {os.path.relpath(e.path, tree): (e.kind, e.reason) for e in problems}
    assert set(got) == {"gone", "locked", "loop", "sub/up", "sub_again"}
    assert got["locked"] == ("unreadable", "cannot read the folder: Permission denied")
    assert got["gone"][0] == "missing" and "broken symbolic link" in got["gone"][1]
    assert got["loop"][0] == "unreadable" and "Too many levels of symbolic links" in got["loop"][1]
    for link, first in (("sub/up", tree), ("sub_again", tree / "sub")):
        assert got[link] == ("repeated_folder", f"the same folder as {first}, already read: not read again (a "
                                                "link makes a cycle, or a second path to it)")


def test_tokenize_records_an_unreadable_folder_and_reads_a_linked_one(tree, tmp_path, local_weights):
    """A mode-000 subfolder is a failure of kind unreadable in failures.jsonl (and in the summary), the
    audio of a linked folder is tokenized, the rest too; before, both folders vanished without a record."""
    out = tmp_path / "out"
    with locked_folder(tree / "locked"):
        s = tokenize(tree, out, weights=str(local_weights), segment_seconds=1.0, workers=0, progress=False)
    ds, _ = load_tokenized(out)
    assert sorted(set(ds["track"])) == ["a.wav", "ext/d.wav", "sub/c.flac"]
    failures = {r["track"]: r for r in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}
    assert failures["locked"] == {"track": "locked", "path": str(tree / "locked"), "kind": "unreadable",
                                  "reason": "cannot read the folder: Permission denied"}
    assert s.failures_by_kind == {"missing": 1, "repeated_folder": 2, "unreadable": 2}


def test_an_unreadable_source_folder_is_one_line(tree, tmp_path, capsys):
    """tokenize of a folder it cannot enter: exit 1 and one line naming it, before the weights are
    loaded; before, a PermissionError traceback."""
    from musiclm_stab.tokenizer.cli import cli_main

    with locked_folder(tree / "locked"):
        assert cli_main([str(tree / "locked"), str(tmp_path / "out"), "--weights", str(tmp_path / "absent.th")]) == 1
    assert capsys.readouterr().err == f"musiclm-stab tokenize: cannot read the source {tree / 'locked'}: " \
        "Permission denied\n"


def test_make_weights_records_an_unreadable_folder(tmp_path, make_music, capsys):
    """make-weights reports a folder it cannot read among the skipped sources (printed, and in the
    provenance of the weights), and fits on the rest; before, the folder was left out in silence."""
    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    sf.write(src / "a.wav", make_music(2.0, seed=5), SR)
    sf.write(src / "locked" / "b.wav", make_music(2.0, seed=6), SR)
    out = tmp_path / "w.th"
    with locked_folder(src / "locked"):
        assert fit.cli_main([str(src), str(out), "--max-seconds", "2", "--iters", "1"]) == 0
    assert f"skipped {src / 'locked'}: unreadable: cannot read the folder: Permission denied" in capsys.readouterr().out
    skipped = json.loads(out.with_name("w.th.json").read_text())["provenance"]["skipped_sources"]
    assert skipped == [{"path": str(src / "locked"), "kind": "unreadable",
                        "reason": "cannot read the folder: Permission denied"}]


def test_an_input_error_travels_to_a_worker_process():
    """An AudioError survives pickling (a track whose payload is its failure, e.g. an unreadable folder or
    a manifest row without a path, is sent to a worker process); before, unpickling it raised TypeError."""
    e = pickle.loads(pickle.dumps(AudioError("/music/locked", "cannot read the folder: Permission denied",
                                             "unreadable")))
    assert (e.path, e.reason, e.kind, str(e)) == ("/music/locked", "cannot read the folder: Permission denied",
                                                  "unreadable", "/music/locked: cannot read the folder: "
                                                  "Permission denied")


def test_retry_failures_tokenizes_a_folder_that_became_readable(tmp_path, local_weights, make_music, capsys):
    """A subfolder unreadable at the first run (a failure of kind unreadable, with the advice to rerun with
    --retry-failures), readable since: that command tokenizes its files into units of their own, keeps the
    units done before (their tracks are not encoded again) and leaves no failure; then a plain rerun finds the
    output finished, and the rows are those of a run that read the folder from the start (before: the retry was
    refused as an output made "with other settings", the file list having changed)."""
    from musiclm_stab.tokenizer.cli import cli_main

    src = tmp_path / "src"
    (src / "m").mkdir(parents=True)
    for name, seed in (("a.wav", 1), ("m/b.wav", 2), ("m/c.wav", 3), ("m-x.wav", 4), ("z.wav", 5)):
        sf.write(src / name, make_music(0.7, seed=seed), SR)
    args = [str(src), str(tmp_path / "out"), "--weights", str(local_weights), "--segment-seconds", "0.5",
            "--min-seconds", "0.1", "--part-tracks", "1", "--workers", "0", "--no-progress"]

    def run(*extra: str) -> tuple[dict, str]:
        capsys.readouterr()
        assert cli_main([*args, *extra]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        return json.loads(out.split("  summary: ")[1]), out

    with locked_folder(src / "m"):
        first, printed = run()
    assert (first["num_tracks"], first["failures_by_kind"]) == (3, {"unreadable": 1})
    assert "(rerun with --retry-failures to try them again)" in printed
    retried, _ = run("--retry-failures")
    assert (retried["num_tracks"], retried["num_failures"], retried["num_units"]) == (5, 0, 6)
    assert retried["units_done_before"] == 3  # a.wav, m-x.wav, z.wav: kept, not encoded again
    assert (tmp_path / "out" / "failures.jsonl").read_text() == ""
    again, _ = run()
    assert again["units_done_before"] == 6 and again["num_tracks"] == 5
    whole = tokenize(src, tmp_path / "whole", weights=str(local_weights), segment_seconds=0.5, min_seconds=0.1,
                     part_tracks=1, workers=0, progress=False)
    assert whole.num_tracks == 5
    rows, expected = load_tokenized(tmp_path / "out")[0], load_tokenized(tmp_path / "whole")[0]
    assert sorted(rows["id"]) == sorted(expected["id"])
    by_id = {i: c for i, c in zip(rows["id"], rows["codes"])}
    assert all(by_id[i] == c for i, c in zip(expected["id"], expected["codes"]))
