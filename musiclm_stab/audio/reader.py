"""Opening audio and reading it in mono blocks at its own sample rate; what counts as a bad input.

Decoding goes through ``soundfile`` (libsndfile, bundled in its wheel), which reads wav, flac, ogg,
mp3, aiff and au without FFmpeg. ``open_audio`` checks a file path or encoded bytes and gives an
``AudioReader``; ``array_reader`` gives one over a waveform already in memory. A reader decodes in
blocks, its channels down-mixed by averaging, so a long file is never held whole; every pass after the
first decodes from a freshly opened file, never from a seek back to the start. ``list_audio_files``
lists a folder's audio files. What is done with the blocks (checking, resampling to 24 kHz) is in
``musiclm_stab.audio.stream``.

Anything that cannot become a usable waveform raises ``AudioError`` with the source, a reason, and a
``kind`` (one of ``FAILURE_KINDS``), so callers can skip the file and report it. A file cut short is
found from what its container declares (``musiclm_stab.audio.container``) or, for FLAC, OGG and MP3,
from the decoded length (``AudioReader.blocks``). What is odd but still
usable audio is kept and reported as an ``AudioWarning`` (one of ``WARNING_KINDS``): the reader collects
them in ``AudioReader.warnings``, and ``scan`` returns them in ``AudioStats.warnings``.
"""

from __future__ import annotations

import functools
import io
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from musiclm_stab.audio.container import Container, PatchedSoundFile, read_container

AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".mp3", ".aiff", ".aif", ".au")
FAILURE_KINDS = {
    "missing": "the file does not exist (or is a broken link)",
    "unreadable": "the file exists but cannot be opened (permissions, not a regular file, I/O error)",
    "empty": "0 bytes",
    "not_audio": "not a format libsndfile recognises",
    "corrupt": "recognised, but the header or the encoded data is damaged",
    "truncated": "the data ends before the length the container declares: WAV (any kind), RF64, W64, AIFF, "
                 "AU and FLAC by any whole sample; OGG and MP3 (lengths from page granules or frame counts) "
                 "by more than min(0.5 s, 5%) of it (a smaller shortfall is the warning length_mismatch); or "
                 "an OGG stream with no end-of-stream page",
    "no_samples": "a valid file with no samples",
    "bad_sample_rate": "a sample rate outside MIN_SAMPLE_RATE..MAX_SAMPLE_RATE (1 kHz to 768 kHz): a damaged "
                       "header, or not audio the pipeline can use",
    "non_finite": "NaN or inf samples",
    "silent": "peak below the silence threshold (tokenizer policy)",
    "too_short": "shorter than min_seconds, or no whole 320-sample frame at 24 kHz (tokenizer policy)",
    "bad_row": "a dataset row with no usable audio",
    "repeated_folder": "a link to a folder already read (a cycle, or a second path to it): read once only",
    "error": "any other error while reading this one input (its type and message are given)",
}
# Odd but usable audio: kept, and reported to the caller in AudioStats.warnings (see AudioWarning).
WARNING_KINDS = {
    "length_mismatch": "the decoded length differs from the header's, short by at most the OGG/MP3 "
                       "tolerance (min(0.5 s, 5%)) or long by any amount: the audio is kept as decoded",
    "over_full_scale": "float samples with a peak above MAX_PEAK (2.0, +6 dBFS), e.g. PCM stored unscaled: "
                       "the track is scaled by 1/peak to a peak of 1.0",
}
BLOCK_SECONDS = 10.0  # source audio decoded per block
# OGG granule positions and MP3 frame counts are bookkeeping that real files get slightly wrong (an
# end-of-stream mark a page early, a last granule a few samples past the data): a shortfall of at most
# LOOSE_LENGTH_TOLERANCE seconds, and at most LOOSE_LENGTH_FRACTION of the declared length (so that a
# 2 s clip cannot lose a quarter of itself), is a warning there: 5% below 10 s, 0.5 s from 10 s on however
# long the track (a one-hour MP3 may miss 0.5 s, not 36 s). An end-of-stream mark one page early loses
# 0.06 s at 44.1 kHz (tests/test_audio_real_files.py). WAV/FLAC/AIFF/AU state exact sample counts.
_LOOSE_LENGTH_FORMATS = ("OGG", "MP3", "MPEG")
LOOSE_LENGTH_TOLERANCE = 0.5  # seconds
LOOSE_LENGTH_FRACTION = 0.05
# Sample rates outside this range are a damaged header (a WAV declaring 1,000,000,100 Hz would make the
# resampler allocate ~10 GB; one declaring 1 Hz turns 2 s of samples into 13 hours at 24 kHz). 8 kHz is the
# lowest rate recordings use (telephony; 1 kHz leaves room for odd old formats); 768 kHz is the highest PCM
# rate audio interfaces and editors offer (4 x 192 kHz). Checked right after the header is read.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1_000, 768_000


