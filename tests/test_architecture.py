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
import re
import tomllib
from pathlib import Path

import pytest
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


def test_the_c_core_does_not_write_to_stderr():
    """The C core returns what went wrong (an exception, or a value the
    Python side logs); it never writes to stderr or stdout itself."""
    writes = re.compile(r"PySys_Write(Stderr|Stdout)|PySys_Format(Stderr|Stdout)|"
                        r"fprintf\s*\(\s*stderr|fputs\s*\([^;]*stderr|\bperror\s*\(|"
                        r"\bprintf\s*\(|write\s*\(\s*(2|STDERR_FILENO)\s*,")
    bad = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
           for path in sorted((PKG / "_core" / "src").glob("*.[ch]"))
           for n, line in enumerate(path.read_text().splitlines(), 1) if writes.search(line)]
    assert not bad, "the C core writing to stderr:\n" + "\n".join(bad)


#: private names a module may reach on another package's objects, each with
#: its reason: (module, name)
PRIVATE_REACHES = {
    # a benchmark times the recovery a reaper runs, alone, on a dead node's slot
    ("cxlkv/bench/alloc_scale.py", "_recover_allocations"),
    # a benchmark picks the sequences whose first block left the pool itself
    # (match() counts the spill tier too)
    ("cxlkv/bench/spill.py", "_lookup"),
    ("cxlkv/bench/spill.py", "_keys"),
    # other libraries' names: ctypes' structure fields and library path,
    # namedtuple's _replace, os._exit, torch's storage use count
    ("cxlkv/kv/area.py", "_fields_"),
    ("cxlkv/state/alloc.py", "_fields_"),
    ("cxlkv/host/numa.py", "_name"),
    ("cxlkv/daemons/metrics.py", "_replace"),
    ("cxlkv/daemons/agent.py", "_exit"),
    ("cxlkv/integrations/transformers.py", "_C"),
    ("cxlkv/integrations/transformers.py", "_storage_Use_Count"),
    ("cxlkv/integrations/transformers.py", "_cdata"),
    # the engine class this module makes with type(), its own attribute
    ("cxlkv/integrations/lmcache.py", "_memory_format"),
}


def _package(rel: str) -> str:
    """The subpackage a module belongs to (cxlkv/kv/tiers/hot.py: kv), or the
    top-level module's own name (cxlkv/api.py: api)."""
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and \
        not (PKG / name).is_dir()                   # _core: the C core's package


def _private_reaches(tree):
    """(line, name, the node's cxlkv module or None) of each reach to a private
    name outside self and cls: obj._name, getattr(obj, "_name"),
    obj.__dict__["_name"] / .get("_name"), and from cxlkv.x import _name."""
    modules = {}                                    # local name -> cxlkv module it binds
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cxlkv.") and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cxlkv"):
            for a in node.names:
                if _is_private(a.name):
                    yield node.lineno, a.name, node.module
                modules[a.asname or a.name] = f"{node.module}.{a.name}"

    def own(obj) -> bool:
        return isinstance(obj, ast.Name) and obj.id in ("self", "cls")

    def text(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and \
            isinstance(node.value, str) and _is_private(node.value) else None

    for node in ast.walk(tree):
        obj = name = None
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            obj, name = node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2:
            obj, name = node.args[0], text(node.args[1])
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "__dict__":
            obj, name = node.value.value, text(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr == "__dict__" and node.args:
            obj, name = node.func.value.value, text(node.args[0])
        if name and not own(obj):
            mod = modules.get(obj.id) if isinstance(obj, ast.Name) else None
            yield node.lineno, name, mod


def test_no_private_reach_across_packages():
    """Nobody calls another package's private members (rule 4): a package
    reaches others only through public names.  The AST knows no types, so a
    reach `obj._name` counts as another package's when `obj` is a cxlkv
    module of another package, or when no module of this package defines or
    assigns `_name` (another package does, or another library); a name this
    package defines too passes.  PRIVATE_REACHES lists the exceptions."""
    trees = list(_sources())
    defined: dict[str, set[str]] = {}
    for rel, tree in trees:
        for node in ast.walk(tree):
            name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            if name and _is_private(name):
                defined.setdefault(name, set()).add(_package(rel))
    bad, used = [], set()
    for rel, tree in trees:
        here = _package(rel)
        for line, name, mod in _private_reaches(tree):
            if mod is not None:
                mine = _package(mod.replace(".", "/") + ".py") == here
            else:
                mine = here in defined.get(name, ())
            if mine:
                continue
            if (rel, name) in PRIVATE_REACHES:
                used.add((rel, name))
                continue
            bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("private names reached across packages (give the owner a public "
                     "method):\n" + "\n".join(sorted(set(bad))))
    stale = sorted(f"{rel}: {name}" for rel, name in PRIVATE_REACHES - used)
    assert not stale, "PRIVATE_REACHES lists reaches that are gone:\n" + "\n".join(stale)


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


def test_tiny_llama_still_imports_from_transformers_with_a_warning():
    """tiny_llama (and TINY_LLAMA) moved to cxlkv.testing.models: the old
    import keeps working (deprecated) and gives the same object."""
    import warnings

    pytest.importorskip("transformers")
    from cxlkv.integrations import transformers as hf_integration
    from cxlkv.testing import models

    for name in ("tiny_llama", "TINY_LLAMA"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            old = getattr(hf_integration, name)
        assert old is getattr(models, name)
        assert any(issubclass(w.category, DeprecationWarning) and "cxlkv.testing.models" in
                   str(w.message) for w in seen)
    with pytest.raises(AttributeError):
        hf_integration.no_such_name


#: packages whose modules the README's architecture section names as a group:
#: one module per command (cli/) or per `cxlkv bench run` scenario (bench/)
NAMED_AS_A_GROUP = ("cxlkv/cli/", "cxlkv/bench/")


def _architecture_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Architecture\n")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_architecture_section_names_every_module_and_c_source():
    """The section cannot drift from the code: every module is named in the
    lines of its package in the layer drawing (from its `cxlkv/PKG/` to the
    next package's, or the lines that name `PKG/` when it shares its layer's
    lines), a top-level module by its path, every C source and header of the
    core in the section."""
    section = _architecture_section()
    drawing = section[section.index("```"):section.index("```", section.index("```") + 3)]
    blocks: dict[str, str] = {}                 # "cxlkv/kv/" -> its lines
    current = None
    for line in drawing.splitlines():
        m = re.match(r"(cxlkv/[\w/.]+)", line)
        if m:
            current = m.group(1)
        if current is not None:
            blocks[current] = blocks.get(current, "") + line + "\n"
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or rel.startswith(NAMED_AS_A_GROUP):
            continue
        if rel.count("/") == 1:                 # cxlkv/api.py
            if rel not in drawing:
                missing.append(rel)
            continue
        pkg = rel.split("/")[1]
        lines = blocks.get(f"cxlkv/{pkg}/") or "".join(
            b for b in blocks.values() if re.search(rf"(?<![\w/]){pkg}/", b))
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", lines):
            missing.append(rel)
    for path in sorted((PKG / "_core" / "src").glob("*.[ch]")):
        if not re.search(rf"`{re.escape(path.name)}`", section):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, ("README.md's architecture section does not name:\n"
                         + "\n".join(missing))
