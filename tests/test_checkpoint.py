"""Crash safety: SIGTERM checkpoints and exits cleanly, SIGKILL (between steps or during a checkpoint
write) + --resume matches an uninterrupted run, a damaged checkpoint is named and skipped, a full disk
leaves the previous checkpoint intact, keep-last-N / keep-every-M pruning."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inproc import trainer_here

from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train

REPO = Path(__file__).resolve().parent.parent
FAULTS = Path(__file__).resolve().parent / "train_faults.py"  # pretrain.py with a fault (TRAIN_FAULT)


def run_args(data: Path, out: Path, name: str, *extra: str) -> list[str]:
    """pretrain.py's arguments for the tiny recipe's run ``name`` in ``out``: what ``start`` launches."""
    return ["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}", f"--train.output_dir={out}",
            f"--train.name={name}", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
            "--optim.warmup_steps=2", "--train.checkpoint_every=2", "--train.keep_checkpoints=10", *extra]


def start(data: Path, out: Path, name: str, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """The tiny recipe as a subprocess; through tests/train_faults.py when ``env`` sets TRAIN_FAULT; ``popen``:
    more arguments of ``subprocess.Popen``."""
    script = FAULTS if env and "TRAIN_FAULT" in env else REPO / "recipes" / "pretrain.py"
    cmd = [sys.executable, str(script), *run_args(data, out, name, *extra)]
    # One intra-op thread: the tiny model's tensors on shared cores, where threads only add overhead (their
    # waiting made each step cost about 5x its CPU time here); the runs compared all train under it.
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def resume_here(data: Path, out: Path, name: str, capsys, *extra: str) -> str:
    """``--resume`` of run ``name`` to its end in this process (pretrain.py's main, on one intra-op thread as
    ``start``'s runs), where the test is about what was interrupted, not about how the resume is launched:
    what it printed."""
    capsys.readouterr()
    code = trainer_here(run_args(data, out, name, *extra, "--resume"))
    said = capsys.readouterr()
    assert code == 0, (said.out + said.err)[-4000:]
    return said.out + said.err


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete rows: a last line the trainer is still appending (no newline yet) is left out."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= step for r in rows(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"run never reached step {step} (exit {proc.poll()})")


def wait_for_file(proc: subprocess.Popen, path: Path) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared (exit {proc.poll()})")


def kill(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    return out


def pause_at(step: int, phase: str, marker: Path) -> dict:
    """Environment that makes the write of checkpoint ``step`` stop at ``phase`` and create ``marker``
    (tests/train_faults.py holds checkpoint.write_manifest or checkpoint.publish there)."""
    return {"TRAIN_FAULT": f"pause:{phase}:{step}:{marker}"}


def final_rows(run_dir: Path) -> dict[int, dict]:
    final = {}
    for r in rows(run_dir):  # a resumed run repeats the steps after its checkpoint: last row wins
        final[r["step"]] = r
    return final


def assert_same_metrics(final: dict[int, dict], reference: list[dict]) -> None:
    assert sorted(final) == [r["step"] for r in reference]
    for ref in reference:
        got = final[ref["step"]]
        for m in ("loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss/cb0", "lr"):
            assert got[m] == ref[m], (ref["step"], m, got[m], ref[m])  # bit for bit on CPU


@pytest.fixture(scope="module")
def reference_run(tokenized_dataset, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run (checkpoints at steps 2, 4 and 6): its directory. Tests only read it.

    Trained in this process, on one intra-op thread as ``start``'s runs (the runs it is compared with are
    launched: the tests are about them, not about how the reference is started)."""
    out = tmp_path_factory.mktemp("ref")
    assert trainer_here(run_args(tokenized_dataset, out, "ref", "--train.max_steps=6")) == 0
    return out / "ref"


@pytest.fixture(scope="module")
def reference(reference_run):
    """The metrics rows of the uninterrupted 6-step run."""
    return rows(reference_run)


def test_sigkill_then_resume_matches_uninterrupted(tokenized_dataset, tmp_path, reference, capsys):
    """A run killed with SIGKILL after step 3 and resumed logs the same metrics as an uninterrupted run."""
    proc = start(tokenized_dataset, tmp_path, "k", "--train.max_steps=6")
    wait_for_step(proc, tmp_path / "k", 3)
    # checkpoints are written in the background and published at a later step: kill once one is complete
    deadline = time.time() + 300
    while not checkpoint.list_checkpoints(tmp_path / "k") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(tmp_path / "k")][-1] >= 2
    resume_here(tokenized_dataset, tmp_path, "k", capsys, "--train.max_steps=6")
    assert_same_metrics(final_rows(tmp_path / "k"), reference)


