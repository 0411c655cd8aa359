"""Study recipes: each resolves to its run's scheme, attention form, clip, precision and legend; tiny twins run."""

import shlex
from pathlib import Path

import pytest
import torch

from musiclm_stab.analysis.plot import run_label
from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.data.masking import span_mask
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.fp16_arith import Fp16Emulation, round_parameters_
from musiclm_stab.training.run_dir import global_batch_crops, resolve_grad_accum, warmup_line

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

# file stem -> (legend, norm_scheme, attention, clip_grad, run)
STUDY = {
    "study_prenorm_clip10_run1": ("Pre-Norm | Gradient Clip=10 | Run 1", "pre", "math", 10.0, 1),
    "study_prenorm_clip1_run2": ("Pre-Norm | Gradient Clip=1 | Run 2", "pre", "math", 1.0, 2),
    "study_postnorm_deepnorm_clip1": ("Post-Norm | DeepNorm | Gradient Clip=1", "deepnorm", "math", 1.0, 1),
    "study_prenorm_attnrelax_clip1": ("Pre-Norm | Attn. Relax | Gradient Clip=1", "pre", "relax", 1.0, 1),
    # the instability study's positive control (docs/STUDY.md)
    "study_postnorm_clip1": ("Post-Norm | Gradient Clip=1 | Run 1", "post", "math", 1.0, 1),
}


def _twin_command(path: Path) -> list[str]:
    """The tiny-twin command documented in the recipe's header comment: the recipe, then the overlay."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#") and "overlays/tiny.yaml" in ln]
    assert len(lines) == 1, f"{path.name}: expected one documented tiny-twin command"
    argv = shlex.split(lines[0].lstrip("# "))  # what the shell would pass
    assert argv == ["accelerate", "launch", "recipes/pretrain.py", "--config", f"recipes/{path.name}",
                    "--config", "recipes/overlays/tiny.yaml"]
    return [RECIPES.parent / argv[4], RECIPES.parent / argv[6]]


def test_study_recipe_set_is_complete():
    """recipes/ holds exactly the study's runs, one YAML each with a legend of its own: the seed figures' four
    and the instability study's plain Post-Norm control."""
    assert {p.stem for p in RECIPES.glob("study_*.yaml")} == set(STUDY)
    assert len({v[0] for v in STUDY.values()}) == len(STUDY) == 5


@pytest.mark.parametrize("stem", STUDY)
def test_study_recipe_resolves_to_intended_run(stem):
    """MERT-330M's settings (config/pretrain/MERT_RVQ-VAE_CQT_330M.yaml, docs/FIDELITY.md) except the
    scheme / attention form / clip the run varies: large size, fairseq fp16, MERT's dropouts,
    feature_grad_mult, final_dim, init, masking, mixup, CQT, loss weights, optimizer, global batch, warmup and
    schedule, crop, bits."""
    label, scheme, attention, clip, run = STUDY[stem]
    cfg = load_config(RECIPES / f"{stem}.yaml")
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    assert (m.size, m.num_layers, m.width, m.ffn_dim, m.num_heads, m.conv_dim) == ("large", 24, 1024, 4096, 16, 512)
    assert (m.norm_scheme, m.attention, m.norm_type, m.qk_norm) == (scheme, attention, "layernorm", False)
    assert m.relax_alpha == 32.0  # attention_relax: 32.0
    assert (m.dropout, m.attention_dropout, m.activation_dropout, m.feature_dropout, m.layerdrop) == (0, 0, 0, 0, 0)
    assert (m.feature_grad_mult, m.final_dim, m.logit_temp, m.init) == (1.0, 128, 0.1, "mert")
    assert (m.mask_prob, m.mask_length, m.require_same_masks) == (0.8, 5, True)
    assert (m.cqt_bins, m.cqt_bins_per_octave, m.cqt_fmin) == (336, 48, 32.7)
    assert (m.features_pen_weight, m.musical_weight) == (10.0, 1.0)  # loss_weights: [10, 1]
    assert (d.mixup_mode, d.mixup_prob, d.mixup_max_segments) == ("mert", 0.5, 3)
    assert (d.mixup_min_seconds, d.mixup_max_seconds) == (0.5, 1.5)  # [12000, 36000] samples
    assert (d.crop_seconds, d.batch_size) == (5.12, 7)  # max_sample_size 122880; max_tokens 920000 per GPU
    assert (o.clip_mode, o.clip_grad) == ("fixed", clip)
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (1.5e-3, (0.9, 0.98), 1e-6, 0.01)
    assert (o.warmup_steps, t.max_steps, t.stop_at) == (32000, 400000, 100000)  # MERT's schedule; the study's 100k
    assert t.global_batch_crops == 7 * 64 * 8  # per GPU x 64 GPUs x update_freq 8
    assert (t.mixed_precision, t.fp16_mode, t.fp16_init_scale, t.fp16_min_loss_scale) == ("fp16", "fairseq", 128, 1e-4)
    assert (t.run, t.name, t.loss_unit) == (run, stem, "bits")
    assert t.label is None  # the legend is derived, not typed in


