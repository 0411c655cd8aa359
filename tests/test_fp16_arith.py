"""fp16 arithmetic (model/fp16_arith.py): rounding, the emulation's two policies, fp32 islands, and the
attention forms and a Pre-LN stack in fp16 as fairseq's --fp16 and torch amp compute them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from musiclm_stab.config import ModelConfig
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.attention import attend
from musiclm_stab.model.encoder import Encoder
from musiclm_stab.model.fp16_arith import Fp16Emulation, emulating, fp32, round_fp16, round_parameters_


def is_fp16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t, t.half().float()) or not torch.isfinite(t).all())


def test_round_fp16_is_the_half_cast():
    """round_fp16 gives fp16's values: 65504 kept, 65520 to inf, subnormals kept, below 2^-25 to 0."""
    x = torch.tensor([1.0 + 2**-12, 65504.0, 65519.0, 65520.0, -70000.0, 2**-24, 2**-26, 1 / 3])
    y = round_fp16(x)
    assert y.dtype == torch.float32
    assert y.tolist()[:4] == [1.0, 65504.0, 65504.0, float("inf")]
    assert y[4] == -float("inf") and y[5] == 2**-24 and y[6] == 0.0
    assert torch.equal(y, x.half().float())


def test_fairseq_emulation_rounds_every_value_and_gradient():
    """Under the fairseq policy every activation and every gradient of a small MLP holds an fp16 value."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    round_parameters_(net)
    x = torch.randn(8, 16) / 3
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o)) for m in net]
    with Fp16Emulation("fairseq"):
        assert emulating() == "fairseq"
        out = net(x)
        out.pow(2).sum().backward()
    assert emulating() is None
    for h in hooks:
        h.remove()
    assert len(seen) == 4 and all(is_fp16(t) for t in seen)
    assert all(is_fp16(p.grad) for p in net.parameters())
    plain = net(x)  # the same weights without rounding: the emulation changed the values
    assert not torch.equal(plain, out.detach())


def test_fp32_islands_are_wider_and_leave_rounded():
    """fp32(x) is float64 under the fairseq emulation (float32 otherwise), and an island's result brought back
    with .to(float32) is rounded; inside the island 70000 stays finite, as in an fp32 island on a GPU."""
    x = torch.full((3,), 300.0)
    assert fp32(x).dtype == torch.float32
    with Fp16Emulation("fairseq"):
        big = fp32(x).pow(2)  # 90000: over fp16's range, kept in the island
        assert big.dtype == torch.float64 and torch.isfinite(big).all()
        back = (big / 3).to(torch.float32)  # 30000: back in the fp16 model
        assert is_fp16(back) and back[0] == 30000.0
        assert torch.isinf((x * x)[0])  # the same product outside an island overflows


def test_amp_policy_rounds_matmuls_only():
    """Under the amp policy matrix products read and write fp16 (65504 + 32 overflows), elementwise sums
    stay fp32 (the residual stream of an autocast model)."""
    a = torch.full((1, 1), 60000.0)
    with Fp16Emulation("amp"):
        total = a + 10000.0  # fp32: 70000
        prod = (a * 2.0) @ torch.ones(1, 1)  # 120000 out of a matmul: inf
        near = torch.full((1, 1), 1.0 + 2**-13) @ torch.ones(1, 1)  # input rounded to 1.0
    assert total.item() == 70000.0
    assert torch.isinf(prod).all()
    assert near.item() == 1.0


def qk_with_logit(logit: float, d: int = 64, T: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [1, 1, T, d] whose largest attention logit (q.k / sqrt(d)) is ``logit``, fp16-exact inputs."""
    q = torch.zeros(1, 1, T, d)
    k = torch.zeros(1, 1, T, d)
    mag = (logit * d**0.5 / d) ** 0.5  # q = k = mag in every dimension: q.k = d * mag^2
    q[..., 0, :] = mag
    k[..., :, :] = mag * torch.linspace(0.5, 1.0, T)[:, None]
    v = torch.randn(1, 1, T, d, generator=torch.Generator().manual_seed(0))
    return round_fp16(q), round_fp16(k), round_fp16(v)


