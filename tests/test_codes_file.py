"""`musiclm-stab codes save|restore`: a tokenized dataset's codes carried to another tokenization of the same
corpus (made on another CPU), checked and put back in place."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from musiclm_stab.data.codes_file import CodesMismatch, cli_main, read_codes, restore_codes, save_codes
from musiclm_stab.data.tokenized import codes_sha256, load_tokenized


def test_save_restore_round_trip(tokenized_dataset, other_machine_tokens, capsys):
    original, other = other_machine_tokens
    want = codes_sha256(tokenized_dataset)
    made_here = codes_sha256(other)
    assert made_here != want
    header = read_codes(original)["header"]
    assert header["codes_sha256"] == want and header["num_rows"] == 6 and header["saved_on"]["cpu"]
    assert header["restored"] is None
    pcm_before = load_tokenized(other)[0]["pcm"]

    assert cli_main(["restore", str(other), str(original)]) == 0
    out = capsys.readouterr().out
    assert "3 of " in out and "in 2 rows differed" in out, out
    assert codes_sha256(other) == want
    hf, info = load_tokenized(other)
    ref, ref_info = load_tokenized(tokenized_dataset)
    assert [r for r in hf["codes"]] == [r for r in ref["codes"]]
    assert hf["pcm"] == pcm_before  # only the codes change
    assert hf.features == ref.features
    record = info["codes_restored"]
    assert record["codes_sha256"] == want and record["codes_sha256_made_here"] == made_here
    assert (record["codes_changed"], record["rows_changed"]) == (3, 2)
    assert record["codes_changed_per_codebook"] == [1, 0, 1, 0, 0, 0, 0, 1]  # the flips: codebooks 0, 2 and 7
    assert info["codebook_usage"] == ref_info["codebook_usage"]

    again = restore_codes(other, original)  # idempotent: nothing to write
    assert again["already"] and again["codes_changed"] == 0
    resaved = save_codes(other, other.parent / "resaved.npz.xz")  # saved again, the file says they were restored
    assert resaved["codes_sha256"] == want and resaved["restored"]["codes_sha256_made_here"] == made_here


def test_restore_refuses_another_corpus_or_tokenizer(tokenized_dataset, tmp_path, codes_file_writer):
    original = tmp_path / "codes.npz.xz"
    save_codes(tokenized_dataset, original)
    saved = read_codes(original)
    target = tmp_path / "target"
    shutil.copytree(tokenized_dataset, target)
    files = sorted((target / "parts").iterdir())
    before = {f.name: f.read_bytes() for f in files}

    def other_track(arrays, header):
        arrays["track"][4] = "someone_else"

    def other_weights(arrays, header):
        header["tokenizer"] = {**header["tokenizer"], "weights_sha256": "f" * 64}

    def fewer_rows(arrays, header):
        keep = arrays["shape"][:5]
        arrays["codes"] = arrays["codes"][: int(np.prod(keep, axis=1).sum())]
        arrays["shape"], arrays["id"], arrays["track"] = keep, arrays["id"][:5], arrays["track"][:5]
        header["num_rows"] = 5

    for change, match in ((other_track, "row 4 differs"), (other_weights, "another tokenizer.*weights_sha256"),
                          (fewer_rows, "holds 5 rows")):
        bad = tmp_path / f"{change.__name__}.npz.xz"
        codes_file_writer(saved, bad, change)
        with pytest.raises(CodesMismatch, match=match):
            restore_codes(target, bad)
    assert {f.name: f.read_bytes() for f in sorted((target / "parts").iterdir())} == before  # nothing written


def test_a_broken_codes_file_is_named(tokenized_dataset, tmp_path, capsys):
    bad = tmp_path / "broken.npz.xz"
    bad.write_bytes(b"not xz at all")
    assert cli_main(["restore", str(tokenized_dataset), str(bad)]) == 2
    assert f"{bad} is not a codes file" in capsys.readouterr().err
    assert cli_main(["restore", str(tokenized_dataset), str(tmp_path / "missing.npz.xz")]) == 2
    assert "missing.npz.xz" in capsys.readouterr().err


def test_a_restore_records_the_new_parts_sizes_and_hashes(tokenized_dataset, other_machine_tokens, local_weights):
    """After a restore, tokenizer.json, the unit records and state.json's fingerprint describe the rewritten
    parts (the load checks pass), and a rerun of the tokenizer on the folder redoes nothing."""
    import hashlib
    import json

    original, other = other_machine_tokens
    state_before = json.loads((other / "state.json").read_text())["_fingerprint"]
    restore_codes(other, original)
    info = json.loads((other / "tokenizer.json").read_text())
    for p in info["parts"]:
        file = other / p["file"]
        assert (p["bytes"], p["sha256"]) == (file.stat().st_size, hashlib.sha256(file.read_bytes()).hexdigest())
        record = json.loads((other / ".tokenize" / "units" / f"u{p['unit']:06d}.json").read_text())
        assert (record["bytes"], record["sha256"]) == (p["bytes"], p["sha256"])
    assert json.loads((other / "state.json").read_text())["_fingerprint"] != state_before
    assert codes_sha256(other) == codes_sha256(tokenized_dataset)
    from musiclm_stab.tokenizer.pipeline import tokenize

    again = tokenize(tokenized_dataset.parent / "audio", other, weights=str(local_weights), segment_seconds=10.0,
                     min_seconds=1.0, progress=False, workers=0)
    assert again.seconds_this_run == 0.0 and codes_sha256(other) == codes_sha256(tokenized_dataset)


@pytest.mark.parametrize("dies", ["before", "after"])
def test_a_restore_stopped_half_way_is_refused_then_finished_by_running_it_again(other_machine_tokens, monkeypatch,
                                                                                  dies):
    """A restore killed before or after renaming a rewritten part into place leaves a dataset that is refused
    with one line saying to run the restore again, which finishes it (the record as an uninterrupted one's)."""
    import os

    original, other = other_machine_tokens
    real_replace = os.replace

    def killed(src, dst):
        if str(src).endswith(".restore"):
            if dies == "after":
                real_replace(src, dst)
            raise KeyboardInterrupt  # as if killed: nothing after this point runs
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        restore_codes(other, original)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(ValueError, match=f"restore` of {original} stopped half-way; run `musiclm-stab codes restore "
                                         f"{other} {original}` again"):
        load_tokenized(other)
    result = restore_codes(other, original)
    assert not result["already"] and (result["codes_changed"], result["rows_changed"]) == (3, 2)
    hf, info = load_tokenized(other)
    assert "codes_restoring" not in info and info["codes_restored"]["codes_changed"] == 3
    assert codes_sha256(other) == read_codes(original)["header"]["codes_sha256"]
