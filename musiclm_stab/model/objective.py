"""The masked-LM objective, written once, and its metrics by name.

Per batch, on the N masked frames only:

    loss = frame_weight * (sum_k CE_k + musical_weight * MSE(CQT)) + features_pen_weight * features_pen

CE_k is the cross-entropy of codebook k's head against the EnCodec codes, MSE the regression of the
clean crop's CQT, features_pen = mean(features^2) of the conv frontend over every frame. ``frame_weight``
is 1 on one process; with several, the trainer sets it to this process's share of the global batch's
masked frames (so the mean over processes is the global batch's mean). Training, evaluation and the
exported model's check all go through ``mlm_objective``; ``MLMOutput.metrics`` names every logged value.

Precision. The objective is an fp32 island in an fp16 model (``fp32`` of model/fp16_arith.py), as fairseq's
hubert criterion computes its cross-entropy on fp32 logits (MERT's ``get_logits`` casts them); but for the
musical MSE, which MERT computes in fp16 and then casts (``musical_loss``: this caps fairseq's loss scale).

Units. The objective is computed in nats (natural-log cross-entropy) whatever is logged. ``metrics(unit)``
reports every *loss* (``LOSS_METRICS``: loss, acoustic_mlm_loss and its per-codebook parts,
musical_mlm_loss, features_pen) in ``train.loss_unit``: ``bits`` divides each by ln 2, as fairseq's hubert
criterion logs every loss (hubert_criterion.py ``reduce_metrics``: ``/ math.log(2)``), so codebook CE
starts near log2(1024) = 10; ``nats`` reports them as computed. The MSE and the features penalty are not
information quantities; they are divided by ln 2 all the same, as fairseq does, so that ``loss`` stays
``acoustic + musical_weight * musical + features_pen_weight * features_pen`` in either unit. Accuracy and
mask_fraction are not losses and never change. ``features_pen`` is logged unweighted (fairseq's logged
``loss_features_pen`` is features_pen_weight times it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from musiclm_stab.model.fp16_arith import emulating, fp32, round_fp16

NATS_PER_BIT = math.log(2.0)
# The metrics that are losses, whose logged value depends on train.loss_unit (also with an "eval/" prefix).
LOSS_METRICS = re.compile(r"^(eval/)?(loss|acoustic_mlm_loss(/cb\d+)?|musical_mlm_loss|features_pen)$")


def is_loss_metric(name: str) -> bool:
    """Whether a metric name is a loss (changes with the unit): ``loss``, ``acoustic_mlm_loss/cb3``, ..."""
    return LOSS_METRICS.match(name) is not None


def unit_factor(from_unit: str, to_unit: str) -> float:
    """Multiply a loss logged in ``from_unit`` by this to have it in ``to_unit`` (units: bits, nats)."""
    per_nat = {"nats": 1.0, "bits": 1.0 / NATS_PER_BIT}
    for unit in (from_unit, to_unit):
        if unit not in per_nat:
            raise ValueError(f"loss unit {unit!r} is not valid; choose one of: bits, nats")
    return per_nat[to_unit] / per_nat[from_unit]


@dataclass
class MLMOutput:
    loss: torch.Tensor  # scalar: the training objective (with frame_weight)
    acoustic_mlm_loss: torch.Tensor  # scalar: sum over codebooks of the per-codebook CE (unweighted)
    acoustic_ce: torch.Tensor  # [K] CE per codebook
    acoustic_acc: torch.Tensor  # [K] accuracy per codebook
    musical_mlm_loss: torch.Tensor  # scalar MSE on CQT magnitudes
    features_pen: torch.Tensor  # scalar mean(features^2)
    mask_fraction: torch.Tensor  # scalar: share of frames masked
    frame_weight: torch.Tensor | float = 1.0  # see the module docstring

    def metrics(self, unit: str = "bits") -> dict[str, torch.Tensor]:
        """Every logged value by its metric name (detached fp32 scalars), the losses in ``unit`` (bits or
        nats; see the module docstring). Means over masked frames are multiplied by ``frame_weight``, so
        that their mean over processes is the global batch's."""
        w = self.frame_weight
        out = {"loss": self.loss, "acoustic_mlm_loss": self.acoustic_mlm_loss * w,
               "musical_mlm_loss": self.musical_mlm_loss * w, "features_pen": self.features_pen,
               "mask_fraction": self.mask_fraction}
        out.update({f"acoustic_mlm_loss/cb{k}": ce * w for k, ce in enumerate(self.acoustic_ce)})
        out.update({f"acoustic_acc/cb{k}": acc * w for k, acc in enumerate(self.acoustic_acc)})
        factor = unit_factor("nats", unit)
        return {name: value.detach().float() * (factor if is_loss_metric(name) else 1.0)
                for name, value in out.items()}


