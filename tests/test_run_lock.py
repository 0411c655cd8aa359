"""One trainer per run directory: a second one is refused with a clear line and exit 2 while the first
runs, and accepted once the first has died, however (kill -9 included); under several processes the whole
refused job stops together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_checkpoint import REPO, kill, pause_at, resume_here, rows, run_args, start, wait_for_file
from test_distributed import launch_reporting

from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train

LOCK_FILE = ".train.lock"  # run_dir.LOCK_FILE: what a second trainer's refusal names

HOLD = textwrap.dedent("""
    import sys, time
    from musiclm_stab.training.run_dir import RunLock
    lock = RunLock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
""")


def hold(run_dir: Path) -> subprocess.Popen:
    """A process that takes the run directory's lock (as a trainer does) and keeps it until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert line == "locked\n", line + proc.communicate()[0]
    return proc


def test_a_second_trainer_is_refused_while_the_first_runs_and_accepted_after_kill_9(tokenized_dataset, tmp_path,
                                                                                   capsys, fresh_accelerate_state):
    """Trainer A is held in the middle of writing checkpoint 4 (its loader with 2 worker processes); a
    requeued `--resume` of the same run and a fresh start of it (pretrain.py's main, in this process) are
    each refused with exit 2 and one line naming A's pid, and touch nothing: A's partial write is not
    removed as a crash's, no metrics row is added (before: both trained, 43 rows for 30 steps). Right after
    kill -9 of A (its workers may still be exiting: a record lock is not theirs), `--resume` is accepted and
    finishes: A's rows after its checkpoint 2 moved aside, every step logged once, in order."""
    run_dir, marker = tmp_path / "r", tmp_path / "paused"
    a = start(tokenized_dataset, tmp_path, "r", "--train.max_steps=6", "--data.num_workers=2",
              env=pause_at(4, "files", marker))
    try:
        wait_for_file(a, marker)
        logged = rows(run_dir)
        partial = run_dir / "checkpoints" / ".tmp-step_00000004"
        assert partial.is_dir()
        for extra in (["--resume"], []):
            # The second trainer in this process (a refusal needs no process of its own: A's record lock is
            # another process's; test_two_fresh_launches_of_one_run_one_trains refuses a launched one)
            capsys.readouterr()
            code = train.main(run_args(tokenized_dataset, tmp_path, "r", "--train.max_steps=6", *extra))
            said = capsys.readouterr()
            out = said.out + said.err
            errors = [line for line in out.splitlines() if line.startswith("error: ")]
            assert code == 2, out[-3000:]
            assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
            assert errors[0].startswith(f"error: run directory {run_dir} is being trained by process {a.pid} "), errors
            assert f"(its lock, {run_dir / LOCK_FILE}, is released when that process exits)" in errors[0]
            assert rows(run_dir) == logged and partial.is_dir()
    finally:
        kill(a)
    # The requeued trainer in this process too: what is proved is that A's lock died with A (held by
    # another process until its kill -9), not how the trainer is launched
    out = resume_here(tokenized_dataset, tmp_path, "r", capsys, "--train.max_steps=6")
    assert f"removed {partial}" in out and "step_00000002 at step 2" in out, out[-3000:]
    steps = [r["step"] for r in rows(run_dir)]
    assert steps == [1, 2, 3, 4, 5, 6], steps  # A's rows after its checkpoint 2: moved aside
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)][-1] == "step_00000006"