@pytest.mark.parametrize("stem", STUDY)
def test_study_recipe_legend(stem):
    """plot.run_label of the resolved config is exactly the study's legend text (and the header quotes it)."""
    cfg = load_config(RECIPES / f"{stem}.yaml")
    assert run_label(cfg.to_dict()) == STUDY[stem][0]
    assert f'"{STUDY[stem][0]}"' in (RECIPES / f"{stem}.yaml").read_text().splitlines()[0]


@pytest.mark.parametrize("stem", STUDY)
def test_tiny_twin_validates_and_runs(stem):
    """The documented tiny twin (recipe + overlay) validates, keeps the run's identity and precision, and runs
    fwd/bwd on CPU in fairseq fp16 (emulated)."""
    label, scheme, attention, clip, run = STUDY[stem]
    cfg = load_config(_twin_command(RECIPES / f"{stem}.yaml"))
    m = cfg.model
    assert (m.size, m.num_layers, m.width, m.final_dim, m.dropout) == ("tiny", 2, 128, 64, 0.1)
    assert (m.norm_scheme, m.attention, cfg.optim.clip_grad, cfg.train.run) == (scheme, attention, clip, run)
    assert (cfg.train.mixed_precision, cfg.train.fp16_mode, cfg.train.name) == ("fp16", "fairseq", stem)
    assert (cfg.train.global_batch_crops, cfg.train.stop_at, cfg.optim.warmup_steps) == (None, None, 20)
    assert run_label(cfg.to_dict()) == label

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on shared cores: threads only add overhead
    try:
        torch.manual_seed(0)
        model = MusicMLM(cfg.model)
        round_parameters_(model)  # an fp16 model's weights
        g = torch.Generator().manual_seed(0)
        T = 40
        wav = 0.1 * torch.randn(1, 320 * T, generator=g)
        codes = torch.randint(0, m.codebook_size, (1, m.num_codebooks, T), generator=g)
        with Fp16Emulation("fairseq"):
            out = model(wav, wav, codes, span_mask(1, T, m.mask_prob, m.mask_length, g))
            out.loss.backward()
    finally:
        torch.set_num_threads(threads)
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_global_batch_crops_sets_grad_accum_per_process_count():
    """train.global_batch_crops=3584 (MERT-330M's update) with 7 crops per process gives grad_accum 8 on 64
    processes, 64 on 8, 512 on one, always 3584 crops per update; a count that does not divide it, or an
    explicit grad_accum that disagrees, is refused naming the numbers; the banner states batch and warmup."""
    cfg = load_config(RECIPES / "study_prenorm_clip1_run2.yaml")
    for processes, accum in ((64, 8), (8, 64), (1, 512)):
        resolved = resolve_grad_accum(cfg, processes)
        assert resolved.train.grad_accum == accum and global_batch_crops(resolved, processes) == 3584
    with pytest.raises(ConfigError, match=r"global_batch_crops=3584 is not a multiple of data.batch_size 7 x 6 "
                                          r"process\(es\) = 42"):
        resolve_grad_accum(cfg, 6)
    both = load_config(RECIPES / "study_prenorm_clip1_run2.yaml", ["--train.grad_accum=3"])
    with pytest.raises(ConfigError, match="train.grad_accum=3 and train.global_batch_crops=3584 both set"):
        resolve_grad_accum(both, 64)
    line = warmup_line(resolve_grad_accum(cfg, 64), 64)
    assert line.startswith("warmup 32000 updates = 114,688,000 crops") and "stopping at step 100000" in line
