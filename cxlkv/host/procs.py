"""Facts about local processes, read from procfs: what psutil says about them,
computed the way psutil 7 computes it, without importing psutil (its import
costs ~15 ms, several times what attaching to a pool costs).

Always the host's real procfs at PROCFS_PATH (like psutil.PROCFS_PATH), not
$CXLKV_PROCFS_ROOT: a test that makes a process look like another host
(cxlkv.ops.stress.make_host_root) changes its boot id, not which processes
exist.  Tests point PROCFS_PATH elsewhere (monkeypatch) when they need to.
"""
from __future__ import annotations

import errno
import os

PROCFS_PATH = "/proc"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

#: what start_time_ns() returns for a process it may not look at
DENIED = -1


def boot_time() -> float:
    """The host's boot time in seconds since the epoch ("btime" of /proc/stat)."""
    with open(f"{PROCFS_PATH}/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                return float(line.split()[1])
    raise OSError(errno.ENOENT, f"no btime line in {PROCFS_PATH}/stat")


def start_time_ns(pid: int) -> int | None:
    """Start time of a running local process in ns since the epoch (boot time
    + the starttime field of /proc/PID/stat, as psutil's create_time());
    None when no such process exists or it is a zombie (dead, not yet waited
    for); DENIED when procfs does not let us look."""
    if pid < 0:
        return None
    try:
        with open(f"{PROCFS_PATH}/{pid}/stat", "rb") as f:
            data = f.read()
        boot = boot_time()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return DENIED
    fields = data[data.rfind(b")") + 2:].split()
    if len(fields) < 20:
        return None                     # raced with the process's exit
    if fields[0] == b"Z":
        return None
    return int((float(fields[19]) / CLOCK_TICKS + boot) * 1e9)
