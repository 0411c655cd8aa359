"""Feature extraction: stitching plan, chunked vs whole pass, any length, export models, batch mode and CLI;
in batch mode output names never collide, an unreadable folder is recorded, an output error is one line."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from permissions import locked_folder
from safetensors.torch import save_file
from torch.testing import assert_close

import musiclm_stab.export.feature_files as feature_files
from musiclm_stab.config import Config, save_config
from musiclm_stab.export.feature_files import cli_main, extract_folder
from musiclm_stab.export.features import (
    chunk_plan,
    chunking_error,
    extract_features,
    load_feature_model,
    resolve_layers,
)
from musiclm_stab.model import MusicMLM
from musiclm_stab.removal import MARKER
from musiclm_stab.training.checkpoint import write_manifest

TINY = dict(size="tiny", cqt_bins=84, cqt_bins_per_octave=12, final_dim=32)
SR = 24_000
# The documented bound for the test model (tiny, perturbed random weights: diffuse attention) on 24 s of
# music with 8 s windows overlapping by 4 s; measured worst over 3 clips x 3 schemes: rel 0.061, cos 0.992
# (the same to 1e-7 under ATEN_CPU_CAPABILITY=default and avx2). Margins: rel 0.1 is 1.6x the worst, and
# 1 - cos 0.02 is 2.6x the worst 0.0078.
BOUND_REL, BOUND_COS = 0.1, 0.98


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run several times faster on one thread than on two contended ones (2-core CI)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_run(root: Path, seed: int = 0, **model) -> Path:
    """A tiny run directory with one checkpoint, weights perturbed away from their init."""
    cfg = Config()
    for k, v in {**TINY, **model}.items():
        setattr(cfg.model, k, v)
    cfg.validate()
    torch.manual_seed(seed)
    net = MusicMLM(cfg.model)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    ckpt = root / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    save_config(cfg, root / "config.yaml")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ckpt / "model.safetensors"))
    write_manifest(ckpt, 1, {"consumed_micro_batches": 1})  # lists and hashes its files, as the trainer's
    return root


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("features") / "run")


@pytest.fixture(scope="module")
def model(run_dir):
    return load_feature_model(run_dir, "cpu")


@pytest.mark.parametrize("T, C, V", [(10, 20, 4), (100, 20, 4), (101, 20, 5), (1000, 300, 100), (45, 40, 0)])
def test_chunk_plan_tiles_every_frame_once(T, C, V):
    """Kept parts tile [0, T) in order; windows fit in [0, T), are at most C long, leave >= V//2 context."""
    plan = chunk_plan(T, C, V)
    assert plan[0].keep_start == 0 and plan[-1].keep_end == T
    for a, b in zip(plan, plan[1:]):
        assert a.keep_end == b.keep_start
    for c in plan:
        assert 0 <= c.start <= c.keep_start < c.keep_end <= c.end <= T and c.end - c.start <= C
        assert c.keep_start == 0 or c.keep_start - c.start >= V // 2
        assert c.keep_end == T or c.end - c.keep_end >= V // 2


def test_one_window_is_exactly_the_whole_pass(model, make_music):
    """Audio no longer than a chunk gives MusicMLM.encode's hidden states, bit for bit."""
    wav = torch.from_numpy(make_music(4.0, seed=1))
    feats = extract_features(wav, model, chunk_seconds=5.0)
    with torch.no_grad():
        (_, hidden), _ = model.module.encode(wav[None], return_hidden=True)
    assert feats.num_chunks == 1 and sorted(feats.layers) == [0, 1, 2]
    for layer, x in feats.layers.items():
        assert torch.equal(x, hidden[layer][0])


@pytest.mark.parametrize("scheme", ["pre", "deepnorm"])
def test_chunked_agrees_with_whole_pass_within_bound(tmp_path, make_music, scheme):
    """Layer 0 equals the whole pass; deeper layers stay within the documented bound (rel. error, cosine)."""
    model = load_feature_model(make_run(tmp_path / "run", norm_scheme=scheme), "cpu")
    wav = torch.from_numpy(make_music(24.0, seed=0))[:-17]  # not a whole number of frames
    err = chunking_error(wav, model, None, chunk_seconds=8.0, overlap_seconds=4.0)
    assert err[0].max_abs < 1e-5
    for layer in (1, 2):
        assert err[layer].rel_err < BOUND_REL and err[layer].min_cos > BOUND_COS
        assert err[layer].rel_err > 1e-4  # chunking is not free: attention reaches past the window
    per_window_stats = chunking_error(wav, model, [0], 8.0, 4.0, global_stats=False)
    assert per_window_stats[0].rel_err > 0.01  # why the stitching uses whole-clip GroupNorm statistics


