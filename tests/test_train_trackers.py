"""train.trackers: every metrics.jsonl row reaches TensorBoard and MLflow under the same names; a tracker
that is not installed is a clear error before any work."""

from __future__ import annotations

import json

import pytest

from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.training.trainer import Trainer, main

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


def tiny_cfg(data, out, name, *overrides):
    return load_config("recipes/tiny.yaml", [
        f"--data.path={data}", f"--train.output_dir={out}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1", "--train.checkpoint_every=2",
        "--train.max_steps=2", "--train.eval_every=2", *overrides])


def metric_rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}


def test_tensorboard_gets_every_metric_of_metrics_jsonl(tokenized_dataset, tmp_path):
    """By default (trackers: [tensorboard]) the event file holds, per step, exactly the metrics.jsonl
    names (eval/* included) with their values (TensorBoard stores float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "tb")).run()
    expected = metric_rows(run)
    events = EventAccumulator(str(run / "musiclm_stab"), size_guidance={"scalars": 0}).Reload()
    logged: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            logged.setdefault(e.step, {})[tag] = e.value
    assert logged.keys() == expected.keys() == {1, 2}
    for step, row in expected.items():
        assert logged[step].keys() == row.keys(), step
        for name, value in row.items():
            assert logged[step][name] == pytest.approx(value, rel=1e-6), name  # float32 rounding: 6e-8
    assert any(k.startswith("eval/") for k in logged[2])


def test_mlflow_offline_gets_the_same_names_and_values(tokenized_dataset, tmp_path, monkeypatch):
    """trackers: [mlflow] with a local SQLite tracking URI (no server): one MLflow run named after the run,
    whose metric histories are the metrics.jsonl rows; no TensorBoard folder is written."""
    mlflow = pytest.importorskip("mlflow")  # in the dev extra (pyproject.toml)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "ml", "--train.trackers=[mlflow]", "--train.max_steps=1",
                           "--train.eval_every=1")).run()
    expected = metric_rows(run)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("musiclm_stab")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "ml"
    names = {name for row in expected.values() for name in row}
    assert set(found.data.metrics) == names
    for name in names:
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, name)}
        assert history == pytest.approx({s: row[name] for s, row in expected.items() if name in row}), name
    assert found.data.params["train.name"] == "ml"  # the resolved config as parameters
    assert not (run / "musiclm_stab").exists()


def test_tracker_not_installed_is_a_config_error(tokenized_dataset, tmp_path, monkeypatch, capsys):
    """A tracker whose package is missing (accelerate would silently drop it): exit code 2 and one line
    naming train.trackers and what is installed; no run directory."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [accelerate.tracking.LoggerType.TENSORBOARD])
    rc = main(["--config", "recipes/tiny.yaml", f"--data.path={tokenized_dataset}",
               f"--train.output_dir={tmp_path}", "--train.trackers=[tensorboard,wandb]"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: train.trackers: wandb not installed (installed: tensorboard)")
    assert not (tmp_path / "tiny").exists()


def test_tracker_names_are_checked_and_none_is_allowed(tokenized_dataset, tmp_path):
    """An unknown tracker name fails at load with the valid choices; [] logs to no tracker (metrics.jsonl
    only); the default is TensorBoard."""
    with pytest.raises(ConfigError, match="train.trackers='tb' is not valid; choose one of: all, tensorboard"):
        load_config(None, ["--train.trackers=[tb]"])
    assert load_config().train.trackers == ["tensorboard"]
    run = Trainer(tiny_cfg(tokenized_dataset, tmp_path, "quiet", "--train.trackers=[]",
                           "--train.eval_every=0", "--train.max_steps=1")).run()
    assert sorted(p.name for p in run.iterdir()) == [".train.lock", "checkpoints", "config.yaml", "metrics.jsonl",
                                                     "tokenizer.json"]  # .train.lock: run_dir.RunLock's file


def test_mlflow_file_store_is_refused_before_any_work(tokenized_dataset, tmp_path, monkeypatch):
    """MLflow's file store cannot hold acoustic_mlm_loss beside acoustic_mlm_loss/cb0 (it crashed at the
    first logged step): a file: tracking URI is refused up front, naming train.trackers and the fix."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    with pytest.raises(ConfigError, match="train.trackers: mlflow's tracking URI file:.* is a file store"):
        Trainer(tiny_cfg(tokenized_dataset, tmp_path, "ml", "--train.trackers=[mlflow]"))
    assert not (tmp_path / "ml").exists()
