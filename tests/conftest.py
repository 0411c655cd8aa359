"""Shared test fixtures: synthetic music, one small set of fitted EnCodec weights, one tokenized dataset.

``local_weights`` and ``tokenized_dataset`` are session-scoped and used across the test suite
(tokenizer, training loader, end-to-end tests): keep their names and return types. Each is built once per
test session, also under pytest-xdist (``built_once``), so no test may change what they hold.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

SR = 24_000

# `make test` runs two workers on two cores: one intra-op thread per worker, and per process a test starts
# (they inherit it), instead of two each fighting for the same cores. Set before torch starts its thread pool;
# a test that needs more threads sets them itself. An OMP_NUM_THREADS already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def synth_music(seconds: float, seed: int = 0, sr: int = SR, channels: int = 1) -> np.ndarray:
    """Music-like test audio: notes of harmonic tones with decaying envelopes plus noise hits.

    Returns float32 [S] (mono) or [S, C], peak about 0.5, seeded.
    """
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    out = np.zeros((n, channels), dtype=np.float64)
    scale = np.array([0, 2, 4, 5, 7, 9, 11])
    for voice in range(3):
        pos = 0.0
        while pos < seconds:
            dur = rng.choice([0.125, 0.25, 0.5, 1.0])
            midi = 45 + 12 * voice + scale[rng.integers(len(scale))] + 12 * rng.integers(0, 2)
            f0 = 440.0 * 2 ** ((midi - 69) / 12)
            a, b = int(pos * sr), min(n, int((pos + dur) * sr))
            tt = t[a:b] - pos
            env = (1 - np.exp(-tt / 0.005)) * np.exp(-tt / (0.1 + 0.4 * rng.random()))
            tone = sum(np.sin(2 * np.pi * f0 * h * tt + rng.random() * 6.28) / h**1.2 for h in range(1, 8))
            pan = rng.random(channels) if channels > 1 else np.ones(1)
            out[a:b] += (0.25 * env * tone)[:, None] * pan
            pos += dur
    for hit in np.arange(0, seconds, 0.5):  # percussion: short noise bursts
        a = int(hit * sr)
        b = min(n, a + int(0.05 * sr))
        out[a:b] += rng.normal(0, 0.2, (b - a, 1)) * np.exp(-np.arange(b - a) / (0.01 * sr))[:, None]
    out *= 0.5 / max(1e-9, np.abs(out).max())
    return (out[:, 0] if channels == 1 else out).astype(np.float32)


@pytest.fixture(scope="session")
def make_music() -> Callable[..., np.ndarray]:
    """The synthetic-music generator: make_music(seconds, seed=0, sr=24000, channels=1)."""
    return synth_music


# what a shared fixture's folder holds once its build finished: written last, so a folder without it is a build
# that failed or was killed half-way, never reused
COMPLETE = ".complete"


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """Folder ``name``, made by ``build(folder)`` once per test session and shared by the session's xdist workers.

    Each worker would otherwise build it again (the xdist docs' "Making session-scoped fixtures execute only
    once"): the first worker to take the lock builds it in the folder the workers share, the others wait and
    reuse it. The folder is built where it stays, because what it holds names absolute paths (the tokenizer's
    job.json records its source, which a rerun compares); so a build is complete when ``COMPLETE`` is in it,
    written last, and a folder without it (a build that raised or was killed: the lock goes with the process)
    is deleted and built again. Without xdist the folder is this session's own. Users must not change it.
    """
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: .../pytest-N/popen-gwK
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (folder / COMPLETE).exists():
            if folder.exists():
                shutil.rmtree(folder)  # a build of this session that did not finish: its debris
            folder.mkdir()
            build(folder)
            (folder / COMPLETE).write_text(f"built by pid {os.getpid()}\n")
    return folder


def _fit_weights(root: Path) -> None:
    from musiclm_stab.tokenizer.fit import make_local_weights

    audio = root / "audio"
    audio.mkdir()
    for i in range(4):
        sf.write(audio / f"fit_{i}.wav", synth_music(6.0, seed=100 + i), SR)
    make_local_weights(sorted(audio.glob("*.wav")), root / "encodec_local.th", seed=0, max_seconds=60, iters=8,
                       progress=False)


@pytest.fixture(scope="session")
def local_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EnCodec weights with codebooks fitted on 24 s of synthetic music (seed 0); path to the file.

    Built once per session (``built_once``): read it, never write beside it."""
    return built_once(tmp_path_factory, "weights", _fit_weights) / "encodec_local.th"


@pytest.fixture(scope="session")
def tokenized_dataset(tmp_path_factory: pytest.TempPathFactory, local_weights: Path) -> Path:
    """3 tracks x 12 s of synthetic music tokenized with ``local_weights`` (10 s segments): its path.

    Each track gives a 10 s segment and a 2 s tail: 6 rows. Built once per session (``built_once``): a test
    that writes into it (a rerun of the tokenizer, a restore) works on a copy.
    """
    def build(root: Path) -> None:
        from musiclm_stab.tokenizer.pipeline import tokenize

        src = root / "audio"
        src.mkdir()
        for i in range(3):
            sf.write(src / f"track_{i}.wav", synth_music(12.0, seed=200 + i), SR)
        tokenize(src, root / "tokens", weights=str(local_weights), segment_seconds=10.0, min_seconds=1.0,
                 progress=False, weights_note="test weights fitted on synthetic music", workers=0)

    return built_once(tmp_path_factory, "tokenized", build) / "tokens"


def write_codes_file(saved: dict, path: Path, change: Callable[[dict, dict], None]) -> None:
    """A codes file (`musiclm-stab codes save`) like ``saved`` (read_codes' dict), its arrays and header changed
    in place by ``change(arrays, header)``."""
    import io
    import json
    import lzma

    arrays = {k: np.array(saved[k]) for k in ("id", "track", "shape", "codes")}
    header = dict(saved["header"])
    change(arrays, header)
    buf = io.BytesIO()
    np.savez(buf, header=np.array(json.dumps(header)), **arrays)
    path.write_bytes(lzma.compress(buf.getvalue()))


@pytest.fixture
def codes_file_writer() -> Callable[[dict, Path, Callable[[dict, dict], None]], None]:
    """write_codes_file, for tests that make codes files that do not fit."""
    return write_codes_file


@pytest.fixture
def other_machine_tokens(tokenized_dataset: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(codes file of ``tokenized_dataset``, a copy of it whose codes differ in 3 places in 2 rows), as another
    CPU's tokenizing of the same audio would differ. The copy is made by restoring an edited codes file whose
    header names another sha256, which the restore refuses after writing (its last check)."""
    from musiclm_stab.data.codes_file import read_codes, restore_codes, save_codes

    original = tmp_path / "original.npz.xz"
    save_codes(tokenized_dataset, original)
    saved = read_codes(original)
    other = tmp_path / "other_machine"
    shutil.copytree(tokenized_dataset, other)
    starts = np.r_[0, np.cumsum(np.prod(saved["shape"], axis=1))[:-1]]

    def flip(arrays: dict, header: dict) -> None:
        for row, k, t in ((0, 0, 0), (3, 2, 5), (3, 7, 1)):  # (row, codebook, frame)
            i = starts[row] + k * saved["shape"][row][1] + t
            arrays["codes"][i] = (arrays["codes"][i] + 1) % 1024
        header["codes_sha256"] = "0" * 64  # not these codes' sha: the restore writes them, then refuses

    edited = tmp_path / "edited.npz.xz"
    write_codes_file(saved, edited, flip)
    try:
        restore_codes(other, edited)
    except RuntimeError as e:
        assert "after restoring" in str(e)
    else:
        raise AssertionError("a codes file whose header names other codes was restored without complaint")
    return original, other


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; reset them around a test that builds Trainers in-process."""
    from inproc import fresh_accelerate

    with fresh_accelerate():
        yield


@pytest.fixture
def accelerator():
    """An in-process accelerate state with a small model and optimizer, reset afterwards."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 8)
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)
