"""Tokenizing at scale: block-wise resampling and segmenting equal the whole-track result, the segment
boundary policy, manifests, streaming datasets, and sharded runs that merge into the single-run output."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
from pathlib import Path

import datasets
import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

import musiclm_stab.audio.reader as audio_reader
import musiclm_stab.audio.stream as audio_stream
from musiclm_stab.audio import AudioError, StreamResampler, array_reader, open_audio, resampled_blocks
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.threads import one_thread
from musiclm_stab.tokenizer.cli import cli_main
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.tokenizer.segments import cut_segments, segment_bounds
from musiclm_stab.tokenizer.store import OutputDir, OutputMismatch
from musiclm_stab.tokenizer.weights import load_encodec

SR = 24_000
KW = dict(segment_seconds=0.5, min_seconds=0.1, workers=0, progress=False)


def _same(a, b) -> None:
    """Two tokenized datasets hold the same rows, in the same order."""
    assert a["id"] == b["id"] and a["num_frames"] == b["num_frames"] and a["start"] == b["start"]
    for x, y in zip(a["codes"], b["codes"], strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(a["pcm"], b["pcm"], strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 32000, 44100, 44101, 48000, 96000])
def test_stream_resampler_equals_one_whole_resample(rate):
    """Resampling in blocks of any size gives torchaudio's whole-signal result, same length ceil(L*24k/rate)."""
    x = torch.randn(int(rate * 1.3) + 7, generator=torch.Generator().manual_seed(rate))
    usable = audio_stream._usable_rate(rate)
    whole = AF.resample(x, usable, SR)
    assert len(whole) == math.ceil(len(x) * SR / usable)
    for block in (1999, rate // 3, 10**7):  # blocks shorter than the filter's context, a third of a second, all
        pieces = list(resampled_blocks(array_reader(x.numpy(), rate), block))
        torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=1e-6)
    r = StreamResampler(rate)  # blocks fed by hand, the last one flagged
    out = torch.cat([r.process(x[:5000]), r.process(x[5000:9000]), r.process(x[9000:], last=True)])
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-6)


def test_cut_segments_equals_slicing_the_whole_track():
    """Segments cut from a stream of uneven blocks are the slices segment_bounds names; a stream that
    ends early raises AudioError."""
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    bounds = segment_bounds(len(x), 12_160, 1_000)
    assert bounds == [(0, 12_160), (12_160, 12_160), (24_320, 12_160), (36_480, 12_160), (48_640, 1_280)]
    splits = [0, 1, 777, 12_160, 12_161, 30_000, 49_999, 50_000]
    blocks = [x[a:b] for a, b in zip(splits[:-1], splits[1:])]
    got = list(cut_segments(iter(blocks), bounds))
    assert [(s, len(p)) for s, p in got] == bounds
    for (_, p), (start, length) in zip(got, bounds):
        assert torch.equal(p, x[start : start + length])
    with pytest.raises(AudioError, match="ended at 20000 samples"):
        list(cut_segments(iter([x[:20_000]]), bounds))


def test_long_tracks_are_read_in_blocks_with_the_whole_track_result(tmp_path, local_weights, make_music,
                                                                    monkeypatch):
    """With 0.25 s decode blocks, no read asks libsndfile for more than one block, and the rows' pcm equal
    slices of the whole track resampled at once."""
    x = make_music(3.0, seed=50, sr=44_100, channels=2)
    (tmp_path / "src").mkdir()
    sf.write(tmp_path / "src" / "long.flac", x, 44_100, subtype="PCM_24")
    reads = []
    real_read = sf.SoundFile.read

    def spy(self, frames=-1, *args, **kwargs):
        reads.append(frames)
        return real_read(self, frames, *args, **kwargs)

    monkeypatch.setattr(sf.SoundFile, "read", spy)
    monkeypatch.setattr(audio_reader, "BLOCK_SECONDS", 0.25)
    tokenize(tmp_path / "src", tmp_path / "out", weights=str(local_weights), **KW)
    assert reads and max(reads) == 11_025 and -1 not in reads
    decoded, _ = sf.read(tmp_path / "src" / "long.flac", dtype="float32")
    whole = AF.resample(torch.from_numpy(decoded).mean(dim=1), 44_100, SR)
    ds, _ = load_tokenized(tmp_path / "out")
    assert ds["num_frames"] == [37] * 6
    for row in ds.with_format("torch"):
        start = round(float(row["start"]) * SR)
        torch.testing.assert_close(row["pcm"], whole[start : start + len(row["pcm"])], rtol=0, atol=1e-6)


