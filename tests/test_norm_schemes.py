"""Norm schemes: constants, placement (layer output against a formula), init scaling, every combination trains.

The placement tests replace a layer's attention and feed-forward sublayers by known functions G1, G2 and
compare the layer output with the scheme's formula written out here, with the affine parameters of every
norm randomised so that swapping two norms would show.
"""

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

from musiclm_stab.config import ConfigError, ModelConfig, load_config
from musiclm_stab.config.model_section import ATTENTION_FORMS, NORM_SCHEMES, NORM_TYPES
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.attention import SelfAttention, attend
from musiclm_stab.model.encoder import Encoder, EncoderLayer, FeedForward
from musiclm_stab.model.norm_schemes import deepnorm_alpha, deepnorm_beta, make_norm, resolve_scheme

SCALED = ("attn.v_proj", "attn.out_proj", "ffn.fc1", "ffn.fc2")  # DeepNorm / Magneto init targets
UNSCALED = ("attn.q_proj", "attn.k_proj")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add overhead, and on shared cores they multiply run time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _layer_cfg(scheme, norm_type="layernorm", num_layers=6, width=16):
    return ModelConfig(size="tiny", num_layers=num_layers, width=width, ffn_dim=2 * width, num_heads=2,
                       norm_scheme=scheme, norm_type=norm_type, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, pos_conv_groups=4, pos_conv_kernel=8)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _randomise_norms(module, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g))


def _known_sublayers(width, seed=2):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(width, width, generator=g), torch.randn(width, width, generator=g)
    return (lambda h: 2 * torch.tanh(h @ a) + 0.3), (lambda h: 1.5 * torch.sin(h @ b) - 0.2)


# ---------------------------------------------------------------------------------------------------
# Constants


@pytest.mark.parametrize("n, alpha, beta", [(12, 24**0.25, 96**-0.25), (24, 48**0.25, 192**-0.25)])
def test_deepnorm_constants(n, alpha, beta):
    """DeepNorm for an N-layer encoder: alpha = (2N)^(1/4), beta = (8N)^(-1/4), and the spec carries them."""
    assert deepnorm_alpha(n) == pytest.approx(alpha, rel=1e-12)
    assert deepnorm_beta(n) == pytest.approx(beta, rel=1e-12)
    assert (round(alpha, 4), round(beta, 4)) == {12: (2.2134, 0.3195), 24: (2.6321, 0.2686)}[n]
    spec = resolve_scheme("deepnorm", n)
    assert spec.residual_alpha == pytest.approx(alpha) and spec.init_gain == pytest.approx(beta)


@pytest.mark.parametrize("n, gain", [(12, 1.7827), (24, 1.9675)])
def test_subln_init_gain(n, gain):
    """Magneto (Sub-LN) for an encoder-only model of N layers: init gain sqrt(log(2N)), no residual scaling."""
    spec = resolve_scheme("subln", n)
    assert spec.init_gain == pytest.approx(math.sqrt(math.log(2 * n)), rel=1e-12)
    assert round(spec.init_gain, 4) == gain
    assert spec.residual_alpha == 1.0


def test_scheme_table():
    """Each scheme resolves to the placement documented in norm_schemes.py (one spec, nothing implied)."""
    table = {  # before, after_sublayer, after_residual, sublayer_norm, embed_norm, final_norm
        "pre": (True, False, False, False, False, True),
        "post": (False, False, True, False, True, False),
        "deepnorm": (False, False, True, False, True, False),
        "sandwich": (True, True, False, False, False, True),
        "subln": (True, False, False, True, False, True),
    }
    assert set(table) == set(NORM_SCHEMES)
    for name, flags in table.items():
        s = resolve_scheme(name, 6)
        assert (s.norm_before, s.norm_after_sublayer, s.norm_after_residual, s.sublayer_norm, s.embed_norm,
                s.final_norm) == flags, name
        assert s.residual_alpha == (12**0.25 if name == "deepnorm" else 1.0)
        expected_gain = {"deepnorm": 48**-0.25, "subln": math.sqrt(math.log(12))}.get(name, 1.0)
        assert s.init_gain == pytest.approx(expected_gain)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_make_norm_formula(norm_type):
    """make_norm gives LayerNorm (x - mean) / std * w + b or RMSNorm x / rms * w over the last dimension."""
    torch.manual_seed(0)
    norm = make_norm(norm_type, 8)
    _randomise_norms(norm)
    x = 3 * torch.randn(4, 5, 8) + 1
    if norm_type == "layernorm":
        expected = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        expected = expected * norm.weight + norm.bias
    else:
        expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)


