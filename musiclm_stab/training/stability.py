"""Stability tools used by the trainer: gradient-clipping rules, the loss-spike guard, diagnostics.

Only finite, non-overflow steps feed any statistic here: a skipped step (non-finite loss or gradient)
or an fp16 loss-scale overflow never moves a clipping threshold or a spike baseline.
"""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import nn

from musiclm_stab.config import OptimConfig, TrainConfig
from musiclm_stab.model.attention import SelfAttention


class GradClipper:
    """The clipping threshold for the next update.

    - ``fixed``:    always ``optim.clip_grad``.
    - ``zclip``:    ZClip-style z-score rule: EMA mean m and variance v of the gradient norm (decay
                    ``zclip_alpha``); threshold m + ``zclip_z`` * sqrt(v), i.e. clip norms that are
                    outliers against their own recent history.
    - ``autoclip``: AutoClip: threshold = the ``autoclip_percentile``-th percentile of all norms seen.
    Adaptive rules use ``optim.clip_grad`` until ``clip_warmup`` finite norms have been seen.
    """

    def __init__(self, cfg: OptimConfig):
        self.cfg = cfg
        self.count = 0
        self.mean, self.var = 0.0, 0.0
        self.history: list[float] = []

    def threshold(self) -> float:
        cfg = self.cfg
        if cfg.clip_mode == "fixed" or self.count < cfg.clip_warmup:
            return cfg.clip_grad
        if cfg.clip_mode == "zclip":
            return self.mean + cfg.zclip_z * math.sqrt(max(self.var, 0.0))
        ordered = sorted(self.history)
        return ordered[min(len(ordered) - 1, int(cfg.autoclip_percentile / 100 * len(ordered)))]

    def observe(self, norm: float) -> None:
        """Record the pre-clip norm of a finite, applied update."""
        if not math.isfinite(norm):
            return
        self.count += 1
        if self.cfg.clip_mode == "autoclip":
            self.history.append(norm)
        elif self.count == 1:
            self.mean, self.var = norm, 0.0
        else:
            a = self.cfg.zclip_alpha
            delta = norm - self.mean
            self.mean += (1 - a) * delta
            self.var = a * (self.var + (1 - a) * delta * delta)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = state["count"], state["mean"], state["var"]
        self.history = list(state["history"])


class SpikeGuard:
    """PaLM-style loss-spike detection against a running baseline of recent good losses.

    A step's loss is a spike when it exceeds the mean of the last ``spike_window`` losses by more than
    ``spike_z`` standard deviations *and* by more than ``spike_min_rel`` of the mean. The trainer then
    rolls back to the newest checkpoint before the spike and goes on with the data after the spike,
    so the batches in between (the offending ones) are skipped.
    """

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.window: deque[float] = deque(maxlen=cfg.spike_window)

    def is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False  # non-finite steps are skipped by the update rule, not rolled back
        if len(self.window) < self.cfg.spike_warmup:
            return False
        mean = sum(self.window) / len(self.window)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
        return loss - mean > self.cfg.spike_z * std and loss - mean > self.cfg.spike_min_rel * abs(mean)

    def observe(self, loss: float) -> None:
        if math.isfinite(loss):
            self.window.append(loss)

    def reset(self) -> None:
        self.window.clear()

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        self.window = deque(state["window"], maxlen=self.cfg.spike_window)


def attention_modules(model: nn.Module) -> list[SelfAttention]:
    return [m for m in model.modules() if isinstance(m, SelfAttention)]


def record_attention_logits(model: nn.Module, on: bool) -> None:
    """Switch the per-layer max-attention-logit probe on or off (costs one extra QK^T per layer)."""
    for m in attention_modules(model):
        m.record_max_logit = on
        if not on:
            m.max_logit = None


def layer_diagnostics(model: nn.Module, grad_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Per-layer max attention logit (if recorded) and per-layer gradient norm, as device tensors.

    Call after backward, before the optimizer step; ``grad_scale`` is the fp16 loss scale still in the
    gradients (1 otherwise). The caller moves the values to the host at logging time.
    """
    out: dict[str, torch.Tensor] = {}
    for i, m in enumerate(attention_modules(model)):
        if m.max_logit is not None:
            out[f"diag/max_attn_logit/layer{i}"] = m.max_logit.float()
    encoder = getattr(model, "encoder", None)
    if encoder is not None:
        for i, layer in enumerate(encoder.layers):
            grads = [p.grad.float().norm() for p in layer.parameters() if p.grad is not None]
            if grads:
                out[f"diag/grad_norm/layer{i}"] = torch.stack(grads).norm() / grad_scale
    return out
