"""pyproject.toml's dependencies: ranges, not pins, for torch and torchaudio; an upper bound on each package whose
private parts the code uses; no extra that drags in a package which cannot build without system headers; and
requirements/study-lock.txt, the study's exact environment, one that those ranges allow."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# package -> a private name the code uses from it (where: the comment beside its bound in pyproject.toml)
PRIVATE_USE = {"torch": "torch._weight_norm", "datasets": "ArrowExamplesIterable",
               "accelerate": "AcceleratorState._reset_state"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> dict[str, Requirement]:
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return {r.name.lower(): r for r in reqs}


def _lock() -> dict[str, str]:
    lines = (ROOT / "requirements" / "study-lock.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    assert all(len(p) == 2 for p in pins), "every line of the lock is name==version"
    return {name.lower(): v for name, v in pins}


def test_torch_and_torchaudio_are_ranges_and_private_uses_have_a_ceiling():
    """torch and torchaudio take a floor and a ceiling, not one exact release; torch, datasets and accelerate,
    whose private parts the code uses (and still does: the names are in the package), have an upper bound."""
    reqs = _requirements()
    for name in ("torch", "torchaudio"):
        ops = {s.operator for s in reqs[name].specifier}
        assert "==" not in ops and ">=" in ops and "<" in ops, reqs[name]
    source = "\n".join(p.read_text() for p in (ROOT / "musiclm_stab").rglob("*.py"))
    for name, private in PRIVATE_USE.items():
        assert private in source, f"{private} is no longer used: drop or widen {name}'s ceiling"
        assert any(s.operator in ("<", "<=") for s in reqs[name].specifier), reqs[name]


def test_no_extra_needs_a_package_that_builds_only_with_system_headers():
    """The README's install line (`.[corpus,export]`) brings nothing that declares pyaudio (tinysoundfont):
    it installs from wheels and passes `pip check`."""
    for extra, reqs in _project()["optional-dependencies"].items():
        names = {Requirement(r).name.lower() for r in reqs}
        assert not names & {"tinysoundfont", "pyaudio"}, extra


def test_the_study_lock_is_an_environment_the_ranges_allow():
    """Each package pinned by requirements/study-lock.txt that pyproject.toml names is within its range, torch
    at 2.14.1 (the studies' runs record it); the environment running this suite satisfies the core ranges."""
    lock, reqs = _lock(), _requirements()
    assert lock["torch"] == "2.14.1" and lock["torchaudio"] == "2.11.0" and "tinysoundfont" not in lock
    for name, req in reqs.items():
        if name in lock:
            assert req.specifier.contains(lock[name], prereleases=True), (req, lock[name])
    for name in ("torch", "torchaudio", "accelerate", "datasets"):
        installed = re.sub(r"\+.*", "", version(name))
        assert reqs[name].specifier.contains(installed, prereleases=True), (name, installed)
