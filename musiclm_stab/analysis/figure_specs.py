"""The study's figures: which metric each draws, on which axes, and why (``figure_specs``; ``extra_figures``
for ``plot --extra``). analysis/plot.py draws them from run directories, one line per run:

  loss_scale.png             fp16 loss scale        y "Loss Scale", from 0, linear (fp16 runs only)
  loss.png                   training loss          y "Training Loss (bits)"
  grad_norm.png              grad norm before clip  y "Gradient Norm"
  musical_mlm_loss.png       CQT regression loss    y "Musical MLM Loss (MSE / ln 2)", log-scaled steps
  acoustic_mlm_loss_cb0.png  codebook-0 CE          y "Acoustic MLM Loss on Codebook-0 (bits)", log-scaled steps

The study's first seed figure is fairseq's fp16 loss scale as fairseq logs it, not a training loss: its y
axis "Loss Scale" runs 0-2 and its lines end near 0.05, which no training loss of the model reaches
(codebook 0 alone stays above 5.6 bits), while fairseq's scale is a power of two that halves at every
overflow (2^-4 = 0.0625, 2^-5 = 0.031: "0.03-0.07"). It is the scale itself, not divided by anything:
fairseq logs ``loss_scale`` raw (the window's last value, rounded to 4 decimals), and the seed's start at
1.5-2 could not be a scale divided by fairseq's initial 128, since MERT-330M's fp16 musical MSE caps the scale
at 32 (docs/FIDELITY.md, "musical loss"). So loss_scale.png draws the logged scale on the seed's axes:
linear, from 0, the seed's 0-2 with its 0.25 ticks when every curve fits, else widened to the curves (our
runs' scales live far above 2; ``--extra``'s loss_scale_log.png shows them log-scaled); with ``--window``,
each window's last value, as fairseq logs it. The training loss has a figure of its own, under its own name.

Losses are drawn in bits by default, the unit of the study's figures (fairseq logs every loss divided by
ln 2: the codebook-0 CE starts near log2(1024) = 10), or in nats (``--unit nats``); the axis label names
the unit. Each run's losses are converted from the unit it logged (``train.loss_unit``; nats for runs
made before that setting existed), so runs of either kind share a figure correctly. The MSE is not an
information quantity: "bits" there means divided by ln 2 as fairseq logs it, hence its label.

``--extra`` adds:

  acoustic_mlm_loss_codebooks.png  every codebook's CE, one panel each (2 x 4), log-scaled steps
  grad_norm_log.png                the gradient norm, log-scaled
  max_attn_logit.png               largest attention logit |q.k|/sqrt(d) over the layers (diagnostics_every)
  max_attn_logit_layers.png        the same, one panel per layer
  eval.png                         held-out loss, musical MLM loss, codebook-0 CE (train.eval_every), as
                                   evaluated: neither smoothed nor averaged over windows; linear steps,
                                   the evaluations evenly spaced (a log axis from step 0 would leave the
                                   span before the first evaluation, most of its width, empty)
  loss_scale_log.png               fp16's loss scale, log-scaled
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from musiclm_stab.analysis.curves import MAX_LOGIT, layer_count
from musiclm_stab.analysis.runs import RunMetrics
from musiclm_stab.config.sections import LOSS_UNITS

# The seed's first figure: fairseq's fp16 loss scale on a linear axis from 0 to 2, ticked every 0.25.
SEED_LOSS_SCALE_RANGE = (0.0, 2.0, 0.25)

CODEBOOK = re.compile(r"^acoustic_mlm_loss/cb(\d+)$")


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem
    metric: str  # metrics.jsonl key
    ylabel: str
    log_x: bool  # default x scale (the study draws the MLM losses against log-scaled steps)
    log_y: bool = False  # log-scaled values (the extra gradient-norm figure: spikes of 1e4 beside norms of 1)
    reduce: str = "mean"  # what --window keeps of each window: its mean, or its "last" value (the loss scale)
    optional: bool = False  # drawn only when some run logged it, and silently left out otherwise (fp16 only)
    # (bottom, top, tick step): the seed's y axis, kept while every curve fits in it, else widened to them
    seed_range: tuple[float, float, float] | None = None


def figure_specs(codebooks: Iterable[int] = (0,), unit: str = "bits") -> list[FigureSpec]:
    """The study's figures, in order; one acoustic figure per requested codebook. Loss axes name ``unit``."""
    if unit not in LOSS_UNITS:
        raise ValueError(f"loss unit {unit!r} is not valid; choose one of: {', '.join(LOSS_UNITS)}")
    mse = "MSE / ln 2" if unit == "bits" else "MSE"
    specs = [
        # The seed's "Loss Scale" figure is fairseq's fp16 loss scale (module docstring), not a loss.
        FigureSpec("loss_scale", "loss_scale", "Loss Scale", False, reduce="last", optional=True,
                   seed_range=SEED_LOSS_SCALE_RANGE),
        FigureSpec("loss", "loss", f"Training Loss ({unit})", False),
        FigureSpec("grad_norm", "grad_norm", "Gradient Norm", False),
        FigureSpec("musical_mlm_loss", "musical_mlm_loss", f"Musical MLM Loss ({mse})", True),
    ]
    for k in codebooks:
        if int(k) < 0:
            raise ValueError(f"codebook index must be >= 0, got {k}")
        specs.append(
            FigureSpec(
                f"acoustic_mlm_loss_cb{k}",
                f"acoustic_mlm_loss/cb{k}",
                f"Acoustic MLM Loss on Codebook-{k} ({unit})",
                True,
            )
        )
    return specs



