"""fsync of files and of the directories whose entries name them (musiclm_stab.durable), wherever a rename
makes a write count: a checkpoint's files and its publishing, the tokenizer's atomic writes, part files
and merged copies. Checked by recording the path of every descriptor os.fsync is called on."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import soundfile as sf

from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.tokenizer.store import atomic_write
from musiclm_stab.training.checkpoint_writer import CheckpointWriter

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads descriptors' paths from /proc")
SR = 24_000


def record_fsyncs(monkeypatch) -> list[tuple[str, bool]]:
    """os.fsync, recording the path of every descriptor synced (and whether it is a directory)."""
    synced, original = [], os.fsync

    def recording(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((path, os.path.isdir(path)))
        return original(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


@pytest.mark.parametrize("background", [True, False], ids=["writer", "synchronous"])
def test_every_file_and_directory_of_a_checkpoint_is_fsynced(accelerator, tmp_path, monkeypatch, background):
    """Every file of the checkpoint and its directory are fsynced before the rename, and checkpoints/
    after it (before: no directory, and in the synchronous save only the manifest): a power loss after
    publish cannot lose the new checkpoint or leave it half on disk, once the older ones are pruned."""
    synced = record_fsyncs(monkeypatch)
    writer = CheckpointWriter(accelerator, tmp_path, background=background)
    final = writer.save(2, {}, keep=1)
    writer.wait()
    ckpt_dir = tmp_path / "checkpoints"
    tmp = ckpt_dir / ".tmp-step_00000002"
    files = {str(tmp / p.name) for p in final.iterdir()}
    assert files <= {path for path, is_dir in synced if not is_dir}, sorted(files)
    dirs = [path for path, is_dir in synced if is_dir]
    assert str(tmp) in dirs and str(ckpt_dir) in dirs, dirs
    # the directory holding the rename is synced after it (only then may older checkpoints go)
    assert dirs.index(str(ckpt_dir)) > max(i for i, d in enumerate(dirs) if d == str(tmp))


def test_atomic_write_syncs_its_directory(tmp_path, monkeypatch):
    """The tokenizer's atomic_write fsyncs the file, then its directory after the rename (before: only the
    file, so a power loss could undo the rename)."""
    synced = record_fsyncs(monkeypatch)
    atomic_write(tmp_path / "job.json", "{}\n")
    assert [is_dir for _, is_dir in synced] == [False, True] and synced[1][0] == str(tmp_path)


def test_part_renames_and_merged_copies_are_synced(tmp_path, local_weights, make_music, monkeypatch):
    """Tokenizing syncs parts/ after each part file is renamed into place; merging shards across file
    systems (os.link failing, so the part files are copied) fsyncs each copy before its rename and
    parts/ after it (before: neither directory, and no copy, was synced)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        sf.write(src / f"t{i}.wav", make_music(0.7, seed=90 + i), SR)
    kw = dict(weights=str(local_weights), part_tracks=1, segment_seconds=0.5, min_seconds=0.1, workers=0,
              progress=False)
    synced = record_fsyncs(monkeypatch)
    tokenize(src, tmp_path / "shard0", shard="0/2", **kw)
    parts0 = tmp_path / "shard0" / "parts"
    assert (str(parts0), True) in synced
    assert synced.index((str(parts0), True)) > min(i for i, (p, _) in enumerate(synced) if p.startswith(f"{parts0}/"))
    tokenize(src, tmp_path / "shard1", shard="1/2", **kw)

    def cross_device(src_path, dst_path):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src_path))

    monkeypatch.setattr(os, "link", cross_device)
    synced.clear()
    merge_shards(tmp_path / "merged", [tmp_path / "shard0", tmp_path / "shard1"])
    parts = tmp_path / "merged" / "parts"
    names = sorted(p.name for p in parts.iterdir())
    assert len(names) == 2
    copies = [p for p, is_dir in synced if not is_dir and Path(p).parent == parts]
    assert len(copies) == 2 and all(Path(p).name.endswith(".tmp") for p in copies), copies
    assert [p for p, is_dir in synced if is_dir].count(str(parts)) == 2  # after each of the two renames
