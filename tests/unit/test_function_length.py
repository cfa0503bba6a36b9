"""No product function over 100 lines, except declaration lists.

A function that long hides several steps; the tree is laid out so each step has a home
(docs/router.md and docs/reconciler.md, "Code layout"). Declarations (metric families, an
OpenAPI literal) read top to bottom however long they are, so they are named here.

"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 100
# (path relative to the repository, qualified name): lists of declarations, not logic.
DECLARATIONS = {
    ("services/router/http/openapi.py", "document"),  # the OpenAPI document, a literal
}


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _long_functions() -> list[str]:
    found = []
    for top in ("services", "libs"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/migrations/versions/" in rel:
                continue
            for name, lines in _functions(ast.parse(path.read_text())):
                if lines > LIMIT and (rel, name) not in DECLARATIONS:
                    found.append(f"{rel}:{name} ({lines} lines)")
    return found


def test_no_product_function_is_over_100_lines():
    assert _long_functions() == []


def test_every_named_declaration_still_exists():
    # A stale entry would let a new long function of the same name in.
    for rel, name in DECLARATIONS:
        names = {n for n, _ in _functions(ast.parse((ROOT / rel).read_text()))}
        assert name in names, f"{rel}:{name}"
