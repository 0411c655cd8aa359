"""EnCodec encoding of a batch of segments, and the float precision it runs in.

Boundary policy: every segment is encoded on its own, with no audio before or after it, so a row's
codes are the codes of the row's pcm (what training crops rely on). The 24 kHz EnCodec is causal
(convolutions and an LSTM that only look back), so against a whole-track encode only the start of a
segment differs while the encoder warms up. Measured on the default corpus (24 tracks, 95 boundaries;
benchmarks/README.md): frames 0-9 (0.13 s) agree in 0-23% of codes, frames 10-37 in 82-93%, from
0.5 s on 99.7-99.9% (the rest is float rounding), and a track's first segment 100%.
Float rounding also depends on the batch a segment shares and the thread count (with the test weights
~2% of codes differ between batch sizes at near-ties), hence one thread per encoder and a batch size
that is part of the job: a resumed or sharded run encodes exactly like an uninterrupted one. On a GPU,
TF32 (torch's default for cuDNN convolutions) is turned off wherever the encoder runs (``full_fp32``):
its 10-bit mantissa would make GPU codes differ from CPU codes far more than fp32 rounding does (the
agreement itself has not been measured: no GPU was lent; benchmarks/bench_tokenize.py devices).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from musiclm_stab.constants import HOP_LENGTH, NUM_CODEBOOKS

if TYPE_CHECKING:
    from encodec import EncodecModel


def encode_batch(model: EncodecModel, pcm: torch.Tensor) -> torch.Tensor:
    """EnCodec codes of equal-length segments: pcm [B, S] (S a multiple of 320) -> codes [B, K, T] int16.

    The encoder's convolutions (everything before its LSTM, at 24 kHz down to 75 Hz) run one segment at
    a time, the LSTM, the last convolution and the quantizer on the whole batch. The convolutions hold
    almost all of the memory (their first layers: 32 channels at 24 kHz, ~31 MB per activation for a 10 s
    segment) and gain nothing from a batch on a CPU; the LSTM's steps do gain from one. So memory is one
    segment's activations whatever the batch size, at the same CPU time, and the codes are those of
    ``model.encode`` on the batch (bit for bit on both CPUs measured, an AMD EPYC with AVX2 and an Intel
    Xeon with AVX-512: a convolution of one segment does not depend on the others in its batch;
    benchmarks/README.md, "Encoding one segment's convolutions at a time").
    """
    B, S = pcm.shape
    if model.normalize or model.segment is not None:
        raise ValueError("encode_batch needs the 24 kHz EnCodec (no input normalization, one frame per "
                         f"segment); got normalize={model.normalize}, segment={model.segment}")
    front, back = _split_at_lstm(model)
    device = next(model.parameters()).device
    with torch.inference_mode():
        x = pcm.to(device).unsqueeze(1)  # (B, 1, S)
        emb = back(torch.cat([front(x[b : b + 1]) for b in range(B)]))
        codes = model.quantizer.encode(emb, model.frame_rate, model.bandwidth).transpose(0, 1)  # (B, K, T)
    assert codes.shape == (B, NUM_CODEBOOKS, S // HOP_LENGTH), \
        f"EnCodec gave codes {tuple(codes.shape)} for input {(B, 1, S)}; expected {(B, NUM_CODEBOOKS, S // HOP_LENGTH)}"
    return codes.to(torch.int16).cpu()


def _split_at_lstm(model: EncodecModel) -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    """The encoder's layers before its LSTM, and the LSTM with the layers after it."""
    from encodec.modules.lstm import SLSTM

    layers = list(model.encoder.model)
    cut = next((i for i, layer in enumerate(layers) if isinstance(layer, SLSTM)), None)
    if cut is None:
        raise ValueError("the EnCodec encoder has no LSTM layer: not the 24 kHz model's SEANet encoder")
    return torch.nn.Sequential(*layers[:cut]), torch.nn.Sequential(*layers[cut:])


def _precision_knobs() -> dict[str, Any]:
    """torch's fp32-precision settings that reach the encoder on a GPU: its convolutions and LSTM run in
    cuDNN, the quantizer's distances are matmuls (cuBLAS)."""
    return {"cudnn.conv": torch.backends.cudnn.conv, "cudnn.rnn": torch.backends.cudnn.rnn,
            "cuda.matmul": torch.backends.cuda.matmul}


def fp32_precision() -> dict[str, str]:
    """The current fp32 precision of each knob ("ieee": full fp32, "tf32": TensorFloat-32, "none": default)."""
    return {name: knob.fp32_precision for name, knob in _precision_knobs().items()}


def set_full_fp32() -> None:
    """Turn TF32 off for the encoder (process-wide). Through torch's fp32_precision API only: mixing it
    with the older allow_tf32 flags makes torch refuse to read them."""
    for knob in _precision_knobs().values():
        knob.fp32_precision = "ieee"


@contextmanager
def full_fp32() -> Iterator[None]:
    """TF32 off inside the block, the previous settings restored after (for encoding in this process)."""
    before = fp32_precision()
    set_full_fp32()
    try:
        yield
    finally:
        for name, knob in _precision_knobs().items():
            knob.fp32_precision = before[name]
