"""Multi-head self-attention with three interchangeable forms.

- ``sdpa``  fused ``scaled_dot_product_attention`` (fast default): what fairseq's attention runs on torch >= 2
            (``F.multi_head_attention_forward`` with ``need_weights=False`` calls SDPA). It never
            materialises the logits, so it can neither show nor suffer fp16 logit overflow.
- ``math``  the explicit arithmetic MERT's training ran: torch 1.12's ``F.multi_head_attention_forward`` (which
            fairseq's attention calls on every training step) computes ``q = q / sqrt(d)``, then
            ``bmm(q, k^T)`` in the compute dtype and a softmax in that dtype (its kernel accumulates in
            fp32). In fp16 the product overflows to inf once a *logit* passes 65504, and the softmax turns
            the row to NaN. (Dividing after the matmul instead overflows sqrt(d) times earlier.) On torch >= 2
            the same call takes the fused path, ``sdpa``.
- ``relax`` PB-relax (CogView): Q is divided by alpha*sqrt(d) *before* the matmul, so the product stays
            alpha times smaller than ``math``'s; the detached row max is subtracted in the compute dtype,
            the result multiplied by alpha in fp32 (an fp32 island, model/fp16_arith.py), then softmax:
                softmax(((Q / (alpha sqrt d)) K^T - rowmax) * alpha)
            Identical to ``math`` in exact arithmetic; finite where ``math`` overflows (up to alpha times
            larger logits).

MERT's relax (``attention_relax: 32.0`` in the 330M config; mert_model.py ``MultiheadAttention_extend``,
lines 1928-1945 at commit 391062e) is a different formula and never ran in training. With a = the
already-formed logits (q * d^-1/2) K^T in the compute dtype, it computes (a/alpha - rowmax(a/alpha)) * alpha,
then fp32 softmax: mathematically a - rowmax(a), a shift softmax ignores, applied *after* the matmul, so it
cannot prevent an overflow of a. And it sits on the explicit path only, after the fast path
(``F.multi_head_attention_forward``, line 1732) has already returned for every training call. So MERT-330M
trained with ``math`` (torch 1.12, its setup notes' version); our ``relax`` is the relaxation the study's
legend names, made to work.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.model_section import ATTENTION_FORMS
from musiclm_stab.model.fp16_arith import fp32, no_rounding
from musiclm_stab.model.norm_schemes import make_norm


def fast_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout``, but on CPU the keep mask is drawn as ``rand >= p`` (one fp32 uniform per element)
    instead of by ``bernoulli_``: the same distribution, about 2x faster here (benchmarks/README.md).
    On other devices it is ``F.dropout`` itself (fused kernels)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    keep = torch.rand(x.shape, dtype=torch.float32) >= p
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


def attention_probs(q: torch.Tensor, k: torch.Tensor, form: str, alpha: float = 32.0) -> torch.Tensor:
    """Attention probabilities of the explicit forms. q, k: [B, H, T, d] -> [B, H, T, T] (dtype of q)."""
    d = q.shape[-1]
    if form == "math":
        # torch 1.12's order: q divided by sqrt(d) first, the product and the softmax in the compute dtype
        logits = (q / math.sqrt(d)) @ k.transpose(-2, -1)
        return torch.softmax(logits, dim=-1).to(q.dtype)
    if form == "relax":
        logits = (q / (alpha * math.sqrt(d))) @ k.transpose(-2, -1)  # small: divided before the matmul
        # Row max subtracted in the compute dtype (every entry <= 0 and the max exactly 0), then times
        # alpha in fp32 (in fp16 a far-below-max entry times alpha could overflow to -inf: harmless, untidy).
        logits = fp32(logits - logits.amax(dim=-1, keepdim=True).detach()) * alpha
        return torch.softmax(logits, dim=-1).to(q.dtype)
    raise ConfigError(f"attention form {form!r} has no explicit probabilities; use math or relax")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: str, *, alpha: float = 32.0,
           dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """Attention output for q, k, v: [B, H, T, d] -> [B, H, T, d]."""
    if form not in ATTENTION_FORMS:
        raise ConfigError(f"model.attention={form!r} is not valid; choose one of: {', '.join(ATTENTION_FORMS)}")
    dropout = dropout if training else 0.0
    if form == "sdpa":
        if dropout == 0.0 or q.device.type != "cpu":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        # On CPU, SDPA with dropout falls back to the explicit product anyway, drawing its mask with the
        # slow bernoulli_: do the same product here with the faster mask (same result in distribution).
        # in fp32, as SDPA's own fallback computes it (bf16 probabilities were ~7x less accurate)
        logits = (fp32(q) @ fp32(k).transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        probs = torch.softmax(logits, dim=-1).to(v.dtype)
    else:
        probs = attention_probs(q, k, form, alpha)
    return fast_dropout(probs, dropout, training=True) @ v


class SelfAttention(nn.Module):
    """Multi-head self-attention on [B, T, D], with optional QK-norm and Sub-LN before out_proj."""

    def __init__(self, dim: int, num_heads: int, *, form: str = "sdpa", alpha: float = 32.0,
                 dropout: float = 0.0, qk_norm: bool = False, sublayer_norm: bool = False,
                 norm_type: str = "layernorm"):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.form, self.alpha, self.dropout = form, alpha, dropout
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.q_norm = make_norm(norm_type, self.head_dim) if qk_norm else None
        self.k_norm = make_norm(norm_type, self.head_dim) if qk_norm else None
        self.sub_norm = make_norm(norm_type, dim) if sublayer_norm else None
        self.record_max_logit = False  # diagnostics: set by the trainer at its logging interval
        self.max_logit: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        # (B, T, D) -> (B, H, T, d)
        q, k, v = (p(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.record_max_logit:
            with torch.no_grad(), no_rounding():  # the largest logit |q.k|/sqrt(d), in fp32: predicts divergence
                logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)
                self.max_logit = logits.abs().amax()
        out = attend(q, k, v, self.form, alpha=self.alpha, dropout=self.dropout, training=self.training)
        out = out.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        if self.sub_norm is not None:
            out = self.sub_norm(out)
        return self.out_proj(out)
