"""The `musiclm-stab` command itself: --version, `python -m musiclm_stab` as the same command, and
`musiclm-stab docs`, which prints the reference pages that ship with the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import musiclm_stab
from musiclm_stab import cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_names_the_release(capsys):
    """`musiclm-stab --version` prints the package's version (musiclm_stab.__version__) and exits 0."""
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"musiclm-stab {musiclm_stab.__version__}\n"


def test_python_dash_m_is_the_command(tmp_path):
    """`python -m musiclm_stab` is `musiclm-stab`: the same help, the same version, the same refusal of an
    unknown command (exit 2)."""
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "musiclm_stab", *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)

    assert run("--help").stdout == cli.usage() + "\n"
    assert run("--version").stdout == f"musiclm-stab {musiclm_stab.__version__}\n"
    refused = run("nosuch")
    assert refused.returncode == 2 and "unknown command 'nosuch'" in refused.stderr


def test_docs_lists_and_prints_the_pages(capsys):
    """`musiclm-stab docs` lists README and every docs/*.md page with its title; `musiclm-stab docs training`
    (any case, with or without docs/ and .md) prints docs/TRAINING.md as it is."""
    assert cli.main(["docs"]) == 0
    listing = capsys.readouterr().out
    for page in ["README", *(p.stem for p in (ROOT / "docs").glob("*.md"))]:
        assert f"\n  {page} " in listing, page
    assert "  TRAINING      Training\n" in listing
    for name in ("TRAINING", "training", "docs/TRAINING.md"):
        assert cli.main(["docs", name]) == 0
        assert capsys.readouterr().out == (ROOT / "docs" / "TRAINING.md").read_text()


def test_docs_of_an_unknown_page_names_the_pages(capsys):
    """An unknown page is one line naming the pages there are, exit 2."""
    assert cli.main(["docs", "tutorial"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no reference page 'tutorial'; the pages: README, API, ")
    assert len(err.splitlines()) == 1