def objective(acoustic_mlm_loss, musical_mlm_loss, features_pen, musical_weight: float,
              features_pen_weight: float, frame_weight: torch.Tensor | float = 1.0):
    """The training objective from its parts (tensors or floats): the one place it is written."""
    return frame_weight * (acoustic_mlm_loss + musical_weight * musical_mlm_loss) + features_pen_weight * features_pen


def acoustic_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy per codebook on masked frames.

    logits: [N, K, V] for the N masked frames; targets: [N, K] codes.
    Returns (acoustic_mlm_loss = sum over codebooks of the mean CE, ce per codebook [K], accuracy [K]).
    """
    N, K, V = logits.shape
    if N == 0:
        zeros = logits.new_zeros(K)
        return zeros.sum(), zeros, zeros
    ce = F.cross_entropy(fp32(logits.reshape(N * K, V)), targets.reshape(N * K), reduction="none")
    ce_per_codebook = ce.view(N, K).mean(0)  # (K,)
    acc = fp32(logits.argmax(-1) == targets).mean(0)  # (K,)
    return ce_per_codebook.sum(), ce_per_codebook, acc


def musical_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE between predicted and true CQT magnitudes of the masked frames: [N, n_bins] each.

    In an fp16 model as fairseq runs it (real half tensors, or the ``fairseq`` emulation) the MSE is computed
    in fp16 and its scalar then cast to fp32, as MERT computes it (``nn.MSELoss`` on the fp16 prediction and
    target; the criterion takes ``p.float() * sample_size``). That cast matters in backward: the gradient
    reaching the fp16 MSE is loss_scale x masked frames x musical_weight, cast to fp16, so it is inf once
    that product passes 65504, the update overflows and the scaler halves. This caps fairseq's loss scale at
    the largest power of two below 65504 / (frames x weight): 32 for MERT-330M's ~1469 masked frames per GPU
    micro-batch. Elsewhere (fp32, bf16, amp, where autocast computes ``mse_loss`` in fp32) it is fp32.
    """
    if pred.shape[0] == 0:
        return fp32(pred.new_zeros(()))
    if emulating() == "fairseq" or (pred.dtype == torch.float16 and not torch.is_autocast_enabled(pred.device.type)):
        # the target cast to the model's dtype (fp16) as MERT's is, the MSE in fp16, then the scalar widened
        return fp32(F.mse_loss(pred, round_fp16(target.to(pred.dtype))))
    return F.mse_loss(fp32(pred), fp32(target))


def mlm_objective(acoustic_logits: torch.Tensor, codes: torch.Tensor, musical_pred: torch.Tensor,
                  cqt: torch.Tensor, features_pen: torch.Tensor, mask: torch.Tensor, musical_weight: float,
                  features_pen_weight: float, frame_weight: torch.Tensor | float = 1.0) -> MLMOutput:
    """The objective and its parts for one batch.

    acoustic_logits: [N, K, V] and musical_pred: [N, n_bins] of the N masked frames (``x[mask]``);
    codes: [B, K, T] EnCodec codes; cqt: [B, T, n_bins] CQT of the clean crop; mask: [B, T] bool.
    """
    ce_sum, ce, acc = acoustic_losses(acoustic_logits, codes.transpose(1, 2)[mask].long())  # targets (N, K)
    mus = musical_loss(musical_pred, cqt[mask])
    loss = objective(ce_sum, mus, features_pen, musical_weight, features_pen_weight, frame_weight)
    return MLMOutput(loss=loss, acoustic_mlm_loss=ce_sum, acoustic_ce=ce, acoustic_acc=acc, musical_mlm_loss=mus,
                     features_pen=features_pen, mask_fraction=fp32(mask).mean(), frame_weight=frame_weight)