@pytest.mark.parametrize("policy", ["fairseq", "amp"])
def test_math_overflows_where_relax_matches_fp32(policy):
    """Attention logits of 2e5 (> 65504): the explicit product (math) is inf/NaN in fp16 under both policies,
    PB-relax stays finite and equals fp32 attention within fp16 precision; at 3e4 math is finite too."""
    q, k, v = qk_with_logit(2e5)
    reference = attend(q.double(), k.double(), v.double(), "math").float()
    with Fp16Emulation(policy):
        math_out = attend(q, k, v, "math")
        relax_out = attend(q, k, v, "relax", alpha=32.0)
    assert not torch.isfinite(math_out).all()
    assert torch.isfinite(relax_out).all()
    torch.testing.assert_close(relax_out, reference, atol=4e-3, rtol=4e-3)
    q, k, v = qk_with_logit(3e4)
    with Fp16Emulation(policy):
        assert torch.isfinite(attend(q, k, v, "math")).all()


def test_emulation_agrees_with_real_half_tensors():
    """The emulated fairseq fp16 model and the same model cast to half (torch's CPU half kernels) give the
    same loss within fp16 precision, and both differ from fp32 by about that precision."""
    torch.manual_seed(0)
    cfg = ModelConfig(size="tiny", attention="math", cqt_bins=84, cqt_bins_per_octave=12, dropout=0.0,
                      attention_dropout=0.0, feature_dropout=0.0)
    model = MusicMLM(cfg).eval()
    round_parameters_(model)
    wav = torch.randn(2, 320 * 40) * 0.1
    codes = torch.randint(0, 1024, (2, 8, 40))
    mask = torch.rand(2, 40, generator=torch.Generator().manual_seed(1)) < 0.5
    with torch.no_grad():
        fp32_loss = model(wav, wav, codes, mask).loss.item()
        with Fp16Emulation("fairseq"):
            emulated = model(wav, wav, codes, mask).loss.item()
        half = MusicMLM(cfg).eval()
        half.load_state_dict(model.state_dict())
        half.half()
        half.cqt.float()
        real = half(wav.half(), wav, codes, mask).loss.item()
    assert abs(emulated - real) < 2e-3 * abs(real)
    assert emulated != fp32_loss


def residual_growth_stack() -> Encoder:
    """A 4-layer Pre-LN encoder whose feed-forward output is ~4e4 per layer: the residual stream passes 65504."""
    cfg = ModelConfig(size="tiny", num_layers=4, norm_scheme="pre", attention="math", dropout=0.0,
                      attention_dropout=0.0, feature_dropout=0.0)
    encoder = Encoder(cfg).eval()
    with torch.no_grad():
        for layer in encoder.layers:
            layer.ffn.fc2.bias.fill_(4e4)  # each layer adds ~4e4 to the residual: 1.6e5 after four
    round_parameters_(encoder)
    return encoder


def test_prenorm_residual_overflows_in_fairseq_mode_not_in_amp():
    """A Pre-LN stack whose residual grows past 65504: fp16 everywhere (fairseq) overflows, autocast (amp)
    keeps the residual stream and LayerNorms in fp32 and stays finite."""
    encoder = residual_growth_stack()
    x = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with Fp16Emulation("fairseq"):
            fairseq_out = encoder(x)
        with Fp16Emulation("amp"):
            amp_out = encoder(x)
        fp32_out = encoder(x)
    assert not torch.isfinite(fairseq_out).all()
    assert torch.isfinite(amp_out).all() and torch.isfinite(fp32_out).all()


CROSS_CPU_SCRIPT = """
import json, torch
from musiclm_stab.model.fp16_arith import Fp16Emulation, round_fp16
torch.manual_seed(0)
w = round_fp16(torch.randn(64, 64))
x = round_fp16(torch.randn(8, 64))
out = {}
with Fp16Emulation("fairseq"):
    h = x
    for i in range(12):
        h = h @ w * 1.5
        if not torch.isfinite(h).all():
            break
out["first_inf_layer"] = i
out["inf_mask"] = (~torch.isfinite(h)).flatten().tolist()
out["capability"] = torch.backends.cpu.get_cpu_capability()
print(json.dumps(out))
"""


def test_emulated_overflow_is_the_same_on_every_cpu_kernel_set():
    """Under ATEN_CPU_CAPABILITY=default and the machine's best kernels a growing fp16 product overflows at
    the same layer and in the same elements (one emulation path, whatever the CPU)."""
    results = []
    for capability in ("default", None):
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-c", CROSS_CPU_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=600)  # an import of torch alone took 10-25 s on a busy 2-core machine
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0]["capability"].lower() == "default"
    assert results[0]["first_inf_layer"] == results[1]["first_inf_layer"] < 11
    assert results[0]["inf_mask"] == results[1]["inf_mask"] and any(results[0]["inf_mask"])



