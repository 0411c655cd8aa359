"""Initialisation as MERT's (docs/FIDELITY.md): every encoder Linear N(0, 0.02) (fairseq's init_bert_params),
DeepNorm's fc1/fc2/out_proj/v_proj then divided by (8N)^(1/4); the xavier init kept as a choice; the rest
of the model keeps its own inits, as in MERT."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from musiclm_stab.config import ConfigError, ModelConfig, load_config
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.encoder import Encoder, init_encoder_weights
from musiclm_stab.model.norm_schemes import resolve_scheme

GROUPS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "ffn.fc1", "ffn.fc2")
SCALED = {"attn.v_proj", "attn.out_proj", "ffn.fc1", "ffn.fc2"}  # MERT's name test: fc1, fc2, out_proj, v_proj
WIDTH, FFN = 128, 512


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors on shared cores: intra-op threads only add overhead."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _encoder(scheme: str, n: int, init: str) -> Encoder:
    torch.manual_seed(0)
    return Encoder(ModelConfig(size="tiny", num_layers=n, width=WIDTH, ffn_dim=FFN, num_heads=4,
                               norm_scheme=scheme, init=init))


def _pooled_std(enc: Encoder, group: str) -> float:
    """std of one weight group over all layers (>= 16k values per layer)."""
    return float(torch.cat([layer.get_submodule(group).weight.detach().flatten() for layer in enc.layers]).std())


def mert_std(scheme: str, n: int, group: str) -> float:
    """MERT's formula: 0.02, divided by (8N)^(1/4) for DeepNorm's scaled weights (mert_model.py 1453-1461)."""
    if scheme == "deepnorm" and group in SCALED:
        return 0.02 / (8 * n) ** 0.25
    return 0.02


@pytest.mark.parametrize("scheme, n", [(s, n) for s in ("pre", "post", "deepnorm") for n in (12, 24)])
def test_mert_init_std_per_weight_group(scheme, n):
    """Default init (model.init=mert): each of q, k, v, out_proj, fc1, fc2, pooled over the N layers, has
    MERT's std (0.02; DeepNorm's v/out_proj/fc1/fc2 0.02 / (8N)^(1/4)) within 3%; biases are 0."""
    # Pooled over N >= 12 layers: >= 196k values per group, std standard error < 0.2%: 3% is > 15 errors.
    enc = _encoder(scheme, n, ModelConfig().init)
    for group in GROUPS:
        want = mert_std(scheme, n, group)
        got = _pooled_std(enc, group)
        assert got == pytest.approx(want, rel=0.03), (group, got, want)
        assert all(float(layer.get_submodule(group).bias.detach().abs().max()) == 0 for layer in enc.layers)
    if scheme == "deepnorm":  # the numbers the docs state: 0.00639 (N=12) and 0.00537 (N=24)
        assert round(mert_std(scheme, n, "ffn.fc1"), 5) == {12: 0.00639, 24: 0.00537}[n]


@pytest.mark.parametrize("scheme, n", [("pre", 12), ("deepnorm", 24), ("subln", 12)])
def test_xavier_init_kept_as_a_choice(scheme, n):
    """model.init=xavier: xavier_normal_ std sqrt(2 / (fan_in + fan_out)), times the scheme's gain on
    v/out_proj/fc1/fc2 (DeepNorm beta, Sub-LN sqrt(log 2N)), within 3%."""
    enc = _encoder(scheme, n, "xavier")
    gain = resolve_scheme(scheme, n).init_gain
    for group in GROUPS:
        out_f, in_f = enc.layers[0].get_submodule(group).weight.shape
        want = math.sqrt(2.0 / (in_f + out_f)) * (gain if group in SCALED else 1.0)
        assert _pooled_std(enc, group) == pytest.approx(want, rel=0.03), group


def test_mert_init_touches_the_encoder_only():
    """As in MERT (init_bert_params applied by the encoder to itself): feature projection, acoustic and
    musical heads keep torch's Linear init (std 1/sqrt(3 fan_in)), label and mask embeddings U[0, 1)."""
    # Tolerance 5%: the smallest of these has 8k values (std error < 1%).
    torch.manual_seed(0)
    model = MusicMLM(ModelConfig(size="tiny"))
    for linear in (model.feature_proj, model.acoustic.proj, model.musical.proj):
        want = 1 / math.sqrt(3 * linear.in_features)
        assert float(linear.weight.detach().std()) == pytest.approx(want, rel=0.05)
    for emb in (model.acoustic.label_embs, model.mask_emb):
        emb = emb.detach()
        assert 0 <= float(emb.min()) and float(emb.max()) < 1 and float(emb.mean()) == pytest.approx(0.5, abs=0.05)
    assert float(model.encoder.layers[0].attn.q_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.05)


def test_init_choice_is_validated():
    """An unknown model.init is refused at config time and by the encoder, naming the choices."""
    with pytest.raises(ConfigError, match="model.init='kaiming' is not valid; choose one of: mert, xavier"):
        load_config(None, ["--model.init=kaiming"])
    with pytest.raises(ConfigError, match="choose one of: mert, xavier"):
        init_encoder_weights(nn.ModuleList(), resolve_scheme("pre", 2), "kaiming")
