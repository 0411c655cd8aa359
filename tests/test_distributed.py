"""Data-parallel training on CPU (gloo, 2 processes via torchrun) computes what one process computes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from inproc import trainer_here

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FAULTS = Path(__file__).resolve().parent / "train_faults.py"  # pretrain.py + faults + an exit report
# torchrun on a free port of the OS's choosing (--standalone: its store listens on port 0). A fixed
# --master_port failed the launch (EADDRINUSE) whenever anything else on the machine held that port, such as
# these tests run from another checkout at the same time; the ports these tests used to fix, and torchrun's
# default, are held by test_every_exit_of_a_two_process_run_stops_gloo_before_teardown to keep it so.
TORCHRUN = [str(BIN / "torchrun"), "--standalone"]
FIXED_PORTS = (29500, 29517, 29519)


@contextlib.contextmanager
def ports_taken(ports: tuple[int, ...]):
    """Listen on ``ports`` meanwhile (one held by another process already is taken either way)."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("0.0.0.0", port))
                s.listen()
            except OSError:
                pass
        yield


def pretrain_args(data: Path, out: Path, name: str, procs: int, *extra: str) -> list[str]:
    """recipes/pretrain.py's arguments: the tiny recipe on ``procs`` processes, global batch 4, no dropout."""
    return ["--config", str(REPO / "recipes" / "tiny.yaml"),
            f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}",
            f"--data.batch_size={4 // procs}", "--data.crop_seconds=2.0", "--data.eval_fraction=0.3",
            "--data.mixup_prob=0",  # mixup mixes clips of the local batch: it depends on the split
            # The trim to one masked count per batch (fairseq's require_same_masks) is per local batch too,
            # as in fairseq, where each GPU masks its own batch: 2 x 2 trims differently from 1 x 4.
            "--model.require_same_masks=false",
            "--model.dropout=0", "--model.attention_dropout=0", "--model.feature_dropout=0",
            "--optim.warmup_steps=1", "--train.max_steps=3", "--train.checkpoint_every=2", *extra]


def launch(data: Path, out: Path, name: str, procs: int, *extra: str, rc: int = 0, use_cpu: bool = True,
           torchrun: bool = True) -> str:
    """recipes/pretrain.py on ``procs`` processes: their output. Under torchrun, or (``torchrun=False``) as
    ``procs`` ranks started here with the variables torchrun sets (``start_ranks``: the same gloo group, the
    same code path, without torchrun's own process, which imports torch too); each must exit with ``rc``."""
    script = [str(REPO / "recipes" / "pretrain.py"), *pretrain_args(data, out, name, procs, *extra)]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # as run_here
    if procs > 1 and use_cpu:  # `accelerate launch --cpu` starts one process; ACCELERATE_USE_CPU gives gloo ranks
        env["ACCELERATE_USE_CPU"] = "1"
    if procs > 1 and not torchrun:
        ranks = start_ranks([sys.executable, *script], out, env, procs, timeout=600)
        assert all(code == rc for code, _ in ranks.values()), {r: (c, o[-3000:]) for r, (c, o) in ranks.items()}
        said = "".join(o for _, o in ranks.values())
        assert rc or f"{procs} process(es)" in said, said[-2000:]
        return said
    cmd = [sys.executable, *script] if procs == 1 else [*TORCHRUN, "--nproc_per_node", str(procs), *script]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert rc or f"{procs} process(es)" in proc.stdout, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


def start_ranks(cmd: list[str], cwd: Path, env: dict[str, str], procs: int, timeout: float
                ) -> dict[int, tuple[int, str]]:
    """``procs`` processes of ``cmd``, started here with the variables torchrun sets: {rank: (exit code,
    output)}. Each rank exits by itself (torchrun stops the other ranks when one fails), and a rank still
    running after ``timeout`` seconds (one waiting at a barrier would wait for the 30-minute process-group
    timeout) fails the test."""
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs), "RANK": str(rank),
                                   "LOCAL_RANK": str(rank)})
             for rank in range(procs)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in ranks]
    except subprocess.TimeoutExpired:
        for p in ranks:
            p.kill()
        left = [p.communicate()[0] for p in ranks]
        raise AssertionError(f"still running after {timeout} s: a rank hangs\n" +
                             "\n".join(f"rank {r}: {o[-2000:]}" for r, o in enumerate(left))) from None
    return {rank: (ranks[rank].returncode, outputs[rank]) for rank in range(procs)}


