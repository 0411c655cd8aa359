"""fairseq's dynamic loss scaler, as MERT trained with it (``train.fp16_mode=fairseq``).

The loss is multiplied by ``loss_scale`` before backward, so that small fp16 gradients do not flush to zero;
the update divides it out again. The rules (fairseq ``optim/dynamic_loss_scaler.py``, behaviour only):

- an overflow (the unscaled gradient norm is inf or NaN) skips the update; the scale is halved when the
  overflows since the last rescale are at least ``tolerance`` of the updates since then (with the default
  0.0: on every overflow);
- after ``scale_window`` updates since the last overflow (successful ones and overflowed ones counted
  alike), the scale doubles;
- a halving that would bring the scale to ``min_loss_scale`` or below keeps the previous scale and ends the
  run (``MinLossScaleError``; fairseq: "Minimum loss scale reached ... Your loss is probably exploding").

The state is a handful of numbers (the scale and the counters; the settings come from the config):
``state_dict`` is JSON, and a resumed run continues it exactly. (fairseq's own checkpoints keep only
``loss_scale``, so its counters restart on resume.)
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_DIVERGED = 3  # recipes/pretrain.py's exit status when the loss scale reached its floor (the run diverged)


class MinLossScaleError(RuntimeError):
    """The fp16 loss scale would fall to its floor: the gradients overflow at every scale (the run diverged)."""


@dataclass
class DynamicLossScaler:
    loss_scale: float = 128.0
    scale_window: int = 2000
    tolerance: float = 0.0
    min_loss_scale: float = 1e-4
    scale_factor: float = 2.0
    threshold: float | None = None  # never halve below this (fairseq's threshold_loss_scale; None: no bound)
    # counters: iterations (updates and overflows), and the iteration of the last overflow and last rescale
    iteration: int = 0
    last_overflow: int = -1
    last_rescale: int = -1
    overflows_since_rescale: int = 0

    def update(self) -> None:
        """After an update that did not overflow: double the scale at the end of a clean window."""
        if (self.iteration - self.last_overflow) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self.last_rescale = self.iteration
        self.iteration += 1

    def overflow(self) -> None:
        """After an update that overflowed (and was skipped): halve the scale, or raise MinLossScaleError
        when the halved scale would be at or below ``min_loss_scale`` (the scale is then left as it was)."""
        previous = self.loss_scale
        self.last_overflow = self.iteration
        self.overflows_since_rescale += 1
        if self.overflows_since_rescale / (self.iteration - self.last_rescale) >= self.tolerance:
            self.loss_scale /= self.scale_factor
            if self.threshold is not None:
                self.loss_scale = max(self.loss_scale, self.threshold)
            self.last_rescale = self.iteration
            self.overflows_since_rescale = 0
        if self.loss_scale <= self.min_loss_scale:
            self.loss_scale = previous
            raise MinLossScaleError(
                f"the fp16 loss scale would fall to {previous / self.scale_factor:g}, at or below "
                f"train.fp16_min_loss_scale={self.min_loss_scale:g}: the gradients overflow at every scale, "
                "the loss is probably exploding (fairseq: 'Minimum loss scale reached'). Lower optim.lr, clip "
                "gradients harder, or use a larger batch")
        self.iteration += 1

    STATE = ("loss_scale", "iteration", "last_overflow", "last_rescale", "overflows_since_rescale")

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATE:
            setattr(self, name, state[name])
