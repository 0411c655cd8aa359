"""What streaming reads from disk: the start-up scan only ``track`` and ``num_frames``; a process or loader
worker only the crops of its own rows; in the order of the ``datasets`` stream.

Bytes read are measured where they land: the page cache. The files' pages are dropped first
(posix_fadvise DONTNEED), and afterwards ``mincore`` says which pages were read back in.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import types
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets.arrow_writer import ArrowWriter

from musiclm_stab.data import StreamingCrops, eval_tracks, example_key
from musiclm_stab.data import streaming as streaming_module
from musiclm_stab.data.tokenized import FEATURES

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/posix_fadvise: Linux")
MiB = 2**20


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """3 part files in the tokenizer's format (ArrowWriter, FEATURES, record batches of 8 rows), 12 rows
    each: tracks of two 10 s segments and a 2 s tail (random pcm and codes: only their layout matters
    here). 24.5 MiB."""
    root = tmp_path_factory.mktemp("parts")
    rng = np.random.default_rng(0)
    paths = []
    for f in range(3):
        path = root / f"u{f:06d}.arrow"
        writer = ArrowWriter(features=FEATURES, path=str(path), writer_batch_size=8)
        for first in (0, 8):
            rows = range(first, min(12, first + 8))
            frames = [150 if i % 3 == 2 else 750 for i in rows]
            writer.write_batch({
                "id": [f"t{f}_{i // 3}@{i % 3}" for i in rows], "track": [f"t{f}_{i // 3}" for i in rows],
                "start": [10.0 * (i % 3) for i in rows],
                "pcm": [rng.standard_normal(320 * n).astype(np.float32) for n in frames],
                "codes": [rng.integers(0, 1024, (8, n)).astype(np.int16) for n in frames],
                "num_frames": frames})
        writer.finalize()
        writer.close()
        paths.append(str(path))
    return paths


def stream(files: list[str]):
    """The stream exactly as load_tokenized(..., streaming=True) makes it."""
    return datasets.load_dataset("arrow", data_files=files, split="train", streaming=True).cast(FEATURES)


def _mapped(path: str) -> tuple[mmap.mmap, pa.Buffer]:
    with open(path, "rb") as f:  # not pa.memory_map: that one asks the kernel to read ahead
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return m, pa.py_buffer(m)


def drop_cache(paths: list[str]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def resident(path: str) -> np.ndarray:
    """Per page of the file: in the page cache (read from disk since the drop) or not."""
    m, buf = _mapped(path)
    n = (len(m) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(buf.address), ctypes.c_size_t(len(m)), vec) == 0, ctypes.get_errno()
    return np.frombuffer(vec, dtype=np.uint8) & 1 == 1


def cold(paths: list[str]) -> None:
    drop_cache(paths)
    left = sum(resident(p).sum() for p in paths) * mmap.PAGESIZE
    if left > MiB:
        pytest.skip(f"the page cache of {Path(paths[0]).parent} cannot be dropped (tmpfs?): {left} B stayed")


def pcm_pages(path: str) -> dict[str, np.ndarray]:
    """Per row id, the pages that only its pcm occupies (page-aligned inside its values)."""
    m, buf = _mapped(path)
    out = {}
    for batch in pa.ipc.open_stream(buf):
        ids, pcm = batch.column("id").to_pylist(), batch.column("pcm")
        for r, row_id in enumerate(ids):
            values = pcm[r].values
            start = values.buffers()[1].address + values.offset * 4 - buf.address
            end = start + len(values) * 4
            out[row_id] = np.arange(-(-start // mmap.PAGESIZE), end // mmap.PAGESIZE)
    return out


def rchar() -> int:
    """Bytes this process has read through read() and the like (not through memory maps)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def epoch(ds: StreamingCrops, e: int = 0, skip: int = 0, workers: int = 0) -> list[list[dict]]:
    ds.set_epoch(e)
    ds.skip = skip
    return list(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=list, num_workers=workers))


@linux_only
def test_startup_scan_reads_only_track_and_num_frames(files):
    """Constructing StreamingCrops reads the track and num_frames columns and no pcm or codes: under 1 MiB
    of the 24.5 MiB of files come back into the page cache, and nothing is read through read() (it used to
    read every column of every file: 24.5 MiB both ways)."""
    s = stream(files)
    total = sum(os.path.getsize(f) for f in files)
    cold(files)
    before = rchar()
    ds = StreamingCrops(s, 0.2, 2.0, batch_size=2)
    read = rchar() - before
    loaded = sum(resident(f).sum() for f in files) * mmap.PAGESIZE
    assert ds.num_examples > 0 and total > 24 * MiB
    # measured: 0 bytes by read(), 3 pages per record batch (~60 KiB): >16x margin to 1 MiB, 24x below total
    assert read < MiB and loaded < MiB, (read, loaded, total)


