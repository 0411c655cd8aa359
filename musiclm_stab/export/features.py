"""Frame features at 75 Hz from audio of any length, in bounded memory.

    musiclm-stab features MODEL SRC OUT [--layers 0 6 12] [--chunk-seconds 30] [--overlap-seconds 10]

MODEL is a run directory, a checkpoint directory, or an export made by ``musiclm-stab export``. Audio
of S samples (24 kHz mono) gives T = ceil(S / 320) frames (the end is zero-padded to a whole frame);
frame t is centred on sample 320*t + 160. Layer l is the l-th of the encoder's N+1 hidden states:
0 = the input of the first transformer layer (features + positional convolution), l = the output of
layer l. For pre-LN models layer N is taken before the final LayerNorm, as ``hidden_states`` of
``transformers`` 5.x HubertModel (``last_hidden_state`` has it).

Chunking and the stitching rule. The encoder attends over the whole input, so cost and memory grow
with its length (a 10-minute track is 45,000 frames). Audio longer than one chunk is cut into windows
of ``chunk_seconds`` whose neighbours overlap by ``overlap_seconds`` (default: a third of the chunk);
windows start every chunk - overlap seconds, the last one ends at the end of the audio. Each frame is
taken from the one window in which it lies farthest from a cut: windows hand over at the middle of
their overlap, so every kept frame has at least overlap/2 seconds of audio on each side (or the true
start / end of the audio); the outer halves of the overlaps are computed and discarded. One more rule
makes the frontend exact: its first conv's GroupNorm normalizes each channel over the *whole input*
(wav2vec2-style), so a window alone would normalize with its own statistics. A first pass (cheap: one
conv layer, block by block) takes each channel's mean and variance over the whole clip, and every
window is normalized with those. Audio no longer than one chunk is one plain pass, bit for bit.
Memory is bounded by one window, whatever the length; ``extract_features`` keeps the stitched [T, D]
outputs of the chosen layers, batch mode writes them to disk as they are made.

The bound. Layer 0 (frontend + positional conv, whose kernel reaches 64 frames = 0.85 s either side)
equals the whole pass to float rounding (measured max |diff|: 3e-6 on the tiny test models, 0 at base)
whenever overlap/2 >= 0.85 s. Deeper layers differ by what attention would have seen outside the
window, so the gap depends on the model; ``chunking_error`` measures it for a checkpoint and a clip.
Measured with random weights (diffuse attention, probably a hard case for chunking), per layer:
base size, defaults (30 s windows, 10 s overlap), 60 s of music: relative error ||chunked - whole|| /
||whole|| <= 0.045, per-frame cosine >= 0.982 (mean 0.999); tiny test model, 8 s windows, 4 s overlap,
24 s: <= 0.061 and >= 0.992, held in tests/test_features.py to < 0.1 and > 0.99. Details and memory
in benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.export.exported import PAD_SAMPLES, SIDECAR
from musiclm_stab.host import default_device
from musiclm_stab.training.trained import load_checkpoint

DEFAULT_CHUNK_SECONDS = 30.0


# ---------------------------------------------------------------------------------------- models


class FeatureModel:
    """An encoder giving the N+1 hidden states of audio: our MusicMLM, or an export loaded with transformers."""

    def __init__(self, module: torch.nn.Module, kind: str, num_layers: int, width: int, source: str):
        self.module = module.eval()
        self.kind = kind  # "musiclm_stab" or "transformers"
        self.num_layers, self.width, self.source = num_layers, width, source

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _group_norm_slot(self) -> tuple[torch.nn.Module, str | int]:
        """(parent, key) of the frontend's first-conv GroupNorm, the one norm that spans time."""
        if self.kind == "transformers":
            return self.module.feature_extractor.conv_layers[0], "layer_norm"
        return self.module.frontend.convs[0], 1

    @property
    def first_conv(self) -> torch.nn.Conv1d:
        if self.kind == "transformers":
            return self.module.feature_extractor.conv_layers[0].conv
        return self.module.frontend.convs[0][0]

    @contextmanager
    def group_norm_stats(self, stats: tuple[torch.Tensor, torch.Tensor] | None):
        """Within the block the first-conv GroupNorm normalizes with ``stats`` (mean, var per channel)."""
        if stats is None:
            yield
            return
        parent, key = self._group_norm_slot()
        gn = parent[key] if isinstance(key, int) else getattr(parent, key)
        _set_child(parent, key, _FixedStatsGroupNorm(gn, *stats))
        try:
            yield
        finally:
            _set_child(parent, key, gn)

    @torch.inference_mode()
    def hidden_states(self, wav: torch.Tensor) -> list[torch.Tensor]:
        """[B, S] audio, S a multiple of 320 -> N+1 states [B, S/320, D]."""
        if self.kind == "transformers":
            from musiclm_stab.export.exported import pad_for_export

            return list(
                self.module(pad_for_export(wav, align=False), output_hidden_states=True).hidden_states
            )
        (_, hidden), _ = self.module.encode(wav, return_hidden=True)
        return hidden


