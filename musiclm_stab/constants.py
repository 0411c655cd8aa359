"""The package's ground floor: the numbers every part shares, and the version. Nothing here imports anything.

Every module of the package imports these from here; ``musiclm_stab/__init__.py``, the package's public face,
only re-exports them (a face hands names on; nothing below imports it: tests/test_layout.py checks both).
"""

# The one place the version is written: pyproject.toml reads it (dynamic version), CHANGELOG.md has an entry
# for each release. Data formats carry their own versions (tokenizer.json, checkpoints, exports).
__version__ = "0.2.0"

SAMPLE_RATE = 24_000  # EnCodec 24 kHz; every waveform in the pipeline is mono at this rate
HOP_LENGTH = 320  # samples per frame: EnCodec's hop and the conv frontend's total stride
FRAME_RATE = SAMPLE_RATE // HOP_LENGTH  # 75 Hz
NUM_CODEBOOKS = 8  # EnCodec 24 kHz at 6 kbps
CODEBOOK_SIZE = 1024