def extra_figures(runs: Sequence[RunMetrics], unit: str) -> dict[str, tuple[list[FigureSpec], str]]:
    """The extra figures' panels: {file stem: (one FigureSpec per panel, figure title)}.

      acoustic_mlm_loss_codebooks  training CE of every codebook (2 x 4 panels for 8), log-scaled steps
      grad_norm_log                the gradient norm on a log scale (one blow-up no longer hides the rest)
      max_attn_logit               largest attention logit over all layers, |q.k|/sqrt(d)
      max_attn_logit_layers        the same per layer, one panel per layer
      eval                         held-out loss, musical MLM loss and codebook-0 CE (train.eval_every)
    """
    mse = "MSE / ln 2" if unit == "bits" else "MSE"
    codebooks = sorted({int(m.group(1)) for run in runs for k in run.series if (m := CODEBOOK.match(k))})
    out = {
        "acoustic_mlm_loss_codebooks": (
            [FigureSpec(f"cb{k}", f"acoustic_mlm_loss/cb{k}", f"Acoustic MLM Loss on Codebook-{k} ({unit})", True)
             for k in codebooks],
            f"Acoustic MLM loss per codebook (training, {unit})",
        ),
        "grad_norm_log": (
            [FigureSpec("grad_norm_log", "grad_norm", "Gradient Norm (log scale)", False, log_y=True)],
            "Gradient norm before clipping, log-scaled",
        ),
        "max_attn_logit": (
            [FigureSpec("max", MAX_LOGIT, "Max Attention Logit (all layers)", False)],
            "Largest attention logit |q.k|/sqrt(d) over all layers",
        ),
        "max_attn_logit_layers": (
            [FigureSpec(f"layer{i}", f"diag/max_attn_logit/layer{i}", f"Max Attention Logit, Layer {i}", False)
             for i in range(layer_count(runs))],
            "Largest attention logit |q.k|/sqrt(d) per layer",
        ),
        "loss_scale_log": (
            [FigureSpec("loss_scale_log", "loss_scale", "fp16 Loss Scale (log scale)", False, log_y=True,
                        reduce="last")],
            "fp16 loss scale (fairseq: halved on an overflow, doubled after a clean window)",
        ),
        "eval": (
            [FigureSpec("eval_loss", "eval/loss", f"Held-out Loss ({unit})", False),
             FigureSpec("eval_musical", "eval/musical_mlm_loss", f"Held-out Musical MLM Loss ({mse})", False),
             FigureSpec("eval_cb0", "eval/acoustic_mlm_loss/cb0", f"Held-out Acoustic MLM Loss on Codebook-0 ({unit})",
                        False)],
            "Held-out evaluation (fixed batches of the held-out tracks)",
        ),
    }
    return {name: (panels, title) for name, (panels, title) in out.items() if panels}
