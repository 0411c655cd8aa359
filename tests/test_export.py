"""Export to transformers.HubertModel: every hidden state against ours, refusals, padding, heads, CLI."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.testing import assert_close

from musiclm_stab.config import Config, save_config
from musiclm_stab.data.masking import span_mask
from musiclm_stab.export.exported import load_heads, mlm_losses, pad_for_export
from musiclm_stab.export.hubert import ATOL, RTOL, ExportError, cli_main, export
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.norm_schemes import deepnorm_alpha
from musiclm_stab.training.checkpoint import write_manifest
from musiclm_stab.training.trained import load_checkpoint

transformers = pytest.importorskip("transformers")

TINY = dict(size="tiny", cqt_bins=84, cqt_bins_per_octave=12, final_dim=32)


def make_run(root: Path, seed: int = 0, **model) -> Path:
    """A tiny run directory with one checkpoint; every weight perturbed so that no LayerNorm is the identity
    (a swapped norm or a missing bias would then go unnoticed)."""
    cfg = Config()
    for k, v in {**TINY, **model}.items():
        setattr(cfg.model, k, v)
    cfg.validate()
    torch.manual_seed(seed)
    net = MusicMLM(cfg.model)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    ckpt = root / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    save_config(cfg, root / "config.yaml")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(ckpt / "model.safetensors"))
    write_manifest(ckpt, 1, {"consumed_micro_batches": 1})  # lists and hashes its files, as the trainer's
    return root


_EXPORTS: dict[tuple, tuple[Path, Path]] = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run several times faster on one thread than on two contended ones (2-core CI)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def exported(tmp_path_factory):
    """exported(scheme, attention, num_layers) -> (run_dir, export_dir), made once per session."""

    def get(scheme: str, attention: str = "sdpa", num_layers: int = 2) -> tuple[Path, Path]:
        key = (scheme, attention, num_layers)
        if key not in _EXPORTS:
            root = tmp_path_factory.mktemp(f"{scheme}_{attention}")
            run = make_run(root / "run", norm_scheme=scheme, attention=attention, num_layers=num_layers)
            export(run, root / "hf")
            _EXPORTS[key] = (run, root / "hf")
        return _EXPORTS[key]

    return get


@pytest.mark.parametrize(
    "scheme, attention, num_layers",
    [
        ("pre", "sdpa", 2),
        ("post", "sdpa", 2),
        ("deepnorm", "sdpa", 4),
        ("pre", "relax", 2),
        ("post", "math", 2),
    ],
)
def test_every_hidden_state_matches_ours(exported, make_music, scheme, attention, num_layers):
    """Plain HubertModel.from_pretrained on the export gives our N+1 hidden states and output (atol=rtol=1e-4)."""
    run, out = exported(scheme, attention, num_layers)
    model, _, _ = load_checkpoint(run)
    hf = transformers.HubertModel.from_pretrained(out).eval()
    assert hf.config.do_stable_layer_norm is (scheme == "pre")
    wav = torch.from_numpy(np.stack([make_music(3.0, seed=1), make_music(3.0, seed=2)]))  # (2, 72000)
    with torch.no_grad():
        (ours_out, ours_hidden), _ = model.encode(wav, return_hidden=True)
        theirs = hf(pad_for_export(wav), output_hidden_states=True)
    assert len(theirs.hidden_states) == num_layers + 1 == len(ours_hidden)
    for ours, hf_state in zip(ours_hidden, theirs.hidden_states):
        assert_close(hf_state, ours, atol=ATOL, rtol=RTOL)
    assert_close(theirs.last_hidden_state, ours_out, atol=ATOL, rtol=RTOL)
    report = json.loads((out / "musiclm_stab.json").read_text())["verification"]
    assert report["passed"] and report["audio"].startswith("bach/")  # verified on a rendered chorale


def test_deepnorm_fold_differs_only_by_layernorm_eps(exported, make_music):
    """Folding alpha leaves eps where eps/alpha^2 would be exact: that accounts for nearly all of the difference."""
    run, out = exported("deepnorm", "sdpa", 4)
    model, _, _ = load_checkpoint(run)
    hf = transformers.HubertModel.from_pretrained(out).eval()
    wav = torch.from_numpy(make_music(3.0, seed=3))[None]
    with torch.no_grad():
        (_, ours), _ = model.encode(wav, return_hidden=True)

        def max_err():
            theirs = hf(pad_for_export(wav), output_hidden_states=True).hidden_states
            return max(float((a - b).abs().max()) for a, b in zip(ours, theirs))

        folded = max_err()
        for layer in hf.encoder.layers:  # the exact equivalent: LN(alpha z, eps) = LN(z, eps / alpha^2)
            layer.layer_norm.eps = layer.final_layer_norm.eps = 1e-5 / deepnorm_alpha(4) ** 2
        exact = max_err()
    assert 1e-6 < folded < ATOL and exact < folded / 3


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"norm_scheme": "sandwich"}, "model.norm_scheme=sandwich"),
        ({"norm_scheme": "subln"}, "model.norm_scheme=subln"),
        ({"norm_type": "rmsnorm"}, "model.norm_type=rmsnorm"),
        ({"qk_norm": True}, "model.qk_norm=true"),
    ],
)
def test_inexpressible_settings_are_refused(tmp_path, setting, match):
    """Settings HubertModel cannot express are refused by name, and nothing is written."""
    run = make_run(tmp_path / "run", **setting)
    with pytest.raises(ExportError, match=match):
        export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf*"))


def test_failed_verification_is_loud(tmp_path, monkeypatch):
    """A mapping error fails the export naming the layer, even one last_hidden_state hides; no OUT_DIR."""
    import musiclm_stab.export.hubert as ex

    mapped = ex.hubert_state_dict

    def wrong(model):
        sd = mapped(model)
        sd["encoder.layers.1.feed_forward.output_dense.bias"] += 1e-3
        return sd

    monkeypatch.setattr(ex, "hubert_state_dict", wrong)
    run = make_run(tmp_path / "run")
    # the final LayerNorm removes a uniform shift: only the per-layer comparison sees this error
    with pytest.raises(ExportError, match="does not reproduce .*: layer 2;"):
        export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and (tmp_path / "hf.unverified" / "model.safetensors").is_file()


def test_padding_is_explicit_and_recorded(exported):
    """Unpadded audio gives T-1 frames; pad_for_export gives T; the pad is in config.json and musiclm_stab.json."""
    _, out = exported("pre")
    hf = transformers.HubertModel.from_pretrained(out).eval()
    wav = torch.randn(1, 320 * 50) * 0.1
    with torch.no_grad():
        assert hf(wav).last_hidden_state.shape[1] == 49
        assert hf(pad_for_export(wav)).last_hidden_state.shape[1] == 50
    assert pad_for_export(np.zeros(330, np.float32)).shape == (640 + 80,)  # aligned to 2 frames, then padded
    assert pad_for_export(torch.zeros(2, 330), align=False).shape == (2, 410)
    assert json.loads((out / "config.json").read_text())["musiclm_stab"]["pad_samples"] == 40
    assert json.loads((out / "musiclm_stab.json").read_text())["pad_samples"] == 40
    fe = transformers.AutoFeatureExtractor.from_pretrained(out)
    assert (fe.sampling_rate, fe.do_normalize, type(fe).__name__) == (
        24000,
        False,
        "Wav2Vec2FeatureExtractor",
    )


@pytest.mark.parametrize("scheme", ["pre", "post"])
def test_heads_recompute_our_losses(exported, make_music, scheme):
    """Losses recomputed from the export and heads.safetensors equal MusicMLM.forward's, term by term."""
    run, out = exported(scheme)
    model, _, _ = load_checkpoint(run)
    hf = transformers.HubertModel.from_pretrained(out).eval()
    g = torch.Generator().manual_seed(0)
    wav = torch.from_numpy(np.stack([make_music(2.0, seed=4), make_music(2.0, seed=5)]))  # (2, 48000)
    codes = torch.randint(0, 1024, (2, 8, 150), generator=g)
    mask = span_mask(2, 150, 0.8, 5, g)
    with torch.no_grad():
        ours = model(wav, wav, codes, mask)
        theirs = mlm_losses(hf, load_heads(out), wav, wav, codes, mask)
    for name in (
        "loss",
        "acoustic_mlm_loss",
        "acoustic_ce",
        "acoustic_acc",
        "musical_mlm_loss",
        "features_pen",
    ):
        assert_close(getattr(theirs, name), getattr(ours, name), atol=1e-4, rtol=1e-4, msg=name)
    assert float(ours.acoustic_mlm_loss) > 1.0  # not a degenerate zero


