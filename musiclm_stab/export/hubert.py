"""Export a trained encoder as a plain ``transformers.HubertModel`` checkpoint, verified layer by layer.

    musiclm-stab export RUN_DIR_OR_CHECKPOINT OUT_DIR [--audio FILE] [--seconds 6] [--overwrite]

OUT_DIR then holds ``config.json`` + ``model.safetensors`` (loads with
``transformers.HubertModel.from_pretrained(OUT_DIR)``, no remote code), ``preprocessor_config.json``
(``Wav2Vec2FeatureExtractor`` at 24 kHz, ``do_normalize=False``: our model sees raw samples),
``heads.safetensors`` (the acoustic and musical heads, see ``load_heads``), ``musiclm_stab.json``
(provenance, padding, head settings and the verification report) and ``README.md``, the model card
(export/card.py: what the model is, its data, config, steps and held-out codebook-0 loss, how to load it).
Needs transformers: the ``export`` extra (``pip install 'musiclm_stab[export]'``).

Padding, the one thing to know: our frontend pads 40 zero samples on each side of the waveform, so
that 320*T samples give exactly T frames; HuBERT's does not pad (320*T samples give T-1 frames, each
shifted by 40 samples). **The exported model reproduces our frames when fed the audio padded with 40
zero samples on each side: ``model(pad_for_export(wav))``.** Fed unpadded audio it still works, but it
gives one frame fewer, every frame covers samples 40 later, and the states differ from ours. The pad
is recorded as ``musiclm_stab.pad_samples`` in ``config.json`` and in ``musiclm_stab.json``. (As in
every wav2vec2-base-style model, the first conv's GroupNorm normalizes each channel over the whole
input: zero-padding clips of a batch to one length changes their states; batch equal lengths.) For
``pre`` models, ``hidden_states[N]`` is the last layer before the final LayerNorm (transformers 5.x,
as ours); ``last_hidden_state`` has it.

What maps to what. ``pre`` -> ``do_stable_layer_norm=True`` (LN before each sublayer, final LN);
``post`` -> ``do_stable_layer_norm=False`` (LN on the embeddings, LN after each residual add); both with
``feat_extract_norm="group"``, ``conv_bias=False``. ``deepnorm`` (x = LN(alpha*x + G(x))) is a post-LN
model once alpha is folded into the weights: LayerNorm is scale-invariant, so LN(alpha*x + G(x)) =
LN(x + G(x)/alpha) with eps replaced by eps/alpha^2; out_proj and fc2 (weights and biases), which
produce G(x), are scaled by 1/alpha. HuBERT has one ``layer_norm_eps`` for every LayerNorm, so the
per-layer norms keep eps=1e-5 where eps/alpha^2 would be exact: the output changes by a relative
eps*(1 - 1/alpha^2) / (2 var), ~4e-6 for a residual stream of unit variance. Measured: max |ours - hf|
1.9e-5 over all states at base size (alpha = 2.21), 2.2e-5 for a 6-layer model whose states reach
|5.8|, against 3e-6 from rounding alone when the layer norms are given eps/alpha^2 (``pre`` and
``post`` export bit-exactly). The attention forms ``relax`` and ``math`` equal plain attention in
exact arithmetic and are exported as HuBERT's attention (measured: 2e-6). Settings HuBERT cannot
express (sandwich and subln schemes, RMSNorm, QK-norm) are refused, never approximated.

Verification is part of the export: the written directory is loaded back with transformers, and every
hidden state (input of layer 0, output of each layer, and the final output) is compared with ours on a
few seconds of real music (``--audio FILE``, else a Bach chorale rendered offline, else synthetic
tones); any element beyond |ours - hf| <= atol + rtol*|ours| (1e-4 each, fp32) fails the export.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run
from musiclm_stab.config.model_section import ModelConfig
from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH, SAMPLE_RATE
from musiclm_stab.export.card import model_card
from musiclm_stab.export.exported import HEADS_FILE, PAD_SAMPLES, PADDING_NOTE, SIDECAR, pad_for_export
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.frontend import CONV_LAYERS
from musiclm_stab.model.norm_schemes import SchemeSpec, resolve_scheme
from musiclm_stab.output_errors import OutputWriteError, stops_on_write_errors
from musiclm_stab.removal import discard_temporary, is_inside, mark_output, replace_output, why_not_removable
from musiclm_stab.training.checkpoint import STATE_FILE
from musiclm_stab.training.trained import load_checkpoint, resolve_checkpoint

ATOL, RTOL = 1e-4, 1e-4  # verification tolerance, fp32: |ours - hf| <= ATOL + RTOL * |ours|
FORMAT_VERSION = 1
# HuBERT builds masked_spec_embed only when SpecAugment is on: we keep HF's fine-tuning default rate
# (it acts only in training mode); the pretraining masking is recorded in musiclm_stab.json.
SPEC_AUGMENT_PROB = 0.05
CARD = "README.md"  # the model card, where the transformers convention puts it
# Every file an export holds (what an earlier version's export is recognised by, before markers).
EXPORT_FILES = {"config.json", "model.safetensors", "preprocessor_config.json", HEADS_FILE, SIDECAR, CARD}
INSTALL_HINT = "pip install 'musiclm_stab[export]'"


class ExportError(ValueError):
    """The model cannot be exported exactly, or the exported model does not reproduce ours."""


def require_transformers() -> None:
    """transformers is importable, or ExportError saying which extra installs it."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ExportError(f"export needs transformers, which the `export` extra installs: {INSTALL_HINT} "
                          f"({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------- mapping


