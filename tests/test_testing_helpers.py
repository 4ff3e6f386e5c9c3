"""cxlkv.testing is for tests, benches and demos: nothing in the library imports it."""
from __future__ import annotations

import ast
from pathlib import Path

import cxlkv

PKG = Path(cxlkv.__file__).resolve().parent


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def test_the_library_never_imports_cxlkv_testing():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "testing":
            continue
        offenders += [f"{rel}: {name}" for name in _imports(path)
                      if name == "cxlkv.testing" or name.startswith("cxlkv.testing.")]
    assert not offenders, offenders