MERT_330M_FRAMES = 1469  # masked frames of one MERT-330M GPU micro-batch: 7 crops x 384 frames x 0.547


def mse_gradient_finite(scale: float, frames: int, emulate: bool) -> bool:
    """Backpropagate the musical MSE of ``frames`` masked frames times loss_scale x frames, as fairseq's
    criterion (``p.float() * sample_size``) and optimizer (``loss * loss_scale``) do; whether the fp16
    prediction's gradient is finite."""
    from musiclm_stab.model.objective import musical_loss

    gen = torch.Generator().manual_seed(0)
    target = torch.rand(frames, 336, generator=gen)
    pred = round_fp16(target + 0.1 * torch.randn(frames, 336, generator=gen))
    if not emulate:
        pred = pred.half()
    pred.requires_grad_(True)
    with Fp16Emulation("fairseq") if emulate else contextlib.nullcontext():
        (musical_loss(pred, target) * (scale * frames)).backward()
    return bool(torch.isfinite(pred.grad).all())


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "half"])
def test_fp16_musical_mse_caps_the_loss_scale_at_32_for_mert_330m_frames(emulate):
    """The musical MSE is computed in fp16 and its scalar cast, as MERT does: for MERT-330M's 1469 masked
    frames the gradient reaching it (scale x frames) is finite at loss scale 32 and inf at 64, so fairseq's
    scaler sits at 32 (emulated and on real half tensors alike)."""
    assert mse_gradient_finite(32, MERT_330M_FRAMES, emulate)
    assert not mse_gradient_finite(64, MERT_330M_FRAMES, emulate)
    assert mse_gradient_finite(64, 1000, emulate)  # 64 x 1000 < 65504: the cap follows the frame count


def test_musical_mse_stays_fp32_outside_fairseq_fp16():
    """In fp32 (and the amp policy, where autocast computes mse_loss in fp32) the MSE is an fp32 value: no
    cap, the same gradient at any scale."""
    from musiclm_stab.model.objective import musical_loss

    gen = torch.Generator().manual_seed(0)
    pred = torch.rand(MERT_330M_FRAMES, 8, generator=gen).requires_grad_(True)
    target = torch.rand(MERT_330M_FRAMES, 8, generator=gen)
    (musical_loss(pred, target) * 1e9).backward()
    assert torch.isfinite(pred.grad).all()
    with Fp16Emulation("amp"):
        out = musical_loss(pred, target)
    assert out.dtype == torch.float32 and torch.equal(out, torch.nn.functional.mse_loss(pred, target))


def test_positional_conv_weight_norm_keeps_its_norms_fp32_and_rounds_once():
    """The positional conv's weight norm under the fairseq emulation is g * v / ||v|| computed wider and
    rounded once to fp16 (CUDA's fused kernel keeps the norms fp32), not norms, ratio and product each
    rounded; in fp32 it is torch's weight_norm to the bit, with the same parameter names."""
    from musiclm_stab.model.encoder import PositionalConv

    torch.manual_seed(0)
    ours = PositionalConv(128, 128, 16)
    torchs = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(128, 128, 128, padding=64, groups=16), dim=2)
    torchs.load_state_dict(ours.conv.state_dict())
    assert torch.equal(ours.conv.weight, torchs.weight)
    round_parameters_(ours)
    g, v = (getattr(ours.conv.parametrizations.weight, f"original{i}").double() for i in (0, 1))
    rounded_once = round_fp16((v * (g / torch.norm_except_dim(v, 2, 2))).float())
    with Fp16Emulation("fairseq"):
        weight = ours.conv.weight
        weight.sum().backward()
    assert torch.equal(weight, rounded_once)
    assert all(is_fp16(p.grad) for p in ours.conv.parametrizations.weight.parameters())


def attention_grads(form: str, scale: float, emulate: bool = True):
    """Gradients of q, k, v of ``scale`` x a fixed weighted sum of attention's output (a loss scale times a
    loss), under the fairseq emulation or in float64."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(2, 4, 24, 16, generator=gen) for _ in range(4))
    if emulate:
        q, k, v, w = (round_fp16(t) for t in (q, k, v, w))
    else:
        q, k, v, w = (t.double() for t in (q, k, v, w))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with Fp16Emulation("fairseq") if emulate else contextlib.nullcontext():
        ((attend(q, k, v, form, alpha=32.0) * w).sum() * scale).backward()
    return [t.grad.double() / scale for t in (q, k, v)]


def test_relax_backward_in_fp16_equals_math_and_has_32x_less_headroom():
    """PB-relax's backward in fp16: at an ordinary loss scale its q, k, v gradients equal the exact ones as
    closely as math's do; but the gradient of its small logits (Q / (alpha sqrt d)) K^T is alpha = 32 times
    math's logit gradient and is held in fp16, so at a loss scale where that passes 65504 relax's gradients
    overflow while math's stay finite (here relax overflows from loss scale 512, math from 4096)."""
    exact = attention_grads("math", 1.0, emulate=False)
    for form in ("math", "relax"):
        for got, want in zip(attention_grads(form, 128.0), exact):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-2)
    math_grads, relax_grads = attention_grads("math", 1024.0), attention_grads("relax", 1024.0)
    assert all(torch.isfinite(g).all() for g in math_grads)
    assert not all(torch.isfinite(g).all() for g in relax_grads)