def check_exportable(cfg: ModelConfig) -> SchemeSpec:
    """The scheme of ``cfg`` if HubertModel can express it exactly; else ExportError naming every setting."""
    cfg = cfg.resolved()
    spec = resolve_scheme(cfg.norm_scheme, cfg.num_layers)
    problems = []
    pre_like = (
        spec.norm_before
        and spec.final_norm
        and not spec.embed_norm
        and not spec.norm_after_residual
        and spec.residual_alpha == 1.0
    )
    post_like = not spec.norm_before and not spec.final_norm and spec.embed_norm and spec.norm_after_residual
    if spec.norm_after_sublayer or spec.sublayer_norm or not (pre_like or post_like):
        problems.append(
            f"model.norm_scheme={cfg.norm_scheme} places norms where HubertEncoderLayer has none "
            "(exportable schemes: pre, post, deepnorm)"
        )
    if cfg.norm_type != "layernorm":
        problems.append(
            f"model.norm_type={cfg.norm_type}: HubertModel's norms are LayerNorms (mean and bias), "
            "not RMSNorm"
        )
    if cfg.qk_norm:
        problems.append("model.qk_norm=true: HubertAttention has no norm on queries and keys")
    if problems:
        raise ExportError(
            "cannot export to transformers.HubertModel without changing what the model computes "
            "(refusing rather than exporting an approximation): " + "; ".join(problems)
        )
    return spec


def hubert_config(cfg: ModelConfig, layer_norm_eps: float = 1e-5, extra: dict | None = None):
    """The ``transformers.HubertConfig`` of an exportable ModelConfig."""
    from transformers import HubertConfig

    cfg = cfg.resolved()
    spec = check_exportable(cfg)
    return HubertConfig(
        hidden_size=cfg.width,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.ffn_dim,
        hidden_act="gelu",
        layer_norm_eps=layer_norm_eps,
        do_stable_layer_norm=spec.norm_before,  # pre -> stable layer norm; post, deepnorm -> not
        feat_extract_norm="group",
        feat_extract_activation="gelu",
        conv_bias=False,
        conv_dim=(cfg.conv_dim,) * len(CONV_LAYERS),
        conv_kernel=tuple(k for k, _ in CONV_LAYERS),
        conv_stride=tuple(s for _, s in CONV_LAYERS),
        feat_proj_layer_norm=True,
        num_conv_pos_embeddings=cfg.pos_conv_kernel,
        num_conv_pos_embedding_groups=cfg.pos_conv_groups,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.activation_dropout,
        feat_proj_dropout=cfg.feature_dropout,
        layerdrop=cfg.layerdrop,
        apply_spec_augment=True,
        mask_time_prob=SPEC_AUGMENT_PROB,
        mask_time_length=cfg.mask_length,
        musiclm_stab=extra or {},
    )


def _layer_norm_eps(model: MusicMLM) -> float:
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise ExportError(f"HubertModel has one layer_norm_eps; this model's LayerNorms use {sorted(eps)}")
    return eps.pop()