def test_sigkill_during_checkpoint_writes_then_resume_matches(tokenized_dataset, tmp_path, reference, capsys):
    """SIGKILL in the middle of a checkpoint write, twice: once when checkpoint 4 is complete but not yet
    renamed, once (in the resumed run) when checkpoint 6's accelerate state is written but has no manifest.
    Each resume removes the partial write with a message, starts from the previous complete checkpoint,
    and the final metrics equal an uninterrupted run's bit for bit."""
    run_dir, ckpts = tmp_path / "w", tmp_path / "w" / "checkpoints"
    marker = tmp_path / "paused"
    proc = start(tokenized_dataset, tmp_path, "w", "--train.max_steps=6",
                 env=pause_at(4, "rename", marker))
    wait_for_file(proc, marker)
    kill(proc)
    assert (ckpts / ".tmp-step_00000004" / checkpoint.STATE_FILE).is_file()  # complete, never moved in
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002"]

    marker.unlink()
    proc = start(tokenized_dataset, tmp_path, "w", "--train.max_steps=6", "--resume",
                 env=pause_at(6, "files", marker))
    wait_for_file(proc, marker)
    out = kill(proc)
    assert f"removed {ckpts / '.tmp-step_00000004'}" in out and "step_00000002 at step 2" in out, out[-3000:]
    partial = ckpts / ".tmp-step_00000006"
    assert (partial / "model.safetensors").is_file() and not (partial / checkpoint.STATE_FILE).exists()
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002", "step_00000004"]

    out = resume_here(tokenized_dataset, tmp_path, "w", capsys, "--train.max_steps=6")
    assert f"removed {partial}" in out and "step_00000004 at step 4" in out, out[-3000:]
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)][-1] == "step_00000006"
    assert not list(ckpts.glob(".tmp-*"))
    assert_same_metrics(final_rows(run_dir), reference)


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


def test_sigterm_to_the_whole_process_group_with_loader_workers_still_checkpoints(tokenized_dataset, tmp_path):
    """Schedulers (and study_gpu.sh's deadline) signal the whole process group, the DataLoader workers too:
    the workers ignore SIGTERM and SIGINT (they end with the trainer), so the trainer still stops after its
    step with a checkpoint of it, rather than dying of 'DataLoader worker ... killed by signal'."""
    proc = start(tokenized_dataset, tmp_path, "g", "--train.max_steps=1000", "--train.checkpoint_every=1000",
                 "--data.num_workers=2", start_new_session=True)
    try:
        wait_for_step(proc, tmp_path / "g", 2)
        deadline = time.time() + 60  # the workers are up (the trainer and its 2 in the group): now signal them all
        while len(subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()) < 3:
            assert time.time() < deadline and proc.poll() is None, "the loader's workers never came up"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "stopped by SIGTERM" in out, out[-3000:]
    ckpt = checkpoint.newest_valid(tmp_path / "g")
    assert ckpt is not None and checkpoint.checkpoint_step(ckpt) == rows(tmp_path / "g")[-1]["step"] < 1000
    deadline = time.time() + 60  # and no worker outlives the trainer
    while time.time() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a DataLoader worker outlived the trainer")


def test_damaged_checkpoint_is_skipped(reference_run, tmp_path):
    """A checkpoint whose weights no longer match the manifest is skipped with a warning naming it."""
    run_dir = tmp_path / "d"
    shutil.copytree(reference_run, run_dir)  # a trained run's copy: the reference run is shared, read only
    newest = checkpoint.list_checkpoints(run_dir)[-1]
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="step_00000006.*model.safetensors does not match"):
        ckpt = checkpoint.newest_valid(run_dir)
    assert ckpt.name == "step_00000004"
    (run_dir / "checkpoints" / ".tmp-step_00000008").mkdir()  # a write interrupted by a crash
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002", "step_00000004",
                                                                      "step_00000006"]


