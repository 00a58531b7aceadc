"""Imports point one way: the layer order of docs/DESIGN (masks and numerics <- heads, rope, cache,
steps, trace <- backends <- functional <- module <- integrations, distributed <- explain,
diagnose <- the package's front door <- cli), and no cycle between any two modules.

Read from the source with ``ast``, every ``import`` counted wherever it is written (module top,
inside a function or a block): a function-level import that points backwards is a cycle that only
waits for the first call. An import under ``if TYPE_CHECKING:`` never runs, so it does not make a
cycle (a renderer may name the type of the result it renders), but it still keeps the layer
order. Nothing is imported, so the test is cheap and names the file and line of each offending
import.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SRC = ROOT / "src"
PACKAGE = "multihead"

#: each module (or package: the name covers everything under it) and its layer; a module may
#: import from its own layer or a lower one, never a higher one
LAYERS: dict[str, int] = {
    # 0: the convention and the numerics, importing nothing of multihead but each other
    "multihead.masks": 0, "multihead._numerics": 0, "multihead._checks": 0, "multihead._progress": 0,
    # 1: the pieces a forward pass is made of
    "multihead.heads": 1, "multihead.rope": 1, "multihead.cache": 1, "multihead.ragged": 1, "multihead.paged": 1,
    "multihead.steps": 1, "multihead.trace": 1,
    # 2: the kernels
    "multihead.backends": 2,
    # 3: the functional core
    "multihead.functional": 3,
    # 4: the module, its settings and what drives it; beside them the codecs of (AttentionConfig,
    # weights) from and to other layouts, which the module's from_torch/from_hf/to_torch call
    "multihead.config": 4, "multihead.module": 4, "multihead.per_head": 4, "multihead.decode_step": 4, "multihead._torch_habits": 4,
    "multihead.decoding": 4, "multihead.hf": 4, "multihead.interop": 4, "multihead.integrations.torch_mha": 4,
    # 5: around the module: other conventions in and out, many devices
    "multihead.integrations": 5, "multihead.nn": 5,
    "multihead.distributed": 5, "multihead.ulysses": 5,
    # 6: showing and checking what attention did
    "multihead.explain": 6, "multihead.diagnosis": 6,
    # 7: the package's front door (``import multihead``), then the command line
    "multihead": 7, "multihead.__main__": 8, "multihead.cli": 8,
}


@dataclass(frozen=True)
class Import:
    source: str    # the importing module
    target: str    # the multihead module it reaches
    line: int
    where: str     # "top", "nested (in a function or block)" or "type checking only"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _known(name: str) -> str:
    """The module ``name`` lives in: itself, or the nearest enclosing module (``pkg.Name`` -> pkg)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, path: pathlib.Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [_known(a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    return [_known(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]


def _imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = {id(n) for n in tree.body}
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for inner in block.body for n in ast.walk(inner)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                where = ("type checking only" if id(node) in typing_only
                         else "top" if id(node) in top else "nested (in a function or block)")
                for target in _targets(module, path, node):
                    if target != module:
                        found.append(Import(module, target, node.lineno, where))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


IMPORTS = _imports()


def layer(module: str) -> int:
    """The layer of ``module``: that of the longest name in LAYERS covering it, the package's own
    entry (``multihead``, the front door) covering no other module: a new top-level module must
    be given its layer."""
    name = module
    while name not in LAYERS or (name == PACKAGE and module != PACKAGE):
        if "." not in name:
            raise KeyError(module)
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set())
        graph.setdefault(imp.target, set())
        if imp.where != "type checking only":
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_every_kind_of_import():
    """The reader itself: relative, absolute, from-package, nested and aliased imports all found."""
    by_source = {(i.source, i.target) for i in IMPORTS}
    assert ("multihead.functional", "multihead.backends") in by_source          # from . import backends
    assert ("multihead.functional", "multihead.backends.reference") in by_source  # from .backends import reference
    assert ("multihead.cli", "multihead.diagnosis.load") in by_source                 # inside a function
    assert ("multihead", "multihead.explain.explanation") in by_source               # under TYPE_CHECKING too
    assert {i.where for i in IMPORTS} == {"top", "nested (in a function or block)", "type checking only"}
    assert len(MODULES) > 40 and len(IMPORTS) > 150


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if not _has_layer(m))
    assert not missing, f"add these modules to LAYERS in tests/project/test_imports.py (and docs/DESIGN's order): {missing}"


def _has_layer(module: str) -> bool:
    try:
        layer(module)
    except KeyError:
        return False
    return True


def test_no_import_points_against_the_layer_order():
    backwards = [f"{i.source} (line {i.line}, {i.where}) imports {i.target}: layer {layer(i.source)} -> {layer(i.target)}"
                 for i in IMPORTS if _has_layer(i.source) and _has_layer(i.target) and layer(i.target) > layer(i.source)]
    assert not backwards, "imports against the layer order:\n" + "\n".join(backwards)


def test_the_import_graph_has_no_cycle():
    found = cycles(IMPORTS)
    lines = []
    for component in found:
        inside = set(component)
        edges = [f"  {i.source}:{i.line} -> {i.target} ({i.where})" for i in IMPORTS
                 if i.source in inside and i.target in inside and i.where != "type checking only"]
        lines.append(f"{len(component)} modules: {', '.join(component)}\n" + "\n".join(sorted(set(edges))))
    assert not found, "import cycles:\n" + "\n".join(lines)


@pytest.mark.parametrize("edges, expected", [
    ([("a", "b"), ("b", "c")], []),
    ([("a", "b"), ("b", "a"), ("b", "c")], [["a", "b"]]),
    ([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")], [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(edges, expected):
    """The finder on small graphs, so that an empty answer on the package means no cycle."""
    assert cycles([Import(a, b, 1, "top") for a, b in edges]) == expected


# -- private names stay in their room

def room(module: str) -> str:
    """The room a module belongs to: its subpackage (``multihead.masks.core`` -> ``multihead.masks``),
    or the module itself when it sits at the top of the package (``multihead.heads``)."""
    parts = module.split(".")
    if len(parts) >= 2 and f"{parts[0]}.{parts[1]}" in MODULES and any(m.startswith(f"{parts[0]}.{parts[1]}.") for m in MODULES):
        return f"{parts[0]}.{parts[1]}"
    return module


def _resolve_from(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return node.module or ""


def private_uses() -> list[str]:
    """Each use of another room's private name (``from .heads import _split``, or ``_x._name`` where
    ``_x`` is a multihead module imported into the file): 'file:line name (from module)'."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bound: dict[str, str] = {}   # local name -> the multihead module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve_from(module, path, node)
                if base.split(".")[0] != PACKAGE:
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in MODULES:
                        bound[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__") and room(_known(base)) != room(module):
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} {a.name} (from {base})")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PACKAGE and a.asname:
                        bound[a.asname] = _known(a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and f"{bound[node.value.id]}.{node.attr}" not in MODULES
                    and room(bound[node.value.id]) != room(module)):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.attr} (of {bound[node.value.id]})")
    return found


def test_private_names_stay_in_their_room():
    """A leading underscore means "of this module, or of the files of its subpackage": another room
    reaches a name only when it is public (named without the underscore; ``__all__`` still says
    what the package promises its users). Modules named with an underscore (``_numerics``,
    ``backends.tiles``) are internal modules: importing them is fine, their private names are not."""
    found = private_uses()
    assert not found, "private names used from another room:\n" + "\n".join(sorted(found))


def test_a_room_is_a_subpackage_or_a_top_level_module():
    assert room("multihead.masks.core") == room("multihead.masks.geometry") == "multihead.masks"
    assert room("multihead.backends") == room("multihead.backends.tiles") == "multihead.backends"
    assert room("multihead.heads") == "multihead.heads" != room("multihead.module")
