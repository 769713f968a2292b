"""The package's import graph, read with ``ast`` (nothing is imported): no cycle between the modules
of ``megatron_slim``, and the layers keep to their imports (``plan`` and ``data`` know neither torch
nor Megatron, nor the package's torch layers; only ``megatron/`` names megatron).

Edges are module-level imports: statements that run when the module is imported, including those
in module-level ``if``/``try`` blocks and class bodies, but not in functions (they run only when
called, after every module involved has finished importing, so they cannot deadlock an import;
``hooks.py`` and ``cp/hooks.py`` use them to reach torch-heavy modules lazily) and not under
``if TYPE_CHECKING:``. ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to
``a.b``. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, so those are edges too,
except the importer's own ancestors (Python has imported them before the importer starts).

The layer rules count every import, function-level ones included (``tests/plan/test_no_torch.py``
checks the same at run time for ``plan`` and ``data``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_slim"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], module_level_only: bool):
    """The Import/ImportFrom statements of ``body``, walking into blocks; into function bodies only
    when not ``module_level_only``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _import_nodes(node.orelse, module_level_only)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and module_level_only:
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _import_nodes(inner, module_level_only)


def _imported_names(module: str, module_level_only: bool) -> set[str]:
    """Absolute dotted names ``module`` imports (relative imports resolved)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(tree.body, module_level_only):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return names


def _edges(module: str) -> set[str]:
    """Modules of the package that importing ``module`` runs first (see the module doc)."""
    own_ancestors = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
    targets: set[str] = set()
    for name in _imported_names(module, module_level_only=True):
        parts = name.split(".")
        targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
    return targets - own_ancestors


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``[]``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph = {module: _edges(module) for module in MODULES}
    assert sum(map(len, graph.values())) > 100  # the parser sees the package's imports
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _third_party_roots(prefix: str) -> dict[str, set[str]]:
    """Per module under ``prefix``: the top-level names of everything it imports, at any level."""
    return {
        module: {name.split(".")[0] for name in _imported_names(module, module_level_only=False)}
        for module in MODULES
        if module == prefix or module.startswith(prefix + ".")
    }


def _imports_of_package(prefix: str) -> dict[str, set[str]]:
    return {
        module: _imported_names(module, module_level_only=False)
        for module in MODULES
        if module == prefix or module.startswith(prefix + ".")
    }


@pytest.mark.parametrize("layer", ["megatron_slim.plan", "megatron_slim.data"])
def test_pure_layers_import_neither_torch_nor_megatron(layer):
    offenders = {
        module: sorted(roots & {"torch", "megatron", "transformer_engine", "flash_attn"})
        for module, roots in _third_party_roots(layer).items()
    }
    assert not {m: r for m, r in offenders.items() if r}


@pytest.mark.parametrize("layer", ["megatron_slim.plan", "megatron_slim.data"])
def test_pure_layers_import_no_torch_layer_of_the_package(layer):
    torch_layers = ("megatron_slim.megatron", "megatron_slim.runtime", "megatron_slim.train")
    offenders = {
        module: sorted(n for n in names if n.startswith(torch_layers))
        for module, names in _imports_of_package(layer).items()
    }
    assert not {m: n for m, n in offenders.items() if n}


def test_megatron_is_named_only_by_the_megatron_package():
    offenders = sorted(
        module
        for module, roots in _third_party_roots(PACKAGE).items()
        if "megatron" in roots and not module.startswith("megatron_slim.megatron")
    )
    assert not offenders
