"""Resuming trusts nothing it loads: a pickle of code in a checkpoint is refused without running, data of
other weights or other rows is refused; the registered state is JSON; a finished background write
survives an exception in training; SIGTERM on a checkpoint step publishes that step once."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from inproc import fresh_accelerate

from musiclm_stab.config import load_config
from musiclm_stab.training import checkpoint
from musiclm_stab.training import trainer as train
from musiclm_stab.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)

REPO = Path(__file__).resolve().parent.parent
NAME = "r"


def args(data, out: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}", f"--train.output_dir={out}",
            f"--train.name={NAME}", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
            "--optim.warmup_steps=1", "--train.checkpoint_every=2", "--train.keep_checkpoints=10", *extra]


def config(data, out: Path, *extra: str):
    """The configuration ``args`` gives recipes/pretrain.py, for an in-process Trainer."""
    given = args(data, out, *extra)
    return load_config(given[1], given[2:])


def steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tokenized_dataset, tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint of step 2 (copied by each test before it changes anything)."""
    out = tmp_path_factory.mktemp("trained")
    with fresh_accelerate():
        assert train.main(args(tokenized_dataset, out, "--train.max_steps=2")) == 0
    return out


def copy_run(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained / NAME, tmp_path / NAME)
    return tmp_path / NAME / "checkpoints" / "step_00000002"


def rehash(ckpt: Path, name: str) -> None:
    """Record file ``name``'s sha256 in the manifest, as whoever crafted the checkpoint would."""
    state = checkpoint.read_state(ckpt)
    state["files"][name] = checkpoint.sha256_file(ckpt / name)
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps(state))


class Payload:
    """Unpickling it runs code: here, it creates the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_registered_state_is_json(trained):
    """The clipping and spike-guard state is in registered.json (hashed in the manifest), and the only
    pickle-format files are accelerate's optimizer, scheduler and RNG states, none a registered object."""
    ckpt = trained / NAME / "checkpoints" / "step_00000002"
    saved = json.loads((ckpt / "registered.json").read_text())
    assert sorted(saved) == ["grad_clipper", "precision", "spike_guard"]
    assert saved["grad_clipper"]["count"] == 2 and isinstance(saved["spike_guard"]["window"], list)
    assert "registered.json" in checkpoint.read_state(ckpt)["files"]
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix in (".pkl", ".bin")) == [
        "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]


@pytest.mark.parametrize("target", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin",
                                    "scheduler.bin"])
