"""``musiclm-stab docs [PAGE]``: the reference pages (docs/*.md and the README), wherever the package is
installed and offline.

The pages ship inside the package: ``musiclm_stab/docs`` is package data, in a checkout a symlink to its
``docs/`` (the one copy, as ``recipes/`` is the other way round). The README is the package's description,
so an installed package reads it from its metadata; a checkout reads its own file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import pydoc
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DOCS = PACKAGE / "docs"
README = "README"


def _checkout_readme() -> Path | None:
    """The README.md beside the package when the package is a checkout's (its pyproject.toml is there too)."""
    root = PACKAGE.parent
    return root / "README.md" if (root / "README.md").is_file() and (root / "pyproject.toml").is_file() else None


def page_names() -> list[str]:
    """README, then every page under docs/ by its name without ``.md`` (TRAINING, STUDY, ...)."""
    return [README, *sorted(p.stem for p in DOCS.glob("*.md"))]


def page_text(name: str) -> str:
    """The text of a page: ``TRAINING``, ``training``, ``TRAINING.md`` or ``docs/TRAINING.md`` alike.
    KeyError naming the pages when there is no such page."""
    stem = Path(name).name.removesuffix(".md").upper()
    if stem == README:
        readme = _checkout_readme()
        if readme is not None:
            return readme.read_text()
        return importlib.metadata.metadata("musiclm_stab").get_payload()  # type: ignore[attr-defined]
    page = DOCS / f"{stem}.md"
    if stem not in page_names() or not page.is_file():
        raise KeyError(f"no reference page {name!r}; the pages: {', '.join(page_names())}")
    return page.read_text()


def _title(name: str) -> str:
    first = page_text(name).lstrip().splitlines()[0]
    return first.lstrip("#").strip()


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab docs",
                                description="Print a reference page (README, TRAINING, ...), or list the pages "
                                "without one. They ship with the package: no checkout or network needed.",
                                epilog="Reference: README.md (offline: musiclm-stab docs README)")
    p.add_argument("page", nargs="?", help="the page's name: README, TRAINING, docs/STUDY.md, ...")
    args = p.parse_args(argv)
    if args.page is None:
        print("reference pages (musiclm-stab docs PAGE):")
        for name in page_names():
            print(f"  {name:<14}{_title(name)}")
        return 0
    try:
        text = page_text(args.page)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    if sys.stdout.isatty():
        pydoc.pager(text)  # $PAGER or less, as `python -m pydoc` shows a page
    else:
        sys.stdout.write(text)
    return 0