def test_cli_export(tmp_path, capsys):
    """`musiclm-stab export` writes a verified export; a second run without --overwrite is refused."""
    run = make_run(tmp_path / "run", norm_scheme="post")
    ckpt = run / "checkpoints" / "step_00000001"
    assert cli_main([str(ckpt), str(tmp_path / "hf"), "--seconds", "2"]) == 0
    assert "last_hidden" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "musiclm_stab.json").read_text())["source"]["step"] == 1
    assert cli_main([str(run), str(tmp_path / "hf")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def _card_run(root: Path, evaluated: bool) -> Path:
    """A tiny run directory with the record a trained run has: its data's tokenizer.json, metrics.jsonl and,
    when ``evaluated``, eval/step_00000001.json as `musiclm-stab evaluate` writes it."""
    run = make_run(root / "run", norm_scheme="pre")
    cfg = Config()
    for k, v in TINY.items():
        setattr(cfg.model, k, v)
    cfg.train.name, cfg.data.path, cfg.train.max_steps = "card-run", "work/bach_tokens", 7
    save_config(cfg.validate(), run / "config.yaml")
    (run / "tokenizer.json").write_text(json.dumps({
        "model": "encodec_24khz", "weights": "local", "weights_sha256": "ab" * 32, "num_codebooks": 8,
        "codebook_size": 1024, "frame_rate": 75, "weights_note": "weights fitted on the chorales (<urlopen> | offline)",
        "source": "work/bach", "source_kind": "folder", "num_tracks": 24, "total_seconds": 1320.0}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.9, "eval/acoustic_mlm_loss/cb0": 9.75}) + "\n")
    if evaluated:
        (run / "eval").mkdir()
        (run / "eval" / "step_00000001.json").write_text(json.dumps({
            "eval/acoustic_mlm_loss/cb0": 9.512, "unit": "bits", "split": "eval", "data": "work/bach_tokens",
            "num_segments": 12, "masked_frames": 3456, "step": 1}))
    return run


def test_export_writes_a_model_card_from_the_runs_record(tmp_path):
    """The export's README.md says what the model is, its data and tokenizer, config, steps and held-out
    codebook-0 loss (eval/step_N.json), and how to load it: its code block loads the export and runs."""
    run = _card_run(tmp_path, evaluated=True)
    export(run, tmp_path / "hf", seconds=2)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    for fact in ("card-run", "2-layer transformer (128 wide, 4 heads, norm scheme `pre`", "1 of 7",
                 "`bach_tokens`", "`bach`", "24 tracks, 0.37 h of audio", "local weights (sha256 `abababababababab…`) |",
                 "**9.512 bits** at step 1", "12 segments", "HubertModel.from_pretrained", "pad_for_export",
                 "AdamW, peak lr", "| precision | fp32 |"):
        assert fact in card, fact
    code = card.split("```python\n")[1].split("```")[0].replace("path/to/this/folder", str(tmp_path / "hf"))
    scope = {"wav": torch.zeros(1, 24_000)}
    exec(code, scope)
    assert len(scope["out"].hidden_states) == 3 and scope["out"].hidden_states[-1].shape == (1, 75, 128)


def test_model_card_has_the_hubs_metadata_and_no_local_paths_or_errors(tmp_path):
    """The card's front matter has license (other unless --license names one) and pipeline_tag
    (feature-extraction); its body names the run, data, source and verification audio by their last
    component and describes the weights from their identity: no absolute path of this machine, no error text
    from the weights' note (a failed download's URLError); a licence that is not an identifier is refused."""
    run = _card_run(tmp_path, evaluated=True)
    cfg_text = (run / "config.yaml").read_text().replace("work/bach_tokens", str(tmp_path / "work" / "bach_tokens"))
    (run / "config.yaml").write_text(cfg_text)
    tokenizer = json.loads((run / "tokenizer.json").read_text())
    tokenizer.update(source=str(tmp_path / "work" / "bach"), weights_file="encodec_local_seed0.pt",
                     weights_provenance={"made_by": "musiclm-stab make-weights", "seed": 0},
                     weights_note=f"local weights because: <urlopen error [Errno -3] name resolution> ({tmp_path})")
    (run / "tokenizer.json").write_text(json.dumps(tokenizer))
    evaluated = json.loads((run / "eval" / "step_00000001.json").read_text())
    (run / "eval" / "step_00000001.json").write_text(json.dumps({**evaluated, "data": str(tmp_path / "work" / "bach_tokens")}))
    audio = tmp_path / "clip.wav"
    import soundfile as sf

    sf.write(audio, np.zeros(48_000, dtype=np.float32) + 0.01, 24_000)
    export(run, tmp_path / "hf", audio=audio, seconds=2)
    card = (tmp_path / "hf" / "README.md").read_text()
    front = card.split("---\n")[1].splitlines()
    assert "license: other" in front and "pipeline_tag: feature-extraction" in front, front
    assert str(tmp_path) not in card and str(run.resolve()) not in card, card
    assert "urlopen" not in card and "Errno" not in card, card
    for fact in ("| data | `bach_tokens`", "| source | `bach`", "`bach_tokens` (12 segments", "clip.wav (first 2.00 s)",
                 "local weights `encodec_local_seed0.pt` made by `musiclm-stab make-weights` (seed 0)",
                 "(run directory `run`)", "`musiclm-stab export --license`"):
        assert fact in card, fact
    targets = next(line for line in card.splitlines() if line.startswith("| targets |"))
    assert targets.replace("\\|", "").count("|") == 3
    export(run, tmp_path / "hf", seconds=2, overwrite=True, license="cc-by-4.0")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "license: cc-by-4.0" in card.split("---\n")[1].splitlines() and "named it `cc-by-4.0`" in card
    with pytest.raises(ExportError, match="licence identifier"):
        export(run, tmp_path / "hf2", seconds=2, license="MIT\npipeline_tag: x")
    assert not (tmp_path / "hf2").exists()


def test_model_card_without_an_evaluation_says_where_the_loss_comes_from(tmp_path):
    """Without eval/step_N.json the card takes the step's eval/ column of metrics.jsonl (train.eval_every),
    and without either it says how to get the loss instead of inventing one."""
    run = _card_run(tmp_path, evaluated=False)
    export(run, tmp_path / "hf", seconds=2)
    assert "**9.750 bits** at step 1, evaluated during training" in (tmp_path / "hf" / "README.md").read_text()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.9}) + "\n")
    export(run, tmp_path / "hf", seconds=2, overwrite=True)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "not recorded for this step: run `musiclm-stab evaluate RUN`" in card and "bits**" not in card