def test_boundary_policy_segments_are_encoded_without_context(local_weights, make_music):
    """Each segment is encoded on its own: its codes are those of its pcm alone. Against a whole-track
    encode of the causal 24 kHz EnCodec, the first 10 frames after a segment boundary mostly differ while
    the encoder warms up; from 0.5 s in, codes agree nearly everywhere (float noise aside)."""
    model, _ = load_encodec(str(local_weights))
    x = torch.from_numpy(make_music(8.0, seed=51))
    seg = 150 * 320  # 2 s segments
    with one_thread(), torch.inference_mode():
        whole = model.encode(x.view(1, 1, -1))[0][0][0]  # (8, 600)
        parts = torch.cat([model.encode(x[i : i + seg].view(1, 1, -1))[0][0][0] for i in range(0, len(x), seg)], 1)
    same = (whole == parts).float().view(8, 4, 150)  # (K, segment, frame)
    warm_up, settled = same[:, 1:, :10].mean().item(), same[:, 1:, 38:].mean().item()
    assert warm_up < 0.5 and settled > 0.95, (warm_up, settled)
    assert same[:, 0].mean() > 0.95  # the first segment starts where the track does: no boundary


def test_manifest_csv_and_jsonl(tmp_path, local_weights, make_music):
    """A CSV manifest names tracks by its id column (paths relative to it), reports a missing file and a
    row without a path; a JSONL manifest without ids names tracks by their path."""
    (tmp_path / "audio").mkdir()
    sf.write(tmp_path / "audio" / "x.wav", make_music(0.5, seed=52), SR)  # one 0.49 s row each
    sf.write(tmp_path / "audio" / "y.flac", make_music(0.5, seed=53, sr=16_000), 16_000)
    (tmp_path / "m.csv").write_text("id,path\npiece-1,audio/x.wav\npiece-2,audio/missing.wav\npiece-3,\n"
                                    f"piece-4,{tmp_path / 'audio' / 'y.flac'}\n")
    s = tokenize(tmp_path / "m.csv", tmp_path / "out_csv", weights=str(local_weights), **KW)
    ds, meta = load_tokenized(tmp_path / "out_csv")
    assert ds["id"] == ["piece-1@0", "piece-4@0"] and meta["source_kind"] == "manifest"
    assert s.failures_by_kind == {"bad_row": 1, "missing": 1}
    fails = [json.loads(line) for line in (tmp_path / "out_csv" / "failures.jsonl").read_text().splitlines()]
    assert [(f["track"], f["kind"]) for f in fails] == [("piece-2", "missing"), ("piece-3", "bad_row")]
    (tmp_path / "m.jsonl").write_text(json.dumps({"path": "audio/y.flac"}) + "\n" + json.dumps({"path": "audio/x.wav"}))
    tokenize(tmp_path / "m.jsonl", tmp_path / "out_jsonl", weights=str(local_weights), **KW)
    assert load_tokenized(tmp_path / "out_jsonl")[0]["id"] == ["audio/y.flac@0", "audio/x.wav@0"]
    (tmp_path / "dup.csv").write_text("id,path\na,audio/x.wav\na,audio/y.flac\n")
    with pytest.raises(RuntimeError, match="track id 'a' appears twice"):
        tokenize(tmp_path / "dup.csv", tmp_path / "out_dup", weights=str(local_weights), **KW)


def test_streaming_dataset_equals_saved_dataset(tmp_path, local_weights, make_music):
    """A dataset streamed from parquet files (datasets.load_dataset(..., streaming=True)) tokenizes to the
    rows of the same dataset saved to disk; load_tokenized(streaming=True) streams them back."""
    rows = []
    for i in range(5):
        buf = io.BytesIO()
        sf.write(buf, make_music(0.6, seed=60 + i, sr=22_050), 22_050, format="FLAC")
        rows.append({"bytes": buf.getvalue() if i != 3 else b"garbage", "path": None})
    ds = datasets.Dataset.from_dict({"audio": rows}).cast_column("audio", datasets.Audio())
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "stream" / "data").mkdir(parents=True)
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(tmp_path / "stream" / "data" / f"train-0000{k}-of-00002.parquet"))
    saved = tokenize(tmp_path / "saved", tmp_path / "out_saved", weights=str(local_weights), part_tracks=2, **KW)
    streamed = tokenize(tmp_path / "stream", tmp_path / "out_stream", weights=str(local_weights), streaming=True,
                        part_tracks=2, **KW)
    a, _ = load_tokenized(tmp_path / "out_saved")
    b, meta = load_tokenized(tmp_path / "out_stream")
    _same(a, b)
    assert a["track"] == ["0", "0", "1", "1", "2", "2", "4", "4"] and streamed.num_units == 3
    assert (saved.num_failures, streamed.num_failures, meta["source_kind"]) == (1, 1, "hf_streaming")
    it, _ = load_tokenized(tmp_path / "out_stream", streaming=True)
    assert isinstance(it, datasets.IterableDataset)
    assert [r["id"] for r in it] == b["id"]
    again = tokenize(tmp_path / "stream", tmp_path / "out_stream", weights=str(local_weights), streaming=True,
                     part_tracks=2, **KW)
    assert again.seconds_this_run == 0.0 and again.units_done_before == 3


