"""The shape of the package: the import contract (import-linter, its
contracts in pyproject.toml), imports at module top, subprocess only behind
its seams, one version.  These read the source; they fail on the first
change that breaks the house rules, naming the file and line."""
from __future__ import annotations

import ast
import builtins
import contextlib
import io
import logging
import tomllib
from pathlib import Path

from importlinter import cli as importlinter_cli

import cxlkv
import cxlkv.errors

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cxlkv"

#: third-party modules a function may import when it needs them: optional
#: (torch, transformers, vllm, pyudev, libnuma) or heavy and needed only on one
#: path (redis: the remote tier's backend; cbor2: vLLM-compatible keys;
#: packaging: version comparisons of old pools; sglang, lmcache: the engines whose
#: base classes cxlkv.integrations.sglang / .lmcache derive from when the engine asks
#: for the backend class, so those modules import without the engine)
LAZY_THIRD_PARTY = {"torch", "transformers", "vllm", "pyudev", "numa", "redis", "cbor2",
                    "packaging", "sglang", "lmcache"}
#: cxlkv modules a function may import: the lazy public names of cxlkv/__init__.py,
#: the KV cache's tiers (loaded when a tier is enabled, so that the cache alone
#: does not pull in asyncio, Redis or Prometheus) and the remote tier's backend
LAZY_CXLKV = {
    "cxlkv/__init__.py": {"cxlkv.api", "cxlkv.ops.init", "cxlkv.kv.cache", "cxlkv.pool.format"},
    "cxlkv/kv/cache.py": {"cxlkv.kv.tiers"},
    "cxlkv/remote/tier.py": {"cxlkv.remote.redis_cluster"},
    # the scenarios that need torch load its users when they run
    "cxlkv/bench/ttft.py": {"cxlkv.integrations.transformers", "cxlkv.testing.models"},
    "cxlkv/bench/hitpath.py": {"cxlkv.integrations.transformers", "cxlkv.integrations.kvcopy"},
    "cxlkv/bench/remote_ttft.py": {"cxlkv.integrations.transformers", "cxlkv.testing.models"},
}
#: where subprocess may be used: the seams that start processes
SUBPROCESS_SEAMS = ("cxlkv/host/", "cxlkv/testing/", "cxlkv/bench/")


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
    # import-linter configures logging (dictConfig), which disables every logger
    # that exists already, cxlkv's too: give the later tests theirs back
    disabled = {name: lg.disabled for name, lg in logging.root.manager.loggerDict.items()
                if isinstance(lg, logging.Logger)}
    try:
        with contextlib.redirect_stdout(out):
            code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"),
                                                 no_cache=True)
    finally:
        for name, was in disabled.items():
            logging.getLogger(name).disabled = was
    assert code == 0, out.getvalue()[-4000:]


def test_imports_are_at_module_top():
    """A function imports only what cli/ loads for --help speed, the lazy
    names listed above, and optional or heavy third-party modules."""
    bad = []
    for rel, tree in _sources():
        if rel.startswith("cxlkv/cli/"):
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
        if rel.startswith(SUBPROCESS_SEAMS):
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


#: exception classes defined outside cxlkv/errors.py, each with its reason
EXCEPTIONS_ELSEWHERE = {
    # private control flow: raised in Agent._pool_lock, caught in Agent.tick,
    # never seen outside the module
    ("cxlkv/daemons/agent.py", "_Stopping"),
}
#: the modules that may write to stderr or print: the CLI owns the terminal;
#: the benchmarks and the test helpers are programs beside the library
MAY_PRINT = ("cxlkv/cli/", "cxlkv/bench/", "cxlkv/testing/")


def _base_name(node) -> str:
    """The last name of a base class expression (`E.CxlkvError`: CxlkvError)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def test_every_exception_is_defined_in_errors():
    """One exception tree (rule 3): a class deriving from BaseException - a
    builtin exception, a class of cxlkv/errors.py or one derived from them,
    by its last name - is defined in cxlkv/errors.py only."""
    known = {n for mod in (builtins, cxlkv.errors) for n, o in vars(mod).items()
             if isinstance(o, type) and issubclass(o, BaseException)}
    classes = [(rel, node) for rel, tree in _sources() if rel != "cxlkv/errors.py"
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    found: dict[tuple[str, str], int] = {}
    grew = True
    while grew:                       # a class derived from one found elsewhere counts too
        grew = False
        for rel, node in classes:
            if (rel, node.name) not in found and any(_base_name(b) in known
                                                      for b in node.bases):
                found[(rel, node.name)] = node.lineno
                known.add(node.name)
                grew = True
    bad = sorted(f"{rel}:{line}: {name}" for (rel, name), line in found.items()
                 if (rel, name) not in EXCEPTIONS_ELSEWHERE)
    assert not bad, "exception classes outside cxlkv/errors.py:\n" + "\n".join(bad)
    stale = sorted(f"{rel}: {name}" for rel, name in EXCEPTIONS_ELSEWHERE
                   if (rel, name) not in found and (PKG.parent / rel).exists())
    assert not stale, "EXCEPTIONS_ELSEWHERE names classes that are gone:\n" + "\n".join(stale)


def test_library_code_does_not_write_to_stderr():
    """The library logs (rule 5): outside the CLI no print() and no write to
    sys.stderr; daemons/ may name sys.stderr to install a handler or flush it."""
    bad = []
    for rel, tree in _sources():
        if rel.startswith(MAY_PRINT):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "print":
                bad.append(f"{rel}:{node.lineno}: print()")
            elif (isinstance(node, ast.Attribute) and node.attr in ("stderr", "__stderr__")
                  and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                if not rel.startswith("cxlkv/daemons/"):
                    bad.append(f"{rel}:{node.lineno}: sys.{node.attr}")
            elif (isinstance(node, ast.Attribute) and node.attr == "write"
                  and isinstance(node.value, ast.Attribute)
                  and node.value.attr in ("stderr", "__stderr__")):
                bad.append(f"{rel}:{node.lineno}: sys.{node.value.attr}.write")
    assert not bad, ("library code writing to stderr (log through "
                     "logging.getLogger(__name__)):\n" + "\n".join(bad))


def test_the_tiers_old_names_still_import_with_a_warning():
    """cxlkv.kv.spill / hot / remote moved to cxlkv.kv.tiers: `from cxlkv.kv
    import spill` keeps working (deprecated) and gives the same module."""
    import warnings

    from cxlkv.kv.tiers import hot, remote, spill

    for name, mod in (("spill", spill), ("hot", hot), ("remote", remote)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            old = getattr(__import__("cxlkv.kv", fromlist=[name]), name)
        assert old is mod
        assert any(issubclass(w.category, DeprecationWarning) and "cxlkv.kv.tiers" in
                   str(w.message) for w in seen)
