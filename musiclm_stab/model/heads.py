"""Prediction heads: acoustic (one cosine-logit head per EnCodec codebook) and musical (CQT regression)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from musiclm_stab.model.fp16_arith import fp32


class AcousticHeads(nn.Module):
    """HuBERT-style cosine logits against learned label embeddings, one set per codebook.

    [N, D] frame states -> [N, K, V] logits = cos(proj_k(x), e_k,v) / temperature.

    As MERT (mert_model.py ``compute_nce``): the cosine in fp32, brought back to the model's dtype, then
    divided by the temperature there: fp16 logits in an fp16 model, fp32 ones in an fp32 or autocast model.
    """

    def __init__(self, dim: int, num_codebooks: int, codebook_size: int, final_dim: int, temperature: float):
        super().__init__()
        self.num_codebooks, self.final_dim, self.temperature = num_codebooks, final_dim, temperature
        self.proj = nn.Linear(dim, final_dim * num_codebooks)
        self.label_embs = nn.Parameter(torch.empty(num_codebooks, codebook_size, final_dim))
        nn.init.uniform_(self.label_embs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N = x.shape[0]
        h = self.proj(x).view(N, self.num_codebooks, self.final_dim)  # (N, K, F)
        h = F.normalize(fp32(h), dim=-1)
        e = F.normalize(fp32(self.label_embs), dim=-1)  # (K, V, F)
        cosine = torch.einsum("nkf,kvf->nkv", h, e)  # (N, K, V), fp32
        return cosine.to(self.proj.weight.dtype) / self.temperature


class MusicalHead(nn.Module):
    """Linear regression of CQT magnitudes: [N, D] -> [N, n_bins]."""

    def __init__(self, dim: int, n_bins: int):
        super().__init__()
        self.proj = nn.Linear(dim, n_bins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)
