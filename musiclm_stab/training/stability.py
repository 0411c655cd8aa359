"""Stability tools used by the trainer: gradient-clipping rules, the loss-spike guard, diagnostics.

Only finite, non-overflow steps feed any statistic here: a skipped step (non-finite loss or gradient)
or an fp16 loss-scale overflow never moves a clipping threshold or a spike baseline.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator

import torch
from torch import nn

from musiclm_stab.config.sections import OptimConfig, TrainConfig
from musiclm_stab.model.attention import SelfAttention
from musiclm_stab.model.fp16_arith import no_rounding

FP16_MAX = 65504.0  # the largest finite fp16 value: headroom is max |x| / FP16_MAX (>= 1: an overflow)


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


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), no_rounding():  # a measurement, not a value of the fp16 model
        return t.detach().abs().amax().float()


def _rms(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), no_rounding():
        return t.detach().double().pow(2).mean().sqrt().float()


@contextlib.contextmanager
def record_activations(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While inside, record what locates a failure, in the dict it yields (device tensors; over several
    forward passes inside, the largest), named as the ``diag/`` metrics without the prefix:

    - ``frontend_rms``: the RMS of the conv frontend's output, what the transformer is fed (before the
      feature LayerNorm): near 0 the input is dead (the features penalty has shrunk the frontend to
      nothing) and the model can only predict the codes' marginal;
    - ``headroom/...``: the largest |value| of each place an fp16 model can overflow, as a fraction of
      fp16's largest value (>= 1 is an overflow, inf one that happened): ``frontend`` (the convolution
      outputs, the first before its GroupNorm, all layers), ``residual/layer{i}`` (the residual stream
      after encoder layer i), ``ffn/layer{i}`` (the feed-forward intermediate, fc1's output), ``heads``
      (the prediction heads' fp16 outputs: acoustic projection, musical prediction).

    The attention logits have their own probe (``record_attention_logits``); the largest gradient is
    ``grad_headroom`` after backward. Hooks only: the model computes exactly as without them."""
    inner = getattr(model, "module", model)  # under DDP
    out: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name: str, m: torch.Tensor) -> None:
        out[name] = torch.maximum(out[name], m) if name in out else m

    def on_input(name):
        return lambda module, args: keep(name, _max_abs(args[0]) / FP16_MAX)

    def on_output(name):
        return lambda module, args, result: keep(name, _max_abs(result) / FP16_MAX)

    frontend = getattr(inner, "frontend", None)
    if frontend is not None:
        hooks.append(frontend.register_forward_hook(lambda module, args, result: keep("frontend_rms", _rms(result))))
        for block in frontend.convs:
            # the module after the convolution reads its output (GroupNorm for the first layer, else GELU);
            # both implementations of the frontend (conv, gemm) call it
            hooks.append(block[1].register_forward_pre_hook(on_input("headroom/frontend")))
    encoder = getattr(inner, "encoder", None)
    if encoder is not None:
        for i, layer in enumerate(encoder.layers):
            hooks.append(layer.register_forward_hook(on_output(f"headroom/residual/layer{i}")))
            hooks.append(layer.ffn.fc1.register_forward_hook(on_output(f"headroom/ffn/layer{i}")))
    for head in ("acoustic", "musical"):
        proj = getattr(getattr(inner, head, None), "proj", None)
        if proj is not None:
            hooks.append(proj.register_forward_hook(on_output("headroom/heads")))
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


def grad_headroom(model: nn.Module) -> torch.Tensor | None:
    """The largest |gradient| held by the model's parameters after backward, as a fraction of fp16's
    largest value: in fairseq fp16 the model's own (scaled) fp16 gradients, so >= 1 (or inf) is the
    overflow that skips the update. None when no parameter has a gradient."""
    grads = [_max_abs(p.grad) for p in model.parameters() if p.grad is not None]
    return torch.stack(grads).amax() / FP16_MAX if grads else None
