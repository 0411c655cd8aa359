"""musiclm_stab: pretraining MERT-style music masked-language models and studying their training stability."""

__version__ = "0.1.0"

SAMPLE_RATE = 24_000  # EnCodec 24 kHz; every waveform in the pipeline is mono at this rate
HOP_LENGTH = 320  # samples per frame: EnCodec's hop and the conv frontend's total stride
FRAME_RATE = SAMPLE_RATE // HOP_LENGTH  # 75 Hz
NUM_CODEBOOKS = 8  # EnCodec 24 kHz at 6 kbps
CODEBOOK_SIZE = 1024
