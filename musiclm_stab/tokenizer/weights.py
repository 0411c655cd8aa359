"""EnCodec 24 kHz for tokenizing: loading the pretrained model or local weights, and their identity.

The default is the pretrained model, which the ``encodec`` package downloads at first use. Offline,
``load_encodec(None)`` raises ``WeightsUnavailable`` with the ways to proceed; it never falls back.

Local weights are for offline work and tests. A fresh ``encodec_model_24khz(pretrained=False)`` has
all-zero codebooks (EnCodec fits them by k-means on the first training batch), so every code would
be 0. ``fit.make_local_weights`` keeps the seeded random encoder and fits the 8 residual codebooks used at
6 kbps with a fast Lloyd k-means on encoder frames of the given audio. A random encoder with fitted
codebooks still yields usable self-supervised targets (cf. BEST-RQ), but they are not the pretrained
model's codes: the weights are identified by a sha256 that travels with every tokenized dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from musiclm_stab.constants import CODEBOOK_SIZE, FRAME_RATE, HOP_LENGTH, NUM_CODEBOOKS, SAMPLE_RATE

if TYPE_CHECKING:
    from encodec import EncodecModel


BANDWIDTH = 6.0  # kbps: 8 codebooks of 1024 codes at 75 Hz

PRETRAINED_CHECKPOINT = "encodec_24khz-d7cc33bc.th"

PRETRAINED_URL = f"https://dl.fbaipublicfiles.com/encodec/v0/{PRETRAINED_CHECKPOINT}"


class WeightsUnavailable(RuntimeError):
    """The pretrained EnCodec weights could not be had (no internet and no cached checkpoint)."""


def _new_model(pretrained: bool) -> EncodecModel:
    from encodec import EncodecModel  # imported only when a model is built

    with warnings.catch_warnings():  # encodec uses the deprecated torch.nn.utils.weight_norm
        warnings.simplefilter("ignore", FutureWarning)
        return EncodecModel.encodec_model_24khz(pretrained=pretrained)


def seeded_random_model(seed: int) -> EncodecModel:
    """The untrained EnCodec 24 kHz model drawn from ``seed``, bit for bit the same on every CPU.

    EnCodec's modules initialise themselves as torch does by default (``kaiming_uniform_`` and
    ``uniform_(-b, b)``, then weight norm's magnitudes as float32 norms), and those float32 kernels round
    differently on AVX2, AVX-512 and plain CPUs. So every parameter is drawn again here with the same
    distributions, in float64 arithmetic that rounds the same everywhere (one IEEE operation at a time),
    and rounded to float32 once: convolutions U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases,
    the LSTM U(-1/sqrt(hidden), 1/sqrt(hidden)), and weight norm's magnitudes ``weight_g`` = |weight_v|.
    The caller's RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):  # EnCodec's own init draws from the global RNG: leave it be
        model = _new_model(pretrained=False)
    g = torch.Generator().manual_seed(seed)

    def uniform(p: torch.Tensor, bound: float) -> None:
        u = torch.rand(p.shape, dtype=torch.float64, generator=g)
        p.copy_((u * 2.0 - 1.0) * bound)

    drawn: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                v = getattr(module, "weight_v", None)
                weight = v if v is not None else module.weight
                fan_in = weight.shape[1] * math.prod(weight.shape[2:])  # as torch's default conv init
                uniform(weight, fan_in**-0.5)
                drawn.add(id(weight))
                if module.bias is not None:
                    uniform(module.bias, fan_in**-0.5)
                    drawn.add(id(module.bias))
                if v is not None:  # weight_norm(dim=0): one magnitude per output channel
                    v64 = v.double()
                    module.weight_g.copy_(v64.pow(2).sum(dim=tuple(range(1, v.dim())), keepdim=True).sqrt())
                    drawn.add(id(module.weight_g))
            elif isinstance(module, torch.nn.LSTM):
                for p in module.parameters():
                    uniform(p, module.hidden_size**-0.5)
                    drawn.add(id(p))
    missed = [name for name, p in model.named_parameters() if id(p) not in drawn]
    assert not missed, f"parameters of EnCodec not drawn by seeded_random_model: {missed}"
    return model.eval()


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict: key names, dtypes, shapes and raw bytes, in sorted key order.

    Identical weights give the identical hash wherever they came from (download, file, memory).
    """
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_info(model: EncodecModel, weights: str, weights_file: str | Path | None) -> dict[str, Any]:
    return {
        "model": "encodec_24khz",
        "weights": weights,
        "weights_file": Path(weights_file).name if weights_file else None,
        "weights_sha256": weights_sha256(model.state_dict()),
        "bandwidth": BANDWIDTH,
        "sample_rate": SAMPLE_RATE,
        "frame_rate": FRAME_RATE,
        "hop_length": HOP_LENGTH,
        "num_codebooks": NUM_CODEBOOKS,
        "codebook_size": CODEBOOK_SIZE,
    }


def _how_to() -> str:
    checkpoints = Path(torch.hub.get_dir()) / "checkpoints"
    return (
        "To proceed, do one of:\n"
        "  1. connect to the internet and run again (the checkpoint is then cached for offline use);\n"
        f"  2. place {PRETRAINED_CHECKPOINT} (from {PRETRAINED_URL}) in {checkpoints}/;\n"
        "  3. pass --weights FILE with a local EnCodec 24 kHz state dict, e.g. one made by\n"
        "     `musiclm-stab make-weights AUDIO_DIR FILE` (a random encoder with codebooks fitted to your\n"
        "     audio: NOT the pretrained model; the tokenized data records which weights were used)."
    )


def load_encodec(weights: str | Path | None = None) -> tuple[EncodecModel, dict[str, Any]]:
    """EnCodec 24 kHz at 6 kbps (8 codebooks) in eval mode on the CPU, and its tokenizer info.

    ``weights=None`` loads the pretrained model (raises WeightsUnavailable when it cannot be had);
    ``weights=FILE`` loads a local state dict strictly. The info dict identifies the weights by sha256.
    """
    if weights is None:
        try:
            model = _new_model(pretrained=True)
        except OSError as e:  # URLError, timeouts, DNS failures, unwritable cache
            raise WeightsUnavailable(
                f"Could not download the pretrained EnCodec 24 kHz weights ({type(e).__name__}: {e}).\n"
                + _how_to()
            ) from e
        except Exception as e:  # a corrupt or partial checkpoint in the cache
            cached = Path(torch.hub.get_dir()) / "checkpoints" / PRETRAINED_CHECKPOINT
            raise WeightsUnavailable(
                f"Could not load the pretrained EnCodec 24 kHz weights ({type(e).__name__}: {e}); "
                f"if {cached} exists it may be corrupt: delete it.\n" + _how_to()
            ) from e
        info = model_info(model, "pretrained", None)
    else:
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"EnCodec weights file {path} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{path} is not a readable torch state dict: {e}") from None
        model = _new_model(pretrained=False)
        try:
            model.load_state_dict(state, strict=True)
        except (RuntimeError, TypeError, AttributeError) as e:
            raise ValueError(f"{path} is not an EnCodec 24 kHz state dict: {e}") from None
        for k, layer in enumerate(model.quantizer.vq.layers[:NUM_CODEBOOKS]):
            if not layer._codebook.embed.any():
                raise ValueError(
                    f"{path}: codebook {k} is all zeros, so every code would be 0; make weights with "
                    "`musiclm-stab make-weights AUDIO_DIR FILE`"
                )
        info = model_info(model, "local", path)
        sidecar = _sidecar(path)  # written by make_local_weights; trusted only if it describes these weights
        if sidecar.is_file():
            made = json.loads(sidecar.read_text())
            if made.get("weights_sha256") == info["weights_sha256"] and made.get("provenance"):
                info["weights_provenance"] = made["provenance"]
    model.set_target_bandwidth(BANDWIDTH)
    return model.eval(), info


def prepare_for_inference(model: EncodecModel) -> EncodecModel:
    """Fold weight norm into plain conv weights, in place: the same outputs, bit for bit, without
    recomputing every weight at every forward (~0.2 s per call on a CPU). Compute the weights' sha256
    before this (``load_encodec`` does): the state dict's keys change."""
    for module in model.modules():
        if hasattr(module, "weight_g") and hasattr(module, "weight_v"):
            torch.nn.utils.remove_weight_norm(module)
    return model.eval()


def _sidecar(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.name + ".json")
