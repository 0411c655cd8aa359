"""Loading EnCodec (pretrained or local), weights identity by sha256, and making local weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error

import pytest
import torch

from musiclm_stab.threads import one_thread
from musiclm_stab.tokenizer.fit import cli_main, codebook_usage, make_local_weights
from musiclm_stab.tokenizer.kmeans import exact_grid, held_out_residual, kmeans, snap
from musiclm_stab.tokenizer.weights import (
    PRETRAINED_CHECKPOINT,
    WeightsUnavailable,
    _new_model,
    load_encodec,
    weights_sha256,
)

SR = 24_000


def _online() -> bool:
    try:
        socket.create_connection(("dl.fbaipublicfiles.com", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.fixture
def empty_hub(tmp_path):
    """torch.hub pointed at an empty folder, so no cached checkpoint can answer."""
    old = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    yield tmp_path / "hub"
    torch.hub.set_dir(old)


def test_pretrained_without_internet_raises_with_how_to(empty_hub):
    """Offline, the real pretrained download fails and raises WeightsUnavailable with the ways out."""
    if _online():
        pytest.skip("the internet is reachable here; the offline path cannot be exercised for real")
    with pytest.raises(WeightsUnavailable) as e:
        load_encodec(None)
    msg = str(e.value)
    assert "connect to the internet" in msg
    assert f"{empty_hub}/checkpoints" in msg and PRETRAINED_CHECKPOINT in msg
    assert "--weights FILE" in msg and "musiclm-stab make-weights" in msg


def test_download_failure_never_falls_back(monkeypatch, empty_hub):
    """A URLError from the package's own downloader becomes WeightsUnavailable, not a silent fallback."""
    def fail(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", fail)
    with pytest.raises(WeightsUnavailable, match="no route to host") as e:
        load_encodec(None)
    assert isinstance(e.value, RuntimeError) and "--weights FILE" in str(e.value)


def test_local_weights_load_with_full_info(local_weights):
    """A local file loads strictly at 6 kbps in eval mode; info names it and carries its sha256."""
    model, info = load_encodec(str(local_weights))
    sidecar = json.loads(local_weights.with_name(local_weights.name + ".json").read_text())
    assert {k: v for k, v in info.items() if k != "weights_provenance"} == {
        k: v for k, v in sidecar.items() if k != "provenance"}
    assert info["weights_provenance"] == sidecar["provenance"]
    assert {k: info[k] for k in ("model", "weights", "weights_file", "bandwidth", "sample_rate", "frame_rate",
                                 "hop_length", "num_codebooks", "codebook_size")} == {
        "model": "encodec_24khz", "weights": "local", "weights_file": "encodec_local.th", "bandwidth": 6.0,
        "sample_rate": 24000, "frame_rate": 75, "hop_length": 320, "num_codebooks": 8, "codebook_size": 1024}
    assert len(info["weights_sha256"]) == 64 and info["weights_sha256"] == weights_sha256(model.state_dict())
    assert model.bandwidth == 6.0 and not model.training
    codes = model.encode(torch.zeros(1, 1, 3200))[0][0]
    assert codes.shape == (1, 8, 10)


def test_identical_weights_same_sha_different_weights_different_sha(local_weights, tmp_path):
    """The sha256 depends on the weights only: a renamed copy matches, one changed value does not."""
    copy = tmp_path / "renamed.th"
    shutil.copy(local_weights, copy)
    _, info_a = load_encodec(str(local_weights))
    model_b, info_b = load_encodec(str(copy))
    assert info_a["weights_sha256"] == info_b["weights_sha256"]
    assert info_a["weights_file"] != info_b["weights_file"]
    # provenance comes from make-weights' side file, and only when it describes these very weights
    assert "weights_provenance" in info_a and "weights_provenance" not in info_b
    copy.with_name(copy.name + ".json").write_text(json.dumps({"weights_sha256": "0" * 64, "provenance": {}}))
    assert "weights_provenance" not in load_encodec(str(copy))[1]
    state = model_b.state_dict()
    state["quantizer.vq.layers.0._codebook.embed"][0, 0] += 1e-6
    assert weights_sha256(state) != info_a["weights_sha256"]


def test_fitted_codebooks_give_many_distinct_codes(local_weights, make_music):
    """Unlike a fresh model (all codes 0), fitted weights use >= 20 codes per level on 5 s of new audio."""
    x = torch.from_numpy(make_music(5.0, seed=999)).view(1, 1, -1)
    fresh = _new_model(pretrained=False)
    fresh.set_target_bandwidth(6.0)
    with torch.inference_mode(), one_thread():
        assert fresh.encode(x)[0][0].eq(0).all()  # why local weights must be fitted
        model, _ = load_encodec(str(local_weights))
        codes = model.encode(x)[0][0][0]  # (K, T)
    assert codes.shape == (8, 375)
    distinct = [len(codes[k].unique()) for k in range(8)]
    # Measured [193, 143-144, 117, 94-95, 66-67, 61-62, 54, 57] (ATEN_CPU_CAPABILITY=default / avx2; the
    # weights are the same bytes on both, the float32 encode differs at near-ties): 20 leaves 2.7x margin.
    assert min(distinct) >= 20, distinct


def test_made_weights_are_the_same_bytes_on_every_cpu(local_weights, tmp_path):
    """make-weights gives the same file with the plainest CPU kernels in 2 worker processes as the session
    fixture made in-process with this CPU's best kernels (ATEN_CPU_CAPABILITY unset) and torch's threads."""
    audio = sorted((local_weights.parent / "audio").glob("*.wav"))
    script = (
        "import sys\n"
        "from musiclm_stab.tokenizer.fit import make_local_weights\n"
        "if __name__ == '__main__':\n"
        "    make_local_weights(sys.argv[2:], sys.argv[1], seed=0, max_seconds=60, iters=8, progress=False,\n"
        "                       workers=2)\n"
    )
    out = tmp_path / "plain_cpu.th"  # not beside local_weights: the session's workers share that folder
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run([sys.executable, "-c", script, str(out), *map(str, audio)], env=env, check=True, timeout=600)
    assert out.read_bytes() == local_weights.read_bytes()


def test_provenance_says_what_the_sha_depends_on_and_codebook_usage(local_weights, capsys):
    """The side file records the audio's sha256, versions, what the sha256 depends on and per-level usage."""
    prov = load_encodec(str(local_weights))[1]["weights_provenance"]
    assert len(prov["audio_sha256"]) == 64 and prov["torch_version"] and prov["encodec_version"] == "0.1.1"
    assert any("seed" in d for d in prov["sha256_depends_on"])
    usage = prov["codebook_usage_on_fitting_audio"]
    assert len(usage) == 8 and all(1 <= u["perplexity"] <= u["codes_used"] <= 1024 for u in usage)


def test_codebook_usage_counts_codes_and_perplexity():
    """Perplexity is exp(entropy): 4 codes equally often give 4, one code gives 1."""
    codes = torch.tensor([[0, 1, 2, 3] * 5, [7] * 20])
    assert codebook_usage(codes) == [{"codes_used": 4, "perplexity": 4.0}, {"codes_used": 1, "perplexity": 1.0}]


def test_kmeans_on_an_exact_grid_keeps_centroids_on_it():
    """With a grid step, k-means centroids stay multiples of the step (where float64 sums are exact)."""
    x = torch.randn(500, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    step = exact_grid(x)
    assert float(x.abs().max()) < step * 2**21 <= 2 * float(x.abs().max())
    c, _, _ = kmeans(snap(x, step), 32, 10, torch.Generator().manual_seed(0), step=step)
    assert torch.equal(c, snap(c, step)) and torch.equal(c.float().double(), c)  # float32 holds them as they are


def test_make_local_weights_is_reproducible_and_seeded(tmp_path, make_music):
    """Same inputs and seed give the same file bytes and sha; another seed gives another sha."""
    waves = [torch.from_numpy(make_music(1.0, seed=s)) for s in (1, 2)]  # short: 3 makes, ~0.5 s a second each
    rng_before = torch.get_rng_state()
    a = make_local_weights(waves, tmp_path / "a.th", seed=3, iters=4, progress=False)
    b = make_local_weights(waves, tmp_path / "b.th", seed=3, iters=4, progress=False)
    c = make_local_weights(waves, tmp_path / "c.th", seed=4, iters=4, progress=False)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]
    assert (tmp_path / "a.th").read_bytes() == (tmp_path / "b.th").read_bytes()
    assert a["provenance"]["seconds_used"] == 2.0 and a["provenance"]["num_frames"] == 150
    assert load_encodec(str(tmp_path / "a.th"))[1]["weights_sha256"] == a["weights_sha256"]


def test_max_seconds_limits_the_sample(tmp_path, make_music):
    """With more audio than max_seconds, only whole chunks (chunk_seconds) up to the limit are encoded; [C, S]
    is refused."""
    # 2 s chunks (the default 10 s would encode 10 s of audio, ~5 s of CPU, for the same proof): 4 chunks, 2 kept
    waves = [torch.from_numpy(make_music(4.0, seed=s)) for s in (5, 6)]
    info = make_local_weights(waves, tmp_path / "w.th", seed=0, max_seconds=5, chunk_seconds=2.0, iters=2,
                              progress=False)
    assert info["provenance"]["seconds_used"] == 4.0 and info["provenance"]["num_frames"] == 300
    with pytest.raises(ValueError, match="mono"):
        make_local_weights([torch.zeros(2, 24_000)], tmp_path / "x.th", progress=False)


def test_load_rejects_unfitted_and_foreign_files(tmp_path):
    """Unfitted (all-zero codebook) weights, non-state-dict files and missing files raise clearly."""
    fresh = _new_model(pretrained=False)
    torch.save(fresh.state_dict(), tmp_path / "unfitted.th")
    with pytest.raises(ValueError, match="codebook 0 is all zeros"):
        load_encodec(str(tmp_path / "unfitted.th"))
    (tmp_path / "text.th").write_text("hello")
    with pytest.raises(ValueError, match="not a readable torch state dict"):
        load_encodec(str(tmp_path / "text.th"))
    torch.save({"encoder.bogus": torch.zeros(1)}, tmp_path / "other.th")
    with pytest.raises(ValueError, match="not an EnCodec 24 kHz state dict"):
        load_encodec(str(tmp_path / "other.th"))
    with pytest.raises(FileNotFoundError):
        load_encodec(str(tmp_path / "missing.th"))


def test_kmeans_converges_to_a_seeded_fixed_point_using_every_code():
    """k-means ends with centroids = cluster means, nearest assignment, all codes used, seeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(300, 16, generator=g), torch.zeros(100, 16)])  # 100 duplicate points
    c, assign, counts = kmeans(x, 64, 50, torch.Generator().manual_seed(1), tol=0.0)
    assert (counts > 0).all() and counts.sum() == 400
    assert torch.equal(assign, torch.cdist(x, c).argmin(dim=1))
    means = torch.zeros_like(c).index_add_(0, assign, x) / counts[:, None]
    torch.testing.assert_close(c, means)
    inertia = (x - c[assign]).pow(2).sum()
    distinct = torch.unique(x, dim=0)  # the draw k-means starts from: 64 of the distinct points
    start = distinct[torch.randperm(len(distinct), generator=torch.Generator().manual_seed(1))[:64]]
    start_inertia = torch.cdist(x, start).min(dim=1).values.pow(2).sum()
    # measured ratio 0.601 (default and AVX2 kernels alike); 0.9 leaves a margin of 0.3, while k-means
    # that stopped at its starting point would give 1.0
    assert inertia < 0.9 * start_inertia, float(inertia / start_inertia)
    c2, assign2, _ = kmeans(x, 64, 50, torch.Generator().manual_seed(1), tol=0.0)
    assert torch.equal(c, c2) and torch.equal(assign, assign2)
    c3, _, _ = kmeans(x, 64, 50, torch.Generator().manual_seed(2), tol=0.0)
    assert not torch.equal(c, c3)
    few = kmeans(x[:10], 64, 5, torch.Generator().manual_seed(0))[0]  # fewer points than codes
    assert few.shape == (64, 16) and torch.isfinite(few).all()


def test_held_out_residual_is_leave_one_out():
    """The residual equals x minus the centroid refitted without that point (next-nearest if alone)."""
    x = torch.tensor([[0.0], [2.0], [10.0], [20.0]])
    centroids = torch.tensor([[1.0], [10.0], [20.0]])
    assign = torch.tensor([0, 0, 1, 2])
    counts = torch.tensor([2, 1, 1])
    r = held_out_residual(x, centroids, assign, counts)
    # points 0 and 1: the other point of their cluster; 10 and 20 are alone: their next-nearest centroid
    assert r.squeeze(1).tolist() == [0.0 - 2.0, 2.0 - 0.0, 10.0 - 1.0, 20.0 - 10.0]


def test_make_weights_cli(tmp_path, make_music, capsys):
    """`musiclm-stab make-weights SRC OUT` writes loadable weights and refuses to overwrite them."""
    import soundfile as sf

    (tmp_path / "audio").mkdir()
    sf.write(tmp_path / "audio" / "a.wav", make_music(2.0, seed=7), SR)  # short: the encoder costs ~0.5 s a second
    (tmp_path / "audio" / "broken.wav").write_text("no")
    out = tmp_path / "w.th"
    assert cli_main([str(tmp_path / "audio"), str(out), "--max-seconds", "20", "--iters", "2"]) == 0
    printed = capsys.readouterr().out
    _, info = load_encodec(str(out))
    assert info["weights_sha256"] in printed and "1 unreadable" in printed and "perplexity" in printed
    assert info["weights_provenance"]["skipped_sources"][0]["path"].endswith("broken.wav")
    with pytest.raises(SystemExit):
        cli_main([str(tmp_path / "audio"), str(out)])
    assert "--overwrite" in capsys.readouterr().err