def run_here(data: Path, out: Path, name: str, capsys, *extra: str, rc: int = 0) -> str:
    """One process, in this one: pretrain.py's main with ``launch``'s arguments (a subprocess would spend
    most of its time importing torch again), on one intra-op thread as ``launch``'s processes (the tiny
    model's tensors on shared cores: threads only add overhead), with accelerate's state fresh around it
    (``trainer_here``)."""
    capsys.readouterr()
    assert trainer_here(pretrain_args(data, out, name, 1, *extra), cwd=out) == rc
    said = capsys.readouterr()
    assert rc or "1 process(es)" in said.out, said.out[-2000:]
    return said.out + said.err


def last_rows(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r
    return rows


def test_two_processes_match_one_and_resume(tokenized_dataset, tmp_path, capsys, fresh_accelerate_state):
    """2 gloo processes x batch 2 give the per-step loss and grad norm of 1 process x batch 4
    (relative 1e-5), and a 2-process run stopped at step 2 resumes from its checkpoint to the same numbers;
    resuming the 2-process checkpoint with 1 process is refused with a message naming both counts.
    The run stopped at step 2 is torchrun's; its resume, 2 gloo ranks started here with torchrun's variables
    (what torchrun would start: one process importing torch fewer)."""
    run_here(tokenized_dataset, tmp_path, "one", capsys)
    launch(tokenized_dataset, tmp_path, "two", 2, "--train.stop_at=2")
    out = launch(tokenized_dataset, tmp_path, "two", 2, "--resume", torchrun=False)
    assert "resumed from" in out
    one, two = last_rows(tmp_path / "one"), last_rows(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        for m in ("loss", "grad_norm", "lr", "musical_mlm_loss", "acoustic_mlm_loss/cb0", "acoustic_acc/cb0"):
            assert two[step][m] == pytest.approx(one[step][m], rel=1e-5, abs=1e-6), (step, m)
    out = run_here(tokenized_dataset, tmp_path, "two", capsys, "--resume", "--train.max_steps=6", rc=2)
    assert "was written by 2 process(es); resume it with 2" in out and "not 1" in out, out[-2000:]


def test_two_ranks_without_a_distributed_setup_are_refused(tokenized_dataset, tmp_path):
    """2 ranks as torchrun starts them (its variables, WORLD_SIZE 2) but no ACCELERATE_USE_CPU on a CPU machine:
    accelerate would set up two independent single-process runs writing into one directory. Refused before any
    work, naming the fix, by each rank, exit code 2 (started here: torchrun's own process, which imports torch
    too, adds nothing to the refusal, which reads WORLD_SIZE, and says 1 for any rank's failure; the other tests
    launch torchrun)."""
    out = launch(tokenized_dataset, tmp_path, "two", 2, rc=2, use_cpu=False, torchrun=False)
    assert "launched as 2 processes (WORLD_SIZE) but accelerate set up 1" in out and "ACCELERATE_USE_CPU=1" in out
    assert not (tmp_path / "two" / "metrics.jsonl").exists()


def launch_reporting(data: Path, out: Path, name: str, *extra: str, fault: str = "",
                     torchrun: bool = True, timeout: float = 600) -> dict[int, tuple[int, str]]:
    """2 gloo processes of tests/train_faults.py (pretrain.py that reports on its exit): {rank: (exit code,
    output)}. Under torchrun (its exit code for both ranks), or started here by ``start_ranks`` (each rank
    exits by itself: torchrun stops the other ranks when one fails, and a rank stopped before its report
    would make the test flaky)."""
    logs = out / f"logs-{name}-{len(list(out.glob(f'logs-{name}-*')))}"
    args = [str(FAULTS), "--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}",
            f"--train.output_dir={out}", f"--train.name={name}", "--data.batch_size=1", "--data.crop_seconds=2.0",
            "--data.eval_fraction=0.3", "--train.max_steps=3", "--train.checkpoint_every=1", *extra]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", "TRAIN_FAULT": fault,
           "OMP_NUM_THREADS": "1"}
    if torchrun:
        cmd = [*TORCHRUN, "--nproc_per_node", "2", "--log-dir", str(logs), "--redirects", "3", *args]
        with ports_taken(FIXED_PORTS):  # as by anything else on the machine: the launch must not need them
            code = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600).returncode
        return {int(p.parent.name): (code, (p.parent / "stdout.log").read_text() + p.read_text())
                for p in logs.rglob("stderr.log")}
    return start_ranks([sys.executable, *args], out, env, 2, timeout)