def hubert_state_dict(model: MusicMLM) -> dict[str, torch.Tensor]:
    """Our encoder's weights under HubertModel's names (deepnorm's alpha folded into out_proj and fc2).

    Raises ExportError if a weight of the encoder has no place in HubertModel (the heads go elsewhere).
    """
    spec = check_exportable(model.cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {"masked_spec_embed": "mask_emb"}  # HubertModel name -> our name
    for i in range(len(CONV_LAYERS)):
        names[f"feature_extractor.conv_layers.{i}.conv.weight"] = f"frontend.convs.{i}.0.weight"
    for p in ("weight", "bias"):
        names[f"feature_extractor.conv_layers.0.layer_norm.{p}"] = f"frontend.convs.0.1.{p}"  # GroupNorm
        names[f"feature_projection.layer_norm.{p}"] = f"feature_norm.{p}"
        names[f"feature_projection.projection.{p}"] = f"feature_proj.{p}"
    # the same weight-norm parametrization (original0 = g, original1 = v, dim=2) on both sides
    for name in ("bias", "parametrizations.weight.original0", "parametrizations.weight.original1"):
        names[f"encoder.pos_conv_embed.conv.{name}"] = f"encoder.pos_conv.conv.{name}"
    if spec.norm_before:  # pre: LN before attention / FFN, final LN after the last layer
        (attn_norm, ffn_norm), encoder_norm = ("attn_norm_in", "ffn_norm_in"), "final_norm"
    else:  # post, deepnorm: LN after each residual add, LN on the embeddings
        (attn_norm, ffn_norm), encoder_norm = ("attn_norm_res", "ffn_norm_res"), "embed_norm"
    for p in ("weight", "bias"):
        names[f"encoder.layer_norm.{p}"] = f"encoder.{encoder_norm}.{p}"
        for i in range(model.cfg.num_layers):
            layer = f"encoder.layers.{i}"
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                names[f"{layer}.attention.{proj}.{p}"] = f"{layer}.attn.{proj}.{p}"
            names[f"{layer}.feed_forward.intermediate_dense.{p}"] = f"{layer}.ffn.fc1.{p}"
            names[f"{layer}.feed_forward.output_dense.{p}"] = f"{layer}.ffn.fc2.{p}"
            names[f"{layer}.layer_norm.{p}"] = f"{layer}.{attn_norm}.{p}"
            names[f"{layer}.final_layer_norm.{p}"] = f"{layer}.{ffn_norm}.{p}"
    unmapped = sorted(
        set(sd) - set(names.values()) - {k for k in sd if k.startswith(("acoustic.", "musical."))}
    )
    if unmapped:
        raise ExportError(f"weights with no place in HubertModel: {', '.join(unmapped)}")
    out = {hf: sd[ours] for hf, ours in names.items()}
    if spec.residual_alpha != 1.0:  # deepnorm: LN(alpha x + G(x)) = LN(x + G(x) / alpha), eps aside
        for hf in out:
            if hf.endswith(
                (
                    "attention.out_proj.weight",
                    "attention.out_proj.bias",
                    "output_dense.weight",
                    "output_dense.bias",
                )
            ):
                out[hf] = out[hf] / spec.residual_alpha
    return out


# ----------------------------------------------------------------------------------- verification


def verification_audio(seconds: float = 6.0) -> tuple[torch.Tensor, str]:
    """A few seconds of real music, deterministic: ([S] at 24 kHz, S a multiple of 320, description).

    A Bach chorale (bwv1.6, string quartet) rendered with the corpus builder when its optional packages
    are installed; otherwise harmonic tones with decaying envelopes.
    """
    audio, note = _verification_audio(int(seconds * SAMPLE_RATE) // HOP_LENGTH * HOP_LENGTH)
    return torch.from_numpy(audio.copy()), note


@functools.lru_cache(maxsize=4)
def _verification_audio(n: int) -> tuple[np.ndarray, str]:
    try:
        from musiclm_stab.corpus.chorales import plan_track
        from musiclm_stab.corpus.render import render_track

        source = "bach/bwv1.6.mxl"
        track = plan_track(source, seed=0, ensemble="string quartet")
        audio = render_track(track, SAMPLE_RATE, max_seconds=n / SAMPLE_RATE + 1).mean(
            axis=1
        )  # (S,) mono
        return np.ascontiguousarray(
            audio[:n], dtype=np.float32
        ), f"{source} rendered (string quartet, seed 0)"
    except ImportError:
        t = np.arange(n) / SAMPLE_RATE
        audio = np.zeros(n)
        for j, midi in enumerate([57, 60, 64, 69, 62, 65, 69, 74]):  # two chords' notes, one every 0.75 s
            on = t - 0.75 * j
            env = np.where(on >= 0, np.exp(-np.clip(on, 0, None) / 0.6), 0.0)
            f0 = 440.0 * 2 ** ((midi - 69) / 12)
            audio += env * sum(np.sin(2 * np.pi * f0 * h * t) / h for h in range(1, 6))
        return (0.3 * audio / np.abs(audio).max()).astype(np.float32), "synthetic harmonic tones"


@dataclass
class Verification:
    """Per-state agreement of the exported model with ours: index 0..N = hidden states, N+1 = output."""

    names: list[str]
    max_abs: list[float]
    worst_ratio: list[float]  # max of |ours - hf| / (atol + rtol |ours|): <= 1 passes
    atol: float
    rtol: float
    audio: str
    num_frames: int

    @property
    def failing(self) -> list[str]:
        return [n for n, r in zip(self.names, self.worst_ratio) if not r <= 1.0]  # NaN fails too

    @property
    def passed(self) -> bool:
        return not self.failing

    def table(self) -> str:
        rows = [f"{'state':>14} {'max |ours-hf|':>14} {'/ tolerance':>12}"]
        rows += [
            f"{n:>14} {a:14.3e} {r:12.3f}" for n, a, r in zip(self.names, self.max_abs, self.worst_ratio)
        ]
        return "\n".join(rows)


@torch.inference_mode()
def compare_with_export(
    model: MusicMLM, hf_model, wav: torch.Tensor, audio: str = "", atol: float = ATOL, rtol: float = RTOL
) -> Verification:
    """Compare every hidden state of ``hf_model`` (fed the padded audio) with ours on ``wav`` [S] or [B, S]."""
    model, hf_model = model.eval(), hf_model.eval()
    wav = wav.float().reshape(-1, wav.shape[-1])  # (B, S)
    (ours_out, ours_hidden), _ = model.encode(wav, return_hidden=True)
    hf = hf_model(pad_for_export(wav, align=False), output_hidden_states=True)
    ours = [*ours_hidden, ours_out]
    theirs = [*hf.hidden_states, hf.last_hidden_state]
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        raise ExportError(
            f"exported model gives states {[tuple(t.shape) for t in theirs]}, ours "
            f"{[tuple(t.shape) for t in ours]}"
        )
    names = ["embeddings"] + [f"layer {i}" for i in range(1, len(ours_hidden))] + ["last_hidden"]
    max_abs, ratio = [], []
    for a, b in zip(ours, theirs):
        err = (a - b).abs()
        max_abs.append(float(err.max()))
        ratio.append(float((err / (atol + rtol * a.abs())).max()))
    return Verification(names, max_abs, ratio, atol, rtol, audio, int(ours_out.shape[1]))


# ------------------------------------------------------------------------------------------ export


@dataclass
class ExportResult:
    out_dir: Path
    verification: Verification
    source: str  # the checkpoint exported


@stops_on_write_errors("out_dir", lambda error, out: f"The export was not written: {error.advice()}, then rerun "
                       "the same command", what="write the export")
def export(
    path: str | Path,
    out_dir: str | Path,
    audio: str | Path | None = None,
    seconds: float = 6.0,
    overwrite: bool = False,
    atol: float = ATOL,
    rtol: float = RTOL,
    license: str | None = None,
) -> ExportResult:
    """Export the checkpoint at ``path`` (run dir: newest checkpoint) to ``out_dir``, verified.

    ``license``: the Hub's identifier of the weights' licence for the model card (``mit``, ``cc-by-4.0``, ...;
    ``other`` when None: it is that of the training data, which the run does not record).

    Raises ExportError when the model cannot be expressed exactly (nothing is written), when the
    written model disagrees with ours beyond tolerance (it is left in ``<out_dir>.unverified``), or when
    transformers is not installed (the ``export`` extra); OutputWriteError (one line) when the disk is full
    (or another error only a write raises: a quota, a file size limit, a read-only file system).
    """
    if license is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+_-]*", license):
        raise ExportError(f"license {license!r} is not a licence identifier as the Hub writes them (mit, apache-2.0, "
                          "cc-by-4.0, other)")
    require_transformers()
    from transformers import HubertModel, Wav2Vec2FeatureExtractor
    from transformers import __version__ as transformers_version

    out_dir = Path(out_dir)
    failed = out_dir.with_name(f"{out_dir.name}.unverified")
    check_target(out_dir, path, overwrite)
    check_target(failed, path, overwrite=True)  # where a failed verification is left
    model, ckpt, step = load_checkpoint(path)
    cfg = model.cfg
    spec = check_exportable(cfg)  # refuse before writing anything

    if audio is not None:
        from musiclm_stab.audio.stream import load_audio

        wav = load_audio(audio)
        wav = wav[: int(seconds * SAMPLE_RATE) // HOP_LENGTH * HOP_LENGTH]
        audio_note = f"{Path(audio).name} (first {wav.numel() / SAMPLE_RATE:.2f} s)"  # no local path in the card
    else:
        wav, audio_note = verification_audio(seconds)
    if wav.numel() < HOP_LENGTH:
        raise ExportError(f"verification audio {audio_note} is shorter than one frame ({HOP_LENGTH} samples)")

    info = {
        "pad_samples": PAD_SAMPLES,
        "sample_rate": SAMPLE_RATE,
        "frame_rate": FRAME_RATE,
        "hop_length": HOP_LENGTH,
        "note": PADDING_NOTE,
    }
    eps = _layer_norm_eps(model)
    hf_model = HubertModel(hubert_config(cfg, eps, extra=info))
    hf_model.load_state_dict(hubert_state_dict(model), strict=True)

    partial = out_dir.with_name(f".{out_dir.name}.partial")
    discard_temporary(partial, ignore_errors=True)  # left by a killed export
    hf_model.save_pretrained(partial)
    mark_output(partial, "export")  # what makes it replaceable by a later --overwrite
    Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=SAMPLE_RATE,
        padding_value=0.0,
        do_normalize=False,
        return_attention_mask=False,
    ).save_pretrained(partial)
    heads = {f"acoustic.{k}": v.contiguous() for k, v in model.acoustic.state_dict().items()}
    heads.update({f"musical.{k}": v.contiguous() for k, v in model.musical.state_dict().items()})
    save_file(heads, str(partial / HEADS_FILE))
    del hf_model

    try:
        loaded, loading = HubertModel.from_pretrained(partial, output_loading_info=True)
        verification = compare_with_export(model, loaded, wav, audio_note, atol, rtol)
    except Exception:
        _replace_export(partial, failed, path)
        raise
    bad = {k: sorted(v) for k, v in loading.items() if v}
    sidecar = {
        "format_version": FORMAT_VERSION,
        **info,
        "source": {"checkpoint": str(ckpt.resolve()), "step": step},
        "export": {
            "norm_scheme": cfg.norm_scheme,
            "hubert_do_stable_layer_norm": spec.norm_before,
            "attention": cfg.attention,
            "attention_exported_as": "HubertAttention (plain softmax attention)",
            "deepnorm_alpha_folded": spec.residual_alpha if spec.residual_alpha != 1.0 else None,
            "layer_norm_eps": eps,
            "transformers_version": transformers_version,
            "torch_version": torch.__version__,
        },
        "pretraining_masking": {
            "mask_prob": cfg.mask_prob,
            "mask_length": cfg.mask_length,
            "hubert_mask_time_prob": SPEC_AUGMENT_PROB,
        },
        "heads": {
            "file": HEADS_FILE,
            "num_codebooks": cfg.num_codebooks,
            "codebook_size": cfg.codebook_size,
            "final_dim": cfg.final_dim,
            "logit_temp": cfg.logit_temp,
            "cqt_bins": cfg.cqt_bins,
            "cqt_bins_per_octave": cfg.cqt_bins_per_octave,
            "cqt_fmin": cfg.cqt_fmin,
            "musical_weight": cfg.musical_weight,
            "features_pen_weight": cfg.features_pen_weight,
        },
        "model_config": _plain(cfg),
        "verification": {
            "passed": verification.passed and not bad,
            "audio": verification.audio,
            "num_frames": verification.num_frames,
            "atol": atol,
            "rtol": rtol,
            "max_abs_error": dict(zip(verification.names, verification.max_abs)),
            "loading_problems": bad,
        },
    }
    (partial / SIDECAR).write_text(json.dumps(sidecar, indent=2))
    if bad or not verification.passed:
        _replace_export(partial, failed, path)
        raise ExportError(
            f"the exported model does not reproduce {ckpt}: states beyond |ours - hf| <= {atol:g} + "
            f"{rtol:g}*|ours|: {', '.join(verification.failing) or 'none'}; loading problems: "
            f"{bad or 'none'}; left in {failed}\n"
            f"{verification.table()}"
        )
    run_dir = resolve_checkpoint(path)[0]
    tokenizer = run_dir / "tokenizer.json"
    card = model_card(config_from_run(run_dir), run_dir.resolve(), step,
                      json.loads(tokenizer.read_text()) if tokenizer.is_file() else None,
                      sidecar["verification"], sum(p.numel() for p in loaded.parameters()), license)
    (partial / CARD).write_text(card)
    _replace_export(partial, out_dir, path)
    return ExportResult(out_dir, verification, str(ckpt))


def made_by_an_earlier_version(folder: Path) -> bool:
    """Whether the unmarked ``folder`` is an export of a version before markers: it holds an export's files
    and nothing else, its musiclm_stab.json among them with the export's format version."""
    try:
        names = {p.name for p in folder.iterdir()}
        sidecar = json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return False
    return names <= EXPORT_FILES and isinstance(sidecar, dict) and "format_version" in sidecar


def check_target(out_dir: Path, source: str | Path, overwrite: bool) -> None:
    """Refuse (ExportError), before any work, an export target that is not new, empty or an earlier export
    to be replaced (``overwrite``): the source run or checkpoint, a folder holding it, a run directory, a
    folder inside a checkpoint, anything the package did not make (removal.py)."""
    source = Path(source)
    checkpoints = source if (source / STATE_FILE).is_file() else source / "checkpoints"
    if is_inside(out_dir, checkpoints):
        raise ExportError(f"refusing to write the export to {out_dir}: it is inside {checkpoints}, which holds "
                          "the checkpoints; choose a folder outside it")
    if not (out_dir.exists() or out_dir.is_symlink()) or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    why = why_not_removable(out_dir, "export", sources=[source], recognised=made_by_an_earlier_version)
    if why is not None:
        raise ExportError(f"refusing to replace {out_dir}: {why}; choose another folder for the export")
    if not overwrite:
        raise ExportError(f"{out_dir} holds an earlier export; pass overwrite=True (--overwrite) to replace it")


def _replace_export(partial: Path, out_dir: Path, source: str | Path) -> None:
    """The complete ``partial`` in place of ``out_dir``, an earlier export only (checked again: removal.py)."""
    replace_output(partial, out_dir, "export", sources=[source], recognised=made_by_an_earlier_version)


def _plain(cfg: ModelConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab export", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/EXPORT.md (offline: musiclm-stab docs EXPORT)")
    p.add_argument("path", help="run directory (newest checkpoint) or a checkpoint directory")
    p.add_argument("out_dir", help="directory for the transformers checkpoint")
    p.add_argument("--audio", help="audio file to verify on (default: a Bach chorale rendered offline)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds of audio to verify on")
    p.add_argument("--atol", type=float, default=ATOL)
    p.add_argument("--rtol", type=float, default=RTOL)
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds an earlier export")
    p.add_argument("--license", help="the weights' licence for the model card, as the Hub names it (mit, "
                   "cc-by-4.0, ...; default: other, since it is the training data's)")
    args = p.parse_args(argv)
    try:
        result = export(
            args.path, args.out_dir, args.audio, args.seconds, args.overwrite, args.atol, args.rtol, args.license
        )
    except (ExportError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutputWriteError as e:  # a full disk: nothing was exported, the rerun exports
        print(f"error: {e}", file=sys.stderr)
        return 1
    v = result.verification
    print(
        f"exported {result.source} -> {result.out_dir}\nverified on {v.audio}, {v.num_frames} frames, "
        f"|ours - hf| <= {v.atol:g} + {v.rtol:g}*|ours|:\n{v.table()}"
    )
    print(f"load with: HubertModel.from_pretrained({str(result.out_dir)!r}); {PADDING_NOTE}")
    return 0