def random_mse_case(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 prediction, target and upstream gradient (float32 holding fp16 values) of a random shape, with
    residuals from 1e-5 (below the subnormal threshold of alpha x residual) to 10 and an upstream gradient
    of 1e-2 to 6e4 (a loss scale times masked frames)."""
    dims = int(torch.randint(1, 4, (), generator=gen))
    shape = tuple(int(n) for n in torch.randint(1, 70, (dims,), generator=gen))
    level = float(10 ** (torch.rand((), generator=gen) * 3 - 1))
    spread = float(10 ** (torch.rand((), generator=gen) * 6 - 5))
    target = round_fp16(level * torch.rand(shape, generator=gen))
    pred = round_fp16(target + spread * torch.randn(shape, generator=gen))
    grad = round_fp16(torch.tensor(float(10 ** (torch.rand((), generator=gen) * 6.7 - 2))))
    return pred, target, grad


def test_emulated_mse_kernels_are_torchs_half_kernels_to_the_bit():
    """mse_loss (none, mean) and mse_loss_backward (none, mean, sum) under the fairseq emulation equal torch's
    CPU half kernels bit for bit over 120 random shapes and magnitudes: each difference and product rounded
    to fp16, alpha = 2/numel converted to fp16 through float32, the mean one rounding of a float32 mean."""
    gen = torch.Generator().manual_seed(0)
    aten = torch.ops.aten
    for _ in range(120):
        pred, target, grad = random_mse_case(gen)
        with Fp16Emulation("fairseq"):
            losses = [aten.mse_loss(pred, target, r) for r in (0, 1)]
            grads = [aten.mse_loss_backward(g, pred, target, r) for g, r in ((grad.expand(pred.shape), 0),
                                                                               (grad, 1), (grad, 2))]
        half = pred.half(), target.half()
        assert all(torch.equal(x, aten.mse_loss(*half, r).float()) for x, r in zip(losses, (0, 1)))
        assert all(torch.equal(x, aten.mse_loss_backward(g.half(), *half, r).float())
                   for x, (g, r) in zip(grads, ((grad.expand(pred.shape), 0), (grad, 1), (grad, 2))))


def test_mert_330m_musical_gradient_is_zero_below_a_residual_of_1_136():
    """At MERT-330M's musical MSE size (1469 frames x 336 bins) alpha = 2/numel is the fp16 subnormal
    68 x 2^-24, and alpha x residual rounds to fp16 before the upstream gradient multiplies it: a residual
    of 0.007 gets exactly zero gradient, 0.0075 one 2^-24 step, 0.1 seven (6.8 exactly), emulated as on real
    half tensors; the emulation before computed 2/numel x residual x gradient in fp32 and rounded once."""
    frames, bins = MERT_330M_FRAMES, 336
    assert round_fp16(torch.tensor(2.0 / (frames * bins))).item() == 68 * 2**-24
    target = torch.zeros(frames, bins)
    pred = target.clone()
    pred[:, 0], pred[:, 1], pred[:, 2] = 0.007, 0.0075, 0.1
    pred = round_fp16(pred)
    grad_out = round_fp16(torch.tensor(32.0 * frames))  # loss scale 32 x masked frames, 47008 in fp16
    with Fp16Emulation("fairseq"):
        emulated = torch.ops.aten.mse_loss_backward(grad_out, pred, target, 1)
    real = torch.ops.aten.mse_loss_backward(grad_out.half(), pred.half(), target.half(), 1).float()
    assert torch.equal(emulated, real)
    assert (emulated[:, 0] == 0).all() and (emulated[:, 3:] == 0).all()
    for column, steps in ((1, 1), (2, 7)):
        assert (emulated[:, column] == round_fp16(torch.tensor(steps * 2**-24 * 47008.0))).all()