def test_two_fresh_launches_of_one_run_one_trains(tokenized_dataset, tmp_path):
    """Two fresh launches of the same run at the same moment: exactly one trains (exit 0), the other is
    refused with exit 2 and one line (the run is being trained, or already exists); the run's metrics
    have each step once."""
    procs = [start(tokenized_dataset, tmp_path, "f", "--train.max_steps=2") for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, o[-2000:]) for p, o in zip(procs, outs)]
    refused = outs[[p.returncode for p in procs].index(2)]
    errors = [line for line in refused.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in refused, refused[-3000:]
    assert (f"run directory {tmp_path / 'f'} is being trained by process" in errors[0]
            or f"run directory {tmp_path / 'f'} already exists" in errors[0]), errors
    assert [r["step"] for r in rows(tmp_path / "f")] == [1, 2]


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    """A run directory locked by another process is refused (RunBusy, naming that pid), also when asked
    again; after kill -9 of the holder the lock is free at once, with its file still there. Five rounds."""
    from musiclm_stab.training.run_dir import RunBusy, RunLock

    run_dir = tmp_path / "run"
    for _ in range(5):
        holder = hold(run_dir)
        try:
            for _ in range(2):
                with pytest.raises(RunBusy, match=rf"is being trained by process {holder.pid} on "):
                    RunLock(run_dir)
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.communicate()
        lock = RunLock(run_dir)
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()


def test_one_process_cannot_lock_a_run_directory_twice(tmp_path):
    """A second RunLock of the same directory in the same process is refused (record locks do not
    conflict within a process, and closing its file would drop the first one's lock); after release the
    directory can be locked again, and another process is refused meanwhile."""
    from musiclm_stab.training.run_dir import RunBusy, RunLock

    first = RunLock(tmp_path / "run")
    with pytest.raises(RunBusy, match=r"\(this process\)"):
        RunLock(tmp_path / "run")
    probe = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path / "run")], capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode != 0 and f"is being trained by process {os.getpid()}" in probe.stderr, probe.stderr
    first.release()
    RunLock(tmp_path / "run").release()


def test_both_ranks_of_a_refused_job_stop_together(tokenized_dataset, tmp_path):
    """2 gloo processes launched on a run directory another process holds: both ranks exit 2 with the same
    line naming the holder, and neither waits at a barrier for the other (before: both trained into it)."""
    holder = hold(tmp_path / "busy")
    try:
        ranks = launch_reporting(tokenized_dataset, tmp_path, "busy", "--train.max_steps=2", torchrun=False,
                                 timeout=600)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    errors = {r: [line for line in out.splitlines() if line.startswith("error: ")] for r, (_, out) in ranks.items()}
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert f"is being trained by process {holder.pid} " in errors[0][0], errors
    for rank, (code, out) in ranks.items():
        assert code == 2 and "process group left before exit: True" in out, (rank, code, out[-3000:])
    assert not (tmp_path / "busy" / "config.yaml").exists() and not (tmp_path / "busy" / "metrics.jsonl").exists()


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: relative path -> (size, mtime_ns)."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


HOLD_OUTPUT = textwrap.dedent("""
    import sys, time
    from musiclm_stab.tokenizer.lock import output_lock
    with output_lock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(600)
""")


