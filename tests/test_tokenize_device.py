"""The same tokens on CPU and GPU: TF32 is off wherever the encoder runs, the device type is recorded, and
shards made on different device types merge and load with a warning instead of being refused."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import soundfile as sf
import torch

import musiclm_stab.tokenizer.units as units_mod
from musiclm_stab.data.tokenized import DeviceMixWarning, load_tokenized
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.tokenizer.store import OutputMismatch

SR = 24_000
KNOBS = {"cudnn.conv": torch.backends.cudnn.conv, "cudnn.rnn": torch.backends.cudnn.rnn,
         "cuda.matmul": torch.backends.cuda.matmul}
IEEE = {name: "ieee" for name in KNOBS}


@pytest.fixture
def tf32_on():
    """TF32 on for cuDNN convolutions, cuDNN RNNs and CUDA matmuls in this process (torch's fp32_precision
    API; the flags exist without a GPU), restored after."""
    before = {name: knob.fp32_precision for name, knob in KNOBS.items()}
    for knob in KNOBS.values():
        knob.fp32_precision = "tf32"
    yield
    for name, knob in KNOBS.items():
        knob.fp32_precision = before[name]


@pytest.fixture(scope="module")
def src(tmp_path_factory, make_music):
    """Four 1 s tracks, one unit each (part_tracks=1): 2 rows of 0.5 s per track."""
    folder = tmp_path_factory.mktemp("device") / "src"
    folder.mkdir()
    for i in range(4):
        sf.write(folder / f"t{i}.wav", make_music(1.0, seed=900 + i), SR)
    return folder


def test_tf32_is_off_where_the_encoder_runs(src, local_weights, tmp_path, tf32_on, monkeypatch):
    """With TF32 on in the caller, every encode runs with it off: in this process (seen at each
    encode_batch call, the caller's settings restored after) and in worker processes (each unit's record
    says "ieee" for cuDNN conv, cuDNN RNN and CUDA matmul); tokenizer.json records device cpu, tf32 false."""
    seen = []
    real = units_mod.encode_batch

    def spy(model, pcm):
        seen.append({name: knob.fp32_precision for name, knob in KNOBS.items()})
        return real(model, pcm)

    monkeypatch.setattr(units_mod, "encode_batch", spy)
    kw = dict(weights=str(local_weights), segment_seconds=0.5, min_seconds=0.1, part_tracks=1, progress=False)
    tokenize(src, tmp_path / "in_process", workers=0, **kw)
    assert seen and all(s == IEEE for s in seen)
    assert all(knob.fp32_precision == "tf32" for knob in KNOBS.values())  # restored

    tokenize(src, tmp_path / "workers", workers=2, **kw)
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "workers" / ".tokenize" / "units").iterdir())]
    assert len(records) == 4 and all(r["fp32_precision"] == IEEE for r in records)
    assert all(r["pid"] != os.getpid() for r in records)  # encoded in the workers (how many units each got
    # is the scheduler's choice: one worker may take all four while the other still loads its model)
    meta = json.loads((tmp_path / "workers" / "tokenizer.json").read_text())
    assert (meta["device"], meta["tf32"]) == ("cpu", False)


def _as_if_made_on(out, device: str) -> None:
    """Rewrite what a run with --device DEVICE writes differently: job.json's encode.device and
    tokenizer.json's device (the codes a GPU would make are the same tokenizer's, not bit-identical)."""
    job_path = out / ".tokenize" / "job.json"
    job = json.loads(job_path.read_text())
    job["encode"]["device"] = device
    job_path.write_text(json.dumps(job))
    meta_path = out / "tokenizer.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "device": device}))


def test_shards_from_different_device_types_merge_and_load_with_a_warning(src, local_weights, tmp_path):
    """Shard 1/2 recorded as tokenized on cuda: loading the two shards together and merging them warn
    (DeviceMixWarning naming both devices) instead of refusing; the merge records device "mixed" and
    loading it warns too; shards of one device type load without a warning; resuming one output on
    another device type is still refused, naming encode.device."""
    kw = dict(weights=str(local_weights), segment_seconds=0.5, min_seconds=0.1, part_tracks=1, progress=False,
              workers=0)
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for i, out in enumerate(shards):
        tokenize(src, out, shard=f"{i}/2", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one device type: no warning
        same, _ = load_tokenized(shards)
    _as_if_made_on(shards[1], "cuda")

    with pytest.warns(DeviceMixWarning, match=r"shard0: cpu, .*shard1: cuda.*not bit-identical.*has not been measured"):
        mixed, info = load_tokenized(shards)
    assert mixed["id"] == same["id"] and info["device"] == "mixed"  # still the single-run order
    with pytest.warns(DeviceMixWarning, match="Merging data tokenized on different device types"):
        meta = merge_shards(tmp_path / "merged", shards)
    assert meta["device"] == "mixed" and meta["num_rows"] == 8
    with pytest.warns(DeviceMixWarning, match=r"merged: mixed"):
        merged, _ = load_tokenized(tmp_path / "merged")
    assert merged["id"] == same["id"]

    with pytest.raises(OutputMismatch, match=r"(?s)encode.device: 'cuda' \(existing output\) != 'cpu'.*another folder"):
        tokenize(src, shards[1], shard="1/2", **kw)
