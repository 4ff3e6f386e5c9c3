"""How the pool's bulk copies store, chosen by measurement on this host.

Two process-wide modes (the C side: gather.c):

    read   plain | nt    copies out of the pool (get, load_into, gathers into an
                         engine's layout): plain stores, or non-temporal stores
                         (no read-for-ownership of the destination)
    write  nt | clwb     copies into the pool (put, store): non-temporal stores,
                         or regular stores followed by a write-back (clwb)

Either way written pool lines reach memory before a block is published.
Which is faster depends on the CPU, the memory and the load beside it, so
`calibrate()` times both on private buffers four times the last-level
cache (about 1 s for 128 MiB; a span the cache holds favours plain stores,
which lose once the destination is out of cache; the default is kept
unless the other mode is 5% faster) and caches the
choice per host in $XDG_CACHE_HOME/cxlkv/copy-modes.json (~/.cache/...),
keyed by host name and CPU model.  Precedence, applied by `apply()`:

    CXLKV_COPY="read=plain,write=clwb"   (either part; "auto" = measured)
    the host's cached calibration
    defaults: read=nt, write=nt (the historical paths)

`ensure()` applies and calibrates once if the host has no cached choice
(the integrations and `cxlkv bench` call it; importing cxlkv never measures).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time

import numpy as np

from cxlkv._core import _native
from cxlkv.errors import UsageError

log = logging.getLogger(__name__)

READ_MODES = ("plain", "nt")
WRITE_MODES = ("nt", "clwb")
DEFAULTS = {"read": "nt", "write": "nt"}
#: bytes copied per measured pass, in blocks of BLOCK bytes; None: span()
SPAN: int | None = None
BLOCK = 256 << 10
#: what a cached choice must have been measured by (2: the span out of cache;
#: method 1 copied 32 MiB, which a 32 MiB last-level cache held, and chose
#: plain reads that lost to non-temporal ones on a prefix load by 15-25 %)
METHOD = 2
ROUNDS = 5
#: an alternative to the default must beat it by this factor (noise margin)
MARGIN = 1.05

#: what apply() decided: {"read", "write", "source", ...}
_state: dict = {"read": DEFAULTS["read"], "write": DEFAULTS["write"], "source": "default"}


def host_key() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.node()}|{model or platform.machine()}"


def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest cache of CPU 0 (sysfs), or None where sysfs does not say."""
    best = None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(root, name, "size")) as f:
                txt = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:].upper(), 1)
        digits = txt[:-1] if mult != 1 else txt
        if digits.isdigit():
            best = max(best or 0, int(digits) * mult)
    return best


def span() -> int:
    """Bytes per measured pass: four times the last-level cache, 32-128 MiB
    (128 where sysfs does not say), so that the copies' destinations are out
    of cache, as an engine's buffer is when a prefix is loaded into it."""
    if SPAN is not None:
        return SPAN
    llc = llc_bytes()
    return 128 << 20 if llc is None else min(128 << 20, max(32 << 20, 4 * llc))


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cxlkv", "copy-modes.json")


def _parse_env() -> dict:
    """The CXLKV_COPY override ({} when unset); UsageError for a bad value."""
    raw = os.environ.get("CXLKV_COPY", "").strip()
    out: dict = {}
    if not raw:
        return out
    for part in raw.split(","):
        k, sep, v = part.strip().partition("=")
        k, v = k.strip(), v.strip()
        allowed = {"read": READ_MODES, "write": WRITE_MODES}.get(k)
        if not sep or allowed is None or (v not in allowed and v != "auto"):
            raise UsageError(f"CXLKV_COPY={raw!r}: expected read=plain|nt|auto and/or "
                             "write=nt|clwb|auto, comma-separated")
        if v != "auto":
            out[k] = v
    return out


def _cached() -> dict | None:
    try:
        with open(cache_path()) as f:
            d = json.load(f)
        got = d.get(host_key())
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(got, dict) or got.get("read") not in READ_MODES \
            or got.get("write") not in WRITE_MODES:
        return None
    if got.get("method") != METHOD:
        log.info("the cached copy modes in %s were measured by an earlier method: "
                 "measuring again", cache_path())
        return None
    return got