def test_shards_merge_into_the_single_run_output(tmp_path, local_weights, make_music, capsys):
    """--shard 0/3, 1/3, 2/3 then --merge give the single run's rows, order and failures; load_tokenized
    of the shard folders gives them too; an incomplete set of shards is refused."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        sf.write(src / f"t{i}.wav", make_music(0.7, seed=70 + i), SR)
    (src / "t2_bad.wav").write_text("x")
    kw = dict(weights=str(local_weights), part_tracks=1, **KW)
    tokenize(src, tmp_path / "single", **kw)
    for i in range(3):
        s = tokenize(src, tmp_path / f"shard{i}", shard=f"{i}/3", **kw)
        assert s.num_units == 2
    single, info = load_tokenized(tmp_path / "single")
    joined, joined_info = load_tokenized([tmp_path / f"shard{i}" for i in (2, 0, 1)])
    _same(single, joined)
    assert joined_info["num_rows"] == info["num_rows"] == 10 and joined_info["num_failures"] == 1
    assert cli_main(["--merge", str(tmp_path / "merged"), *(str(tmp_path / f"shard{i}") for i in range(3))]) == 0
    assert "merged 3 shards" in capsys.readouterr().out
    merged, merged_info = load_tokenized(tmp_path / "merged")
    _same(single, merged)
    _same(single, datasets.load_from_disk(str(tmp_path / "merged")))
    assert (tmp_path / "merged" / "failures.jsonl").read_text() == (tmp_path / "single" / "failures.jsonl").read_text()
    assert merged_info["job_sha256"] == info["job_sha256"]
    assert merged_info["codebook_usage"] == info["codebook_usage"] is not None  # counted per unit, summed
    assert tokenize(src, tmp_path / "merged", **kw).seconds_this_run == 0.0  # it is the single run's output
    with pytest.raises(ValueError, match="each of the shards 0/3 .. 2/3 once"):
        merge_shards(tmp_path / "m2", [tmp_path / "shard0", tmp_path / "shard1"])
    with pytest.raises(OutputMismatch, match="shard"):
        tokenize(src, tmp_path / "shard0", shard="1/3", **kw)

    # more shards than units (6 units): shard 6/7 gets none, finishes empty, and still merges
    for i in range(7):
        tokenize(src, tmp_path / f"s7_{i}", shard=f"{i}/7", **kw)
    assert json.loads((tmp_path / "s7_6" / "tokenizer.json").read_text())["num_rows"] == 0
    with pytest.raises(ValueError, match="no rows"):
        load_tokenized(tmp_path / "s7_6")
    shards7 = [tmp_path / f"s7_{i}" for i in range(7)]
    _same(single, load_tokenized(shards7)[0])
    merge_shards(tmp_path / "m7", shards7)
    _same(single, load_tokenized(tmp_path / "m7")[0])


def test_open_audio_on_bytes_and_arrays_shares_the_checks(make_music):
    """Encoded bytes and in-memory arrays go through the same reader: same blocks, same errors."""
    x = make_music(1.0, seed=80)
    buf = io.BytesIO()
    sf.write(buf, x, SR, format="WAV", subtype="FLOAT")
    from_bytes = torch.cat(list(resampled_blocks(open_audio(buf.getvalue(), "row 1"))))
    from_array = torch.cat(list(resampled_blocks(array_reader(x, SR))))
    assert torch.equal(from_bytes, from_array) and len(from_bytes) == SR
    with pytest.raises(AudioError, match="empty audio bytes") as e:
        open_audio(b"", "row 2")
    assert e.value.kind == "empty"


def test_review_cases_manifests_rows_and_the_output_guard(tmp_path, local_weights, make_music):
    """A CSV manifest with a BOM is read; a JSONL line that is not an object is named; an HF row with no
    sample rate or with integer samples of unknown scale is that row's failure, not the run's; --overwrite
    never deletes a folder the tokenizer did not write; a run killed before it wrote its job starts afresh."""
    sf.write(tmp_path / "x.wav", make_music(0.5, seed=61), SR)
    (tmp_path / "bom.csv").write_text("\ufeffpath\nx.wav\n", encoding="utf-8")
    tokenize(tmp_path / "bom.csv", tmp_path / "out_bom", weights=str(local_weights), **KW)
    assert load_tokenized(tmp_path / "out_bom")[0]["track"] == ["x.wav"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"path": "x.wav"}) + "\n" + json.dumps("x.wav") + "\n")
    with pytest.raises(RuntimeError, match=r"bad.jsonl:2: not a JSON object \(a str\)"):
        tokenize(tmp_path / "bad.jsonl", tmp_path / "out_jsonl", weights=str(local_weights), **KW)

    wave = make_music(1.0, seed=62).astype(np.float32)
    rows = {"audio": [{"array": wave.tolist(), "sampling_rate": SR},
                      {"array": wave.tolist(), "sampling_rate": None}]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "hf"))
    s = tokenize(tmp_path / "hf", tmp_path / "out_hf", weights=str(local_weights), **KW)
    assert set(load_tokenized(tmp_path / "out_hf")[0]["track"]) == {"0"} and s.num_failures == 1
    (fail,) = map(json.loads, (tmp_path / "out_hf" / "failures.jsonl").read_text().splitlines())
    assert fail["track"] == "1" and fail["kind"] == "error" and "TypeError" in fail["reason"]
    with pytest.raises(AudioError, match="samples of type torch.int64") as e:
        array_reader((wave * 2000).astype(np.int64), SR)
    assert e.value.kind == "bad_row"

    with pytest.raises(FileExistsError, match="does not look like a tokenized dataset"):
        tokenize(tmp_path / "bom.csv", tmp_path / "hf", weights=str(local_weights), overwrite=True, **KW)
    assert datasets.load_from_disk(str(tmp_path / "hf")).num_rows == 2  # untouched

    (tmp_path / "out_killed" / ".tokenize" / "units").mkdir(parents=True)  # killed before job.json
    tokenize(tmp_path / "bom.csv", tmp_path / "out_killed", weights=str(local_weights), **KW)
    assert load_tokenized(tmp_path / "out_killed")[0]["track"] == ["x.wav"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, local_weights, make_music):
    """4 tracks of 0.7 s tokenized once whole and once as 2 shards (one track per unit): (single, shards)."""
    root = tmp_path_factory.mktemp("sharded")
    src = root / "src"
    src.mkdir()
    for i in range(4):
        sf.write(src / f"t{i}.wav", make_music(0.7, seed=70 + i), SR)
    kw = dict(weights=str(local_weights), part_tracks=1, **KW)
    tokenize(src, root / "single", **kw)
    shards = [root / f"shard{i}" for i in range(2)]
    for i, out in enumerate(shards):
        tokenize(src, out, shard=f"{i}/2", **kw)
    return root / "single", shards


def test_a_killed_merge_is_finished_by_running_it_again(sharded, tmp_path, local_weights, monkeypatch, capsys):
    """A merge that dies after copying two units, and one that dies before writing tokenizer.json, are both
    finished by running the same `--merge` again, with the single run's rows; a finished merge run again
    changes nothing; a folder holding another tokenization's unit is refused and left as it was."""
    single_dir, shards = sharded
    src, kw = single_dir.parent / "src", dict(weights=str(local_weights), part_tracks=1, **KW)
    single, _ = load_tokenized(single_dir)
    merge_cmd = ["--merge", str(tmp_path / "merged"), *map(str, shards)]

    real_commit, calls = OutputDir.commit, []

    def dies_at_the_third(self, record):
        calls.append(record["unit"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if killed: nothing after this point runs
        real_commit(self, record)

    monkeypatch.setattr(OutputDir, "commit", dies_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        cli_main(merge_cmd)
    monkeypatch.setattr(OutputDir, "commit", real_commit)
    assert len(list((tmp_path / "merged" / ".tokenize" / "units").iterdir())) == 2
    assert not (tmp_path / "merged" / "tokenizer.json").exists()
    assert cli_main(merge_cmd) == 0, capsys.readouterr().err  # old code: "already holds units"
    _same(single, load_tokenized(tmp_path / "merged")[0])

    (tmp_path / "merged" / "tokenizer.json").unlink()  # killed while finishing
    assert cli_main(merge_cmd) == 0, capsys.readouterr().err
    _same(single, load_tokenized(tmp_path / "merged")[0])
    before = (tmp_path / "merged" / "tokenizer.json").read_text()
    assert cli_main(merge_cmd) == 0 and (tmp_path / "merged" / "tokenizer.json").read_text() == before

    other = tmp_path / "other"  # a run of the same job whose unit 0 holds other rows
    tokenize(src, other, **kw)
    record = json.loads((other / ".tokenize" / "units" / "u000000.json").read_text())
    (other / ".tokenize" / "units" / "u000000.json").write_text(json.dumps({**record, "num_rows": 99}))
    (other / "tokenizer.json").unlink()
    assert cli_main(["--merge", str(other), *map(str, shards)]) == 1
    assert "already holds unit 0" in capsys.readouterr().err
    assert not (other / "tokenizer.json").exists()


def test_a_full_disk_while_merging_is_one_line_and_the_rerun_finishes(sharded, tmp_path, monkeypatch, capsys):
    """A merge onto another file system (parts copied, not linked) whose disk fills at the second part: exit 1
    and one line naming the file, the reason and the free space, what is kept and to free space and rerun;
    the same command afterwards finishes with the single run's rows (before: an OSError traceback)."""
    import shutil

    single, shards = sharded
    out = tmp_path / "merged"
    real_copy, copies = shutil.copyfile, []

    def other_file_system(src, dst, **kwargs):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))

    def fills_at_the_second(src, dst, **kwargs):
        copies.append(dst)
        if len(copies) == 2:
            Path(dst).write_bytes(b"\0" * 16)  # cut short
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_copy(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", other_file_system)
    monkeypatch.setattr(shutil, "copyfile", fills_at_the_second)
    capsys.readouterr()
    assert cli_main(["--merge", str(out), *map(str, shards)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"musiclm-stab tokenize --merge: cannot write {out}"), err
    assert f"{os.strerror(errno.ENOSPC)} (" in err and " MB free)" in err, err
    assert err.endswith("Merging stopped; the 1 units merged so far are kept: free some space, then rerun the "
                        "same command to finish it\n"), err
    assert not (out / "tokenizer.json").exists()
    monkeypatch.undo()
    assert cli_main(["--merge", str(out), *map(str, shards)]) == 0, capsys.readouterr().err
    _same(load_tokenized(single)[0], load_tokenized(out)[0])


def test_a_real_full_disk_while_merging(sharded, tmp_path, capsys):
    """The same on a real small file system (a 128 kB tmpfs holding the merged output; needs the right to mount,
    else skipped): one line, exit 1; after freeing space (the tmpfs made larger) the rerun finishes."""
    single, shards = sharded
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN): the other test simulates it")
    try:
        out = disk / "merged"
        capsys.readouterr()
        assert cli_main(["--merge", str(out), *map(str, shards)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and os.strerror(errno.ENOSPC) in err, err
        assert err.startswith(f"musiclm-stab tokenize --merge: cannot write {out}") and "free some space" in err, err
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert cli_main(["--merge", str(out), *map(str, shards)]) == 0, capsys.readouterr().err
        _same(load_tokenized(single)[0], load_tokenized(out)[0])
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_lost_unit_record_is_redone_by_the_rerun(sharded, tmp_path, local_weights):
    """A finished shard that lost a unit record (refused by the merge: "tokenize that shard again") is completed
    by running its tokenize again: that unit only is redone and tokenizer.json written again, and the merge
    then gives the single run's rows (before: the rerun returned at once as finished, so the merge kept
    refusing: a loop). A finished output run again redoes nothing."""
    import shutil

    single, shards = sharded
    copies = [tmp_path / s.name for s in shards]
    for s, c in zip(shards, copies):
        shutil.copytree(s, c)
    (copies[1] / ".tokenize" / "units" / "u000001.json").unlink()
    with pytest.raises(ValueError, match="has no record of its unit 1.*tokenize that shard again"):
        merge_shards(tmp_path / "merged", copies)
    assert not (tmp_path / "merged").exists()
    kw = dict(weights=str(local_weights), part_tracks=1, **KW)
    redone = tokenize(single.parent / "src", copies[1], shard="1/2", **kw)
    assert (redone.units_done_before, redone.num_units, redone.num_tracks) == (1, 2, 2)
    assert redone.seconds_this_run > 0
    assert json.loads((copies[1] / "tokenizer.json").read_text())["parts"] == \
        json.loads((shards[1] / "tokenizer.json").read_text())["parts"]
    again = tokenize(single.parent / "src", copies[1], shard="1/2", **kw)
    assert (again.units_done_before, again.seconds_this_run) == (2, 0.0)
    merge_shards(tmp_path / "merged", copies)
    _same(load_tokenized(single)[0], load_tokenized(tmp_path / "merged")[0])