@linux_only
def test_a_worker_reads_only_the_crops_of_its_own_rows(files, monkeypatch):
    """Loader worker 0 of 2 on process 1 of 2 reads the pcm of its own rows' crops only: no page that
    only another row's pcm occupies (another process's, another worker's, a held-out or too-short one)
    is read, and of its own rows only about the crop (2 s of 10 s). The old reader read every row in
    every worker and process."""
    s = stream(files)
    ds = StreamingCrops(s, 0.2, 2.0, batch_size=2, rank=1, world_size=2)
    monkeypatch.setattr(streaming_module, "get_worker_info", lambda: types.SimpleNamespace(id=0, num_workers=2))
    cold(files)
    mine = {it["index"] for b in epoch(ds) for it in b}
    pages = {}
    for f in files:
        pages.update({row_id: (f, p) for row_id, p in pcm_pages(f).items()})
    loaded = {f: resident(f) for f in files}
    own = [row_id for row_id in pages if example_key(row_id) in mine]
    assert len(own) == len(mine) > 0 and len(pages) - len(own) >= 3 * len(own)
    crop_pages = 150 * 320 * 4 / mmap.PAGESIZE  # 2 s of pcm: 46.9 pages (of 234 for a 10 s row)
    for row_id, (f, p) in pages.items():
        n = int(loaded[f][p].sum())
        if row_id in own:  # the crop's pages (a 2 s tail: all of it); measured within 1.2 of that, allowed 2
            assert abs(n - min(crop_pages, len(p))) <= 2, (row_id, n, len(p))
        else:
            assert n == 0, (row_id, n, len(p))


def test_order_is_that_of_the_datasets_stream(files):
    """Over several files, shuffle buffers and epochs, StreamingCrops yields the rows in the order of the
    datasets stream it was given (shuffled by datasets), worked out without reading pcm: each micro-batch
    holds the ids, and the crops of the bytes, that iterating the stream itself gives."""
    s = stream(files)
    for buffer in (0, 3, 16):
        ds = StreamingCrops(s, 0.2, 2.0, batch_size=3, seed=5, shuffle_buffer=buffer)
        held = eval_tracks([t for f in files for t in pa.ipc.open_stream(_mapped(f)[1]).read_all()["track"]
                            .to_pylist()], 0.2)
        assert held == ds.held_out and held
        for e in (0, 1):
            full = s.with_format("arrow")
            if buffer:
                full = full.shuffle(seed=5, buffer_size=buffer)
                full.set_epoch(e)
            rows = [(i, p, c) for t in full.iter(batch_size=64)
                    for i, tr, n, p, c in zip(*(t.column(k).to_pylist() for k in ("id", "track", "num_frames",
                                                                                     "pcm", "codes")))
                    if tr not in held and n >= 150]
            got = [it for b in epoch(ds, e) for it in b]
            assert len(got) == len(ds) * 3 == len(rows) // 3 * 3
            assert [it["index"] for it in got] == [example_key(i) for i, _, _ in rows[:len(got)]]
            for it, (_, pcm, codes) in zip(got, rows):
                pcm, codes = np.asarray(pcm, np.float32), np.asarray(codes, np.int64)
                found = [s0 for s0 in range(codes.shape[1] - 149) if np.array_equal(codes[:, s0:s0 + 150],
                                                                                   it["codes"].numpy())]
                assert found and np.array_equal(pcm[found[0] * 320:(found[0] + 150) * 320], it["pcm"].numpy())
        assert [[it["index"] for it in b] for b in epoch(ds, 1, workers=2)] == \
            [[it["index"] for it in b] for b in epoch(ds, 1)]


def test_a_damaged_file_is_named(files, tmp_path):
    """A part file that is not arrow data (cut short) is refused at start-up with its path and the reason."""
    bad = tmp_path / "u000009.arrow"
    bad.write_bytes(Path(files[0]).read_bytes()[:5000])
    with pytest.raises(ValueError, match=f"{bad}: not a readable arrow file: .*"):
        StreamingCrops(stream([files[0], str(bad)]), 0.2, 2.0, batch_size=2)
