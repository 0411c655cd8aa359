"""The built wheel is the package a researcher installs: it carries its recipes, its training entry point,
its licence, its type marker and the version written in musiclm_stab/__init__.py, and its main job runs from
a fresh venv outside the checkout.

Kept cheap: the wheel is built without isolation or dependencies, and the fresh venv reuses this venv's
installed dependencies through a .pth line naming its site-packages (a plain path line: the editable
install's finder, itself a .pth there, is not run, so the checkout is not importable from the new venv).
"""

from __future__ import annotations

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

import musiclm_stab

ROOT = Path(__file__).resolve().parent.parent
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "musiclm_stab")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of its sources (no build/ or egg-info left in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, text=True)
    (built,) = (tmp / "dist").glob("*.whl")
    return built


def test_wheel_carries_recipes_entry_point_licence_and_version(wheel):
    """Every recipe YAML and recipes/pretrain.py are in the wheel (once, under musiclm_stab/recipes), with
    py.typed and the LICENSE; its version is musiclm_stab.__version__."""
    names = zipfile.ZipFile(wheel).namelist()
    packaged = sorted(p.relative_to(ROOT / "musiclm_stab").as_posix()
                      for p in (ROOT / "musiclm_stab" / "recipes").rglob("*") if p.suffix in (".yaml", ".py"))
    assert len(packaged) > 10
    missing = [p for p in packaged if f"musiclm_stab/{p}" not in names]
    assert not missing
    assert "musiclm_stab/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith("recipes/")]  # the checkout's symlink is not a second copy
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
