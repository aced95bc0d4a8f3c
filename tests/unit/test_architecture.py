"""The dependency rule, read from the source: domain and ports import no adapter or framework."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "atlas"
FORBIDDEN = (
    "atlas.adapters", "atlas.app", "cuda", "nvmath", "nccl", "quart", "hypercorn", "anyio", "torch", "transformers",
)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            found.extend((node.lineno, arg.value) for arg in node.args[:1] if isinstance(arg, ast.Constant))
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", ["domain", "ports"])
def test_inner_layers_import_no_adapter_or_framework(package):
    assert violations(package) == []


def test_the_check_sees_a_violation(tmp_path):
    sample = tmp_path / "bad.py"
    sample.write_text("import anyio\nfrom atlas.adapters.mock import backend\nfrom torch import nn\n")
    modules = [m for _, m in imported_modules(sample)]
    assert modules == ["anyio", "atlas.adapters.mock", "torch"]
    assert all(any(m == f or m.startswith(f + ".") for f in FORBIDDEN) for m in modules)
