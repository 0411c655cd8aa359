"""Precision given to `accelerate launch` (its --mixed_precision flag, or its config file) is obeyed, and said;
accelerate's default, "no", leaves the run's config in charge; what the project cannot do is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from musiclm_stab.config import ConfigError, load_config
from musiclm_stab.training.precision import ACCELERATE_PRECISION_ENV, launched_precision

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def _tiny(*overrides: str):
    return load_config(REPO / "recipes" / "tiny.yaml", list(overrides))


def test_no_variable_or_accelerates_default_leaves_the_config_in_charge():
    """Without the variable (plain python, torchrun) or with accelerate's default "no", nothing changes."""
    for environ in ({}, {ACCELERATE_PRECISION_ENV: "no"}, {ACCELERATE_PRECISION_ENV: "NO"}):
        for precision in ("no", "bf16", "fp16"):
            cfg = _tiny(f"--train.mixed_precision={precision}")
            assert launched_precision(cfg, environ) == (cfg, None)


def test_bf16_from_accelerate_is_obeyed_and_said():
    """ACCELERATE_MIXED_PRECISION=bf16 makes an fp32 or fp16 config bf16; the line names both values."""
    for precision in ("no", "fp16"):
        cfg, said = launched_precision(_tiny(f"--train.mixed_precision={precision}"), {ACCELERATE_PRECISION_ENV: "bf16"})
        assert cfg.train.mixed_precision == "bf16"
        assert "bf16" in said and f"train.mixed_precision={precision}" in said and ACCELERATE_PRECISION_ENV in said
    cfg = _tiny("--train.mixed_precision=bf16")
    assert launched_precision(cfg, {ACCELERATE_PRECISION_ENV: "bf16"}) == (cfg, None)


def test_fp16_from_accelerate_is_amp_unless_the_config_has_its_own_fp16():
    """accelerate's fp16 is torch amp with a GradScaler: a config not in fp16 becomes train.fp16_mode=amp; one
    already in fp16 keeps its mode (fairseq's, as the study recipes have it)."""
    cfg, said = launched_precision(_tiny("--train.mixed_precision=no"), {ACCELERATE_PRECISION_ENV: "fp16"})
    assert (cfg.train.mixed_precision, cfg.train.fp16_mode) == ("fp16", "amp") and "amp" in said
    for mode in ("fairseq", "amp"):
        cfg = _tiny("--train.mixed_precision=fp16", f"--train.fp16_mode={mode}")
        assert launched_precision(cfg, {ACCELERATE_PRECISION_ENV: "fp16"}) == (cfg, None)


def test_a_precision_the_project_lacks_is_refused_naming_both():
    """fp8 (or anything else) from accelerate is a ConfigError that names it and the config's precision."""
    with pytest.raises(ConfigError, match=r"fp8.*train\.mixed_precision=no|train\.mixed_precision=no.*fp8"):
        launched_precision(_tiny(), {ACCELERATE_PRECISION_ENV: "fp8"})


def _launch(tmp: Path, data: Path, name: str, *accelerate_args: str) -> subprocess.Popen:
    """`accelerate launch [accelerate_args] recipes/pretrain.py` of one step of the fp32 tiny recipe, its output
    in tmp/<name>.out and .err (files, not pipes: a full pipe would stall one launch while we wait on the other)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    cmd = [ACCELERATE, "launch", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no",
           *accelerate_args, str(REPO / "recipes" / "pretrain.py"), "--config", str(REPO / "recipes" / "tiny.yaml"),
           f"--data.path={data}", f"--train.output_dir={tmp / 'runs'}", f"--train.name={name}",
           "--train.max_steps=1", "--data.crop_seconds=2.0", "--data.batch_size=2", "--optim.warmup_steps=1",
           "--train.trackers=[]"]
    with open(tmp / f"{name}.out", "w") as out, open(tmp / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=tmp, env={**env, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"},
                                stdout=out, stderr=err)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tokenized_dataset) -> dict[str, tuple[Path, str]]:
    """Two launches at once (each mostly waits on its start-up: together they take the time of one): bf16
    asked by accelerate's flag, and by an accelerate config file. {way: (run directory, stdout)}."""
    tmp = tmp_path_factory.mktemp("accelerate_precision")
    config_file = tmp / "accelerate.yaml"
    config_file.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
                                           "num_machines": 1, "num_processes": 1, "mixed_precision": "bf16"}))
    procs = {"flag": _launch(tmp, tokenized_dataset, "flag", "--mixed_precision", "bf16"),
             "file": _launch(tmp, tokenized_dataset, "file", "--config_file", str(config_file))}
    out = {}
    try:
        for way, proc in procs.items():
            proc.wait(timeout=600)
            assert proc.returncode == 0, (tmp / f"{way}.err").read_text()[-3000:]
            out[way] = (tmp / "runs" / way, (tmp / f"{way}.out").read_text())
    finally:
        for proc in procs.values():  # one failed: the other is not left running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def _trained_in(run_dir: Path) -> str:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["mixed_precision"]


@pytest.mark.slow
def test_accelerate_launch_flag_sets_the_runs_precision(launched):
    """`accelerate launch --mixed_precision bf16` on the fp32 tiny recipe trains in bf16 (the run's config.yaml
    records it, the run's line says it) instead of silently training in fp32."""
    run_dir, stdout = launched["flag"]
    assert _trained_in(run_dir) == "bf16"
    assert "precision=bf16" in stdout and "train.mixed_precision=no" in stdout


@pytest.mark.slow
def test_accelerate_config_file_sets_the_runs_precision(launched):
    """The same through an accelerate config file (`accelerate launch --config_file`, mixed_precision: bf16)."""
    run_dir, stdout = launched["file"]
    assert _trained_in(run_dir) == "bf16"
    assert "precision=bf16" in stdout and "train.mixed_precision=no" in stdout
