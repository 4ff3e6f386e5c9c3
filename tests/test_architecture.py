"""The shape of the package: the import contract (import-linter, its
contracts in pyproject.toml), imports at module top, subprocess only behind
its seams, one version.  These read the source; they fail on the first
change that breaks the house rules, naming the file and line."""
from __future__ import annotations

import ast
import contextlib
import io
import logging
import tomllib
from pathlib import Path

from importlinter import cli as importlinter_cli

import cxlkv

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cxlkv"

#: third-party modules a function may import when it needs them: optional
#: (torch, transformers, vllm, pyudev, libnuma) or heavy and needed only on one
#: path (redis: the remote tier's backend; cbor2: vLLM-compatible keys;
#: packaging: version comparisons of old pools)
LAZY_THIRD_PARTY = {"torch", "transformers", "vllm", "pyudev", "numa", "redis", "cbor2",
                    "packaging"}
#: cxlkv modules a function may import: the lazy public names of cxlkv/__init__.py,
#: the KV cache's tiers (loaded when a tier is enabled, so that the cache alone
#: does not pull in asyncio, Redis or Prometheus) and the remote tier's backend
LAZY_CXLKV = {
    "cxlkv/__init__.py": {"cxlkv.api", "cxlkv.ops.init", "cxlkv.kv.cache", "cxlkv.kv.area",
                          "cxlkv.pool.format"},
    "cxlkv/kv/cache.py": {"cxlkv.kv.tiers"},
    "cxlkv/remote/tier.py": {"cxlkv.remote.redis_cluster"},
    # the scenarios that need torch load its users when they run
    "cxlkv/bench/ttft.py": {"cxlkv.integrations.transformers", "cxlkv.testing.models"},
    "cxlkv/bench/remote_ttft.py": {"cxlkv.integrations.transformers", "cxlkv.testing.models"},
}
#: where subprocess may be used: the seams that start processes
SUBPROCESS_SEAMS = ("cxlkv/host/", "cxlkv/testing/", "cxlkv/bench/")
#: modules on their way into cxlkv/bench and cxlkv/testing (issue 20)
MOVING: set[str] = set()


def _sources():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        yield rel, ast.parse(path.read_text(), filename=rel)


def _imported(node) -> list[str]:
    """Dotted names an import statement loads (`from a import b`: a.b)."""
    if isinstance(node, ast.ImportFrom):
        return [f"{node.module}.{a.name}" for a in node.names]
    return [a.name for a in node.names]


def test_the_import_contract_holds():
    out = io.StringIO()
    # import-linter configures logging (dictConfig), which disables every
    # logger made before it - cxlkv's among them: the later tests need them
    loggers = [lg for lg in logging.root.manager.loggerDict.values()
               if isinstance(lg, logging.Logger) and not lg.disabled]
    try:
        with contextlib.redirect_stdout(out):
            code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"),
                                                 no_cache=True)
    finally:
        for lg in loggers:
            lg.disabled = False
    assert code == 0, out.getvalue()[-4000:]


def test_imports_are_at_module_top():
    """A function imports only what cli/ loads for --help speed, the lazy
    names listed above, and optional or heavy third-party modules."""
    bad = []
    for rel, tree in _sources():
        if rel.startswith("cxlkv/cli/") or rel in MOVING:
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for mod in _imported(node):
                    if mod.split(".")[0] in LAZY_THIRD_PARTY:
                        continue
                    if any(mod == ok or mod.startswith(ok + ".")
                           for ok in LAZY_CXLKV.get(rel, ())):
                        continue
                    bad.append(f"{rel}:{node.lineno}: {mod}")
    assert not bad, "imports inside functions:\n" + "\n".join(sorted(set(bad)))


def test_subprocess_only_behind_its_seams():
    bad = []
    for rel, tree in _sources():
        if rel.startswith(SUBPROCESS_SEAMS) or rel in MOVING:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    m.split(".")[0] == "subprocess" for m in _imported(node)):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, ("subprocess outside cxlkv/host (spawn.py, tools.py), testing and bench:\n"
                     + "\n".join(bad))


def test_one_version():
    """pyproject.toml reads the version from cxlkv/version.py: one definition."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "cxlkv.version.__version__"}
    assert cxlkv.__version__.count(".") == 2
