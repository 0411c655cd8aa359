"""Decoding audio into the pipeline's one waveform format: float32 mono at 24 kHz, whole or in blocks.

- ``reader``: opening a file, encoded bytes or an in-memory array and reading it in mono blocks at its
  own sample rate (``open_audio``, ``array_reader``, ``AudioReader``, ``list_audio_files``); what counts
  as a bad input (``AudioError`` and ``FAILURE_KINDS``) or as odd but usable audio (``AudioWarning``
  and ``WARNING_KINDS``).
- ``container``: the length a file's container declares, read from the file itself (WAV, RF64, W64,
  AIFF, AU data sizes; Ogg end-of-stream pages; a FLAC sample count left at 0), which ``open_audio``
  compares with what is on disk.
- ``stream``: what is done with the blocks: ``scan`` (one checking pass and the peak policy,
  ``AudioStats``), ``StreamResampler`` and ``resampled_blocks`` (24 kHz block by block), and the
  whole-waveform helpers ``load_audio``, ``decode_bytes`` and ``from_array``.

The public names are re-exported here. Settings are read from the module that defines them: to change
the decode block length (e.g. in a test), set ``musiclm_stab.audio.reader.BLOCK_SECONDS``. It is not
re-exported, so that a monkeypatch of ``musiclm_stab.audio.BLOCK_SECONDS`` fails rather than having
no effect.
"""

from musiclm_stab.audio.reader import (
    AUDIO_EXTENSIONS,
    FAILURE_KINDS,
    WARNING_KINDS,
    AudioError,
    AudioReader,
    AudioWarning,
    array_reader,
    list_audio_files,
    open_audio,
)
from musiclm_stab.audio.stream import (
    MAX_PEAK,
    AudioFileWarning,
    AudioStats,
    StreamResampler,
    decode_bytes,
    from_array,
    load_audio,
    resampled_blocks,
    scan,
)

__all__ = [
    "AUDIO_EXTENSIONS", "FAILURE_KINDS", "MAX_PEAK", "WARNING_KINDS", "AudioError", "AudioFileWarning",
    "AudioReader", "AudioStats", "AudioWarning", "StreamResampler", "array_reader", "decode_bytes",
    "from_array", "list_audio_files", "load_audio", "open_audio", "resampled_blocks", "scan",
]
