"""End to end through the real entry points: build-corpus -> tokenize -> accelerate launch -> evaluate -> resume.

Nothing of ours is mocked: real chorales rendered to FLAC, real EnCodec (locally fitted weights, since the
pretrained download is impossible offline), a real HF dataset on disk, real `accelerate launch`, the real
`musiclm-stab` command. The corpus, the tokens, the resume, the reference run it is compared with, and the
refusals are asked of the same entry points' main functions in this process (the CLI's, and the trainer's,
which accelerate launch runs): a process each would spend most of its time importing. Each refusal stops
before anything is trained or evaluated.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inproc import trainer_here

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLI = [str(BIN / "musiclm-stab")]
STEP_METRICS = (["loss", "grad_norm", "grad_clipped", "lr", "musical_mlm_loss", "features_pen", "skipped_step",
                 "audio_s_per_s"] + [f"acoustic_mlm_loss/cb{k}" for k in range(8)]
                + [f"acoustic_acc/cb{k}" for k in range(8)])


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def cli_here(argv: list[str], cwd: Path) -> None:
    """`musiclm-stab ARGV` run by the CLI's main in this process, in ``cwd``; it must succeed."""
    from musiclm_stab import cli

    with contextlib.chdir(cwd):
        assert cli.main(argv) == 0, argv


def launch_args(tmp: Path, data: Path, name: str, *extra: str) -> list[str]:
    """The trainer's arguments (recipes/pretrain.py's) for run ``name`` of ``data`` under ``tmp``/runs."""
    return ["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}", f"--train.output_dir={tmp / 'runs'}",
            f"--train.name={name}", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
            "--optim.warmup_steps=2", "--train.checkpoint_every=2", "--train.keep_checkpoints=5", *extra]


def launch(tmp: Path, data: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "recipes" / "pretrain.py"),
           *launch_args(tmp, data, name, *extra)]
    return run(cmd, tmp)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, local_weights) -> Path:
    """Three real chorales (7.5 s each) rendered and tokenized through the CLI: 3 rows of 2.5 s per track,
    longer than the 2 s crop (crops are drawn); one track is held out (eval_fraction 0.3), so an epoch is 3
    batches of 2 and the run stopped at step 4 resumes mid-epoch. Both commands run by the CLI's main in
    this process (``cli_here``; `musiclm-stab evaluate` below runs the console script): a process each would
    spend much of its time importing. Tokenized with --workers 0: the one work unit would go to one spawned
    worker, another process importing torch, and spawned workers are test_api's README example's to prove
    (and the tokenizer's tests')."""
    tmp = tmp_path_factory.mktemp("e2e")
    cli_here(["build-corpus", str(tmp / "corpus"), "--num-tracks", "3", "--max-seconds", "7.5"], tmp)
    cli_here(["tokenize", str(tmp / "corpus"), str(tmp / "tokens"), "--weights", str(local_weights),
              "--segment-seconds", "2.5", "--workers", "0"], tmp)
    assert (tmp / "tokens" / "failures.jsonl").read_text().strip() == ""
    return tmp / "tokens"


def train_here(tmp: Path, data: Path, name: str, *extra: str) -> None:
    """The trainer's main in this process (``trainer_here``) with ``launch``'s arguments, in ``tmp``."""
    assert trainer_here(launch_args(tmp, data, name, *extra), cwd=tmp) == 0


@pytest.fixture(scope="module")
def uninterrupted(tokens, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run of ``tokens``: its directory. Tests only read it. The reference the resumed
    run is compared with, trained in this process (``train_here``)."""
    tmp = tmp_path_factory.mktemp("e2e_runs")
    train_here(tmp, tokens, "b", "--train.max_steps=6")
    return tmp / "runs" / "b"


def test_pretrain_evaluate_resume(tokens, uninterrupted, tmp_path, capsys):
    """accelerate launch trains and logs every metric, evaluate is deterministic, --resume continues exactly.
    The launched run (stopped at step 4) is resumed by the trainer's main in this process (``train_here``):
    from the checkpoint another process wrote, as a launched resume would read it."""
    from musiclm_stab import cli

    proc = launch(tmp_path, tokens, "a", "--train.max_steps=6", "--train.stop_at=4")
    run_dir = tmp_path / "runs" / "a"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        missing = [m for m in STEP_METRICS if m not in r]
        assert not missing, missing
        assert all(math.isfinite(r[m]) for m in STEP_METRICS)
        ce = sum(r[f"acoustic_mlm_loss/cb{k}"] for k in range(8))
        assert r["acoustic_mlm_loss"] == pytest.approx(ce, rel=1e-5)
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tokenizer.json").is_file()
    assert list(run_dir.rglob("events.out.tfevents*")), "no TensorBoard events"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert "resumed from" not in proc.stdout

    # Evaluation: per-codebook table, JSON in the run directory, identical on a second run.
    first = run(CLI + ["evaluate", str(run_dir), "--split", "eval"], tmp_path)
    assert first.stdout.index("cb0") < first.stdout.index("cb7")
    result = json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    capsys.readouterr()
    assert cli.main(["evaluate", str(run_dir), "--split", "eval"]) == 0  # the second in this process: cheaper
    assert first.stdout == capsys.readouterr().out
    assert result == json.loads((run_dir / "eval" / "step_00000004.json").read_text())
    assert result["eval/acoustic_mlm_loss"] == pytest.approx(sum(result[f"eval/acoustic_mlm_loss/cb{k}"] for k in range(8)))
    assert result["masked_frames"] > 0

    # Resume from step 4 to 6, and compare with an uninterrupted run of 6 steps.
    capsys.readouterr()
    train_here(tmp_path, tokens, "a", "--train.max_steps=6", "--resume")
    resumed = capsys.readouterr()
    assert "resumed from" in resumed.out + resumed.err
    a, b = read_metrics(run_dir), read_metrics(uninterrupted)
    assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a[4:], b[4:]):
        for m in ("loss", "grad_norm", "musical_mlm_loss", "acoustic_mlm_loss/cb0"):
            assert ra[m] == pytest.approx(rb[m], rel=1e-6, abs=1e-7), (ra["step"], m)


def test_refuses_mixed_tokenizers_and_existing_run(tokens, uninterrupted, tmp_path, capsys, fresh_accelerate_state):
    """Evaluation refuses data tokenized with other weights; training refuses to overwrite a run."""
    from musiclm_stab import cli
    from musiclm_stab.training import trainer

    before = read_metrics(uninterrupted)
    other = tmp_path / "other_tokens"
    shutil.copytree(tokens, other)
    meta = json.loads((other / "tokenizer.json").read_text())
    meta["weights_sha256"] = "0" * 64
    (other / "tokenizer.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["evaluate", str(uninterrupted), "--data", str(other)]) != 0
    assert "0000000000" in capsys.readouterr().err
    runs = uninterrupted.parent.parent  # the run, already trained (in a folder of the fixture's)
    args = launch_args(runs, tokens, uninterrupted.name, "--train.max_steps=6")
    assert trainer.main(args) != 0 and "already exists" in capsys.readouterr().err
    args = launch_args(runs, other, uninterrupted.name, "--train.max_steps=8", "--resume")
    assert trainer.main(args) != 0 and "0000000000" in capsys.readouterr().err
    assert read_metrics(uninterrupted) == before  # each refusal left the run as it was