# ---------------------------------------------------------------------------------------------------
# Placement: layer output against the scheme's formula


def _formula(scheme, layer, x, g1, g2, n_layers):
    """The scheme's layer, written out: x -> attention block -> feed-forward block."""
    alpha = (2 * n_layers) ** 0.25
    for g, n_in, n_out, n_res in ((g1, layer.attn_norm_in, layer.attn_norm_out, layer.attn_norm_res),
                                  (g2, layer.ffn_norm_in, layer.ffn_norm_out, layer.ffn_norm_res)):
        if scheme in ("pre", "subln"):  # x + G(LN(x)); subln's extra LNs live inside G
            x = x + g(n_in(x))
        elif scheme == "post":  # LN(x + G(x))
            x = n_res(x + g(x))
        elif scheme == "deepnorm":  # LN(alpha * x + G(x))
            x = n_res(alpha * x + g(x))
        elif scheme == "sandwich":  # x + LN(G(LN(x)))
            x = x + n_out(g(n_in(x)))
        else:
            raise AssertionError(scheme)
    return x


PRESENT = {  # which of the layer's norms exist: in, out (after sublayer), res (after residual)
    "pre": (True, False, False), "post": (False, False, True), "deepnorm": (False, False, True),
    "sandwich": (True, True, False), "subln": (True, False, False),
}


@pytest.mark.parametrize("scheme, norm_type", list(itertools.product(NORM_SCHEMES, NORM_TYPES)))
def test_layer_output_matches_scheme_formula(scheme, norm_type):
    """An EncoderLayer with known sublayers G1, G2 computes exactly its scheme's formula."""
    torch.manual_seed(0)
    layer = EncoderLayer(_layer_cfg(scheme, norm_type), resolve_scheme(scheme, 6)).eval()
    for attr, present in zip(("attn_norm_in", "attn_norm_out", "attn_norm_res"), PRESENT[scheme]):
        assert (getattr(layer, attr) is not None) is present, attr
        assert (getattr(layer, attr.replace("attn", "ffn")) is not None) is present, attr
    norm_cls = nn.LayerNorm if norm_type == "layernorm" else nn.RMSNorm
    assert all(isinstance(m, norm_cls) for m in layer.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)))
    _randomise_norms(layer)
    g1, g2 = _known_sublayers(16)
    layer.attn, layer.ffn = _Fn(g1), _Fn(g2)
    x = 2 * torch.randn(3, 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _formula(scheme, layer, x, g1, g2, 6))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_deepnorm_alpha_scales_residual_not_sublayer(norm_type):
    """DeepNorm computes LN(alpha*x + G(x)) and measurably not LN(x + alpha*G(x))."""
    torch.manual_seed(0)
    n = 12
    layer = EncoderLayer(_layer_cfg("deepnorm", norm_type, num_layers=n), resolve_scheme("deepnorm", n)).eval()
    _randomise_norms(layer)
    g1, g2 = _known_sublayers(16)
    layer.attn, layer.ffn = _Fn(g1), _Fn(g2)
    x = 2 * torch.randn(3, 7, 16)
    alpha = 24**0.25
    right = layer.attn_norm_res(alpha * x + g1(x))
    right = layer.ffn_norm_res(alpha * right + g2(right))
    wrong = layer.attn_norm_res(x + alpha * g1(x))
    wrong = layer.ffn_norm_res(wrong + alpha * g2(wrong))
    with torch.no_grad():
        out = layer(x)
        torch.testing.assert_close(out, right)
        assert (out - wrong).abs().max() > 0.1


