"""Small files with one job: no module of megatron_slim/ over 300 lines, no function over 60.

A function's length runs from its first decorator to its last line, nested functions included;
nested functions are also measured on their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_slim

PACKAGE = Path(megatron_slim.__file__).parent
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every function and method in ``source``."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((prefix + child.name, first, child.end_lineno - first + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_function_lengths_counts_nested_functions_inside_and_alone():
    source = "def outer():\n    x = 1\n\n    def inner():\n        return 2\n    return inner\n"
    assert function_lengths(source) == [("outer", 1, 6), ("outer.inner", 4, 2)]


def test_no_file_over_the_limit():
    long = []
    for path in _sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job):\n" + "\n".join(long)


def test_no_function_over_the_limit():
    long = []
    for path in _sources():
        for name, first, length in function_lengths(path.read_text(encoding="utf-8")):
            if length > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{first} {name}: {length} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)
