"""The documentation stays true to the code: links resolve, shown commands name real commands and settings,
the README stays short, and every command's --help points to an existing reference page.

Commands are checked by parsing them with the real parsers (the subcommand's own argparse parser, accelerate's
launch parser, ``load_config`` for settings) and stopping right after parsing: nothing is run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest
from accelerate.commands.launch import launch_command_parser

from musiclm_stab import cli
from musiclm_stab.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SETTING = re.compile(r"^(?:--)?(data|model|optim|train)\.(\w+)=(.*)$")
PLACEHOLDER = re.compile(r"\.\.\.|<|^[A-Z_]+$")  # `...`, `<first machine>`, `DIR`: the text stands for a value


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced blocks (code is not markdown: no links, no headings)."""
    return FENCE.sub("", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as '-', repeats numbered."""
    anchors, counts = set(), {}
    for line in _prose(page.read_text()).splitlines():
        if re.match(r"^#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    """Each relative link (and image) of the page names an existing file, and its #anchor an existing heading."""
    bad = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


def test_readme_links_reach_every_docs_page():
    """Every page in docs/ is one click from the README."""
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    missing = [_rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_readme_is_short():
    """README.md is the front door: at most 200 lines."""
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (limit {README_MAX_LINES})"


def _commands(page: Path) -> list[list[str]]:
    """The shell commands of the page's fenced blocks, continuation lines joined, comments and env vars dropped."""
    out = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # not shell (a diagram, a table)
                continue
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words.pop(0)
            if words:
                out.append(words)
    return out


def _is_checked(words: list[str]) -> bool:
    return (words[0] in ("musiclm-stab", "make") or words[:2] == ["accelerate", "launch"]
            or words[0] == "torchrun"
            or (words[0].startswith("python") and words[1:2] == ["-m"] and words[2].startswith("musiclm_stab")))


CHECKED = [(page, words) for page in COMMAND_PAGES for words in _commands(page) if _is_checked(words)]


def test_the_pages_show_commands():
    """The command check below has something to check in the README and in each reference page it covers."""
    pages = {page.name for page, _ in CHECKED}
    assert {"README.md", "TOKENIZING.md", "TRAINING.md", "CRASH_SAFETY.md", "PROBES.md", "EXPORT.md"} <= pages


class _Parsed(Exception):
    """Raised right after a subcommand's parser accepted its arguments, so that nothing runs."""


def _parse_only(monkeypatch) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _check_settings(words: list[str], configs: list[str]) -> list[str]:
    """Every section.key=value in the command is a real setting; concrete ones also pass load_config's checks."""
    problems, concrete = [], []
    cfg = Config()
    fields = {s.name: {f.name for f in dataclasses.fields(getattr(cfg, s.name))} for s in dataclasses.fields(cfg)}
    for word in words:
        m = SETTING.match(word)
        if not m:
            continue
        section, key, value = m.groups()
        if key not in fields[section]:
            problems.append(f"{section}.{key} is not a setting")
        elif not PLACEHOLDER.search(value):
            concrete.append(f"{section}.{key}={value}")
    try:
        load_config([ROOT / c for c in configs], concrete)
    except Exception as e:  # ConfigError, or a recipe that does not load
        problems.append(f"{type(e).__name__}: {e}")
    return problems


def _check_launch(words: list[str]) -> list[str]:
    """`accelerate launch [options] recipes/X.py args` or `torchrun [options] recipes/X.py args`."""
    if words[0] == "accelerate":
        try:
            ns = launch_command_parser().parse_args(words[2:])
        except SystemExit:
            return ["accelerate launch does not accept these options"]
        script, args = ns.training_script, ns.training_script_args
        problems = []
        if ns.config_file and not (ROOT / ns.config_file).is_file():
            problems.append(f"--config_file {ns.config_file} does not exist")
    else:
        i = next(i for i, w in enumerate(words) if w.endswith(".py"))
        script, args, problems = words[i], words[i + 1:], []
    if not (ROOT / script).is_file():
        return problems + [f"{script} does not exist"]
    configs = [args[i + 1] for i, w in enumerate(args) if w == "--config" and i + 1 < len(args)]
    problems += [f"--config {c} does not exist" for c in configs if not PLACEHOLDER.search(c)
                 and not (ROOT / c).is_file()]
    rest = [w for i, w in enumerate(args) if w not in ("--config", "--resume")
            and not (i > 0 and args[i - 1] == "--config")]
    problems += [f"{w!r} is neither --config, --resume nor --section.key=value" for w in rest if not SETTING.match(w)]
    return problems + _check_settings(args, [c for c in configs if not PLACEHOLDER.search(c)])


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@pytest.mark.parametrize("page, words", CHECKED, ids=[f"{p.name}:{' '.join(w)[:60]}" for p, w in CHECKED])
def test_shown_command_is_real(page, words, monkeypatch, capsys):
    """A command shown in the docs names a real subcommand, target or file, options its parser accepts, and
    real settings."""
    if words[0] == "make":
        assert set(words[1:]) <= _make_targets(), f"{_rel(page)}: make {words[1:]}: no such target"
        return
    if words[0] in ("accelerate", "torchrun"):
        problems = _check_launch(words)
        assert not problems, f"{_rel(page)}: {' '.join(words)}: " + "; ".join(problems)
        return
    if words[0] == "musiclm-stab":
        assert words[1] in cli.COMMANDS, f"{_rel(page)}: no subcommand {words[1]!r}"
        entry, argv = importlib.import_module(cli.COMMANDS[words[1]][0]).cli_main, words[2:]
    else:  # python -m musiclm_stab.<module>
        entry, argv = importlib.import_module(words[2]).cli_main, words[3:]
    _parse_only(monkeypatch)
    with pytest.raises((_Parsed, SystemExit)) as caught:
        entry(argv)
    assert caught.type is _Parsed, f"{_rel(page)}: {' '.join(words)}: {capsys.readouterr().err}"
    sets = [w for i, w in enumerate(argv) if i > 0 and argv[i - 1] == "--set"]
    problems = _check_settings(sets + [w for w in argv if w.startswith("--") and SETTING.match(w)], [])
    assert not problems, f"{_rel(page)}: {' '.join(words)}: " + "; ".join(problems)


def _help(entry, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as caught:
        entry(argv)
    assert caught.value.code == 0
    return capsys.readouterr().out


def _reference(text: str) -> Path:
    m = re.search(r"Reference: (\S+\.md)", text)
    assert m, f"no 'Reference: <page>.md' in:\n{text}"
    return ROOT / m[1]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_command_help_names_its_reference_page(command, capsys):
    """`musiclm-stab CMD --help` says what CMD does and names an existing page, the one `musiclm-stab --help`
    lists for it."""
    _, summary, page = cli.COMMANDS[command]
    text = _help(lambda argv: cli.main([command, *argv]), ["--help"], capsys)
    description = text.split("\n\n")[1].strip()
    assert description and not description.startswith(("positional", "options")), text
    assert _reference(text) == ROOT / page and (ROOT / page).is_file()
    assert f"{summary} ({page})" in cli.usage()


@pytest.mark.parametrize("entry, argv, page", [
    ("musiclm_stab.tokenizer.cli:cli_main", ["--merge", "--help"], "docs/TOKENIZING.md"),
    ("musiclm_stab.training.trainer:main", ["--help"], "docs/TRAINING.md"),  # recipes/pretrain.py
    ("musiclm_stab.analysis.claims:cli_main", ["--help"], "docs/STUDY.md"),
])
def test_other_entry_points_name_their_reference_page(entry, argv, page, capsys):
    """`tokenize --merge`, `recipes/pretrain.py` and the claims module's --help name their existing page too."""
    module, function = entry.split(":")
    text = _help(getattr(importlib.import_module(module), function), argv, capsys)
    assert _reference(text) == ROOT / page and (ROOT / page).is_file()


def test_top_level_help_lists_every_command_with_an_existing_page(capsys):
    """`musiclm-stab --help` lists every command with one line and an existing reference page."""
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command, (_, summary, page) in cli.COMMANDS.items():
        assert re.search(rf"^  {re.escape(command)} +{re.escape(summary)} \({re.escape(page)}\)$", out, re.M), command
        assert (ROOT / page).is_file(), page
    assert "(docs/TRAINING.md)" in out and (ROOT / "docs/TRAINING.md").is_file()
