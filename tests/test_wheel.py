"""The built wheel is the package a researcher installs: it carries its recipes, its training entry point,
its reference pages, its licence, its type marker and the version written in musiclm_stab/constants.py, and
from a fresh venv outside the checkout its commands run as the README and docs/TRAINING.md print them:
--version, --help, `train` (its settings, --print-config, a short run by recipe name), `python -m
musiclm_stab`, `docs`, and the main job.

Kept cheap: the wheel is built without isolation or dependencies, and the fresh venv reuses this venv's
installed dependencies through a .pth line naming its site-packages (a plain path line: the editable
install's finder, itself a .pth there, is not run, so the checkout is not importable from the new venv).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
import yaml

import musiclm_stab
from musiclm_stab.training.checkpoint import checkpoint_step, list_checkpoints

ROOT = Path(__file__).resolve().parent.parent
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "musiclm_stab", "docs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of its sources (no build/ or egg-info left in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        if name == "docs":  # its pages; musiclm_stab/docs is a link to it (the figures and runs are not shipped)
            shutil.copytree(ROOT / name, src / name, ignore=lambda folder, names: [n for n in names
                                                                                   if not n.endswith(".md")])
        elif (ROOT / name).is_dir():  # links kept as links, as a checkout has them
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, text=True)
    (built,) = (tmp / "dist").glob("*.whl")
    return built


def test_wheel_carries_recipes_entry_point_pages_licence_and_version(wheel):
    """Every recipe YAML and recipes/pretrain.py are in the wheel (once, under musiclm_stab/recipes), every
    docs/*.md page (under musiclm_stab/docs, nothing else of docs/), with py.typed and the LICENSE; its
    version is musiclm_stab.__version__."""
    names = zipfile.ZipFile(wheel).namelist()
    packaged = sorted(p.relative_to(ROOT / "musiclm_stab").as_posix()
                      for p in (ROOT / "musiclm_stab" / "recipes").rglob("*") if p.suffix in (".yaml", ".py"))
    assert len(packaged) > 10
    missing = [p for p in packaged if f"musiclm_stab/{p}" not in names]
    assert not missing
    assert "musiclm_stab/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith("recipes/")]  # the checkout's symlink is not a second copy
    pages = sorted(f"musiclm_stab/docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) > 5 and sorted(n for n in names if n.startswith("musiclm_stab/docs/")) == pages
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert re.search(rf"^Version: {re.escape(musiclm_stab.__version__)}$", metadata, flags=re.M)
    assert wheel.name.startswith(f"musiclm_stab-{musiclm_stab.__version__}-")
    assert re.search(r'^Provides-Extra: export$', metadata, flags=re.M)
    assert re.search(r'^Requires-Dist: transformers.*extra == "export"', metadata, flags=re.M)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    """A new venv outside the checkout with the wheel installed and this venv's dependencies reused."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(purelib) / "reuse_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    # pip (importable through that line) installs into the new venv; --ignore-installed: never touch the
    # editable install it sees in the reused site-packages
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed",
                    str(wheel)], check=True, capture_output=True, text=True, env=_env())
    return venv


def _env() -> dict[str, str]:
    """This environment without anything that would put the checkout on the path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("ACCELERATE_")}


@pytest.mark.slow
def test_installed_wheel_runs_the_main_job_outside_the_checkout(fresh_venv, tokenized_dataset, tmp_path):
    """From the fresh venv, in a folder outside the checkout, `musiclm-stab quickstart --data` trains through
    the packaged recipe and entry point (accelerate launch), evaluates and plots; the package it ran is the
    installed one."""
    python, cli = fresh_venv / "bin" / "python", fresh_venv / "bin" / "musiclm-stab"
    where = subprocess.run([str(python), "-c", "import musiclm_stab, musiclm_stab.experiments.launch as l; "
                            "print(musiclm_stab.__file__); print(l.PRETRAIN); print(musiclm_stab.__version__)"],
                           cwd=tmp_path, check=True, capture_output=True, text=True, env=_env()).stdout.split()
    assert all(Path(p).resolve().is_relative_to(fresh_venv.resolve()) for p in where[:2]), where
    assert where[2] == musiclm_stab.__version__
    t0 = time.perf_counter()
    proc = subprocess.run([str(cli), "quickstart", "--data", str(tokenized_dataset), "--steps", "2",
                           "--set", "data.crop_seconds=2.0", "data.batch_size=2", "train.trackers=[]"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**_env(), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert (run_dir / "checkpoints").is_dir() and list((run_dir / "eval").glob("step_*.json"))
    assert (run_dir / "figures" / "loss.png").is_file()
    assert str(fresh_venv) in proc.stdout  # the launch line names the installed pretrain.py
    print(f"quickstart from the installed wheel: {time.perf_counter() - t0:.1f} s")


def _run(venv: Path, argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command of the fresh venv (its bin/ named), run in ``cwd`` outside the checkout, with a Hugging Face
    home of its own: no accelerate default config of this machine's (``accelerate config``) is read."""
    home = cwd.parent / f"{cwd.name}-hf-home"
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**_env(), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1",
                                                "HF_HOME": str(home)})


def test_installed_commands_work_as_printed(fresh_venv, tmp_path):
    """From the fresh venv, in a folder outside the checkout: --version, --help and `python -m musiclm_stab
    --help` (the same text), `train --help` listing the settings, `train --mixed_precision bf16 -- --config
    tiny --print-config` (the tiny recipe by name, resolved by the launched trainer, in the precision accelerate
    was given), and `docs TRAINING` / `docs README` printing the pages shipped in the wheel; nothing is
    written where they run."""
    version = _run(fresh_venv, ["musiclm-stab", "--version"], tmp_path)
    assert version.returncode == 0 and version.stdout == f"musiclm-stab {musiclm_stab.__version__}\n"
    usage = _run(fresh_venv, ["musiclm-stab", "--help"], tmp_path)
    assert usage.returncode == 0 and "\n  train " in usage.stdout and "\n  docs " in usage.stdout
    assert _run(fresh_venv, ["python", "-m", "musiclm_stab", "--help"], tmp_path).stdout == usage.stdout
    settings = _run(fresh_venv, ["musiclm-stab", "train", "--help"], tmp_path)
    assert settings.returncode == 0 and "--train.max_steps INT" in settings.stdout
    assert "--model.norm_scheme {pre,post,deepnorm,sandwich,subln}|none" in settings.stdout
    printed = _run(fresh_venv, ["musiclm-stab", "train", "--mixed_precision", "bf16", "--", "--config", "tiny",
                                "--print-config"], tmp_path)
    assert printed.returncode == 0, printed.stderr[-3000:]
    config = yaml.safe_load(printed.stdout)
    assert (config["train"]["name"], config["model"]["size"], config["model"]["cqt_bins"]) == ("tiny", "tiny", 84)
    assert config["train"]["mixed_precision"] == "bf16" and "ACCELERATE_MIXED_PRECISION=bf16" in printed.stdout
    for page, source in (("TRAINING", ROOT / "docs" / "TRAINING.md"), ("README", ROOT / "README.md")):
        shown = _run(fresh_venv, ["musiclm-stab", "docs", page], tmp_path)
        assert shown.returncode == 0 and shown.stdout.strip() == source.read_text().strip(), page
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_installed_train_runs_a_recipe_by_name(fresh_venv, tokenized_dataset, tmp_path):
    """From the fresh venv, outside the checkout, `musiclm-stab train --config tiny ...` as the README prints
    it trains a few steps under accelerate launch with the installed trainer: the run directory holds the
    tiny recipe's config, metrics of every step and a checkpoint."""
    proc = _run(fresh_venv, ["musiclm-stab", "train", "--config", "tiny", f"--data.path={tokenized_dataset}",
                             "--train.name=by-name", "--train.max_steps=2", "--train.checkpoint_every=2",
                             "--data.crop_seconds=2.0", "--data.batch_size=2", "--train.trackers=[]"],
                tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "by-name"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [checkpoint_step(c) for c in list_checkpoints(run)] == [2]
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["cqt_bins"] == 84  # the tiny recipe's