class AudioError(ValueError):
    """A file or buffer could not be turned into a usable 24 kHz mono waveform."""

    def __init__(self, path: str | Path, reason: str, kind: str = "corrupt"):
        assert kind in FAILURE_KINDS, kind
        self.path, self.reason, self.kind = str(path), reason, kind
        super().__init__(f"{self.path}: {reason}")

    def __reduce__(self):  # picklable (a track's payload travels to worker processes): by its three fields
        return type(self), (self.path, self.reason, self.kind)


@dataclass(frozen=True)
class AudioWarning:
    """Something odd about a track that is still used: ``kind`` is one of ``WARNING_KINDS``."""

    path: str
    kind: str
    reason: str

    def __post_init__(self) -> None:
        assert self.kind in WARNING_KINDS, self.kind

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


# ---------------------------------------------------------------------------------------------------
# Opening and reading in blocks


class AudioReader:
    """An opened audio source at its own sample rate, read from the start in mono blocks.

    ``frames`` is the length libsndfile reports from the header (a container cut short is refused by
    ``open_audio`` before this: ``musiclm_stab.audio.container``). Iterate ``blocks()`` as often as
    needed; each pass decodes again, so memory holds one block, never the track. ``warnings`` collects
    what the passes found odd but usable (each kind once); ``gain`` is the scale ``resampled_blocks``
    applies (``scan`` lowers it for float audio far above full scale).
    """

    def __init__(self, name: str, sample_rate: int, frames: int, channels: int,
                 soundfile: sf.SoundFile | None = None, array: np.ndarray | None = None,
                 reopen: Callable[[], sf.SoundFile] | None = None):
        self.name, self.sample_rate, self.frames, self.channels = name, sample_rate, frames, channels
        self._file, self._array = soundfile, array  # exactly one is set; array is mono (S,)
        self._reopen = reopen  # a new decoder at the start of the same source (files only)
        assert (soundfile is None) == (reopen is None), "a file reader needs reopen for its later passes"
        self._passes = 0  # passes over the file started so far
        self.warnings: list[AudioWarning] = []
        self.gain = 1.0

    def warn(self, kind: str, reason: str) -> None:
        """Record a warning of ``kind`` about this source, once per kind."""
        if all(w.kind != kind for w in self.warnings):
            self.warnings.append(AudioWarning(self.name, kind, reason))

    def blocks(self, block_frames: int | None = None) -> Iterator[np.ndarray]:
        """Mono float32 blocks [n] of at most ``block_frames`` source samples, from the start (every
        pass after the first opens the source again: see ``_restart``).

        Length rule, checked when the decoder reports the end: a shortfall against ``frames`` fails as
        ``truncated`` if it is more than the format's tolerance (0 for WAV, FLAC, AIFF, AU; for OGG and
        MP3 ``loose_tolerance(frames, rate)``: at most 0.5 s, and at most 5% of ``frames``); a smaller
        shortfall, or more samples than declared, keeps the audio as decoded and records the warning
        ``length_mismatch``.
        """
        block_frames = block_frames or int(BLOCK_SECONDS * self.sample_rate)
        if self._array is not None:
            for start in range(0, len(self._array), block_frames):
                yield self._array[start : start + block_frames]
            return
        if self._passes:
            self._restart()
        self._passes += 1
        f, done = self._file, 0
        while True:
            try:
                block = f.read(block_frames, dtype="float32", always_2d=True)  # (n, C)
            except (sf.SoundFileError, RuntimeError) as e:
                raise AudioError(self.name, f"decoding failed after {done / self.sample_rate:.2f} s of "
                                 f"{self.frames / self.sample_rate:.2f} s declared (corrupt or truncated "
                                 f"data): {e}", "corrupt") from None
            if len(block) == 0:
                break
            done += len(block)
            yield block.mean(axis=1) if block.shape[1] > 1 else block[:, 0]  # (n,): average the channels
        self._check_length(done, f.format)

    def _restart(self) -> None:
        """Replace the decoder with one freshly opened at the start of the source.

        Not ``seek(0)``: libsndfile 1.2.2 fails it ("file is malformed") on an Ogg Vorbis stream whose
        first page decodes to more samples than its granule position counts (start trimming), as in
        clips copied out of a longer stream without re-encoding, although such a file decodes whole.
        Opening again reads the headers (and for Ogg the last page), never the track.
        """
        self._file.close()
        try:
            f = self._reopen()
        except (sf.SoundFileError, RuntimeError, TypeError, ValueError, EOFError, OSError) as e:
            raise AudioError(self.name, f"cannot open the file again for another pass: {e}", "unreadable") from None
        now = (f.samplerate, f.channels, f.frames)
        if now != (self.sample_rate, self.channels, self.frames):
            f.close()
            raise AudioError(self.name, f"the file changed while it was read: it was {self.sample_rate} Hz, "
                             f"{self.channels} channels, {self.frames} samples, now {now[0]} Hz, {now[1]} "
                             f"channels, {now[2]} samples", "corrupt")
        self._file = f

    def _check_length(self, done: int, fmt: str) -> None:
        missing = self.frames - done
        if missing == 0:
            return
        loose = fmt in _LOOSE_LENGTH_FORMATS
        tolerance = loose_tolerance(self.frames, self.sample_rate) if loose else 0
        declared, ends = _two_durations(self.frames, done, self.sample_rate)
        what = (f"the header declares {declared} but the data ends at {ends} ({done} of {self.frames} "
                f"samples; {_amount(abs(missing), self.sample_rate)} {'short' if missing > 0 else 'over'}")
        if missing > tolerance:
            allowed = (f"more than the {tolerance / self.sample_rate:.2f} s allowed for {fmt}" if loose
                       else f"{fmt} states its exact length")
            raise AudioError(self.name, f"truncated: {what}, {allowed})", "truncated")
        self.warn("length_mismatch", f"length mismatch: {what}); the audio is kept as decoded")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> AudioReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def loose_tolerance(frames: int, sample_rate: int) -> int:
    """Samples an OGG or MP3 stream of ``frames`` declared samples may fall short of them and still be kept
    (with the warning ``length_mismatch``): LOOSE_LENGTH_TOLERANCE seconds, or LOOSE_LENGTH_FRACTION of the
    declared length if that is less. An absolute bound, so that a long track cannot lose more than a
    short one; the fraction, so that a short clip cannot lose most of itself."""
    return min(int(LOOSE_LENGTH_TOLERANCE * sample_rate), int(LOOSE_LENGTH_FRACTION * frames))


