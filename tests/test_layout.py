"""The package's shape: its layers import only downwards (LAYERS), data flows one way (the training side never
loads the tokenizer or the export writer) and no module imports itself back through others."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "musiclm_stab"

# The training, evaluation and feature-extraction side, and what it must never load (even indirectly):
# the tokenizer (EnCodec) and the export writer (transformers).
READ_SIDE = ["musiclm_stab.training.trainer", "musiclm_stab.analysis.evaluate", "musiclm_stab.analysis.plot",
             "musiclm_stab.export.features", "musiclm_stab.export.feature_files", "musiclm_stab.export.exported",
             "musiclm_stab.data", "musiclm_stab.data.loader", "musiclm_stab.data.tokenized", "musiclm_stab.model",
             "musiclm_stab.training.trained", "musiclm_stab.training.run_dir", "musiclm_stab.analysis.probe",
             "musiclm_stab.analysis.probe_data", "musiclm_stab.analysis.probe_fit", "musiclm_stab.analysis.probe_figure"]
# the tokenizer package (EnCodec, torchaudio resampling, the writer of tokenized data) and the encodec
# package itself; tokenized data is read through musiclm_stab.data.tokenized only
FORBIDDEN = ("musiclm_stab.tokenizer", "encodec", "musiclm_stab.export.hubert", "transformers")

# The package's layers, lowest first, by component (the folder under musiclm_stab/, or a top-level module's
# name; "" is musiclm_stab/__init__.py, the package's face). A module imports modules of its own component and
# of components in lower layers: never a layer above, nor a peer of its own layer (peers are independent: the
# tokenizer and the training side, for instance). The face sits on top: it re-exports the constants and hands on
# the API (loaded on first use, not imported), and nothing inside the package imports it. docs/DESIGN.md draws
# the same order.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("constants",),  # the numbers every part shares, and the version
    ("config", "durable", "host", "threads", "output_errors", "locks", "removal", "spawned"),
    ("audio", "corpus", "model"),
    ("data",),
    ("tokenizer", "training"),
    ("export",),  # a trained encoder elsewhere: transformers export, features
    ("analysis",),  # reads run directories: figures, evaluation, claims, probes (probes take features)
    ("experiments",),  # jobs made of the parts: quickstart, the study, the sweep
    ("api", "cli", "reference", "pretrain", "recipes"),  # entry points: the Python API, the command line (and its
    # pages), the trainer launched as a module,
    # recipes/pretrain.py
    ("__main__", ""),  # python -m musiclm_stab: the command line; the package's face
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for type checkers only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)


def _imports(path: Path) -> set[str]:
    """musiclm_stab modules a file imports anywhere at run time (module level or inside functions; not those
    imported for type checkers only)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("musiclm_stab")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("musiclm_stab"):
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{a.name}"
                found.add(sub if (PACKAGE.parent / sub.replace(".", "/")).with_suffix(".py").is_file()
                          or (PACKAGE.parent / sub.replace(".", "/") / "__init__.py").is_file() else node.module)
    return found


def test_read_side_never_loads_the_tokenizer_or_the_export_writer():
    """Importing any training/evaluation/feature module loads no tokenizer, EnCodec, export writer or
    transformers module (checked in a fresh interpreter, so indirect imports count)."""
    script = (
        "import importlib, json, sys\n"
        f"for name in {READ_SIDE!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert json.loads(out.splitlines()[-1]) == []


def _graph() -> dict[str, set[str]]:
    graph = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_read_side_does_not_even_lazily_import_the_tokenizer_or_the_export_writer():
    """No chain of imports from the read side, function-level imports included, reaches the tokenizer or
    the export writer."""
    graph = _graph()
    for start in READ_SIDE:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        assert not [m for m in seen if m.startswith(FORBIDDEN)], start


def test_no_import_cycles():
    """The graph of imports between the package's modules (function-level imports included) has no cycle."""
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(d):], d]))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_module_imports_from_a_layer_above_its_own():
    """Every module imports only its own component and lower layers (LAYERS), function-level imports included:
    analysis never reaches into experiments, the training side never into the tokenizer or export."""
    graph = _graph()
    layer = {c: i for i, names in enumerate(LAYERS) for c in names}
    unplaced = sorted({_component(m) for m in graph} - set(layer))
    assert not unplaced, f"components with no place in LAYERS (put each in its layer): {unplaced}"
    upward = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
              if _component(d) != _component(m) and layer[_component(d)] >= layer[_component(m)]]
    assert not upward, "imports of a layer above, or of a peer: " + "; ".join(upward)


def test_layer_check_sees_an_upward_import(tmp_path):
    """The layer check's reading of a file finds an upward import inside a function, and skips one made for
    type checkers only."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from musiclm_stab.api import train\n"
                      "def f():\n    from musiclm_stab.experiments import launch\n")
    assert _imports(module) == {"musiclm_stab.experiments.launch"}


def test_package_holds_no_test_hooks():
    """No environment switch or global flag for tests in the package (tests patch seams instead)."""
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "MUSICLM_STAB_TEST" not in text and "CPU_FAST_DROPOUT" not in text, path


def test_nothing_inside_the_package_imports_its_face():
    """No module of the package imports ``musiclm_stab`` itself (its __init__, the face that re-exports the
    constants and hands on the API): every part takes its constants from musiclm_stab/constants.py."""
    graph = _graph()
    assert [m for m, deps in sorted(graph.items()) if "musiclm_stab" in deps] == []
