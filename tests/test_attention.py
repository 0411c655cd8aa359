"""Attention forms: sdpa / math / relax agree in fp32; in fp16 math overflows where relax does not.

``math`` is the reference's arithmetic (fairseq: q scaled by 1/sqrt(d) before Q K^T), so it overflows fp16
once a *logit* passes 65504; the inputs here are sized for that. fp16 matmul and softmax run on the CPU in
this torch (2.14.1), as does ``torch.autocast("cpu", dtype=torch.float16)``, so the fp16 behaviour is
tested here on CPU tensors.
"""

import math

import pytest
import torch

from musiclm_stab.config import ConfigError
from musiclm_stab.model.attention import SelfAttention, attend, attention_probs, fast_dropout

FP16_MAX = torch.finfo(torch.float16).max  # 65504
FORMS = ("sdpa", "math", "relax")


def _qkv(B=2, H=3, T=11, d=16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(B, H, T, d, generator=g) for _ in range(3))


def _mert_relax(q, k, alpha=32.0):
    """MERT's relax branch (mert_model.py 1928-1945, never run in training), written out: the logits
    a = (q * d^-1/2) K^T formed first in the compute dtype, then (a / alpha - rowmax(a / alpha)) * alpha,
    then an fp32 softmax."""
    a = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    relaxed = a / alpha
    return torch.softmax(((relaxed - relaxed.amax(dim=-1, keepdim=True)) * alpha).float(), dim=-1)


def _sign_inputs(seed=0, q_scale=128, k_scale=80):
    """q, k, v in fp16 whose relax arithmetic is exact, with logits q.k / sqrt(d) past the fp16 maximum.

    d = 64, alpha = 32, so alpha*sqrt(d) = 256. q = 128 * signs, k = 80 * signs (duplicated keys give
    ties): q.k = 10240 * m with m an even integer in [-64, 64], so logits q.k / 8 = 1280 * m reach 81920 >
    65504. In relax, q / 256 = 0.5 * signs and (q / 256).k = 40 * m, integers up to 2560: exact in fp16.
    Logit gaps between distinct m are >= 2 * 1280 = 2560, so every row is uniform over its tied keys.
    """
    g = torch.Generator().manual_seed(seed)
    d, T = 64, 12

    def signs(n):
        return torch.randint(0, 2, (n, d), generator=g).float() * 2 - 1

    patterns = signs(5)
    keys = patterns[torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 4, 4, 4, 0])]  # groups of 5, 2, 1, 1, 3
    queries = torch.cat([patterns, -patterns[:2], signs(T - 7)])  # own pattern, opposite, random
    q = (q_scale * queries).view(1, 1, T, d).half()
    k = (k_scale * keys).view(1, 1, T, d).half()
    v = torch.randn(1, 1, T, d, generator=g).half()
    return q, k, v


@pytest.mark.parametrize("qk_scale", [1.0, 4.0])
def test_forms_agree_in_fp32(qk_scale):
    """sdpa, math and relax give the same attention output in fp32 (mild and peaky logits)."""
    q, k, v = _qkv(scale=1.0)
    q, k = q * qk_scale, k * qk_scale
    ref = attend(q, k, v, "sdpa")
    for form in ("math", "relax"):
        torch.testing.assert_close(attend(q, k, v, form), ref, rtol=1e-5, atol=1e-5)