def _two_durations(a: int, b: int, rate: int) -> tuple[str, str]:
    """Two sample counts as seconds, with enough decimals (2 to 6) to tell different counts apart."""
    digits = 2
    while digits < 6 and f"{a / rate:.{digits}f}" == f"{b / rate:.{digits}f}":
        digits += 1
    return f"{a / rate:.{digits}f} s", f"{b / rate:.{digits}f} s"


def _amount(n: int, rate: int) -> str:
    """A sample count with its duration: '104 samples (2.4 ms)' or '5715 samples (0.13 s)'."""
    return f"{n} samples ({n / rate * 1000:.1f} ms)" if n < rate // 10 else f"{n} samples ({n / rate:.2f} s)"


def open_audio(source: str | Path | bytes, name: str | None = None) -> AudioReader:
    """Open a file path, or encoded bytes held in memory, for block reading. Raises AudioError.

    Checks, in order: the path exists (``missing``), is a regular file that can be opened
    (``unreadable``), has bytes (``empty``), is a format libsndfile knows (``not_audio``) with a sound
    header (``corrupt``) and a sample rate in MIN_SAMPLE_RATE..MAX_SAMPLE_RATE (``bad_sample_rate``),
    holds all the data its container declares (``truncated``: see ``musiclm_stab.audio.container``),
    and declares samples (``no_samples``). A length the writer left unstated (a streamed WAV's data size
    0, a pipe-encoded FLAC's sample count 0) is taken from the file, not refused.
    """
    if isinstance(source, bytes):
        name = name or "<bytes>"
        if not source:
            raise AudioError(name, "empty audio bytes (0 bytes)", "empty")
        data = source

        def from_bytes(patch: tuple[int, bytes] | None) -> sf.SoundFile:
            if patch is None:
                return sf.SoundFile(io.BytesIO(data))
            at, field = patch
            return sf.SoundFile(io.BytesIO(data[:at] + field + data[at + len(field) :]))

        return _open_soundfile(from_bytes, name, data[:64], read_container(io.BytesIO(data), len(data)))
    path = Path(source)
    name = name or str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        why = "broken symbolic link" if path.is_symlink() else "file does not exist"
        raise AudioError(name, why, "missing") from None
    except OSError as e:
        raise AudioError(name, f"cannot stat the file: {e.strerror or e}", "unreadable") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise AudioError(name, f"not a regular file ({what})", "unreadable")
    if st.st_size == 0:
        raise AudioError(name, "empty file (0 bytes)", "empty")
    try:  # open it ourselves first: libsndfile reports a permission error as a vague "System error"
        with open(path, "rb") as f:
            head = f.read(64)
            container = read_container(f, st.st_size)
    except OSError as e:
        raise AudioError(name, f"cannot open the file: {e.strerror or e}", "unreadable") from None

    def from_path(patch: tuple[int, bytes] | None) -> sf.SoundFile:
        return sf.SoundFile(str(path)) if patch is None else PatchedSoundFile(path, patch)

    return _open_soundfile(from_path, name, head, container)


