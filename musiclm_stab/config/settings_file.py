"""Reading a settings file (a recipe, an overlay, a run's config.yaml) safely: plain YAML values only, no key
twice in a mapping, no alias that expands the document beyond ``MAX_YAML_VALUES``; every problem one
``ConfigError`` line naming the file and where in it."""

from __future__ import annotations

import codecs
import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from musiclm_stab.config.checks import ConfigError, _show

# A recipe or a run's config.yaml has a few hundred values; YAML aliases (``*name``) may repeat a part of the
# file, and a few nested ones a billion times over (a 301-byte "alias bomb"): refused beyond this many values.
MAX_YAML_VALUES = 10_000
# Texts up to this many characters have their parse kept (``_parsed``, at most 512 of them: a few MB at most); a
# recipe or a run's config.yaml has 1,000-3,000.
CACHED_TEXT_CHARS = 16_384


class _SettingsLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain values only: a ``!!python/...`` tag is refused) that also refuses what a
    settings file must not hold: a key given twice in one mapping (the YAML spec forbids it; SafeLoader
    keeps the last silently), and aliases that expand the document beyond ``MAX_YAML_VALUES`` values."""

    def compose_document(self):
        node = super().compose_document()
        _count_values(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: what follows may override it
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.get(key)
                except TypeError:  # unhashable: SafeLoader's own error says so below
                    continue
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found duplicate key {_show(key)} (first on line {seen.start_mark.line + 1})",
                        key_node.start_mark)
                first[key] = key_node
        return super().construct_mapping(node, deep)


def _count_values(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """Values (nodes) of ``node`` with every alias expanded, each shared node counted once per use but
    visited once; a YAMLError where that passes ``MAX_YAML_VALUES`` or a node contains itself."""
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_nodes:
        raise yaml.composer.ComposerError(None, None, "found an alias inside the node it names (a recursive "
                                          "structure)", node.start_mark)
    open_nodes.add(id(node))
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    for child in children:
        total += _count_values(child, counted, open_nodes)
        if total > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand it to more than {MAX_YAML_VALUES:,} values (a settings file has "
                "a few hundred); write the values out", node.start_mark)
    open_nodes.discard(id(node))
    counted[id(node)] = total
    return total


def _yaml_reason(error: yaml.YAMLError) -> str:
    """A YAML error on one line: where (line and column) and what, without PyYAML's excerpt of the file."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = error.problem or error.context or type(error).__name__
        if error.problem and error.context:
            what += f" ({error.context})"
        if "'\\t'" in what:
            what += "; YAML indents with spaces, not tabs"
        if "could not determine a constructor for the tag" in what:
            what += "; a settings file holds plain values only (no tags)"
        return where + " ".join(what.split())
    if isinstance(error, yaml.reader.ReaderError):
        return f"position {error.position}: {' '.join(error.reason.split())} (character #x{ord(error.character):04x})"
    return " ".join(str(error).split())


def _parse(text: str) -> Any:
    return yaml.load(text, Loader=_SettingsLoader)


@functools.lru_cache(maxsize=512)
def _parsed(text: str) -> Any:
    """``_parse`` of a text, kept by the text itself (not by its path): a study's plan reads the same recipe and
    overlays once per run, and parsing is most of that; the same text parses to the same values, and a file
    whose text changed is parsed anew. Callers get a deep copy (``read_settings_file``): what they change is
    theirs. A text that fails to parse is not kept: its error is raised again on each read."""
    return _parse(text)


def _read(text: str) -> Any:
    if len(text) > CACHED_TEXT_CHARS:
        return _parse(text)
    try:
        return copy.deepcopy(_parsed(text))
    except RecursionError:  # parsed, but nested deeper than a copy can go: parsed again, as before the cache
        return _parse(text)


def read_settings_file(path: str | Path) -> Any:
    """The YAML document of a recipe or a run's config.yaml, read with ``_SettingsLoader``; ConfigError
    ``<path>: <reason>`` for a file that is missing, unreadable, not UTF-8 or not valid YAML."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the text
    except UnicodeDecodeError as e:  # e.start counts from after the mark: the offset named is the file's
        at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise ConfigError(f"{path}: not UTF-8 text: byte 0x{data[at]:02x} at offset {at} cannot be decoded") from None
    try:
        return _read(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {_yaml_reason(e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: its values are nested too deeply") from None
