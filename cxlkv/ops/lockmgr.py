"""A lock manager for one run (stress, bench, tests) on a manager-mode pool
that has none: started as its own process, stopped when the run ends."""
from __future__ import annotations

import signal
import threading

from cxlkv.api import Pool
from cxlkv.errors import CxlkvError
from cxlkv.host import spawn
from cxlkv.state import protocol


def manager_running(path: str) -> bool:
    """Is a lock manager heartbeating for this pool (watched for up to a lease)?"""
    with Pool.open(path, writable=False) as pool:
        return protocol.manager_alive(pool)


def ensure_manager(path: str):
    """Start a lock manager for a run when none is active.

    Returns (started, stop): stop() ends the one started here (no-op otherwise)."""
    if manager_running(path):
        return False, lambda: None
    proc = spawn.python_module("cxlkv.daemons.lockmgr", path, stdin=spawn.DEVNULL,
                               stderr=spawn.PIPE, text=True)
    line = proc.stderr.readline()
    if "active" not in line:
        # it is stopping: its last line says why (the exception, after the
        # traceback); one that does not end is ended.  Read through the same
        # text stream as the first line: communicate() would read the pipe
        # itself and miss what readline() buffered (often all the rest)
        killer = threading.Timer(30, proc.kill)
        killer.start()
        try:
            rest = proc.stderr.read()
        finally:
            killer.cancel()
        proc.wait()
        if manager_running(path):
            # another one became active since the check above (an operator's,
            # started at the same moment): the run uses that one
            return False, lambda: None
        said = [x.strip() for x in (line + rest).splitlines() if x.strip()]
        why = said[-1] if said else f"it exited with status {proc.returncode} saying nothing"
        raise CxlkvError(f"could not start a lock manager for {path}: {why}")
    # keep reading what it logs (a line or two per reap): a full pipe would stall it
    threading.Thread(target=proc.stderr.read, name="cxlkv-lock-manager-log",
                     daemon=True).start()

    def stop():
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except spawn.TimeoutExpired:
            proc.kill()

    return True, stop