def test_resume_with_a_changed_data_position_is_refused(tokenized_dataset, reference_run, reference,
                                                        fresh_accelerate_state, monkeypatch, capsys):
    """The checkpoint's data position (micro-batches consumed) only means the same batches with the same
    batch size, crops, split, order and accumulation: resuming with one of them changed is refused,
    naming each change, before any work."""
    # pretrain.py's main in this process (a refusal needs no process of its own), on the reference run
    monkeypatch.chdir(reference_run.parent)
    code = train.main(["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={tokenized_dataset}",
                       f"--train.output_dir={reference_run.parent}", f"--train.name={reference_run.name}",
                       "--data.crop_seconds=2.0", "--data.eval_fraction=0.3", "--optim.warmup_steps=2",
                       "--train.checkpoint_every=2", "--train.keep_checkpoints=10", "--resume",
                       "--train.max_steps=8", "--data.batch_size=1", "--train.grad_accum=2"])
    out = capsys.readouterr().err
    assert code == 2, out[-3000:]
    assert "cannot resume" in out and "settings that define its data position changed" in out
    assert "data.batch_size: 2 in the checkpoint, 1 now" in out and "train.grad_accum: 1 in the checkpoint, 2 now" in out
    assert rows(reference_run) == reference  # nothing trained, nothing logged
    assert [c.name for c in checkpoint.list_checkpoints(reference_run)][-1] == "step_00000006"


def test_disk_full_keeps_previous_checkpoint(accelerator, tmp_path, monkeypatch, capsys):
    """ENOSPC in the middle of a checkpoint write: the partial write is removed, the previous checkpoint
    is intact, and the error names the directory, the free space and that checkpoint; the entry point
    prints it and exits 1."""
    import accelerate.checkpointing

    checkpoint.save(accelerator, tmp_path, 2, {}, keep=2)

    def disk_full(obj, f, *args, **kwargs):  # the optimizer file is cut short by a full disk
        Path(f).write_bytes(b"\0" * 16)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    monkeypatch.setattr(accelerate.checkpointing, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointWriteError) as e:
        checkpoint.save(accelerator, tmp_path, 4, {}, keep=2)
    message = str(e.value)
    for part in (f"step_00000004 in {tmp_path / 'checkpoints'}", "GiB free", "No space left on device",
                 "previous checkpoint step_00000002 is intact", "--resume"):
        assert part in message, message
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]
    assert checkpoint.verify(checkpoint.list_checkpoints(tmp_path)[0]) is None

    monkeypatch.setattr(train, "train", lambda cfg, resume: checkpoint.save(accelerator, tmp_path, 4, {}, 2))
    assert train.main([]) == 1
    assert f"error: could not write checkpoint step_00000004 in {tmp_path / 'checkpoints'}" in capsys.readouterr().err


def test_a_failed_torch_save_keeps_previous_checkpoint(accelerator, tmp_path, monkeypatch):
    """torch.save reports a full disk as RuntimeError (its zip writer: "unexpected pos"), not OSError:
    still a clean CheckpointWriteError, the partial write removed, the previous checkpoint intact."""
    import accelerate.checkpointing

    checkpoint.save(accelerator, tmp_path, 2, {}, keep=2)

    def full(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK" + b"\0" * 14)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(accelerate.checkpointing, "save", full)
    with pytest.raises(checkpoint.CheckpointWriteError, match="unexpected pos.*previous checkpoint step_00000002 is intact"):
        checkpoint.save(accelerator, tmp_path, 4, {}, keep=2)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]


def test_keep_last_and_every(accelerator, tmp_path):
    """keep_checkpoints=2 with keep_every=3: the newest two and every multiple of 3 survive pruning."""
    assert checkpoint.to_prune([1, 2, 3, 4, 5, 6, 7], keep=2) == [1, 2, 3, 4, 5]
    assert checkpoint.to_prune([1, 2, 3, 4, 5, 6, 7], keep=2, keep_every=3) == [1, 2, 4, 5]
    for step in range(1, 8):
        checkpoint.save(accelerator, tmp_path, step, {}, keep=2, keep_every=3)
    assert [checkpoint.checkpoint_step(c) for c in checkpoint.list_checkpoints(tmp_path)] == [3, 6, 7]