def test_subln_norms_sit_before_out_proj_and_fc2():
    """Sub-LN: attention = out_proj(LN(attn(q, k, v))), feed-forward = fc2(LN(gelu(fc1 x)))."""
    torch.manual_seed(0)
    layer = EncoderLayer(_layer_cfg("subln"), resolve_scheme("subln", 6)).eval()
    _randomise_norms(layer)
    attn, ffn = layer.attn, layer.ffn
    assert attn.sub_norm.normalized_shape == (16,) and ffn.sub_norm.normalized_shape == (32,)
    x = torch.randn(2, 5, 16)

    def heads(t):
        return t.view(2, 5, 2, 8).transpose(1, 2)  # (B, H, T, d)

    with torch.no_grad():
        o = attend(heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x)), "sdpa")
        expected_attn = attn.out_proj(attn.sub_norm(o.transpose(1, 2).reshape(2, 5, 16)))
        torch.testing.assert_close(attn(x), expected_attn)
        expected_ffn = ffn.fc2(ffn.sub_norm(torch.nn.functional.gelu(ffn.fc1(x))))
        torch.testing.assert_close(ffn(x), expected_ffn)
    for scheme in ("pre", "post", "deepnorm", "sandwich"):
        other = EncoderLayer(_layer_cfg(scheme), resolve_scheme(scheme, 6))
        assert other.attn.sub_norm is None and other.ffn.sub_norm is None
    assert isinstance(attn, SelfAttention) and isinstance(ffn, FeedForward)


@pytest.mark.parametrize("scheme", NORM_SCHEMES)
def test_encoder_embedding_and_final_norms(scheme):
    """Encoder: post-LN family normalises the embeddings before layer 1; pre family adds a final LN."""
    torch.manual_seed(0)
    enc = Encoder(_layer_cfg(scheme, num_layers=2)).eval()
    _randomise_norms(enc)
    g1, g2 = _known_sublayers(16)
    enc.layers = nn.ModuleList([_Fn(g1), _Fn(g2)])
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        h = x + enc.pos_conv(x)
        if scheme in ("post", "deepnorm"):
            assert enc.final_norm is None
            expected = g2(g1(enc.embed_norm(h)))
        else:
            assert enc.embed_norm is None
            expected = enc.final_norm(g2(g1(h)))
        out, hidden = enc(x, return_hidden=True)
    torch.testing.assert_close(out, expected)
    assert len(hidden) == 3


# ---------------------------------------------------------------------------------------------------
# Initialisation


def _pooled_std_ratio(enc, name, n_layers, seed):
    """std of the named weight over all layers / std of a fresh unscaled xavier_normal init of the same shapes."""
    weights = [enc.layers[i].get_submodule(name).weight.detach().flatten() for i in range(n_layers)]
    g = torch.Generator().manual_seed(seed)
    shape = enc.layers[0].get_submodule(name).weight.shape
    refs = [nn.init.xavier_normal_(torch.empty(shape), gain=1.0, generator=g).flatten() for _ in range(n_layers)]
    return float(torch.cat(weights).std() / torch.cat(refs).std())


@pytest.mark.parametrize("scheme, n", [("deepnorm", 12), ("deepnorm", 24), ("subln", 12), ("pre", 12),
                                       ("post", 12), ("sandwich", 12)])
def test_init_scales_exactly_the_right_weights(scheme, n):
    """Under model.init=xavier, fc1, fc2, out_proj, v_proj of every layer get gain beta (deepnorm) /
    sqrt(log 2N) (subln); q, k never. (MERT's init, the default: tests/test_fidelity_init.py.)"""
    # Checked twice: the names in Encoder.scaled_at_init, and the weights' std against an unscaled xavier
    # init of the same shapes (pooled over layers: >= 49k values each, std error < 0.5%, tolerance 3%).
    torch.manual_seed(0)
    enc = Encoder(dataclasses.replace(_layer_cfg(scheme, num_layers=n, width=64), init="xavier"))
    gain = {"deepnorm": (8 * n) ** -0.25, "subln": math.sqrt(math.log(2 * n))}.get(scheme, 1.0)
    expected = {f"{i}.{name}.weight" for i in range(n) for name in SCALED} if gain != 1.0 else set()
    assert set(enc.scaled_at_init) == expected
    assert len(enc.scaled_at_init) == len(expected)
    for j, name in enumerate(SCALED + UNSCALED):
        ratio = _pooled_std_ratio(enc, name, n, seed=100 + j)
        want = gain if name in SCALED else 1.0
        assert ratio == pytest.approx(want, rel=0.03), (name, ratio, want)
    for i in range(n):  # biases zero, every layer scaled (not just the first)
        layer = enc.layers[i]
        assert all(float(m.bias.detach().abs().max()) == 0 for m in layer.modules() if isinstance(m, nn.Linear))
        r = float(layer.ffn.fc1.weight.detach().std() / layer.attn.q_proj.weight.detach().std())
        # fc1 is 64 x 128, q_proj 64 x 64: xavier stds differ by sqrt(128 / 192)
        assert r == pytest.approx(gain * math.sqrt(128 / 192), rel=0.06), (i, r)


