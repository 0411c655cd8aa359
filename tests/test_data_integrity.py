"""Tokenized data is checked before it is used: part files carry their size and sha256 in tokenizer.json
(checked once per file and remembered outside the dataset), codes are range-checked, a damaged part is a
one-line error naming it and how to redo it (training, evaluation and probes alike), and file names read
from a dataset or a shard never lead outside it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pytest
import soundfile as sf

from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.data.tokenized import load_tokenized
from musiclm_stab.tokenizer.cli import cli_main as tokenize_main
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize

SR = 24_000
KW = dict(segment_seconds=0.5, min_seconds=0.1, workers=0, progress=False, part_tracks=1)
PART = "parts/u000000.arrow"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test has its own user cache (where checked parts are remembered) and an empty in-process one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))
    import musiclm_stab.data.part_checks as part_checks

    part_checks._VERIFIED.clear()


@pytest.fixture
def copy(tokenized_dataset, tmp_path) -> Path:
    """A copy of the session's tokenized dataset (3 tracks, 6 rows), to damage."""
    out = tmp_path / "tokens"
    shutil.copytree(tokenized_dataset, out)
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory, local_weights, make_music) -> tuple[Path, Path, dict]:
    """Three 0.7 s tracks (one work unit each), tokenized: (source folder, output, tokenize keywords)."""
    root = tmp_path_factory.mktemp("integrity")
    src = root / "src"
    src.mkdir()
    for i in range(3):
        sf.write(src / f"t{i}.wav", make_music(0.7, seed=400 + i), SR)
    kw = dict(weights=str(local_weights), **KW)
    tokenize(src, root / "tokens", **kw)
    return src, root / "tokens", kw