_OPEN_ERRORS = (sf.SoundFileError, RuntimeError, TypeError, ValueError, EOFError, OSError)


def _open_soundfile(opener: Callable[[tuple[int, bytes] | None], sf.SoundFile], name: str, head: bytes,
                    container: Container | None) -> AudioReader:
    """Open the source with ``opener`` (called again for each later pass, with the container's patch if
    it has one) and check its header against what the container declares."""
    try:
        f = opener(None)
    except _OPEN_ERRORS as e:
        unknown = "Format not recognised" in str(e) or not _looks_like_audio(head)
        kind = "not_audio" if unknown else "corrupt"
        what = "not a readable audio file" if unknown else "a damaged audio file"
        raise AudioError(name, f"{what} ({'unknown format' if unknown else 'header unreadable'}): {e}",
                         kind) from None
    rate, channels, fmt = f.samplerate, f.channels, f.format
    if channels <= 0:
        f.close()
        raise AudioError(name, f"invalid header: {rate} Hz, {channels} channels", "corrupt")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        f.close()
        raise AudioError(name, f"the header's sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}.."
                         f"{MAX_SAMPLE_RATE} Hz (a damaged header?)", "bad_sample_rate")
    if container is not None:
        why = container.problem and f"a damaged {container.format} file: {container.problem}"
        if why:
            f.close()
            raise AudioError(name, why, "corrupt")
        why = _truncation(container, f.frames, rate)
        if why:
            f.close()
            raise AudioError(name, f"truncated: {why}", "truncated")
    reopen = functools.partial(opener, container.patch if container is not None else None)
    if container is not None and container.patch is not None:
        f.close()
        try:
            f = reopen()
        except _OPEN_ERRORS as e:
            raise AudioError(name, f"a damaged {fmt} file: reading it with {container.patched} fails: {e}",
                             "corrupt") from None
    if f.frames == 0:
        f.close()
        raise AudioError(name, "no audio samples (0 samples)", "no_samples")
    return AudioReader(name, rate, f.frames, channels, soundfile=f, reopen=reopen)


