"""Using an export made by ``musiclm-stab export``: the padding it needs, its heads and its losses.

Reading side only (transformers is not imported here): load an export with
``transformers.HubertModel.from_pretrained(OUT_DIR)``, pad the audio with ``pad_for_export``, and to recompute
the pretraining losses load the heads with ``load_heads`` and call ``mlm_losses``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from musiclm_stab.constants import HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.model.cqt import CQT
from musiclm_stab.model.frontend import PAD
from musiclm_stab.model.heads import AcousticHeads, MusicalHead
from musiclm_stab.model.objective import MLMOutput, mlm_objective

PAD_SAMPLES = PAD  # 40 zero samples on each side
SIDECAR = "musiclm_stab.json"
HEADS_FILE = "heads.safetensors"
PADDING_NOTE = (
    "Feed the audio padded with 40 zero samples on each side (musiclm_stab.export.pad_for_export): "
    "320*T padded samples + 80 give the T frames of the original model, frame t centred on "
    "sample 320*t + 160 of the unpadded audio."
)



def pad_for_export(wav: torch.Tensor | np.ndarray, align: bool = True) -> torch.Tensor | np.ndarray:
    """Pad a waveform [..., S] for the exported HubertModel: 40 zeros each side -> [..., S' + 80].

    With ``align`` the end is first zero-padded to S' = 320*ceil(S/320), so the exported model gives
    ceil(S/320) frames, the frames ``musiclm_stab.export.features`` gives for the same audio.
    """
    S = wav.shape[-1]
    extra = (-S) % HOP_LENGTH if align else 0
    if isinstance(wav, np.ndarray):
        widths = [(0, 0)] * (wav.ndim - 1) + [(PAD_SAMPLES, PAD_SAMPLES + extra)]
        return np.pad(wav, widths)
    return torch.nn.functional.pad(wav, (PAD_SAMPLES, PAD_SAMPLES + extra))


@dataclass
class ExportedHeads:
    """The prediction heads saved with an export, to recompute the MLM losses from it."""

    acoustic: AcousticHeads  # [N, D] -> [N, K, V] cosine logits
    musical: MusicalHead  # [N, D] -> [N, n_bins]
    cqt: CQT  # target of the musical head: [B, S] -> [B, T, n_bins]
    musical_weight: float
    features_pen_weight: float


def load_heads(out_dir: str | Path) -> ExportedHeads:
    """The acoustic and musical heads (and the CQT that makes the musical target) of an export."""
    out_dir = Path(out_dir)
    meta = json.loads((out_dir / SIDECAR).read_text())
    h, width = meta["heads"], meta["model_config"]["width"]
    acoustic = AcousticHeads(width, h["num_codebooks"], h["codebook_size"], h["final_dim"], h["logit_temp"])
    musical = MusicalHead(width, h["cqt_bins"])
    state = load_file(str(out_dir / h["file"]))
    acoustic.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("acoustic.")})
    musical.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("musical.")})
    cqt = CQT(SAMPLE_RATE, fmin=h["cqt_fmin"], n_bins=h["cqt_bins"], bins_per_octave=h["cqt_bins_per_octave"])
    return ExportedHeads(acoustic.eval(), musical.eval(), cqt, h["musical_weight"], h["features_pen_weight"])


def mlm_losses(
    hf_model,
    heads: ExportedHeads,
    wav: torch.Tensor,
    clean_wav: torch.Tensor,
    codes: torch.Tensor,
    mask: torch.Tensor,
) -> MLMOutput:
    """The masked-LM objective of ``MusicMLM.forward`` (model/objective.py), from an exported model and its heads.

    wav, clean_wav: [B, S] (S a multiple of 320, unpadded); codes: [B, K, T]; mask: [B, T] bool.
    """
    padded = pad_for_export(wav, align=False)
    feats = hf_model.feature_extractor(padded)  # (B, C, T): the conv features, before their LayerNorm
    pen = feats.float().pow(2).mean()
    x = hf_model(padded, mask_time_indices=mask).last_hidden_state  # (B, T, D)
    cqt = heads.cqt(clean_wav)  # (B, T, n_bins)
    h = x[mask]  # (N, D)
    return mlm_objective(heads.acoustic(h), codes, heads.musical(h), cqt, pen, mask, heads.musical_weight,
                         heads.features_pen_weight)
