"""Crash safety: SIGTERM checkpoints and exits cleanly, SIGKILL + --resume matches an uninterrupted run,
a damaged checkpoint is named and skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from musiclm_stab import checkpoint

REPO = Path(__file__).resolve().parent.parent


def start(data: Path, out: Path, name: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "recipes" / "pretrain.py"), "--config", str(REPO / "recipes" / "tiny.yaml"),
           f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}", "--data.crop_seconds=2.0",
           "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=2",
           "--train.checkpoint_every=2", "--train.keep_checkpoints=10", *extra]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= step for r in rows(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"run never reached step {step} (exit {proc.poll()})")


@pytest.fixture(scope="module")
def reference(tokenized_dataset, tmp_path_factory):
    """An uninterrupted 6-step run."""
    out = tmp_path_factory.mktemp("ref")
    finish(start(tokenized_dataset, out, "ref", "--train.max_steps=6"))
    return rows(out / "ref")


def test_sigkill_then_resume_matches_uninterrupted(tokenized_dataset, tmp_path, reference):
    """A run killed with SIGKILL after step 3 and resumed logs the same metrics as an uninterrupted run."""
    proc = start(tokenized_dataset, tmp_path, "k", "--train.max_steps=6")
    wait_for_step(proc, tmp_path / "k", 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(tmp_path / "k")][-1] >= 2
    finish(start(tokenized_dataset, tmp_path, "k", "--train.max_steps=6", "--resume"))
    final = {}
    for r in rows(tmp_path / "k"):  # a resumed run repeats the steps after its checkpoint: last row wins
        final[r["step"]] = r
    assert sorted(final) == [1, 2, 3, 4, 5, 6]
    for ref in reference:
        got = final[ref["step"]]
        for m in ("loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss/cb0", "lr"):
            assert got[m] == ref[m], (ref["step"], m, got[m], ref[m])  # bit for bit on CPU


def test_sigterm_checkpoints_and_exits_cleanly(tokenized_dataset, tmp_path):
    """SIGTERM stops after the current step with a checkpoint of it and a message on how to resume."""
    proc = start(tokenized_dataset, tmp_path, "t", "--train.max_steps=1000", "--train.checkpoint_every=1000")
    wait_for_step(proc, tmp_path / "t", 1)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert "stopped by SIGTERM" in out and "--resume" in out
    last = rows(tmp_path / "t")[-1]["step"]
    ckpt = checkpoint.newest_valid(tmp_path / "t")
    assert ckpt is not None and checkpoint.checkpoint_step(ckpt) == last < 1000


def test_damaged_checkpoint_is_skipped(tokenized_dataset, tmp_path):
    """A checkpoint whose weights no longer match the manifest is skipped with a warning naming it."""
    finish(start(tokenized_dataset, tmp_path, "d", "--train.max_steps=4"))
    run_dir = tmp_path / "d"
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="step_00000004.*model.safetensors does not match"):
        ckpt = checkpoint.newest_valid(run_dir)
    assert ckpt.name == "step_00000002"
    (run_dir / "checkpoints" / ".tmp-step_00000006").mkdir()  # a write interrupted by a crash
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002", "step_00000004"]
