"""The one harness every benchmark uses.

- scratch space: `scratch_dir()` / `scratch()` make a private directory in
  /dev/shm (the temporary directory where there is none) for scratch pools,
  removed after; `scratch_pool()` formats one there;
- same-run baselines and statistics: `memcpy_gbps()` (the copy baseline of
  the pool and KV figures), `median()`, `median_of()`, `pct()`, `meets()`
  (a figure against its target);
- processes: `child_env()` (fresh interpreters import this cxlkv),
  `python()` (one started on a script), `start_lock_manager()` /
  `lock_manager()`, `cpu_seconds()` / `cpu_pct()` of a process,
  `start_redis()` / `stop_redis()` (one redis-server on loopback);
- optional dependencies: `require_module()` / `require_tools()` raise
  `Unavailable` with one line naming what is missing;
- scenarios: every scenario module (`SCENARIOS`) defines `add_arguments(parser)`,
  `run(args, progress) -> dict` (figures with stable keys), `render(result) -> str`
  and optionally `ok(result) -> bool`; `parse()` builds its command line
  (`cxlkv bench run NAME [ARGS]`), `run()` runs it and `jsonable()` makes its
  result one JSON document.  progress(step) reports each step as it starts.

Nothing in the library imports this package; it may import anything.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterable

import numpy as np
import psutil

import cxlkv
from cxlkv.errors import Unavailable, UsageError
from cxlkv.ops.init import init_pool
from cxlkv.ops.lockmgr import ensure_manager
from cxlkv.testing.redis import ClusterUnavailable, RedisServer

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

Progress = Callable[[str], None]

#: scenario name -> module (`cxlkv bench run NAME`); `cxlkv bench` itself runs
#: cxlkv.bench.suite and `cxlkv bench --scale` cxlkv.bench.scale
SCENARIOS = {
    "alloc-scale": "cxlkv.bench.alloc_scale",
    "evict-scale": "cxlkv.bench.evict_scale",
    "hitpath": "cxlkv.bench.hitpath",
    "hot": "cxlkv.bench.hot",
    "journal": "cxlkv.bench.journal",
    "kv-events": "cxlkv.bench.kv_events",
    "lock-scale": "cxlkv.bench.lock_scale",
    "lockmgr-rt": "cxlkv.bench.lockmgr_rt",
    "remote": "cxlkv.bench.remote",
    "remote-ttft": "cxlkv.bench.remote_ttft",
    "sglang-hicache": "cxlkv.bench.sglang_hicache",
    "lmcache": "cxlkv.bench.lmcache_plugin",
    "spill": "cxlkv.bench.spill",
    "ttft": "cxlkv.bench.ttft",
    "vllm-async": "cxlkv.bench.vllm_async",
}




# -- scratch space --------------------------------------------------------------------------
def scratch_dir(prefix: str = "cxlkv-bench-", base: str | None = None) -> str:
    """A new private directory in `base`, else /dev/shm (the temporary
    directory where /dev/shm is missing or not writable)."""
    if base is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return tempfile.mkdtemp(prefix=prefix, dir=base)


@contextlib.contextmanager
def scratch(prefix: str = "cxlkv-bench-", base: str | None = None):
    """scratch_dir() for the block; removed with everything in it after."""
    d = scratch_dir(prefix, base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def scratch_pool(path: str, size: int, **params) -> str:
    """Format a scratch pool of `size` bytes at `path` (params as init_pool's);
    an existing file there is replaced.  Returns path."""
    if os.path.exists(path):
        os.unlink(path)
    init_pool(path, {"size": size, **params})
    return path


def materialize(path: str, chunk: int = 8 * MiB) -> None:
    """Give every page of a scratch pool file its memory now, contents kept
    (each chunk read and written back; nothing may be attached meanwhile).  A
    file pool is reserved with fallocate, and on tmpfs a reserved page is
    zeroed on its first touch: runs that compare rates would otherwise charge
    that one-time cost to whichever run first reaches a page - a device's
    memory has no such first touch."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        for off in range(0, size, chunk):
            os.pwrite(fd, os.pread(fd, min(chunk, size - off), off), off)
    finally:
        os.close(fd)


def map_in(pool) -> None:
    """Map every page of a scratch pool into this process now, as the first
    bulk copy into each 2 MiB would (Mapping.prefault_range; where
    prefaulting is off, a read of one byte a page).  A serving process has
    long mapped the pages it writes; a bench whose reps write pages this
    process never touched would time that first mapping, not the store."""
    m = pool.mapping
    if m.prefault_range(0, m.size):
        return
    v = m.view(0, m.size)
    try:
        a = np.frombuffer(v, dtype=np.uint8)
        int(a[::4096].sum())
        del a
    finally:
        v.release()


# -- baselines and statistics ------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def median_of(fn: Callable[[], float], repeat: int = 5) -> float:
    """The median of `repeat` calls of fn()."""
    return statistics.median(fn() for _ in range(repeat))


def pct(values, q: float) -> float | None:
    """The q-th percentile of values (numpy's linear interpolation); None when empty."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def meets(value, op: str, target: float) -> bool | None:
    """Whether a figure meets its target (None when it was not measured)."""
    if value is None:
        return None
    if op == "<":
        return value < target
    return value <= target if op == "<=" else value >= target


def buffer(nbytes: int, seed: int | None = None) -> np.ndarray:
    """A 4 KiB-aligned uint8 array, touched: zeros, or seeded random bytes."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    a = raw[off:off + nbytes]
    if seed is None:
        a.fill(0)
    else:
        a[:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    return a


class Memcpy:
    """The copy baseline: numpy copies of `total` bytes in `block` pieces
    between touched, 4 KiB-aligned buffers; `gbps()` times one pass."""

    def __init__(self, total: int = 64 * MiB, block: int = 256 * KiB):
        self.total, self.block = total, block
        self.src = buffer(total, seed=0)
        self.dst = buffer(total)

    def gbps(self) -> float:
        src, dst, block = self.src, self.dst, self.block
        t = time.perf_counter()
        for off in range(0, self.total, block):
            dst[off:off + block] = src[off:off + block]
        return self.total / (time.perf_counter() - t) / 1e9


def memcpy_gbps(total: int = 64 * MiB, block: int = 256 * KiB) -> float:
    """Baseline: Memcpy(total, block), median of 5 passes (GB/s)."""
    return median_of(Memcpy(total, block).gbps)


# -- processes ---------------------------------------------------------------------------
def child_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """The environment of a fresh interpreter that imports this cxlkv: `base`
    (default os.environ) with `extra` set."""
    env = dict(os.environ if base is None else base)
    top = os.path.dirname(os.path.dirname(os.path.abspath(cxlkv.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        [top] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


#: the working directory of the processes started here: `-c` and `-m` put it
#: first on sys.path, and a source tree there would shadow this cxlkv
CHILD_CWD = tempfile.gettempdir()


def python(script: str, *args, **popen) -> subprocess.Popen:
    """A fresh interpreter running `script` (python -c) with `args`, importing
    this cxlkv; popen as Popen's (env defaults to child_env())."""
    popen.setdefault("env", child_env())
    popen.setdefault("cwd", CHILD_CWD)
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], **popen)


def start_lock_manager(path: str, env: dict | None = None) -> subprocess.Popen:
    """`python -m cxlkv lock-manager --pool PATH` in a process of its own (env:
    the environment to start from, default this process's); returns once it
    reports itself active (its later log is drained).  Stop it with
    stop_process()."""
    proc = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", path],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=child_env() if env is None else env, cwd=CHILD_CWD)
    line = proc.stderr.readline()
    if "active" not in line:
        stop_process(proc)
        raise RuntimeError(f"the lock manager for {path} did not start: {line.strip()}")
    threading.Thread(target=proc.stderr.read, name="bench-lock-manager-log",
                     daemon=True).start()
    return proc


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; waits for it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:           # pragma: no cover - a hung process
            proc.kill()
            proc.wait()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


@contextlib.contextmanager
def lock_manager(path: str):
    """A lock manager for `path` while the block runs, unless one runs already
    (daemons.lockmgr.ensure_manager); yields its pid (None when one was already
    running)."""
    before = _children()
    started, stop = ensure_manager(path)
    new = sorted(_children() - before)
    try:
        yield new[0] if started and new else None
    finally:
        stop()


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process `pid`, all threads: the scheduler's nanosecond
    count (/proc/PID/schedstat) where there is one, else psutil's (clock
    ticks: 10 ms steps, too coarse for a process idling at 1 %)."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system


def cpu_pct(pid: int, seconds: float) -> float:
    """CPU % (of one core) process `pid` uses over `seconds`."""
    c0, w0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (cpu_seconds(pid) - c0) / (time.monotonic() - w0)


# -- optional dependencies ---------------------------------------------------------------
def require_module(name: str, hint: str):
    """Import optional module `name`, or raise Unavailable naming it (and `hint`)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise Unavailable(f"{name} is not installed ({hint})") from None


def require_tools(*names: str, hint: str = "Debian package redis-server; scripts/setup "
                                          "installs it") -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        raise Unavailable(f"{' / '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"installed ({hint})")


# -- redis-server ------------------------------------------------------------------------
def start_redis(timeout: float = 30.0) -> tuple[RedisServer, int]:
    """A standalone redis-server on 127.0.0.1 (cxlkv.testing.redis: a free
    port, no persistence); (the server, its port).  Raises Unavailable."""
    if shutil.which("redis-server") is None:
        raise Unavailable("redis-server is not installed (Debian package redis-server; "
                          "scripts/setup installs it)")
    require_module("redis", "pip install redis hiredis")
    server = RedisServer(deadline_s=timeout)
    try:
        server.start()
    except ClusterUnavailable as e:
        server.stop()
        raise Unavailable(f"redis-server did not start: {e}") from None
    except BaseException:
        server.stop()
        raise
    return server, server.port


def stop_redis(server: RedisServer) -> None:
    server.stop()


# -- scenarios ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def module(name: str):
    """The module of scenario `name` (UsageError for an unknown one)."""
    if name not in SCENARIOS:
        raise UsageError(f"unknown bench scenario {name!r}: choose from "
                         f"{', '.join(SCENARIOS)}")
    try:
        return importlib.import_module(SCENARIOS[name])
    except ModuleNotFoundError as e:        # an optional dependency the module imports
        if e.name is None or e.name.split(".")[0] == "cxlkv":
            raise
        raise Unavailable(f"bench scenario {name} needs the Python module {e.name}, which "
                          f"is not installed (scripts/setup installs it)") from None


def describe(name: str) -> str:
    """One line on scenario `name`: the first sentence of its docstring (up to
    its colon when that sentence is long)."""
    para = " ".join((module(name).__doc__ or "").strip().split("\n\n")[0].split())
    line = para.split(". ")[0].rstrip(".")
    return line.split(": ")[0] if len(line) > 90 else line


def parser(name: str) -> argparse.ArgumentParser:
    mod = module(name)
    p = _Parser(prog=f"cxlkv bench run {name}",
                description=(mod.__doc__ or "").strip().split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    return p


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    """Scenario `name`'s options from argv (UsageError when they are wrong)."""
    return parser(name).parse_args(argv)


def run(name: str, args: argparse.Namespace, progress: Progress = lambda step: None) -> dict:
    """Run scenario `name`: its figures, one dict with stable keys."""
    return module(name).run(args, progress)


def render(name: str, result: dict) -> str:
    return module(name).render(result)


def ok(name: str, result: dict) -> bool:
    """False when the scenario's own check failed (its figures are still printed)."""
    check = getattr(module(name), "ok", None)
    return True if check is None else bool(check(result))


def jsonable(obj):
    """obj with numpy scalars and arrays as Python numbers and lists, tuples as lists."""
    if isinstance(obj, dict):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
