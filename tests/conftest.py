"""Shared fixtures: pool paths, a CLI runner, pool-damaging helpers."""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

import pytest

from cxlkv.cli import main
from cxlkv.pool import layout as L
from cxlkv.pool.format import FormatParams

MiB = 1 << 20

#: a small pool used across tests (fast to format)
SMALL = dict(size=8 * MiB, chunk_size=64 * 1024, max_nodes=8, hash_slots=256)


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
def pool_path(tmp_path):
    return str(tmp_path / "test.pool")


@pytest.fixture
def kvpool(pool_path):
    """A formatted 32 MiB pool for KV tests (short lease); returns its path.
    Modules that need another geometry define their own."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {"size": 32 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 300})
    return pool_path


@pytest.fixture
def small_pool(pool_path):
    """A formatted small pool file; returns its path."""
    from cxlkv.ops.init import init_pool

    init_pool(pool_path, SMALL)
    return pool_path


def small_params(**kw) -> FormatParams:
    return FormatParams(**{**SMALL, **kw})


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of a pool file in place (a test helper that damages pools)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def reencode(raw: bytes, **fields) -> bytes:
    """A superblock image with fields changed and a valid checksum."""
    from cxlkv.pool.superblock import checksum

    buf = bytearray(raw)
    s = L.SuperblockStruct.from_buffer(buf)
    for k, v in fields.items():
        setattr(s, k, v)
    s.checksum = 0
    s.checksum = checksum(buf)
    del s
    return bytes(buf)


def rewrite_superblock(path: str, copy: str, **fields) -> None:
    """Re-encode one superblock copy of a pool file with changed fields."""
    off = L.SB_OFFSETS["AB".index(copy)]
    with open(path, "r+b") as f:
        f.seek(off)
        raw = reencode(f.read(L.SB_SIZE), **fields)
        f.seek(off)
        f.write(raw)


def local_pidns() -> int:
    from cxlkv.state.nodes import local_pidns as f

    return f()


def fake_node(path: str, slot: int, *, pid: int, start_time_ns: int, boot_id: str,
              hostname: str = "testhost", heartbeat: int = 1, state: int = L.NODE_ATTACHED):
    """Write a node-table slot as an attached node would (test helper)."""
    from cxlkv.api import Pool

    with Pool.open(path, force=True) as pool:
        off, _ = pool.region("nodes")
        s = L.NodeStruct()
        s.control, s.heartbeat = L.node_control(state, 1), heartbeat
        s.pid, s.start_time_ns = pid, start_time_ns
        s.pidns, s.ident_epoch = local_pidns(), 1
        s.format_version = 1
        s.boot_id[:] = uuid.UUID(boot_id).bytes
        s.hostname = hostname.encode()
        s.sw_version = b"test"
        pool.mapping.write(off + slot * L.NODE_SIZE, bytes(s))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    """No test sees the caller's environment or the machine's default pool."""
    from cxlkv.ops import init as admin

    for k in ("CXLKV_SYSFS_ROOT", "CXLKV_PROCFS_ROOT", "CXLKV_DEV_ROOT", "CXLKV_FLUSH",
              "CXLKV_POOL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(admin, "DEFAULT_POOL_PATH",
                        str(tmp_path_factory.mktemp("default") / "cxlkv-default.pool"))
    # host-local lock files of this test's pools (children inherit it)
    monkeypatch.setenv("CXLKV_HOSTLOCK_DIR", str(tmp_path_factory.mktemp("hostlock")))
    yield


def mode_of(path: str) -> int:
    return os.stat(path).st_mode & 0o7777


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


def wait_for(cond, timeout: float = 30.0, what: str = "condition", step: float = 0.01):
    """Poll `cond()` until it is true (returns its value); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


@pytest.fixture
def remote_env(tmp_path):
    """make() -> environment that makes a child process look like another
    host: a procfs root of its own with its own boot id, so every other node
    judges its liveness by heartbeat, as it judges a remote host."""
    from cxlkv.ops.stress import make_host_root

    def make(**extra) -> dict:
        return {"CXLKV_PROCFS_ROOT": make_host_root(tmp_path)[0], **extra}

    return make