def test_any_length_gives_ceil_frames(model, make_music):
    """S samples give ceil(S / 320) frames at 75 Hz, from one sample up, chunked or not."""
    wav = torch.from_numpy(make_music(3.0, seed=2))
    for n, frames in [(1, 1), (320, 1), (321, 2), (320 * 200 + 17, 201)]:
        feats = extract_features(wav[:n], model, layers=[-1], chunk_seconds=1.0, overlap_seconds=0.4)
        assert list(feats.layers) == [2] and feats.layers[2].shape == (frames, 128) and feats.frame_rate == 75
    with pytest.raises(ValueError, match="layers 0..2"):
        resolve_layers([3], 2)


def test_export_dir_gives_our_features(tmp_path, run_dir, model, make_music):
    """Chunked features from an export (transformers HubertModel) equal ours within the export tolerance."""
    pytest.importorskip("transformers")
    from musiclm_stab.export.hubert import export

    export(run_dir, tmp_path / "hf", seconds=2.0)
    hf = load_feature_model(tmp_path / "hf", "cpu")
    assert hf.kind == "transformers"
    wav = torch.from_numpy(make_music(6.0, seed=3))
    ours = extract_features(wav, model, chunk_seconds=2.0, overlap_seconds=1.0)
    theirs = extract_features(wav, hf, chunk_seconds=2.0, overlap_seconds=1.0)
    assert ours.num_chunks == theirs.num_chunks > 1
    for layer in ours.layers:
        assert_close(theirs.layers[layer], ours.layers[layer], atol=1e-4, rtol=1e-4)


def test_folder_batch_mode_and_cli(tmp_path, run_dir, model, make_music, capsys):
    """The CLI writes layer_XX.npy per file equal to extract_features, reports bad files, skips done ones."""
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    sf.write(src / "a.wav", make_music(5.0, seed=4), SR)
    sf.write(src / "sub" / "b.flac", make_music(2.5, seed=5, sr=44100), 44100)
    (src / "broken.wav").write_bytes(b"RIFF not really audio")
    args = [
        str(run_dir),
        str(src),
        str(out),
        "--layers",
        "0",
        "-1",
        "--chunk-seconds",
        "2",
        "--overlap-seconds",
        "1",
    ]
    assert cli_main(args) == 0
    manifest = json.loads((out / "features.json").read_text())
    assert manifest["layers"] == [0, 2] and [f["output"] for f in manifest["written"]] == ["a", "sub/b"]
    assert [Path(f["source"]).name for f in manifest["failed"]] == ["broken.wav"]
    for name, path in [("a", src / "a.wav"), ("sub/b", src / "sub" / "b.flac")]:
        ref = extract_features(path, model, layers=[0, 2], chunk_seconds=2.0, overlap_seconds=1.0)
        for layer in (0, 2):
            saved = np.load(out / name / f"layer_{layer:02d}.npy")
            assert saved.dtype == np.float32 and saved.shape == tuple(ref.layers[layer].shape)
            assert np.array_equal(saved, ref.layers[layer].numpy())
    assert np.load(out / "a" / "layer_00.npy").shape == (375, 128)  # 5 s at 75 Hz
    capsys.readouterr()
    assert cli_main(args) == 0 and "0 written, 2 skipped" in capsys.readouterr().out
    assert cli_main(args[:4] + ["1"]) == 2  # other layers into the same folder: refused
    assert "layers" in capsys.readouterr().err