def _truncation(c: Container, frames: int, rate: int) -> str:
    """Why the container shows the file cut short, or "" (``frames``: what libsndfile found in it)."""
    if c.unended:
        return (f"the {c.format} stream ends without an end-of-stream page: it was cut short "
                f"({frames / rate:.2f} s are left)")
    if not c.short_by:
        return ""
    if c.frame_bytes:
        want, has = c.declared // c.frame_bytes, c.present // c.frame_bytes
        declared, holds = _two_durations(want, has, rate)
        return f"the {c.format} header declares {declared} but the file holds {holds} ({has} of {want} " \
            "samples)"
    return (f"the {c.format} header declares {c.declared} bytes of audio data but the file holds "
            f"{c.present} ({100 * c.present / c.declared:.1f}%)")


_MAGIC = (b"RIFF", b"RIFX", b"RF64", b"BW64", b"riff", b"fLaC", b"OggS", b"ID3", b"FORM", b".snd", b"dns.",
          b"\xff\xfb", b"\xff\xf3", b"\xff\xf2", b"\xff\xfa")


def _looks_like_audio(head: bytes) -> bool:
    return head.startswith(_MAGIC)


# ---------------------------------------------------------------------------------------------------
# Waveforms already in memory, and folders of files


def array_reader(array: np.ndarray | torch.Tensor, sample_rate: int, name: str = "<array>") -> AudioReader:
    """An AudioReader over a waveform already in memory: [S], or 2-D with channels on the shorter
    axis ([S, C] as soundfile returns it, [C, S] as torch code holds it). Integer PCM is scaled to [-1, 1]."""
    if not MIN_SAMPLE_RATE <= int(sample_rate) <= MAX_SAMPLE_RATE:
        raise AudioError(name, f"sample rate {sample_rate} Hz is outside {MIN_SAMPLE_RATE}.."
                         f"{MAX_SAMPLE_RATE} Hz", "bad_sample_rate")
    wave = torch.as_tensor(np.asarray(array))
    if wave.dtype in (torch.int16, torch.int32, torch.int8, torch.uint8):
        wave = _int_to_float(wave)
    elif not (wave.is_floating_point() or wave.dtype == torch.bool):
        raise AudioError(name, f"samples of type {wave.dtype} (give float, or int8/uint8/int16/int32 PCM): "
                         "their full scale is unknown", "bad_row")
    wave = wave.to(torch.float32)
    if wave.dim() == 2:
        channel_axis = 0 if wave.shape[0] < wave.shape[1] else 1
        wave = wave.mean(dim=channel_axis)  # (S,)
    elif wave.dim() != 1:
        raise AudioError(name, f"expected a waveform of shape [S] or [S, C], got {tuple(wave.shape)}", "bad_row")
    if wave.numel() == 0:
        raise AudioError(name, "no audio samples (0 samples)", "no_samples")
    return AudioReader(name, int(sample_rate), wave.numel(), 1, array=wave.numpy())


