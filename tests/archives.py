"""Committed archives of runs (docs/*/*.tar.xz) unpacked for the tests that recompute from them (a helper of the
tests, not collected)."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from pathlib import Path


def unpack(archive: Path, dest: Path, keep: Callable[[str], bool] | None = None) -> None:
    """``archive``'s members (only those whose name ``keep`` accepts, if given) into ``dest``, through tarfile's
    data filter where Python has it (3.10.12+)."""
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if keep is None or keep(m.name)]
        tar.extractall(dest, members=members, **safe)


def by_name(claims: dict) -> dict:
    """``claims`` (a claims.json's content) with every run folder reduced to its name, so that claims computed in
    one place compare equal to claims computed in another (``run_dirs`` sorted, each run's ``path``); in place."""
    claims["run_dirs"] = sorted(Path(p).name for p in claims["run_dirs"])
    for r in claims["runs"]:
        r["path"] = Path(r["path"]).name
    return claims