def _save(result: dict) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                d = json.load(f)
            if not isinstance(d, dict):
                d = {}
        except (OSError, ValueError):
            d = {}
        d[host_key()] = result
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(d, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:                     # a cache: the choice still holds in-process
        log.info("cannot cache the copy modes in %s: %s", path, e)


def apply() -> dict:
    """Set the modes from CXLKV_COPY, else the host's cached calibration, else
    the defaults; returns what is in use (see modes())."""
    env = _parse_env()
    cached = _cached()
    base = cached or DEFAULTS
    read, write = env.get("read", base["read"]), env.get("write", base["write"])
    _native.set_copy_modes(read, write)
    src = "env" if env else ("calibrated" if cached else "default")
    if env and len(env) < 2:
        src = f"env+{'calibrated' if cached else 'default'}"
    _state.clear()
    _state.update({"read": read, "write": write, "source": src})
    if cached:
        _state["measured"] = {k: cached[k] for k in ("read_gbps", "write_gbps", "at")
                              if k in cached}
    return modes()


def modes() -> dict:
    """The copy modes in use: {"read", "write", "source" (env | calibrated |
    default), "measured" (GB/s of each candidate, when calibrated)}."""
    d = dict(_state)
    cur = _native.copy_modes()
    d["read"], d["write"] = cur["read"], cur["write"]
    return d


def use(read: str, write: str) -> None:
    """Set both modes in this process (a benchmark comparing them); apply()
    goes back to the configured ones."""
    _native.set_copy_modes(read, write)


def _gbps(nbytes: int, secs: float) -> float:
    return round(nbytes / secs / 1e9, 2) if secs > 0 else 0.0


def measure(nbytes: int | None = None, rounds: int = ROUNDS) -> dict:
    """Time each read and write mode on private buffers of `nbytes` (default
    span(); the pool's copy routines, 256 KiB blocks), interleaved round by
    round; the median of `rounds`, GB/s."""
    n = nbytes if nbytes is not None else span()
    pool = np.ones(n, dtype=np.uint8)                 # touched: no page faults timed
    priv = np.ones(n, dtype=np.uint8)
    m = _native.Mapping.from_buffer(pool)
    before = _native.copy_modes()
    res: dict = {"read": {k: [] for k in READ_MODES}, "write": {k: [] for k in WRITE_MODES}}
    try:
        for _ in range(rounds):
            for w in WRITE_MODES:
                _native.set_copy_modes(before["read"], w)
                t = time.perf_counter()
                for off in range(0, n, BLOCK):
                    m.write(off, priv[off:off + BLOCK], True)
                res["write"][w].append(_gbps(n, time.perf_counter() - t))
            for r in READ_MODES:
                _native.set_copy_modes(r, before["write"])
                t = time.perf_counter()
                for off in range(0, n, BLOCK):
                    m.readinto(off, priv[off:off + BLOCK])
                res["read"][r].append(_gbps(n, time.perf_counter() - t))
    finally:
        _native.set_copy_modes(before["read"], before["write"])
        m.close()
    return {d: {k: statistics.median(v) for k, v in per.items()} for d, per in res.items()}


def _pick(gbps: dict, default: str) -> str:
    """The fastest mode; the default unless another beats it by MARGIN."""
    best = max(gbps, key=gbps.get)
    return best if gbps[best] >= MARGIN * gbps[default] else default


def calibrate(save: bool = True) -> dict:
    """Measure, pick the faster mode of each direction, cache it for this host
    (save=True) and apply (CXLKV_COPY still wins).  Returns modes()."""
    got = measure()
    result = {"read": _pick(got["read"], DEFAULTS["read"]),
              "write": _pick(got["write"], DEFAULTS["write"]),
              "read_gbps": got["read"], "write_gbps": got["write"],
              "method": METHOD, "span": span(),
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log.info("copy modes measured: %s", result)
    if save:
        _save(result)
    if not save:
        _native.set_copy_modes(result["read"], result["write"])
        _state.clear()
        _state.update({"read": result["read"], "write": result["write"], "source": "calibrated",
                       "measured": {k: result[k] for k in ("read_gbps", "write_gbps", "at")}})
        return modes()
    return apply()


def ensure() -> dict:
    """apply(), calibrating first when neither CXLKV_COPY names both modes nor
    the host has a cached choice."""
    env = _parse_env()
    if len(env) < 2 and _cached() is None and _state.get("source") != "calibrated":
        return calibrate()
    return apply()