# ---------------------------------------------------------------------------------------------------
# Every combination builds, runs and trains


def _combos():
    for scheme, form, norm_type, qk in itertools.product(NORM_SCHEMES, ATTENTION_FORMS, NORM_TYPES, (False, True)):
        if form == "relax" and qk:
            continue  # refused by config (test_relax_with_qk_norm_refused)
        yield scheme, form, norm_type, qk


TINY_OVERRIDES = ["--model.num_layers=2", "--model.width=64", "--model.num_heads=4", "--model.ffn_dim=128",
                  "--model.conv_dim=16", "--model.final_dim=16", "--model.cqt_bins=24",
                  "--model.cqt_bins_per_octave=12", "--model.codebook_size=64", "--model.dropout=0",
                  "--model.attention_dropout=0", "--model.feature_dropout=0"]


@pytest.mark.parametrize("scheme, form, norm_type, qk_norm", list(_combos()))
def test_every_combination_trains(scheme, form, norm_type, qk_norm):
    """Builds MusicMLM; finite loss and gradients on every parameter; 8 AdamW steps cut the loss by > 10%."""
    cfg = load_config(None, TINY_OVERRIDES + [f"--model.norm_scheme={scheme}", f"--model.attention={form}",
                                              f"--model.norm_type={norm_type}", f"--model.qk_norm={qk_norm}"])
    torch.manual_seed(0)
    model = MusicMLM(cfg.model)
    g = torch.Generator().manual_seed(0)
    T = 32
    wav = 0.1 * torch.randn(2, 320 * T, generator=g)
    codes = torch.randint(0, 64, (2, 8, T), generator=g)
    mask = span_mask(2, T, 0.8, 5, g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(8):
        out = model(wav, wav, codes, mask)
        opt.zero_grad()
        out.loss.backward()
        if step == 0:
            bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
            assert bad == []
        assert torch.isfinite(out.loss)
        losses.append(float(out.loss.detach()))
        opt.step()
    assert losses[-1] < 0.9 * losses[0], losses


# ---------------------------------------------------------------------------------------------------
# Refused at config time


@pytest.mark.parametrize("overrides, fragment", [
    (["--model.attention=relax", "--model.qk_norm=true"], "relax cannot be combined with model.qk_norm"),
    (["--model.norm_type=batchnorm"], "choose one of: layernorm, rmsnorm"),
    (["--model.norm_scheme=deepnorm_v2"], "choose one of: pre, post, deepnorm, sandwich, subln"),
    (["--model.attention=flash"], "choose one of: sdpa, math, relax"),
    (["--model.relax_alpha=0"], "model.relax_alpha must be > 0"),
    (["--model.qk_norm=sometimes"], "must be true or false"),
])
def test_bad_combinations_refused_at_config_time(overrides, fragment):
    """Unknown or contradictory scheme settings fail in load_config, naming the setting and the choices."""
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, overrides)


def test_factories_name_valid_choices():
    """resolve_scheme and make_norm refuse unknown names with the list of valid ones."""
    with pytest.raises(ConfigError, match="choose one of: pre, post, deepnorm, sandwich, subln"):
        resolve_scheme("prenorm", 12)
    with pytest.raises(ConfigError, match="choose one of: layernorm, rmsnorm"):
        make_norm("batchnorm", 8)
