"""Shared code knows no service: nothing under libs/ imports a package of services/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}


def _imported(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            if node.module == "llmgw":
                out += [f"llmgw.{a.name}" for a in node.names]
    return out


def test_no_module_under_libs_imports_a_service():
    offenders = []
    for path in sorted((ROOT / "libs").rglob("*.py")):
        for name in _imported(ast.parse(path.read_text(), str(path))):
            parts = name.split(".")
            if len(parts) > 1 and parts[0] == "llmgw" and parts[1] in SERVICES:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert SERVICES >= {"agent", "router", "reconciler", "simengine", "dev"}
    assert not offenders, "\n".join(offenders)