# MERT-95M's layerdrop is 0.05 (the base size's default); 0.5 makes a skipped layer all but certain in 3 steps.
LAYERDROP = ("--model.layerdrop=0.5",)


@pytest.fixture(scope="module")
def finished_layerdrop_run(tokenized_dataset, tmp_path_factory) -> tuple[Path, dict[int, dict], dict[int, tuple[int, str]]]:
    """One finished 3-step torchrun run of 2 gloo processes of tests/train_faults.py (pretrain.py, no fault, its
    exit report) with layerdrop: (its folder, its metric rows as the run left them, {rank: (exit code, output)}).
    Tests that go on with the run copy the folder."""
    out = tmp_path_factory.mktemp("ddp_layerdrop")
    ranks = launch_reporting(tokenized_dataset, out, "run", *LAYERDROP)
    return out / "run", last_rows(out / "run"), ranks


def test_layerdrop_trains_under_ddp(finished_layerdrop_run):
    """With layerdrop (MERT-95M's 0.05, the base size's default) a step may skip layers whose parameters
    then get no gradient: 2 gloo processes still train (DDP looks for unused parameters), finite losses."""
    _, rows, ranks = finished_layerdrop_run
    assert sorted(ranks) == [0, 1] and all(code == 0 for code, _ in ranks.values()), ranks
    assert sorted(rows) == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows.values())


def test_every_exit_of_a_two_process_run_stops_gloo_before_teardown(tokenized_dataset, finished_layerdrop_run,
                                                                    tmp_path):
    """A finished 2-process run (torchrun), one refused with a config error after DDP is set up, and one
    stopped by an unexpected exception (with a checkpoint write maybe in flight) leave no gloo thread
    running when main returns, on either rank: destroy_process_group alone left 3 per rank to the
    interpreter's teardown (torch.distributed.nn's default arguments, imported by DDP, held the group),
    where they sometimes aborted the rank (exit -6). The torchrun launch runs with torchrun's default port
    and the ports these tests once fixed held by this process: it failed whenever another process held them.
    The finished run is the layerdrop fixture's (the same torchrun launch); the other two go on from a copy."""
    run_dir, _, finished = finished_layerdrop_run
    shutil.copytree(run_dir, tmp_path / "run")
    runs = [("refused", ("--resume", "--optim.lr=1.5e-4"), "", 2, "error: cannot resume"),
            ("crashed", ("--resume", "--train.max_steps=6"), "raise:5", 1,
             "RuntimeError: injected fault after update 5")]
    results = [("finished", finished, 0, "done: ")]
    for what, extra, fault, rc, said in runs:
        results.append((what, launch_reporting(tokenized_dataset, tmp_path, "run", *LAYERDROP, *extra, fault=fault,
                                               torchrun=False), rc, said))
    for what, ranks, rc, said in results:
        assert sorted(ranks) == [0, 1], (what, ranks)
        for rank, (code, out) in ranks.items():
            assert code == rc and "process group left before exit: True" in out, (what, rank, code, out[-2000:])
            assert "gloo threads left before exit: 0" in out, (what, rank, out[-2000:])
        assert said in ranks[0][1], (what, ranks[0][1][-2000:])