def test_model_card_reads_only_the_held_out_record_of_the_runs_own_data(tmp_path):
    """The card's held-out loss is eval/step_N.json's only when that record is of the held-out split of the
    run's own data: an earlier version wrote `evaluate --split train` there (kept readable: it is passed
    over, as is a record of other data), and a train-split record of its own name is never read (before: the
    card printed the train loss under "Held-out loss")."""
    run = _card_run(tmp_path, evaluated=False)
    (run / "eval").mkdir()
    record = {"eval/acoustic_mlm_loss/cb0": 1.234, "unit": "bits", "split": "train", "data": "work/bach_tokens",
              "num_segments": 12, "masked_frames": 3456, "step": 1}
    (run / "eval" / "step_00000001.json").write_text(json.dumps(record))  # as the old evaluate --split train
    (run / "eval" / "step_00000001.train.json").write_text(json.dumps(record))
    export(run, tmp_path / "hf", seconds=2)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "**9.750 bits** at step 1, evaluated during training" in card and "1.234" not in card
    (run / "eval" / "step_00000001.json").write_text(json.dumps({**record, "split": "eval", "data": "elsewhere"}))
    export(run, tmp_path / "hf", seconds=2, overwrite=True)
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "**9.750 bits** at step 1, evaluated during training" in card and "1.234" not in card
    (run / "eval" / "step_00000001.json").write_text(json.dumps({**record, "split": "eval"}))
    export(run, tmp_path / "hf", seconds=2, overwrite=True)
    assert "**1.234 bits** at step 1, on the eval split of `bach_tokens`" in (tmp_path / "hf" / "README.md").read_text()