def test_folder_outputs_never_collide(tmp_path, model, make_music):
    """a.wav, a.flac and a_wav.ogg get three folders (a.wav, a.flac, a_wav), each with its own file's
    features; before, a.wav's went to a_wav and a_wav.ogg was 'skipped (existing)' with them."""
    src = tmp_path / "src"
    src.mkdir()
    for i, name in enumerate(("a.wav", "a.flac", "a_wav.ogg")):
        sf.write(src / name, make_music(1.0, seed=30 + i), SR)
    summary = extract_folder(model, src, tmp_path / "out", layers=[0], chunk_seconds=2.0, progress=False)
    assert sorted(w["output"] for w in summary.written) == ["a.flac", "a.wav", "a_wav"] and not summary.skipped
    for w in summary.written:
        ref = extract_features(w["source"], model, layers=[0], chunk_seconds=2.0)
        assert np.array_equal(np.load(tmp_path / "out" / w["output"] / "layer_00.npy"), ref.layers[0].numpy())


def test_folder_refuses_a_folder_an_earlier_version_gave_to_another_file(tmp_path, model, make_music):
    """An output an earlier version named alike for two inputs (its manifest says out/a_wav holds a.wav's
    features) is refused naming both inputs, not skipped as the other's."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    sf.write(src / "a.wav", make_music(1.0, seed=33), SR)
    extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    (out / "a").rename(out / "a_wav")  # as the earlier naming left it
    manifest = json.loads((out / "features.json").read_text())
    manifest["written"][0]["output"] = "a_wav"
    (out / "features.json").write_text(json.dumps(manifest))
    sf.write(src / "a_wav.ogg", make_music(1.0, seed=34), SR)
    with pytest.raises(ValueError, match=rf"^{out / 'a_wav'} holds the features of {src / 'a.wav'} \(says "
                       rf"{out / 'features.json'}\), not of {src / 'a_wav.ogg'}"):
        extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)


def test_a_rerun_keeps_the_record_of_what_earlier_runs_wrote(tmp_path, model, make_music):
    """features.json's ``written`` after a rerun that adds a file lists the earlier run's files and this run's
    (before: only this run's; the earlier outputs, skipped as existing, were no longer recorded as written)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    sf.write(src / "a.wav", make_music(1.0, seed=37), SR)
    first = extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    sf.write(src / "b.wav", make_music(1.0, seed=38), SR)
    second = extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    assert len(first.written) == len(second.written) == 1 and second.skipped == [first.written[0]["output"]]
    assert json.loads((out / "features.json").read_text())["written"] == [*first.written, *second.written]
    third = extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    assert not third.written and json.loads((out / "features.json").read_text())["written"] == \
        [*first.written, *second.written]


def test_folder_records_an_unreadable_folder(tmp_path, model, make_music):
    """A subfolder the walk cannot list is in ``failed`` (and features.json) with kind unreadable; before, its
    audio vanished without a record."""
    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    sf.write(src / "a.wav", make_music(1.0, seed=35), SR)
    sf.write(src / "locked" / "b.wav", make_music(1.0, seed=36), SR)
    with locked_folder(src / "locked"):
        summary = extract_folder(model, src, tmp_path / "out", layers=[0], chunk_seconds=2.0, progress=False)
    assert [w["output"] for w in summary.written] == ["a"]
    assert summary.failed == [{"source": str(src / "locked"), "kind": "unreadable",
                               "reason": "cannot read the folder: Permission denied"}]
    assert json.loads((tmp_path / "out" / "features.json").read_text())["failed"] == summary.failed


def test_a_full_disk_stops_features_with_one_line(tmp_path, run_dir, make_music, monkeypatch, capsys):
    """Room for one file's features: the CLI stops at the second with exit 1 and one line (the layer file,
    "No space left on device", what is kept, "free some space"), the partial folder is gone, nothing is
    recorded as a bad input; the rerun writes the other two. Before: an OSError traceback."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i, name in enumerate(("a.wav", "b.wav", "c.wav")):
        sf.write(src / name, make_music(1.0, seed=37 + i), SR)
    args = [str(run_dir), str(src), str(out), "--layers", "0", "--chunk-seconds", "2", "--device", "cpu"]
    left = [int(1.5 * 75 * 128 * 4)]  # bytes the disk still holds: one file's layer (75 frames x 128)
    real_open = open

    class Metered:  # the file's write() fails once the disk is full, as it does on a full disk (ENOSPC)
        def __init__(self, f):
            self.f = f

        def write(self, data):
            n = memoryview(data).nbytes
            if n > left[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= n
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def small_disk(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return Metered(f) if "w" in mode else f

    monkeypatch.setattr(feature_files, "open", small_disk, raising=False)
    assert cli_main(args) == 1
    *bar, err = capsys.readouterr().err.rstrip("\n").split("\n")  # the progress bar, then the error
    assert all(line.startswith("\rfeatures:") for line in bar), bar
    assert err.startswith(f"error: cannot write {out / '.b.partial'}: No space left on device")
    assert err.endswith("Stopped; the 1 files whose features are written are kept: free some space, then rerun the "
                        "same command to go on with the rest (it skips them)")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "a"]  # the marker, written first
    monkeypatch.undo()
    assert cli_main(args) == 0 and "2 written, 1 skipped (existing), 0 failed" in capsys.readouterr().out


def test_an_output_under_a_file_is_one_line(tmp_path, run_dir, make_music, capsys):
    """features into a folder under a file: exit 1, one line naming the file; before, a traceback."""
    sf.write(tmp_path / "a.wav", make_music(1.0, seed=40), SR)
    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "afile" / "out"
    assert cli_main([str(run_dir), str(tmp_path / "a.wav"), str(out), "--device", "cpu"]) == 1
    assert capsys.readouterr().err == f"error: cannot create the output folder {out}: {tmp_path / 'afile'} is a " \
        "file, not a folder\n"


def _tree(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def test_dot_names_get_folders_of_their_own_and_nothing_outside_out_is_touched(tmp_path, model, make_music):
    """Inputs named `...wav`, `..wav`, `sub/...wav`, `sub/..wav`, with spaces and unicode: each gets its own
    folder inside OUT, a plain run extracts every one (before: `...wav` mapped to `OUT/..` and was "skipped
    (existing)", `..wav` to OUT itself), and --overwrite removes nothing outside OUT (before: it emptied the
    folder above OUT, the source audio with it)."""
    work = tmp_path / "work"
    src, out = work / "music", work / "feats"
    (src / "sub").mkdir(parents=True)
    names = ["...wav", "..wav", "a b.wav", "é ü.wav", "sub/...wav", "sub/..wav", "sub/b.wav"]
    for i, name in enumerate(names):
        sf.write(src / name, make_music(0.5, seed=40 + i), SR, format="WAV")
    (work / "notes.txt").write_text("the user's")
    audio = _tree(src)
    summary = extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    assert len(summary.written) == len(names) and not summary.skipped and not summary.failed
    outputs = {w["source"]: w["output"] for w in summary.written}
    assert len(set(outputs.values())) == len(names)
    for source, name in outputs.items():
        folder = out / name
        assert out.resolve() in folder.resolve().parents and sorted(p.name for p in folder.iterdir()) == ["layer_00.npy"]
        ref = extract_features(source, model, layers=[0], chunk_seconds=2.0)
        assert np.array_equal(np.load(folder / "layer_00.npy"), ref.layers[0].numpy())
    again = extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, overwrite=True, progress=False)
    assert sorted(w["output"] for w in again.written) == sorted(outputs.values())
    assert _tree(src) == audio and (work / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in work.iterdir()) == ["feats", "music", "notes.txt"]


def test_features_never_writes_over_or_skips_what_it_did_not_make(tmp_path, model, make_music):
    """An output folder that holds other things is refused before any work; a file's folder inside OUT that
    is not its features (a folder of the user's) is refused by name, neither skipped as "existing" nor, with
    --overwrite, removed."""
    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "a.wav", make_music(0.5, seed=50), SR)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("...")
    with pytest.raises(ValueError, match=f"^refusing to write features into {mine}: it is not empty and is not a "
                       "features output"):
        extract_folder(model, src, mine, layers=[0], chunk_seconds=2.0, progress=False)
    out = tmp_path / "out"
    extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, progress=False)
    for p in (out / "a").iterdir():
        p.unlink()
    (out / "a" / "notes.txt").write_text("the user's")  # the user's folder where a's features would go
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=f"^{out / 'a'}, the output folder of {src / 'a.wav'}, is in the way: "
                           "it is not something this command made"):
            extract_folder(model, src, out, layers=[0], chunk_seconds=2.0, overwrite=overwrite, progress=False)
    assert sorted(p.name for p in (out / "a").iterdir()) == ["notes.txt"]