def _set_child(parent: torch.nn.Module, key: str | int, module: torch.nn.Module) -> None:
    if isinstance(key, int):
        parent[key] = module  # nn.Sequential
    else:
        setattr(parent, key, module)


class _FixedStatsGroupNorm(torch.nn.Module):
    """GroupNorm with one channel per group, normalizing with given statistics instead of the input's."""

    def __init__(self, gn: torch.nn.GroupNorm, mean: torch.Tensor, var: torch.Tensor):
        super().__init__()
        if gn.num_groups != gn.num_channels:
            raise ValueError("only a GroupNorm with one channel per group normalizes each channel over time")
        scale = gn.weight.detach().double() / torch.sqrt(var.double() + gn.eps)  # (C,)
        self.scale = scale.float()[:, None]
        self.shift = (gn.bias.detach().double() - mean.double() * scale).float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, L)
        return torch.addcmul(self.shift.to(x), x, self.scale.to(x))  # one output buffer, no temporary


def _segment(wav: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Samples [start, end) of ``wav`` [S] extended with zeros on both sides; copies only the segment."""
    inner = wav[max(start, 0) : max(min(end, wav.numel()), 0)]
    return F.pad(inner, (max(-start, 0), end - start - inner.numel() - max(-start, 0)))


@torch.inference_mode()
def group_norm_stats(
    wav: torch.Tensor, model: FeatureModel, block_seconds: float = 10.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance over time of the first conv's output in a whole pass over
    ``wav`` [S] (zero-padded to whole frames, and by 40 samples each side as the frontend does), block by
    block: [C] and [C], float64."""
    conv = model.first_conv
    k, stride = conv.kernel_size[0], conv.stride[0]
    total = math.ceil(wav.numel() / HOP_LENGTH) * HOP_LENGTH + 2 * PAD_SAMPLES  # whole-pass input length
    n_out = (total - k) // stride + 1
    step = max(1, int(block_seconds * SAMPLE_RATE) // stride)  # outputs per block
    s1 = torch.zeros(conv.out_channels, dtype=torch.float64)
    s2 = torch.zeros(conv.out_channels, dtype=torch.float64)
    for a in range(0, n_out, step):
        b = min(n_out, a + step)
        x = _segment(
            wav, a * stride - PAD_SAMPLES, (b - 1) * stride + k - PAD_SAMPLES
        )  # inputs of outputs a..b-1
        y = conv(x.to(model.device)[None, None])[0]  # (C, b - a)
        s1 += y.sum(-1, dtype=torch.float64).cpu()
        s2 += y.square().sum(-1, dtype=torch.float64).cpu()
    mean = s1 / n_out
    return mean, (s2 / n_out - mean**2).clamp_min(0.0)


def load_feature_model(path: str | Path, device: str | None = None) -> FeatureModel:
    """A run directory, checkpoint directory or export directory as a FeatureModel on ``device``."""

    path = Path(path)
    device = default_device(device)
    if (path / "config.json").is_file():  # a transformers checkpoint
        if not (path / SIDECAR).is_file():
            raise ValueError(
                f"{path} is a transformers checkpoint but not an export of this project (no {SIDECAR}):"
                " its padding and frame alignment are unknown"
            )
        meta = json.loads((path / SIDECAR).read_text())
        if meta.get("pad_samples") != PAD_SAMPLES:
            raise ValueError(
                f"{path}: pad_samples={meta.get('pad_samples')}, this version expects {PAD_SAMPLES}"
            )
        from transformers import HubertModel

        hf = HubertModel.from_pretrained(path).to(device)
        return FeatureModel(hf, "transformers", hf.config.num_hidden_layers, hf.config.hidden_size, str(path))
    model, ckpt, _ = load_checkpoint(path)
    return FeatureModel(model.to(device), "musiclm_stab", model.cfg.num_layers, model.cfg.width, str(ckpt))


def resolve_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Layer indices in 0..N (negative ones count from N), duplicates removed; None = all N+1."""
    if layers is None:
        return list(range(num_layers + 1))
    out = []
    for layer in layers:
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(
                f"layer {layer} does not exist: this model has layers 0..{num_layers} "
                f"(0 = input of the first transformer layer, {num_layers} = output of the last)"
            )
        layer %= num_layers + 1
        if layer not in out:
            out.append(layer)
    return out


# -------------------------------------------------------------------------------------- chunking


@dataclass(frozen=True)
class Chunk:
    """A window of frames [start, end) fed to the model; frames [keep_start, keep_end) are kept from it."""

    start: int
    end: int
    keep_start: int
    keep_end: int


def chunk_plan(num_frames: int, chunk_frames: int, overlap_frames: int) -> list[Chunk]:
    """Windows of ``chunk_frames`` overlapping by at least ``overlap_frames``; kept parts tile [0, T) once."""
    if overlap_frames < 0 or chunk_frames <= overlap_frames:
        raise ValueError(
            f"need 0 <= overlap < chunk, got chunk={chunk_frames} and overlap={overlap_frames} frames"
        )
    T, C = num_frames, chunk_frames
    if T <= C:
        return [Chunk(0, T, 0, T)]
    hop = C - overlap_frames
    n = math.ceil((T - C) / hop) + 1
    starts = [min(k * hop, T - C) for k in range(n)]  # the last window ends at T
    cuts = [0] + [(starts[k] + C + starts[k + 1]) // 2 for k in range(n - 1)] + [T]  # middles of the overlaps
    return [Chunk(s, s + C, cuts[k], cuts[k + 1]) for k, s in enumerate(starts)]


def _frames(seconds: float) -> int:
    return int(round(seconds * FRAME_RATE))


def overlap_seconds_for(chunk_seconds: float, overlap_seconds: float | None) -> float:
    """The overlap in seconds: a third of the chunk unless given."""
    return chunk_seconds / 3 if overlap_seconds is None else overlap_seconds


def _as_waveform(audio_or_path: str | Path | torch.Tensor | np.ndarray) -> tuple[torch.Tensor, str]:
    if isinstance(audio_or_path, (str, Path)):
        from musiclm_stab.audio.stream import load_audio

        return load_audio(audio_or_path), str(audio_or_path)
    wav = torch.as_tensor(audio_or_path).float()
    if wav.dim() != 1 or wav.numel() == 0:
        raise ValueError(
            f"expected a 24 kHz mono waveform [S], got shape {tuple(wav.shape)} "
            "(use musiclm_stab.audio.from_array to convert other rates and channels)"
        )
    return wav, "<tensor>"


def iter_features(
    wav: torch.Tensor,
    model: FeatureModel,
    layers: list[int],
    chunk_seconds: float,
    overlap_seconds: float | None = None,
    global_stats: bool = True,
) -> Iterator[tuple[Chunk, list[torch.Tensor]]]:
    """Stitched features of ``wav`` [S], in order: (chunk, [kept frames [n, D] per layer, fp32 on CPU]).

    With ``global_stats`` (and more than one window) the first-conv GroupNorm uses the statistics of the
    whole clip, as a whole pass would, instead of each window's own.
    """
    T = math.ceil(wav.numel() / HOP_LENGTH)
    plan = chunk_plan(T, _frames(chunk_seconds), _frames(overlap_seconds_for(chunk_seconds, overlap_seconds)))
    stats = group_norm_stats(wav, model) if global_stats and len(plan) > 1 else None
    with model.group_norm_stats(stats):
        for chunk in plan:  # the last window is zero-padded to a whole frame
            window = _segment(wav, chunk.start * HOP_LENGTH, chunk.end * HOP_LENGTH).to(model.device)
            hidden = model.hidden_states(window[None])  # N+1 x (1, C, D)
            a, b = chunk.keep_start - chunk.start, chunk.keep_end - chunk.start
            kept = [
                hidden[layer][0, a:b].float().cpu().clone() for layer in layers
            ]  # not views of the window
            del hidden, window  # free this window's states before the next one is computed
            yield chunk, kept


@dataclass
class FrameFeatures:
    """Per-layer frame features of one clip: ``layers[l]`` is [T, D] (fp32), T = ceil(num_samples / 320)."""

    layers: dict[int, torch.Tensor]
    num_samples: int
    num_chunks: int
    frame_rate: int = FRAME_RATE
    source: str = ""


def extract_features(
    audio_or_path: str | Path | torch.Tensor | np.ndarray,
    model: FeatureModel | str | Path,
    layers: Sequence[int] | None = None,
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS,
    overlap_seconds: float | None = None,
    device: str | None = None,
    global_stats: bool = True,
) -> FrameFeatures:
    """Features at 75 Hz of a file (decoded to 24 kHz mono) or a waveform [S] at 24 kHz, chunked.

    ``model``: a FeatureModel, or a path for ``load_feature_model``. ``layers``: indices 0..N (None: all).
    ``overlap_seconds``: between neighbouring windows, a third of ``chunk_seconds`` unless given.
    Memory: one chunk's activations plus the returned [T, D] per chosen layer.
    """
    if not isinstance(model, FeatureModel):
        model = load_feature_model(model, device)
    wav, source = _as_waveform(audio_or_path)
    chosen = resolve_layers(layers, model.num_layers)
    T = math.ceil(wav.numel() / HOP_LENGTH)
    out = {layer: torch.empty(T, model.width) for layer in chosen}
    n = 0
    for chunk, feats in iter_features(wav, model, chosen, chunk_seconds, overlap_seconds, global_stats):
        for layer, f in zip(chosen, feats):
            out[layer][chunk.keep_start : chunk.keep_end] = f
        n += 1
    return FrameFeatures(out, wav.numel(), n, source=source)


@dataclass
class LayerAgreement:
    """Chunked vs whole-pass features of one layer, over all frames."""

    max_abs: float  # max |chunked - whole|
    rel_err: float  # ||chunked - whole|| / ||whole|| (Frobenius)
    min_cos: float  # lowest per-frame cosine similarity
    mean_cos: float


def chunking_error(
    audio: torch.Tensor | str | Path,
    model: FeatureModel | str | Path,
    layers: Sequence[int] | None = None,
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS,
    overlap_seconds: float | None = None,
    global_stats: bool = True,
) -> dict[int, LayerAgreement]:
    """How far chunked features are from one whole pass over the same audio, per layer."""
    if not isinstance(model, FeatureModel):
        model = load_feature_model(model)
    wav, _ = _as_waveform(audio)
    chunked = extract_features(wav, model, layers, chunk_seconds, overlap_seconds, global_stats=global_stats)
    whole_seconds = wav.numel() / SAMPLE_RATE + 1.0  # one window
    whole = extract_features(wav, model, layers, whole_seconds, 0.0)
    out = {}
    for layer, c in chunked.layers.items():
        w = whole.layers[layer]
        cos = F.cosine_similarity(c, w, dim=-1)  # (T,)
        out[layer] = LayerAgreement(
            float((c - w).abs().max()), float((c - w).norm() / w.norm()), float(cos.min()), float(cos.mean())
        )
    return out