def test_export_without_transformers_names_the_extra(tmp_path):
    """With transformers not importable, `musiclm-stab export` fails in one line naming the `export` extra
    (exit 2, no traceback) and writes nothing."""
    import subprocess
    import sys

    run = make_run(tmp_path / "run", norm_scheme="pre")
    script = ("import sys; sys.modules['transformers'] = None\n"  # `import transformers` now raises ImportError
              "from musiclm_stab.cli import main\n"
              f"sys.exit(main(['export', {str(run)!r}, {str(tmp_path / 'hf')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export needs transformers"), proc.stderr
    assert "pip install 'musiclm_stab[export]'" in lines[0]
    assert not (tmp_path / "hf").exists()


def test_a_full_disk_while_exporting_is_one_line(tmp_path, monkeypatch, capsys):
    """A disk that fills while the export is written (safetensors' SafetensorError naming the OS error, at the
    heads file) stops with exit 1 and one line: what could not be written, the reason and the free space, and
    to free space and rerun; the rerun then exports (before: a SafetensorError traceback)."""
    import errno
    import os

    from safetensors import SafetensorError

    import musiclm_stab.export.hubert as hubert

    run = make_run(tmp_path / "run", norm_scheme="pre")
    out = tmp_path / "hf"

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hubert, "save_file", full)
    capsys.readouterr()
    assert cli_main([str(run), str(out), "--seconds", "2"]) == 1
    err = capsys.readouterr().err  # transformers' progress bar, then the error
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: cannot write the export {out}: {os.strerror(errno.ENOSPC)} ("), err
    assert errors[0].endswith(" MB free). The export was not written: free some space, then rerun the same command")
    assert not out.exists()
    monkeypatch.undo()
    assert cli_main([str(run), str(out), "--seconds", "2"]) == 0


def test_a_real_full_disk_while_exporting(tmp_path, capsys):
    """The same on a real small file system (a 1 MB tmpfs; the weights need 5 MB; needs the right to mount,
    else skipped): one line, exit 1; after freeing space (the tmpfs made larger) the rerun exports."""
    import subprocess

    run = make_run(tmp_path / "run", norm_scheme="pre")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN): the other test simulates it")
    try:
        capsys.readouterr()
        assert cli_main([str(run), str(disk / "hf"), "--seconds", "2"]) == 1
        err = capsys.readouterr().err  # transformers' progress bar, then the error
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err and "No space left on device" in errors[0], err
        assert errors[0].startswith(f"error: cannot write the export {disk / 'hf'}: ") and \
            errors[0].endswith("free some space, then rerun the same command"), err
        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        assert cli_main([str(run), str(disk / "hf"), "--seconds", "2"]) == 0, capsys.readouterr().err
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
