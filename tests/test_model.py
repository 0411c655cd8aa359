"""The dual-stream model: sizes, frame alignment, losses on masked frames only, per-codebook losses."""

import math

import pytest
import torch

from musiclm_stab.config import ModelConfig
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM, count_parameters
from musiclm_stab.model.frontend import ConvFrontend
from musiclm_stab.model.objective import acoustic_losses

TINY = dict(size="tiny", cqt_bins=84, cqt_bins_per_octave=12, final_dim=32, dropout=0.0,
            attention_dropout=0.0, feature_dropout=0.0)


def _inputs(B=2, T=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    wav = torch.randn(B, 320 * T, generator=g) * 0.1
    codes = torch.randint(0, 1024, (B, 8, T), generator=g)
    mask = span_mask(B, T, 0.8, 5, g)
    return wav, codes, mask


def _encoder_params(model):
    return count_parameters(model) - count_parameters(model.acoustic) - count_parameters(model.musical)


@pytest.mark.parametrize("size, final_dim, encoder, total", [("base", 64, 94_371_712, 95_548_112),
                                                              ("large", 128, 315_428_992, 317_871_568)])
def test_parameter_counts(size, final_dim, encoder, total):
    """base is MERT-95M's size (95.5M parameters with its heads: final_dim 64, 336 CQT bins) and large
    MERT-330M's (317.9M with final_dim 128; 315.4M without heads, as HuBERT counts an encoder)."""
    with torch.device("meta"):  # shapes only: the counts without drawing 318M initial values
        model = MusicMLM(ModelConfig(size=size))
    assert model.cfg.final_dim == final_dim and model.cfg.cqt_bins == 336
    assert (_encoder_params(model), count_parameters(model)) == (encoder, total)


@pytest.mark.parametrize("T", [1, 7, 375])
def test_frontend_gives_one_frame_per_320_samples(T):
    """S = 320*T samples give exactly T frames, aligned with the codes [K, T]."""
    assert ConvFrontend(16)(torch.randn(2, 320 * T)).shape == (2, T, 16)


def test_frontend_rejects_unaligned_length():
    """A waveform that is not a multiple of the hop is refused, with the length named."""
    with pytest.raises(ValueError, match="1000 is not a multiple of 320"):
        ConvFrontend(16)(torch.randn(1, 1000))


@pytest.mark.parametrize("scheme", ["pre", "post"])
def test_forward_backward_finite(scheme):
    """pre and post: forward gives finite losses, backward gives finite gradients on every parameter."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(norm_scheme=scheme, **TINY))
    wav, codes, mask = _inputs()
    out = model(wav, wav, codes, mask)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []


def test_acoustic_loss_is_sum_of_codebook_losses():
    """acoustic_mlm_loss is the sum of the per-codebook CEs, each a plain cross-entropy."""
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(50, 8, 1024, generator=g), torch.randint(0, 1024, (50, 8), generator=g)
    total, per_cb, acc = acoustic_losses(logits, targets)
    ref = torch.stack([torch.nn.functional.cross_entropy(logits[:, k], targets[:, k]) for k in range(8)])
    torch.testing.assert_close(per_cb, ref)
    torch.testing.assert_close(total, ref.sum())
    assert acc.shape == (8,)


def test_losses_use_masked_frames_only():
    """Changing targets on unmasked frames leaves every loss unchanged; on a masked frame it does not."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(**TINY)).eval()
    wav, codes, mask = _inputs(B=1)
    base = model(wav, wav, codes, mask)
    other = codes.clone()
    other[:, :, ~mask[0]] = (codes[:, :, ~mask[0]] + 1) % 1024
    same = model(wav, wav, other, mask)
    torch.testing.assert_close(same.acoustic_ce, base.acoustic_ce)
    torch.testing.assert_close(same.loss, base.loss)
    t = int(mask[0].nonzero()[0])
    other[:, 3, t] = (codes[:, 3, t] + 1) % 1024
    changed = model(wav, wav, other, mask)
    assert not torch.allclose(changed.acoustic_ce[3], base.acoustic_ce[3])
    torch.testing.assert_close(changed.acoustic_ce[:3], base.acoustic_ce[:3])


def test_per_codebook_losses_reported_separately():
    """Corrupting one codebook's targets raises that codebook's loss only."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(**TINY)).eval()
    wav, codes, mask = _inputs(B=1)
    with torch.no_grad():
        logits = model.acoustic(model.encode(wav, mask)[0][mask])
    best = logits.argmax(-1).T.unsqueeze(0)  # (1, K, N): targets the model already predicts
    targets = codes.clone()
    targets[:, :, mask[0]] = best
    good = model(wav, wav, targets, mask)
    assert torch.all(good.acoustic_acc == 1.0)
    targets[:, 5, mask[0]] = (best[:, 5] + 1) % 1024
    bad = model(wav, wav, targets, mask)
    assert bad.acoustic_ce[5] > good.acoustic_ce[5]
    torch.testing.assert_close(bad.acoustic_ce[:5], good.acoustic_ce[:5])
    assert bad.acoustic_acc[5] == 0.0


def test_musical_target_is_cqt_of_clean_waveform():
    """The musical loss regresses the CQT of the clean crop, not of the noise-mixed input."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(**TINY)).eval()
    wav, codes, mask = _inputs(B=1)
    noisy = wav + 0.3 * torch.randn_like(wav)
    out = model(noisy, wav, codes, mask)
    with torch.no_grad():
        pred = model.musical(model.encode(noisy, mask)[0][mask])
        from_clean = torch.nn.functional.mse_loss(pred, model.cqt(wav)[mask])
        from_noisy = torch.nn.functional.mse_loss(pred, model.cqt(noisy)[mask])
    torch.testing.assert_close(out.musical_mlm_loss, from_clean)
    assert not torch.allclose(from_clean, from_noisy)


def _loss_and_grads(model, batch, seed=0):
    torch.manual_seed(seed)  # the same dropout masks in both runs
    model.zero_grad(set_to_none=True)
    loss = model(*batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch():
    wav, codes, mask = _inputs()
    return wav, wav, codes, mask


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    """Recomputing each layer in backward (with dropout on) changes neither the loss nor any gradient;
    the layers really are run twice (forward, then again in backward)."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(size="tiny")).train()
    calls = []
    model.encoder.layers[0].attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    batch = _batch()
    loss, grads = _loss_and_grads(model, batch)
    assert len(calls) == 1
    model.encoder.checkpoint_layers = True
    loss_ckpt, grads_ckpt = _loss_and_grads(model, batch)
    assert len(calls) == 3
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_compiled_frontend_and_encoder_match_eager(monkeypatch):
    """train.compile: frontend and encoder compiled in place keep their parameter names and give the
    eager loss and gradients up to float rounding (dropout off: compiled kernels draw their own masks)."""
    # Inductor's FX graph cache key leaves out the ISA chosen by ATEN_CPU_CAPABILITY: a kernel cached by
    # an avx2 run fails to compile under =default. Compile afresh so the test holds on any capability.
    monkeypatch.setattr("torch._inductor.config.fx_graph_cache", False)
    # Kernels compiled in this process: no pool of compile workers to start (each imports torch), same kernels.
    monkeypatch.setattr("torch._inductor.config.compile_threads", 1)
    torch.manual_seed(0)
    # One encoder layer: the loop over layers is traced (unrolled) all the same, and a second identical layer
    # only adds its nodes to lower and schedule (2 graphs either way, no graph break, no recompile).
    cfg = ModelConfig(size="tiny", num_layers=1, dropout=0.0, attention_dropout=0.0, feature_dropout=0.0)
    eager = MusicMLM(cfg).train()
    compiled = MusicMLM(cfg).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.frontend.compile()
    compiled.encoder.compile()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    batch = _batch()
    loss, grads = _loss_and_grads(eager, batch)
    loss_c, grads_c = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_metrics_in_bits_and_nats():
    """MLMOutput.metrics: in bits every loss (total, acoustic and per codebook, musical, features penalty) is
    the nats value / ln 2, as fairseq logs losses; accuracy and mask share are unchanged; the features
    penalty is unweighted, so loss = acoustic + musical_weight * musical + 10 * features_pen in either unit."""
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(**TINY)).eval()
    out = model(*_batch())
    bits, nats = out.metrics("bits"), out.metrics("nats")
    assert bits.keys() == nats.keys()
    for name in bits:
        factor = 1 / math.log(2) if name.split("/")[0] in ("loss", "acoustic_mlm_loss", "musical_mlm_loss",
                                                           "features_pen") else 1.0
        torch.testing.assert_close(bits[name], nats[name] * factor, msg=name)
    for m in (bits, nats):
        torch.testing.assert_close(m["loss"], m["acoustic_mlm_loss"] + m["musical_mlm_loss"] + 10 * m["features_pen"])
    assert float(nats["features_pen"]) == float(out.features_pen.detach())  # unweighted
    with pytest.raises(ValueError, match="choose one of: bits, nats"):
        out.metrics("dB")
