"""Operating-system errors around the run directory are one clear line, and lose nothing: an output path
under a file, a file too large for the process's limit (EFBIG, not a full disk), a metrics row that
cannot be written whole."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest

from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train

REPO = Path(__file__).resolve().parent.parent


def args(data, out: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}", f"--train.output_dir={out}",
            "--train.name=r", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
            "--optim.warmup_steps=1", "--train.max_steps=2", "--train.checkpoint_every=2", "--train.trackers=[]",
            *extra]


def test_an_output_dir_under_a_file_is_one_line(tokenized_dataset, tmp_path, capsys, fresh_accelerate_state):
    """train.output_dir inside what is a file: exit 2 and one line naming the run directory and the reason
    (before: a NotADirectoryError traceback)."""
    (tmp_path / "file").write_text("not a folder")
    assert train.main(args(tokenized_dataset, tmp_path / "file" / "runs")) == 2
    err = capsys.readouterr().err
    assert err == (f"error: train.output_dir: cannot create the run directory {tmp_path / 'file' / 'runs' / 'r'}: "
                   "Not a directory\n"), err[-3000:]


def limited(limit: int):
    """preexec_fn: this many bytes at most per file written (ulimit -f)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("limit, writer", [(7_000_000, "torch.save of optimizer.bin"),
                                           (3_000_000, "safetensors of model.safetensors")])
def test_a_file_too_large_is_not_called_a_full_disk(tokenized_dataset, tmp_path, limit, writer):
    """A checkpoint file beyond the process's file size limit (EFBIG; the tiny model's weights are 4.8 MB,
    its optimizer state 9.7 MB), written by torch.save (which names no OS error) or safetensors: exit 1
    and one line saying `File too large` with the limit and `Fix the cause` (before: torch's failure was
    called a full disk with "Free some space" beside 60 GiB free; safetensors' was a traceback); the
    partial write is removed."""
    cmd = [sys.executable, str(REPO / "recipes" / "pretrain.py"), *args(tokenized_dataset, tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=limited(limit),
                          env={**os.environ, "TQDM_DISABLE": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, (writer, proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"could not write checkpoint step_00000002 in {tmp_path / 'r' / 'checkpoints'}" in errors[0]
    assert "File too large" in errors[0] and f"at most {limit:,} bytes (ulimit -f)" in errors[0], errors[0]
    assert "Fix the cause" in errors[0] and "Free some space" not in errors[0], errors[0]
    assert not list((tmp_path / "r" / "checkpoints").glob(".tmp-*"))


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("free, full", [(2**20, True), (100 * 2**30, False)])
def test_torchs_nameless_write_failure_is_a_full_disk_only_on_a_full_disk(tmp_path, monkeypatch, free, full):
    """torch.save's RuntimeError names no OS error: it is taken for a full disk (with the advice to free
    space) only when the file system is nearly full, else reported as it is."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(200 * 2**30, 0, free))
    reason, is_full = checkpoint._failure(error, tmp_path)
    assert is_full == full
    assert reason.startswith("No space left on device (inferred") == full, reason
    assert "unexpected pos 64 vs 0" in reason


WRITE_ROWS = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from musiclm_stab.training.run_dir import MetricsWriter
    path = Path(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    writer = MetricsWriter(path, True)
    for step in range(1, 100):
        try:
            writer.write({"step": step, "loss": 1.0 / step, "pad": "x" * 200})
        except Exception as e:
            print(json.dumps({"failed_at": step, "error": type(e).__name__, "message": str(e)}))
            break
""")


def test_a_metrics_row_that_cannot_be_written_whole_is_taken_back(tmp_path):
    """A row that would pass the file size limit (as a full disk): MetricsWriteError naming the file, the
    step and the reason, and metrics.jsonl keeps only whole rows (before: an OSError traceback, with the
    row's first bytes left for the next append to follow on the same line)."""
    path = tmp_path / "metrics.jsonl"
    proc = subprocess.run([sys.executable, "-c", WRITE_ROWS, str(path)], capture_output=True, text=True,
                          timeout=120)
    report = json.loads(proc.stdout)
    assert report["error"] == "MetricsWriteError", report
    assert report["message"].startswith(f"could not append the row of step {report['failed_at']} to {path}: "
                                        "File too large"), report
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["step"] for x in lines[:-1]] == list(range(1, report["failed_at"]))


def test_resume_with_a_damaged_tokenizer_json_is_one_line(tokenized_dataset, tmp_path, capsys,
                                                          fresh_accelerate_state):
    """--resume of a run whose tokenizer.json is not JSON: exit 2 and one line naming it (before: a
    JSONDecodeError traceback)."""
    from musiclm_stab.config import load_config, save_config

    given = args(tokenized_dataset, tmp_path)
    (tmp_path / "r").mkdir()
    save_config(load_config(given[1], given[2:]), tmp_path / "r" / "config.yaml")
    (tmp_path / "r" / "tokenizer.json").write_text('{"model": "encodec_24khz", ')
    assert train.main([*given, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'r' / 'tokenizer.json'}: not a JSON file: ") and err.count("\n") == 1, err
