"""The documentation stays true to the code: links resolve, shown commands name real commands and settings,
the README stays short, and every command's --help points to an existing reference page.

Commands are checked by parsing them with the real parsers (the subcommand's own argparse parser, accelerate's
launch parser, ``load_config`` for settings) and stopping right after parsing: nothing is run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from accelerate.commands.launch import launch_command_parser

from musiclm_stab import cli, reference
from musiclm_stab.config import Config, ConfigError, load_config, recipe_file, recipe_names

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
        load_config([_recipe(c) for c in configs], concrete)
    except Exception as e:  # ConfigError, or a recipe that does not load
        problems.append(f"{type(e).__name__}: {e}")
    return problems


def _recipe(config: str) -> Path | str:
    """A --config as the docs write it: a file of the checkout, else a packaged recipe's name."""
    return ROOT / config if (ROOT / config).is_file() else config


def _missing_recipes(configs: list[str]) -> list[str]:
    """Recipes that do not exist, or exist only in a checkout: a shown command works installed too."""
    problems = []
    for c in configs:
        if PLACEHOLDER.search(c):
            continue
        try:
            recipe_file(_recipe(c))
        except ConfigError as e:
            problems.append(str(e))
        if c.removeprefix("recipes/").removesuffix(".yaml") not in recipe_names():
            problems.append(f"--config {c} is no packaged recipe: it works only in a checkout")
    return problems


def _check_launch(words: list[str]) -> list[str]:
    """`accelerate launch [options] -m module args` or `torchrun [options] -m module args`: the trainer's
    module, as an installed package has it (not a checkout's script path)."""
    if words[0] == "accelerate":
        try:
            ns = launch_command_parser().parse_args(words[2:])
        except SystemExit:
            return ["accelerate launch does not accept these options"]
        script, args, module = ns.training_script, ns.training_script_args, ns.module
        problems = []
        if ns.config_file:  # accelerate reads it as a path: a checkout's file is not there when installed
            problems.append(f"--config_file {ns.config_file}: a checkout's file; `musiclm-stab train --config_file "
                            "NAME --` takes a packaged one")
    else:
        i = next(i for i, w in enumerate(words) if w.endswith(".py") or w == "-m")
        module = words[i] == "-m"
        script, args, problems = words[i + module], words[i + 1 + module:], []
    if not module:  # recipes/pretrain.py is a checkout's path; installed, the trainer is a module
        return problems + [f"{script}: a checkout's file; launch the module (-m musiclm_stab.pretrain)"]
    if importlib.util.find_spec(script) is None:
        return problems + [f"no module {script}"]
    return problems + _check_trainer_args(args)


def _check_trainer_args(args: list[str]) -> list[str]:
    """The trainer's arguments: --config (recipes that exist, by name or file), --resume, --print-config and
    real settings."""
    configs = [args[i + 1] for i, w in enumerate(args) if w == "--config" and i + 1 < len(args)]
    problems = _missing_recipes(configs)
    rest = [w for i, w in enumerate(args) if w not in ("--config", "--resume", "--print-config")
            and not (i > 0 and args[i - 1] == "--config")]
    problems += [f"{w!r} is neither --config, --resume, --print-config nor --section.key=value" for w in rest
                 if not SETTING.match(w)]
    return problems + _check_settings(args, [c for c in configs if not PLACEHOLDER.search(c)])


def _check_train(words: list[str]) -> list[str]:
    """`musiclm-stab train [ACCELERATE OPTIONS --] ARGS`: accelerate's options as `accelerate launch` parses
    them (a packaged --config_file by name), the trainer's arguments as the trainer parses them."""
    from musiclm_stab.experiments.train import packaged_config_files, split_arguments
    from musiclm_stab.training.arguments import ENTRY_MODULE

    try:
        options, args = split_arguments(words[2:])
        options = packaged_config_files(options)
    except ConfigError as e:
        return [str(e)]
    try:
        launch_command_parser().parse_args([*options, "-m", ENTRY_MODULE])
    except SystemExit:
        return ["accelerate launch does not accept these options"]
    if args == ["--help"]:
        return []
    return _check_trainer_args(args)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@pytest.mark.parametrize("page, words", CHECKED, ids=[f"{p.name}:{' '.join(w)[:60]}" for p, w in CHECKED])
def test_shown_command_is_real(page, words, monkeypatch, capsys):
    """A command shown in the docs names a real subcommand, target or file, options its parser accepts, and
    real settings."""
    if words[0] == "make":
        assert set(words[1:]) <= _make_targets(), f"{_rel(page)}: make {words[1:]}: no such target"
        return
    if words[0] in ("accelerate", "torchrun") or words[:2] == ["musiclm-stab", "train"]:
        problems = _check_launch(words) if words[0] != "musiclm-stab" else _check_train(words)
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
    """The page a --help names (``Reference: docs/X.md``), checked to say how to read it offline: ``musiclm-stab
    docs X`` on the same line, which prints that very page."""
    m = re.search(r"Reference: (\S+\.md)\b[^\n]*?offline: musiclm-stab docs (\w+)\)", " ".join(text.split()))
    assert m, f"no 'Reference: <page>.md (... offline: musiclm-stab docs PAGE)' in:\n{text}"
    assert reference.page_text(m[2]) == (ROOT / m[1]).read_text(), f"musiclm-stab docs {m[2]} is not {m[1]}"
    return ROOT / m[1]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_command_help_names_its_reference_page(command, capsys):
    """`musiclm-stab CMD --help` says what CMD does and names an existing page, the one `musiclm-stab --help`
    lists for it, with the `musiclm-stab docs` command that prints it offline."""
    _, summary, page = cli.COMMANDS[command]
    text = _help(lambda argv: cli.main([command, *argv]), ["--help"], capsys)
    description = text.split("\n\n")[1].strip()
    assert description and not description.startswith(("positional", "options")), text
    assert _reference(text) == ROOT / page and (ROOT / page).is_file()
    assert f"{summary} ({page})" in cli.usage()


@pytest.mark.parametrize("entry, argv, page", [
    ("musiclm_stab.tokenizer.cli:cli_main", ["--merge", "--help"], "docs/TOKENIZING.md"),
    ("musiclm_stab.training.trainer:main", ["--help"], "docs/TRAINING.md"),  # -m musiclm_stab.pretrain
    ("musiclm_stab.analysis.claims:cli_main", ["--help"], "docs/STUDY.md"),
    ("musiclm_stab.analysis.instability:cli_main", ["--help"], "docs/STUDY.md"),
    ("musiclm_stab.analysis.power:cli_main", ["--help"], "docs/STUDY.md"),
])
def test_other_entry_points_name_their_reference_page(entry, argv, page, capsys):
    """`tokenize --merge`, the trainer's module and the study's analysis modules name their existing page
    too, with the command that prints it offline."""
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


def test_the_package_carries_the_checkouts_pages():
    """`musiclm-stab docs` reads the checkout's own pages (musiclm_stab/docs is a link to docs/, one copy):
    README and every docs/*.md, each under its name."""
    assert (ROOT / "musiclm_stab" / "docs").resolve() == (ROOT / "docs").resolve()
    assert reference.page_names() == ["README", *sorted(p.stem for p in (ROOT / "docs").glob("*.md"))]
    for name in reference.page_names():
        path = ROOT / "README.md" if name == "README" else ROOT / "docs" / f"{name}.md"
        assert reference.page_text(name) == path.read_text(), name
