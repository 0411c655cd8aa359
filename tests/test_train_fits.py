"""Settings that are valid alone but do not fit the data or the machine are refused at start, before the
run directory is touched or the model built: one line, exit 2 (training/fits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from musiclm_stab.config import load_config
from musiclm_stab.training import trainer as train

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)

REPO = Path(__file__).resolve().parent.parent


def args(data, out: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "recipes" / "tiny.yaml"), f"--data.path={data}", f"--train.output_dir={out}",
            "--train.name=r", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
            "--train.max_steps=2", "--train.trackers=[]", *extra]


@pytest.mark.parametrize("setting, message", [
    ("--model.codebook_size=10", "model.codebook_size=10 does not fit data.path={data}: its tokenizer "
                                 "(tokenizer.json) gives 1024 codes per codebook"),
    ("--model.num_codebooks=9", "model.num_codebooks=9 does not fit data.path={data}: its tokenizer "
                                "(tokenizer.json) gives 8 codebooks"),
    ("--model.num_codebooks=4", "model.num_codebooks=4 does not fit data.path={data}"),
    # 262144 wide: ~1.1e12 parameters, 28 TiB at 28 bytes each; the 65536 (1.8 TiB) as well
    ("--model.width=262144", "the model does not fit in memory: model.size=tiny with num_layers=2, width=262144"),
    ("--model.width=65536", "the model does not fit in memory: model.size=tiny with num_layers=2, width=65536"),
])
def test_a_model_that_does_not_fit_is_refused_before_any_work(tokenized_dataset, tmp_path, capsys, setting, message):
    """Heads that do not match the data's codebooks, or a model too large for the machine's memory: exit 2
    and one line saying so (before: an IndexError or shape error in the first step, or an allocation
    failure building the model, each a traceback, after config.yaml was written), and no run directory."""
    code = train.main(args(tokenized_dataset, tmp_path / "runs", setting))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and errors[0].startswith("error: " + message.format(data=tokenized_dataset)), err[-3000:]
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_the_memory_bound_is_below_what_training_holds(tokenized_dataset, tmp_path):
    """memory_needed's parameter state (weights, gradients, AdamW's moments) is at most what a real tiny
    Trainer holds after one update, counted tensor by tensor: a lower bound, so it refuses no run that fits."""
    from musiclm_stab.training.fits import memory_needed

    cfg = load_config(args(tokenized_dataset, tmp_path)[1], args(tokenized_dataset, tmp_path)[2:])
    need = memory_needed(cfg)
    trainer = train.Trainer(cfg)
    trainer.train_step()
    trainer.update()  # the optimizer's moments exist
    trainer.train_step()  # and the gradients
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = list(model.parameters())
    held = sum(p.numel() * p.element_size() for p in params)
    held += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    held += sum(t.numel() * t.element_size() for s in trainer.optimizer.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    assert need.parameters == sum(p.numel() for p in params)
    assert 0.9 * held <= need.state <= held, (need.state, held)
    trainer.release_run_dir()