def _flip(path: Path, n: int = 4096) -> None:
    """Invert ``n`` bytes in the middle of a file, in place (its size stays)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _edit_info(dataset: Path, change) -> None:
    info = json.loads((dataset / "tokenizer.json").read_text())
    change(info)
    (dataset / "tokenizer.json").write_text(json.dumps(info, indent=2))


def _rehash(dataset: Path) -> None:
    """Record the parts as they now are in tokenizer.json: a dataset consistent with itself (as a shard
    from another machine may be, whatever it holds)."""
    def change(info):
        for p in info["parts"]:
            p.update(bytes=(dataset / p["file"]).stat().st_size, sha256=_sha256(dataset / p["file"]))
    _edit_info(dataset, change)


def _unhash(dataset: Path) -> None:
    """Make tokenizer.json as a version before part hashes wrote it."""
    def change(info):
        info["parts"] = [{k: p[k] for k in ("unit", "file", "rows")} for p in info["parts"]]
    _edit_info(dataset, change)


def _set_code(part: Path, row: int, value: int) -> None:
    """Rewrite a part file with code [0, 0] of ``row`` set to ``value``."""
    table = pa.ipc.open_stream(pa.py_buffer(part.read_bytes())).read_all()  # not mapped: rewritten below
    col = table.schema.get_field_index("codes")
    codes = table.column(col).to_pylist()
    codes[row][0][0] = value
    table = table.set_column(col, table.schema.field(col), pa.array(codes, type=table.schema.field(col).type))
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _set_pcm(part: Path, row: int, value: float) -> None:
    """Rewrite a part file with sample 5 of ``row``'s pcm set to ``value``."""
    table = pa.ipc.open_stream(pa.py_buffer(part.read_bytes())).read_all()  # not mapped: rewritten below
    col = table.schema.get_field_index("pcm")
    pcm = table.column(col).to_pylist()
    pcm[row][5] = value
    table = table.set_column(col, table.schema.field(col), pa.array(pcm, type=table.schema.field(col).type))
    with pa.OSFile(str(part), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_parts_carry_their_size_and_sha256(copy):
    """tokenizer.json and the unit records give each part file's size and sha256, as the file is on disk."""
    info = json.loads((copy / "tokenizer.json").read_text())
    for p in info["parts"]:
        file = copy / p["file"]
        assert p["bytes"] == file.stat().st_size and p["sha256"] == _sha256(file)
        record = json.loads((copy / ".tokenize" / "units" / f"u{p['unit']:06d}.json").read_text())
        assert (record["bytes"], record["sha256"]) == (p["bytes"], p["sha256"])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_flipped_part_is_refused_naming_it_and_how_to_redo_it(copy, streaming):
    """4 KiB inverted inside a part (its size unchanged): loading fails with one line naming the part, the
    reason and the command that redoes it; before, the bytes were trained and evaluated on (loss inf)."""
    _flip(copy / PART)
    with pytest.raises(ValueError) as e:
        load_tokenized(copy, streaming=streaming)
    text = _one_line(e)
    assert str(copy / PART) in text and "sha256" in text and "musiclm-stab tokenize" in text, text


def test_a_truncated_part_is_named(copy):
    """A part cut short is refused naming the file and both sizes, with or without recorded hashes (before:
    a pyarrow OSError naming no file)."""
    part = copy / PART
    size = part.stat().st_size
    os.truncate(part, size // 2)
    with pytest.raises(ValueError) as e:
        load_tokenized(copy)
    text = _one_line(e)
    assert str(part) in text and f"{size // 2} bytes" in text and str(size) in text, text
    _unhash(copy)  # made by an older version: no size to compare, the arrow data itself is found cut
    with pytest.warns(UserWarning, match="no sha256"), pytest.raises(ValueError) as e:
        load_tokenized(copy)
    assert str(part) in _one_line(e) and "not readable" in str(e.value)


@pytest.mark.parametrize("value", [1024, -1])
def test_codes_out_of_range_are_refused(copy, value):
    """A part holding a code outside [0, 1024), even one whose tokenizer.json records its hash (a shard from
    elsewhere), is refused naming the file, the row and the code (before: an IndexError from the loss)."""
    _set_code(copy / PART, 3, value)
    _refused_with_its_hashes(copy, f"code {value}", "row 3")


def _refused_with_its_hashes(copy: Path, *says: str) -> None:
    """The changed part of ``copy``, its hashes recorded as they now are, is refused at load (also streaming)
    in one line naming it and saying ``says``."""
    _rehash(copy)
    for streaming in (False, True):
        with pytest.raises(ValueError) as e:
            load_tokenized(copy, streaming=streaming)
        text = _one_line(e)
        assert all(part in text for part in (str(copy / PART), *says)), text


@pytest.mark.parametrize("value, shown", [(2.4e24, "2.4e+24"), (float("nan"), "nan"), (float("-inf"), "-inf"),
                                          (-7.5, "-7.5")])
def test_pcm_that_no_tokenizer_writes_is_refused(copy, value, shown):
    """A part whose audio holds a value no tokenizer writes (not finite, or beyond PCM_LIMIT), even with its
    hashes recorded (forged, or a shard from elsewhere), is refused naming the file, the row and the value
    (before: it trained on 2.4e24)."""
    _set_pcm(copy / PART, 3, value)
    _refused_with_its_hashes(copy, f"audio sample {shown} in its row 3")


def test_pcm_limit_is_above_what_the_tokenizer_can_write():
    """PCM_LIMIT leaves room for what the tokenizer keeps: float audio up to MAX_PEAK unscaled, resampled to
    24 kHz from any common rate, whose filter can overshoot by the sum of its |taps| (its worst case)."""
    import torch
    import torchaudio

    from musiclm_stab.audio import MAX_PEAK
    from musiclm_stab.data.tokenized import PCM_LIMIT

    for rate in (8000, 11025, 16000, 22050, 32000, 44100, 48000, 88200, 96000, 192000):
        kernel = torchaudio.transforms.Resample(rate, 24_000, dtype=torch.float64).kernel  # (phases, 1, taps)
        worst = float(kernel.abs().sum(dim=-1).max())
        assert MAX_PEAK * worst < PCM_LIMIT, (rate, worst)


def test_a_dataset_without_part_hashes_loads_with_a_warning(copy):
    """tokenizer.json of an older version (no part hashes): it loads, with one warning saying what is not
    checked; codes out of range are still found."""
    _unhash(copy)
    with pytest.warns(UserWarning, match=f"{copy}: tokenizer.json records no sha256 of its part files"):
        ds, _ = load_tokenized(copy)
    assert len(ds) == 6
    _set_code(copy / PART, 0, 5000)
    with pytest.raises(ValueError, match="code 5000"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_tokenized(copy)


def test_parts_are_hashed_once_and_remembered_outside_the_dataset(copy, tmp_path, monkeypatch):
    """The first load hashes each part; later loads (a new process: the in-process memory cleared) only stat
    them, remembering under the user's cache dir, never in the dataset folder; a part changed since is hashed
    again; an unwritable cache dir costs a warning, not the load."""
    import musiclm_stab.data.part_checks as part_checks

    hashed = []
    real = part_checks.file_sha256
    monkeypatch.setattr(part_checks, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    listing = sorted((p.relative_to(copy), p.stat().st_mtime_ns) for p in copy.rglob("*"))
    load_tokenized(copy)
    assert hashed == ["u000000.arrow"]
    assert sorted((p.relative_to(copy), p.stat().st_mtime_ns) for p in copy.rglob("*")) == listing
    assert list((tmp_path / "user_cache" / "musiclm_stab").rglob("*.json"))
    part_checks._VERIFIED.clear()
    load_tokenized(copy)
    assert hashed == ["u000000.arrow"]  # remembered
    os.utime(copy / PART)  # touched: maybe changed
    part_checks._VERIFIED.clear()
    load_tokenized(copy)
    assert hashed == ["u000000.arrow"] * 2

    (tmp_path / "not_a_dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not_a_dir"))
    part_checks._VERIFIED.clear()
    with pytest.warns(UserWarning, match="could not remember"):
        load_tokenized(copy)
    assert len(hashed) == 3


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_training_evaluation_and_probes_refuse_a_damaged_part(tokenized_dataset, copy, tmp_path, capsys):
    """Training (exit 2 via ConfigError), `musiclm-stab evaluate` (exit 2) and the probes' data reading all
    stop on the damaged part with its one-line message: they read through load_tokenized."""
    from musiclm_stab.analysis.evaluate import cli_main as evaluate_main
    from musiclm_stab.analysis.probe_data import load_probe_data
    from musiclm_stab.training.trainer import Trainer

    def cfg(data, name):
        return load_config("recipes/tiny.yaml", [
            f"--data.path={data}", f"--train.output_dir={tmp_path / 'runs'}", f"--train.name={name}",
            "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1",
            "--train.max_steps=1", "--train.checkpoint_every=1", "--train.trackers=[]"])

    run = Trainer(cfg(tokenized_dataset, "good")).run()
    _flip(copy / PART)
    with pytest.raises(ConfigError, match=f"data.path: .*{copy / PART}.*sha256"):
        Trainer(cfg(copy, "damaged")).run()
    capsys.readouterr()
    assert evaluate_main([str(run), "--data", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(copy / PART) in err and err.count("\n") == 1, err
    with pytest.raises(ValueError, match=f"{copy / PART}.*sha256"):
        load_probe_data(run, data=str(copy))


def test_a_rerun_of_tokenize_redoes_only_the_damaged_unit(small, tmp_path):
    """The advice of the error holds: rerunning the tokenize command redoes the damaged unit (and no other)
    and the dataset loads with the rows it had."""
    src, tokens, kw = small
    out = tmp_path / "tokens"
    shutil.copytree(tokens, out)
    before = load_tokenized(out)[0].to_dict()
    _flip(out / "parts" / "u000001.arrow")
    with pytest.raises(ValueError, match="u000001.arrow"):
        load_tokenized(out)
    others = {k: (out / "parts" / f"u00000{k}.arrow").stat().st_mtime_ns for k in (0, 2)}
    with pytest.warns(UserWarning, match="redoing 1 work unit.*parts/u000001.arrow: sha256"):
        summary = tokenize(src, out, **kw)
    assert summary.units_done_before == 2 and summary.seconds_this_run > 0
    assert {k: (out / "parts" / f"u00000{k}.arrow").stat().st_mtime_ns for k in (0, 2)} == others
    assert load_tokenized(out)[0].to_dict() == before


def test_paths_leading_outside_a_dataset_are_refused(copy, tmp_path):
    """tokenizer.json (any load) or state.json (what a single folder's load reads) naming a file through
    '..', by an absolute path or through a link out of the folder: refused by name; before, the file outside
    was read as the dataset's."""
    outside = tmp_path / "outside.arrow"
    shutil.copyfile(copy / PART, outside)
    original = (copy / "tokenizer.json").read_text(), (copy / "state.json").read_text()
    for name in ("../outside.arrow", str(outside)):
        def point(info, name=name):
            info["parts"][0]["file"] = name
        _edit_info(copy, point)
        for streaming in (False, True):
            with pytest.raises(ValueError, match=f"{copy}.*{name}.*outside the dataset folder"):
                load_tokenized(copy, streaming=streaming)
        (copy / "tokenizer.json").write_text(original[0])
        state = json.loads(original[1])
        state["_data_files"][0]["filename"] = name
        (copy / "state.json").write_text(json.dumps(state))
        with pytest.raises(ValueError, match=f"{copy}.*{name}.*outside the dataset folder"):
            load_tokenized(copy)
        (copy / "state.json").write_text(original[1])
    (copy / PART).unlink()
    (copy / PART).symlink_to(outside)
    with pytest.raises(ValueError, match=f"outside the dataset folder.*{copy / PART} is a link to {outside}"):
        load_tokenized(copy)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_merge_refuses_a_shard_naming_a_file_outside_it_before_writing(small, tmp_path, where):
    """A shard whose unit record names "../owned.txt" (or an absolute path) is refused by `tokenize --merge`
    (exit 1, one line naming the shard's record) before anything is written: the file outside is not
    overwritten and the output folder is not created. Before, the merge replaced that file."""
    src, _, kw = small
    shards = [tmp_path / "shards" / f"s{i}" for i in range(2)]
    for i, d in enumerate(shards):
        tokenize(src, d, shard=f"{i}/2", **kw)
    victim = tmp_path / "out" / "owned.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    (tmp_path / "shards" / "owned.txt").write_text("planted")  # what the record would have copied
    record_file = shards[1] / ".tokenize" / "units" / "u000001.json"
    record = json.loads(record_file.read_text())
    record["file"] = "../owned.txt" if where == "relative" else str(victim)
    record_file.write_text(json.dumps(record))
    out = tmp_path / "out" / "merged"
    assert tokenize_main(["--merge", str(out), *map(str, shards)]) == 1
    assert victim.read_text() == "precious" and not out.exists()
    with pytest.raises(ValueError) as e:
        merge_shards(out, shards)
    text = _one_line(e)
    assert str(record_file) in text and record["file"] in text and not out.exists(), text


def test_merge_refuses_a_damaged_shard_before_writing(small, tmp_path):
    """A shard whose part does not match its record's sha256 is refused by the merge, naming the part,
    before the output folder is made."""
    src, _, kw = small
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, d in enumerate(shards):
        tokenize(src, d, shard=f"{i}/2", **kw)
    _flip(shards[0] / "parts" / "u000002.arrow")
    with pytest.raises(ValueError) as e:
        merge_shards(tmp_path / "merged", shards)
    assert str(shards[0] / "parts" / "u000002.arrow") in _one_line(e) and "sha256" in str(e.value)
    assert not (tmp_path / "merged").exists()


def test_shards_without_part_hashes_merge_into_a_hashed_output(small, tmp_path):
    """Shards of a version before part hashes (no sizes or hashes in their records and tokenizer.json) still
    merge; the merged output records every part's size and sha256, and running the merge again changes
    nothing."""
    src, _, kw = small
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, d in enumerate(shards):
        tokenize(src, d, shard=f"{i}/2", **kw)
        for record_file in (d / ".tokenize" / "units").iterdir():
            record = json.loads(record_file.read_text())
            record_file.write_text(json.dumps({k: v for k, v in record.items() if k not in ("bytes", "sha256")}))
        _unhash(d)
    merged = tmp_path / "merged"
    merge_shards(merged, shards)
    info = json.loads((merged / "tokenizer.json").read_text())
    assert [(p["bytes"], p["sha256"]) for p in info["parts"]] == [
        ((merged / p["file"]).stat().st_size, _sha256(merged / p["file"])) for p in info["parts"]]
    before = (merged / "tokenizer.json").read_text()
    merge_shards(merged, shards)
    assert (merged / "tokenizer.json").read_text() == before