def test_tokenize_overwrite_into_a_run_a_trainer_holds_is_refused_touching_nothing(tokenized_dataset, tmp_path,
                                                                                 make_music, local_weights, capsys):
    """`tokenize SRC RUN --overwrite` while a trainer holds RUN (its lock held by another process; config, data
    record, metrics and a checkpoint there) stops with exit 2 and one line naming the trainer's pid, host and
    command, and touches nothing in RUN (before: the tokenizer's lock was another file, and --overwrite
    deleted the live run)."""
    import soundfile as sf

    from musiclm_stab.tokenizer.cli import cli_main

    src = tmp_path / "src"
    src.mkdir()
    sf.write(src / "a.wav", make_music(2.0, seed=3), 24_000)
    run_dir = tmp_path / "run"
    holder = hold(run_dir)
    try:
        (run_dir / "config.yaml").write_text("train:\n  max_steps: 4\n")
        (run_dir / "tokenizer.json").write_text((tokenized_dataset / "tokenizer.json").read_text())
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
        (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_00000002" / "model.safetensors").write_bytes(b"weights")
        before = _tree(run_dir)
        capsys.readouterr()
        code = cli_main([str(src), str(run_dir), "--weights", str(local_weights), "--overwrite", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"musiclm-stab tokenize: {run_dir} is being written by process {holder.pid} on "), err
        assert f": -c {run_dir}; wait for it to finish or stop it (its lock, {run_dir / LOCK_FILE}," in err, err
        assert _tree(run_dir) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()


def test_a_trainer_is_refused_a_folder_a_tokenizer_is_writing_touching_nothing(tokenized_dataset, tmp_path, capsys,
                                                                               fresh_accelerate_state):
    """A training run whose directory is a folder a tokenizer is writing (its lock held by another process)
    stops with exit 2 and one line naming that process and its lock, creating nothing in the folder (before:
    it trained into it beside the tokenizer)."""
    from musiclm_stab.training import trainer as train

    out = tmp_path / "tokens"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUTPUT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        before = _tree(out)
        capsys.readouterr()
        code = train.main(["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={tokenized_dataset}",
                           f"--train.output_dir={tmp_path}", "--train.name=tokens", "--data.crop_seconds=2.0",
                           "--data.batch_size=2", "--data.eval_fraction=0.3", "--train.max_steps=2",
                           "--optim.warmup_steps=1", "--train.trackers=[]"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert errors[0].startswith(f"error: run directory {out} is being written by process {holder.pid} on "), errors
        assert f"(its lock, {out / '.tokenize.lock'}, is released when that process exits)" in errors[0], errors
        assert _tree(out) == before
    finally:
        holder.kill()
        holder.communicate()


def test_a_trainer_whose_lock_file_was_deleted_stops_and_the_metrics_stay_in_order(tokenized_dataset, tmp_path,
                                                                                   capsys):
    """The lock bypassed as the issue did it: trainer A is held after update 4 (rows 1-3 written, checkpoint 2
    published), its lock file is deleted, and a `--resume` B locks a new one and trains to step 6. Let go, A
    stops before its next write with exit 2 and one line saying its lock was deleted and why that stops it,
    writing no row or checkpoint more: the metrics are A's rows 1-2, then B's from its checkpoint on, A's row 3 moved aside by B's resume (before: A
    went on beside B, steps interleaved, and died on B's checkpoints with a misleading message)."""
    from musiclm_stab.analysis.runs import read_run

    run_dir, marker = tmp_path / "r", tmp_path / "held"
    a = start(tokenized_dataset, tmp_path, "r", "--train.max_steps=6", env={"TRAIN_FAULT": f"hold:4:{marker}"})
    try:
        wait_for_file(a, marker)
        assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]
        (run_dir / LOCK_FILE).unlink()  # "a stale lock file"
        # B in this process (A, the trainer whose lock was deleted, is the launched one): it locks the new
        # file, as any other process would, and releases it when it returns
        resume_here(tokenized_dataset, tmp_path, "r", capsys, "--train.max_steps=6")
        after_b = (run_dir / "metrics.jsonl").read_bytes()
        published = sorted(c.name for c in checkpoint.list_checkpoints(run_dir))
        marker.unlink()  # A goes on
        out, _ = a.communicate(timeout=300)
    finally:
        if a.poll() is None:
            kill(a)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert a.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith(f"error: the lock of run directory {run_dir} ({run_dir / LOCK_FILE}) was deleted "
                                "or replaced while this trainer held it, so another trainer may be writing the run now: "
                                "stopped before the metrics row of step 4, without writing anything more."), errors
    assert (run_dir / "metrics.jsonl").read_bytes() == after_b
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    (aside,) = run_dir.glob("metrics.jsonl.aside-*")  # A's row 3, past B's checkpoint 2, moved aside by B
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [3]
    assert sorted(c.name for c in checkpoint.list_checkpoints(run_dir)) == published
    assert published[-1] == "step_00000006"
    assert list(read_run(run_dir).series["loss"][0]) == list(range(1, 7))