def test_a_pickle_of_code_in_a_checkpoint_is_refused_not_run(tokenized_dataset, trained, tmp_path, capsys, target):
    """A checkpoint file (with its hash updated in the manifest) holding a pickle whose loading would run
    code: --resume exits 2 with an error naming the checkpoint and the file, and the code never ran
    (before: custom_checkpoint_0.pkl was unpickled with weights_only=False and ran; a refused RNG file was
    ignored and the run resumed inexactly; a refused optimizer file raised torch's error unexplained)."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(probe)))  # the payload is live: plain unpickling runs it
    assert probe.read_text() == "ran"
    ckpt = copy_run(trained, tmp_path)
    marker = tmp_path / "marker"
    torch.save({"state": Payload(marker)}, ckpt / target)
    rehash(ckpt, target)
    capsys.readouterr()
    try:
        code = train.main(args(tokenized_dataset, tmp_path, "--train.max_steps=3", "--resume"))
    except Exception as e:  # not the clean refusal wanted; checked below, after the marker
        code = e
    err = capsys.readouterr().err
    assert not marker.exists(), "the checkpoint's code ran"
    assert code == 2, (code, err[-2000:])
    assert f"error: cannot load checkpoint {ckpt}: " in err and target in err, err[-2000:]
    assert "never loaded" in err or "refused without being unpickled" in err, err[-2000:]
    assert steps_logged(tmp_path / NAME) == [1, 2]


def test_resume_refuses_a_checkpoint_of_other_tokenizer_weights(tokenized_dataset, trained, tmp_path, capsys):
    """A checkpoint whose manifest names other tokenizer weights than data.path's (e.g. copied from
    another run) is refused on --resume with both sha256 (before: the manifest's tokenizer_sha256 was
    ignored and the run resumed)."""
    ckpt = copy_run(trained, tmp_path)
    state = checkpoint.read_state(ckpt)
    now, state["tokenizer_sha256"] = state["tokenizer_sha256"], "0" * 64
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps(state))
    capsys.readouterr()
    assert train.main(args(tokenized_dataset, tmp_path, "--train.max_steps=3", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"error: cannot resume {ckpt} with data.path={tokenized_dataset}" in err, err[-2000:]
    assert f"tokenized with other EnCodec weights (sha256 {'0' * 64} in the checkpoint, {now} now)" in err
    assert steps_logged(tmp_path / NAME) == [1, 2]


@pytest.fixture(scope="module")
def other_rows(tokenized_dataset, local_weights, tmp_path_factory) -> Path:
    """The audio of ``tokenized_dataset`` tokenized with the same weights into 6 s segments: the same
    tokenizer, other rows."""
    from musiclm_stab.tokenizer.pipeline import tokenize

    out = tmp_path_factory.mktemp("other") / "tokens6"
    tokenize(tokenized_dataset.parent / "audio", out, weights=str(local_weights), segment_seconds=6.0,
             min_seconds=1.0, progress=False, weights_note="test weights fitted on synthetic music", workers=0)
    return out


def test_resume_refuses_other_rows_but_not_a_copy(tokenized_dataset, trained, other_rows, tmp_path, capsys):
    """--resume with data.path set to other rows tokenized with the same weights is refused with an
    error naming both paths (before: the saved data position was applied to the other dataset); the
    same rows under another path (a copied folder) resume."""
    ckpt = copy_run(trained, tmp_path)
    capsys.readouterr()
    with fresh_accelerate():
        assert train.main(args(other_rows, tmp_path, "--train.max_steps=3", "--resume")) == 2
    err = capsys.readouterr().err
    assert (f"error: cannot resume {ckpt} with data.path={other_rows}: its data position counts the rows of "
            f"data.path={tokenized_dataset}, and data.path={other_rows} holds other rows") in err, err[-2000:]
    assert steps_logged(tmp_path / NAME) == [1, 2]
    moved = tmp_path / "moved_tokens"
    shutil.copytree(tokenized_dataset, moved)
    with fresh_accelerate():
        assert train.main(args(moved, tmp_path, "--train.max_steps=3", "--resume")) == 0
    assert steps_logged(tmp_path / NAME) == [1, 2, 3]


class FailingTrainer(Trainer):
    """The real trainer; at step ``fail_at`` it waits until the background write of the previous
    checkpoint has finished (but has not been published: the loop polled while it was still going),
    then raises as any bug or failed data read would."""

    fail_at = 3

    def perturb_loss(self, step, loss):
        if step == self.fail_at:
            pending = self.checkpoints.pending
            assert pending is not None, "the write was published before the failure: the test needs it pending"
            pending.thread.join()
            raise RuntimeError("a failure in training")
        return loss


def test_a_finished_write_is_published_when_training_raises(tokenized_dataset, tmp_path, monkeypatch):
    """Training raises one step after a checkpoint whose background write has finished unpublished: the
    error propagates, and checkpoint 2 is published intact (before: its complete .tmp-step_2 was left for
    --resume to delete as interrupted by a crash, losing those steps)."""
    original = torch.save

    def slow(obj, f, *a, **kw):  # a slow disk: the write is still going when step 3 polls it
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name.startswith(checkpoint.PARTIAL_PREFIX):
            time.sleep(0.5)
        return original(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", slow)
    trainer = FailingTrainer(config(tokenized_dataset, tmp_path, "--train.max_steps=6"))
    with pytest.raises(RuntimeError, match="a failure in training"):
        trainer.run()
    run_dir = tmp_path / NAME
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002"]
    assert checkpoint.verify(run_dir / "checkpoints" / "step_00000002") is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


class SignalledTrainer(Trainer):
    """The real trainer, sent SIGTERM (by itself) during step ``signal_at``."""

    signal_at = 2

    def perturb_loss(self, step, loss):
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss


def test_sigterm_on_a_checkpoint_step_publishes_that_step_once(tokenized_dataset, tmp_path, monkeypatch, capsys):
    """SIGTERM during checkpoint step 2 with keep_checkpoints=1: the stop saves step 2 again, which is
    published once and kept as it is (before: it was deleted and written again, so a kill in between
    left no checkpoint at all)."""
    published = []
    original = checkpoint.publish
    monkeypatch.setattr(checkpoint, "publish", lambda tmp, dst: (published.append(dst.name), original(tmp, dst)))
    SignalledTrainer(config(tokenized_dataset, tmp_path, "--train.max_steps=6", "--train.keep_checkpoints=1")).run()
    assert "stopped by SIGTERM at step 2" in capsys.readouterr().out
    assert published == ["step_00000002"]
    run_dir = tmp_path / NAME
    assert [c.name for c in checkpoint.list_checkpoints(run_dir)] == ["step_00000002"]
    assert checkpoint.verify(run_dir / "checkpoints" / "step_00000002") is None