def _int_to_float(wave: torch.Tensor) -> torch.Tensor:
    if wave.dtype == torch.uint8:  # unsigned 8-bit PCM is centred on 128
        return (wave.to(torch.float32) - 128.0) / 128.0
    return wave.to(torch.float32) / float(torch.iinfo(wave.dtype).max)


def list_audio_files(folder: str | Path, problems: list[AudioError] | None = None) -> list[Path]:
    """Audio files under ``folder`` (recursive), sorted by their path relative to it.

    Every entry with an audio extension that is not a folder is listed, broken links and FIFOs included:
    they are bad inputs to report, not to pass over in silence. What the walk itself cannot read is never
    passed over either: a folder that cannot be listed (kind ``unreadable``), an entry whose type cannot
    be read (``unreadable``), a broken link without an audio extension (``missing``: it may have been a
    folder), a link to a folder already read (``repeated_folder``: a cycle, or a second path to it).
    Each is appended to ``problems`` as an AudioError naming its path, in order of the paths; with
    ``problems=None`` the first one is raised instead. ``folder`` itself unreadable is always raised.

    Links to folders are followed, each real folder read once (by device and inode): first every folder
    reached without a link, then the links in order of their paths, each with what it leads to. So a
    folder of links to albums is read, and a link back up the tree (a cycle) is recorded instead of
    looping, or of leaving the folder out in silence.
    """
    root = Path(folder)
    found: list[Path] = []
    issues: list[AudioError] = []
    try:
        st = os.stat(root)
    except OSError as e:
        raise AudioError(root, f"cannot read the folder: {e.strerror or e}", "unreadable") from None
    read: dict[tuple[int, int], Path] = {(st.st_dev, st.st_ino): root}  # real folders read -> the path read
    todo, links = [root], []  # folders to list; links to folders, to follow once todo is empty

    def claim(path: Path, target: os.stat_result) -> bool:
        """Whether the folder ``path`` leads to is new (then it is listed), else a record."""
        key = (target.st_dev, target.st_ino)
        if key in read:
            issues.append(AudioError(path, f"the same folder as {read[key]}, already read: not read again (a "
                                     "link makes a cycle, or a second path to it)", "repeated_folder"))
            return False
        read[key] = path
        todo.append(path)
        return True

    while todo or links:
        if not todo:
            links.sort(key=lambda p: p.relative_to(root).as_posix())
            path = links.pop(0)
            try:
                claim(path, os.stat(path))
            except OSError as e:  # gone since it was seen
                issues.append(AudioError(path, f"cannot read the folder: {e.strerror or e}", "unreadable"))
            continue
        where = todo.pop()
        try:
            with os.scandir(where) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=True)  # popped from todo in name order
        except OSError as e:
            unread = AudioError(where, f"cannot read the folder: {e.strerror or e}", "unreadable")
            if where == root:
                raise unread from None
            issues.append(unread)
            continue
        for entry in entries:
            path = Path(entry.path)
            audio = path.suffix.lower() in AUDIO_EXTENSIONS
            try:
                is_dir = entry.is_dir()  # follows links; False for a broken one
                is_link = entry.is_symlink()
                target = entry.stat() if is_dir else None
            except OSError as e:  # a link loop (ELOOP), an I/O error: what it is cannot be known
                if audio:
                    found.append(path)  # opening it reports why
                else:
                    issues.append(AudioError(path, f"cannot tell what this entry is: {e.strerror or e}",
                                             "unreadable"))
                continue
            if target is not None:
                if is_link:
                    links.append(path)
                else:
                    claim(path, target)
            elif audio:
                found.append(path)
            elif is_link and not path.exists():
                issues.append(AudioError(path, f"broken symbolic link{_link_target(path)}: nothing read through "
                                         "it", "missing"))
    issues.sort(key=lambda e: Path(e.path).relative_to(root).as_posix())
    if problems is None and issues:
        raise issues[0]
    if problems is not None:
        problems += issues
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _link_target(path: Path) -> str:
    """' (to TARGET)' for a symbolic link, or '' if it cannot be read."""
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""
