"""Shared fixtures: pool paths, formatted pools, a CLI runner, isolation from
the caller's environment.  Shared helpers that are not fixtures live in
cxlkv.testing (pools, damage, data, checks, nodes, redis, replay, models)."""
from __future__ import annotations

import contextlib
import gc
import json
import os
from dataclasses import dataclass

import pytest

from cxlkv.cli import main
from cxlkv.testing.pools import SMALL, MiB


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `cxlkv ARGS...` in-process; returns code, stdout, stderr."""
    monkeypatch.delenv("CXLKV_POOL", raising=False)

    def run(*args: str, env: dict | None = None) -> CliResult:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        code = main([str(a) for a in args])
        cap = capsys.readouterr()
        for k in env or {}:
            monkeypatch.delenv(k, raising=False)
        return CliResult(code, cap.out, cap.err)

    return run


@pytest.fixture
def golden_pool(tmp_path):
    """golden_pool(name): a copy (mode 0660) of tests/golden/<name>.img.gz, a
    pool formatted by an earlier version; returns its path."""
    import gzip
    from pathlib import Path

    def make(name: str) -> str:
        raw = gzip.decompress((Path(__file__).parent / "golden" / f"{name}.img.gz").read_bytes())
        path = tmp_path / f"{name}.pool"
        path.write_bytes(raw)
        os.chmod(path, 0o660)
        return str(path)

    return make


@pytest.fixture
def pool_path(tmp_path):
    return str(tmp_path / "test.pool")


@pytest.fixture
def kvpool(pool_path):
    """A formatted 32 MiB pool for KV tests (short lease); returns its path.
    Modules that need another geometry define a fixture of another name."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


@pytest.fixture
def engine_pool(pool_path):
    """A formatted 64 MiB pool of the default geometry, for the engine
    integrations (vLLM, SGLang, LMCache); returns its path."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 64 * MiB})
    return pool_path


@pytest.fixture
def spool(pool_path):
    """A formatted 16 MiB pool for the serving agent's tests (64 KiB chunks,
    512 hash slots, a 1 s lease); returns its path."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 1000, "hash_slots": 512})
    return pool_path


@pytest.fixture
def small_pool(pool_path):
    """A formatted small pool file; returns its path."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, SMALL)
    return pool_path


@pytest.fixture(scope="session")
def _cache_home(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory, _cache_home):
    """No test sees the caller's environment or the machine's default pool;
    the per-host caches (the copy-mode calibration) go to this session's
    directory, not the user's ~/.cache."""
    from cxlkv.ops import init as admin

    for k in ("CXLKV_SYSFS_ROOT", "CXLKV_PROCFS_ROOT", "CXLKV_DEV_ROOT", "CXLKV_FLUSH",
              "CXLKV_POOL", "CXLKV_POOL_UUID", "CXLKV_COPY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", _cache_home)
    monkeypatch.setattr(admin, "DEFAULT_POOL_PATH",
                        str(tmp_path_factory.mktemp("default") / "cxlkv-default.pool"))
    # host-local lock files of this test's pools (children inherit it)
    monkeypatch.setenv("CXLKV_HOSTLOCK_DIR", str(tmp_path_factory.mktemp("hostlock")))
    yield


def pytest_collection_modifyitems(config, items):
    """The lab tier (QEMU guests, about a minute each) and the long stress runs
    (minutes each) run only when asked."""
    asked = config.getoption("-m") or ""
    skips = {
        "lab": pytest.mark.skip(reason="lab tier: run ./scripts/test -m lab (after "
                                       "scripts/cxl-lab setup) or set CXLKV_LAB=1"),
        "long": pytest.mark.skip(reason="long run: pytest -m long, or set CXLKV_LONG=1"),
    }
    for marker in [m for m in skips
                   if m in asked or os.environ.get(f"CXLKV_{m.upper()}") == "1"]:
        del skips[marker]
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def tool_seam():
    """install(runner) -> runner: every external tool call (cxl, ndctl, daxctl)
    goes through `runner` from then until the test ends - the one seam,
    cxlkv.host.tools.use_runner; a later install replaces an earlier one."""
    from cxlkv.host import tools

    with contextlib.ExitStack() as stack:
        yield lambda r: stack.enter_context(tools.use_runner(r))


@pytest.fixture(scope="module")
def cluster():
    """A Redis Cluster of three local redis-servers for one test module
    (cxlkv.testing.redis.TestCluster); skipped where redis-server is missing."""
    from cxlkv.testing.redis import TestCluster, skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with TestCluster(masters=3) as c:
        yield c


@pytest.fixture
def remote_env(tmp_path):
    """make() -> environment that makes a child process look like another
    host: a procfs root of its own with its own boot id, so every other node
    judges its liveness by heartbeat, as it judges a remote host."""
    from cxlkv.ops.stress import make_host_root

    def make(**extra) -> dict:
        return {"CXLKV_PROCFS_ROOT": make_host_root(tmp_path)[0], **extra}

    # those children judge this process by heartbeat too: a full collection of
    # the test session's heap (a long run, under ASan) holds the GIL long
    # enough to stall its heartbeat thread past a 300 ms lease and get it
    # fenced mid-test, which is not what these tests test - the objects from
    # before the test are kept out of the collector meanwhile
    gc.freeze()
    try:
        yield make
    finally:
        gc.unfreeze()