def test_explicit_probabilities_are_softmax_of_scaled_logits():
    """math and relax probabilities equal softmax(q.k / sqrt(d)) in fp32, for any relax alpha."""
    q, k, _ = _qkv(scale=2.0)
    ref = torch.softmax(q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1).float()
    torch.testing.assert_close(attention_probs(q, k, "math"), ref)
    for alpha in (1.0, 32.0, 1000.0):
        torch.testing.assert_close(attention_probs(q, k, "relax", alpha), ref)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_self_attention_modules_agree_across_forms(qk_norm):
    """SelfAttention with the same weights gives the same output with sdpa, math and relax (fp32)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 32)
    mods = {f: SelfAttention(32, 4, form=f, qk_norm=qk_norm) for f in FORMS}
    for f in ("math", "relax"):
        mods[f].load_state_dict(mods["sdpa"].state_dict())
    ref = mods["sdpa"](x)
    for f in ("math", "relax"):
        torch.testing.assert_close(mods[f](x), ref, rtol=1e-5, atol=1e-5)


def test_fp16_large_logits_math_overflows_relax_matches_fp32():
    """fp16, logits q.k / sqrt(d) > 65504: math gives inf/NaN, relax is finite and equals the fp32 reference."""
    # Tolerance: the inputs make relax's logits exact (see _sign_inputs), so the only errors left are
    # the fp16 rounding of the probabilities (1/3, 1/5: relative 2^-11) and of the output of probs @ v
    # (relative 2^-11, |v| < 5): rtol 2e-3 and atol 2e-3 are about four times those bounds.
    q, k, v = _sign_inputs()
    logits = (q * 0.125) @ k.transpose(-2, -1)  # fp16 matmul of the pre-scaled q, as math forms it
    assert torch.isinf(logits).any()  # the logits overflow fp16 ...
    relaxed = (q / 256.0) @ k.transpose(-2, -1)
    assert torch.isfinite(relaxed).all() and relaxed.abs().max() <= 2560  # ... relax's product does not
    ref = attend(q.float(), k.float(), v.float(), "math")  # fp32 reference on the same values
    assert torch.isfinite(ref).all()

    out_math = attend(q, k, v, "math")
    assert out_math.dtype == torch.float16
    assert not torch.isfinite(out_math).all()
    out_relax = attend(q, k, v, "relax", alpha=32.0)
    assert out_relax.dtype == torch.float16 and torch.isfinite(out_relax).all()
    torch.testing.assert_close(out_relax.float(), ref, rtol=2e-3, atol=2e-3)
    # The rows are not trivially one-hot: ties over 5, 3 and 2 keys give averaged values.
    probs = attention_probs(q, k, "relax").float()
    assert {round(float(p), 3) for p in probs.amax(-1).flatten()} >= {1.0, 0.5, 0.333, 0.2}


def test_math_scales_q_before_the_matmul():
    """math forms the logits as the reference does, (q / sqrt(d)) K^T: in fp16 it is finite and equals the
    fp32 reference while the raw q.k (160k) is past 65504, where dividing after the matmul gives NaN."""
    # q = 64 * signs, k = 40 * signs: raw q.k = 2560 * m up to 163840 (overflows), logits 320 * m up to
    # 20480 (fit, exact: (q / 8) = 8 * signs). Tolerance as in the test above (exact logits, fp16 output).
    q, k, v = _sign_inputs(q_scale=64, k_scale=40)
    assert torch.isinf(q @ k.transpose(-2, -1)).any()
    divided_after = torch.softmax(((q @ k.transpose(-2, -1)) / 8).float(), dim=-1)
    assert torch.isnan(divided_after).any()
    out = attend(q, k, v, "math")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), attend(q.float(), k.float(), v.float(), "math"), rtol=2e-3, atol=2e-3)


def test_fp16_random_large_logits_relax_matches_fp32():
    """fp16 self-attention with keys near queries (logits ~ 1e5): math NaN, relax = fp32 reference."""
    # Tolerance: the diagonal logit exceeds every other by > 5000 (checked below), far above relax's fp16
    # logit resolution (alpha * ulp(relax's product < 8192) <= 32 * 4 = 128), so both put all mass on the
    # diagonal and relax's output is v after one fp16 rounding (2^-11 relative): rtol 1e-3, atol 1e-3.
    g = torch.Generator().manual_seed(1)
    q = (120 * torch.randn(2, 2, 16, 64, generator=g)).half()
    k = (q.float() + torch.randn(q.shape, generator=g)).half()
    v = torch.randn(q.shape, generator=g).half()
    logits = q.double() @ k.double().transpose(-2, -1) / 8
    assert logits.max() > FP16_MAX and logits.max() / 32 < 8192  # math overflows; relax's product fits
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 5000
    ref = attend(q.float(), k.float(), v.float(), "math")
    assert torch.isnan(attend(q, k, v, "math")).any()
    out = attend(q, k, v, "relax")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=1e-3, atol=1e-3)


def test_relax_divides_before_matmul():
    """relax is finite where MERT's relax branch (dividing by alpha *after* the fp16 matmul) is NaN."""
    q, k, _ = _sign_inputs()
    assert torch.isnan(_mert_relax(q, k)).any()  # the inputs tell the orders apart
    probs = attention_probs(q, k, "relax")
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.float().sum(-1), torch.ones(1, 1, 12), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("form, finite", [("math", False), ("relax", True)])
def test_fp16_autocast_module(form, finite):
    """Under fp16 autocast a SelfAttention with huge logits: math turns NaN, relax matches fp32."""
    # q_proj = k_proj = 160 * I, v_proj = out_proj = I: logits q.k / 8 = 3200 |x|^2 ~ 2e5 on the diagonal
    # (|x|^2 ~ 64; > 65504 needs only |x|^2 > 21). The fp32 module puts all mass on the diagonal (output =
    # x). Tolerance: relax in fp16 rounds x through three fp16 casts (input, v_proj, out_proj), each 2^-11
    # relative: rtol 5e-3, atol 5e-3 (|x| < 4).
    torch.manual_seed(0)
    attn = SelfAttention(64, 1, form=form)
    with torch.no_grad():
        for proj, gain in ((attn.q_proj, 160.0), (attn.k_proj, 160.0), (attn.v_proj, 1.0), (attn.out_proj, 1.0)):
            proj.weight.copy_(gain * torch.eye(64))
            proj.bias.zero_()
    x = torch.randn(2, 10, 64)
    ref = attn(x)  # fp32
    torch.testing.assert_close(ref, x, rtol=1e-5, atol=1e-5)  # one-hot on the diagonal
    with torch.autocast("cpu", dtype=torch.float16):
        out = attn(x)
    assert out.dtype == torch.float16
    assert bool(torch.isfinite(out).all()) is finite
    if finite:
        torch.testing.assert_close(out.float(), ref, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("form", FORMS)
def test_record_max_logit(form):
    """With record_max_logit on, max_logit is max |q.k| / sqrt(d) over heads, in fp32; off, untouched."""
    torch.manual_seed(0)
    attn = SelfAttention(32, 4, form=form)
    x = torch.randn(2, 7, 32)
    attn(x)
    assert attn.max_logit is None
    attn.record_max_logit = True
    attn(x)
    q = attn.q_proj(x).view(2, 7, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(2, 7, 4, 8).transpose(1, 2)
    expected = (q @ k.transpose(-2, -1) / math.sqrt(8)).abs().amax()
    torch.testing.assert_close(attn.max_logit, expected.detach())


def test_qk_norm_bounds_logits():
    """QK-norm (LayerNorm per head, unit gain) caps |logit| at sqrt(d); without it logits grow with x."""
    torch.manual_seed(0)
    x = 100 * torch.randn(2, 7, 32)
    for qk_norm, bounded in ((True, True), (False, False)):
        attn = SelfAttention(32, 4, form="math", qk_norm=qk_norm)
        attn.record_max_logit = True
        attn(x)
        assert (float(attn.max_logit) <= math.sqrt(8) + 1e-4) is bounded


def test_attention_dropout_only_in_training():
    """Attention dropout drops probabilities in training (math, relax) and is off in eval."""
    q, k, v = _qkv()
    for form in ("math", "relax"):
        torch.manual_seed(0)
        train = attend(q, k, v, form, dropout=0.5, training=True)
        assert not torch.allclose(train, attend(q, k, v, form))
        torch.testing.assert_close(attend(q, k, v, form, dropout=0.5, training=False), attend(q, k, v, "sdpa"),
                                   rtol=1e-5, atol=1e-5)


def test_unknown_form_refused():
    """An unknown attention form names the valid ones; sdpa has no explicit probabilities."""
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="choose one of: sdpa, math, relax"):
        attend(q, k, v, "flash")
    with pytest.raises(ConfigError, match="use math or relax"):
        attention_probs(q, k, "sdpa")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_is_dropout(dtype):
    """Keeps each element with probability 1 - p (binomial 5-sigma bound on 1M draws), scales the kept
    ones by 1 / (1 - p), passes the gradient through the same mask, and is the identity in eval."""
    p, n = 0.1, 1_000_000
    x = torch.ones(n, dtype=dtype, requires_grad=True)
    y = fast_dropout(x, p, training=True)
    kept = y != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    y.sum().backward()
    torch.testing.assert_close(x.grad, (kept.to(dtype) / (1 - p)).detach())
    assert fast_dropout(x, p, training=False) is x and fast_dropout(x, 0.0, training=True) is x


def test_sdpa_dropout_on_cpu_matches_the_explicit_product_in_expectation():
    """With dropout in training, sdpa on CPU draws its own mask (fast_dropout); averaged over many draws
    it equals the output without dropout (dropout is unbiased), and each draw differs from it."""
    q, k, v = _qkv(B=1, H=2, T=8, d=4)
    torch.manual_seed(0)
    # 4000 draws in one call: the batch holds 4000 copies of q, k, v and each copy gets its own mask, as
    # 4000 calls would (those took 14-42 s with torch's 2 threads on a loaded 2-core machine; this, ~1.5 s)
    many = [t.expand(4000, -1, -1, -1) for t in (q, k, v)]
    draws = attend(*many, "sdpa", dropout=0.2, training=True)
    exact = attend(q, k, v, "sdpa")[0]
    assert not torch.allclose(draws[0], exact)
    torch.testing.assert_close(draws.mean(0), exact, atol=0.05, rtol=0)
