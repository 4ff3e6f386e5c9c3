"""Which of the spill read's two paths a store takes, learnt from its own reads.

    mapped   payloads copied out of a read-only mapping of the slot file,
             each hashed in the same pass (one pass over the bytes; pages
             not mapped yet are faulted in by the copy)
    pread    preadv into the buffers (the kernel's copy, no page tables),
             then the hash as a second pass over them

Both verify the same way (spill.c).  Which is faster depends on the CPU,
the kernel and the file system: on the Xeon host of 2026-12-05 the store
read 0.63-0.66x a raw read mapped against 0.53-0.58x with pread; on the AMD
EPYC host of 2026-12-06 (same kernel, same ext4) pread 0.56-0.64x against
mapped 0.33-0.48x.  So with "auto" a store times its runs on both: the first
TRIAL runs alternate between them, then it takes the one whose median
bytes/s over its last WINDOW runs is higher and gives the other one run in
every RECHECK, so that a change of conditions is noticed.

`SpillStore(read_path=...)` or CXLKV_SPILL_READ (auto, mapped, pread)
fixes it; the store's stats() say which it takes and what each measured.
"""
from __future__ import annotations

import collections
import os
import statistics
import threading

from cxlkv.errors import UsageError

PATHS = ("mapped", "pread")
CHOICES = ("auto",) + PATHS
ENV = "CXLKV_SPILL_READ"
#: runs timed on each path before the first choice
TRIAL = 8
#: runs per path the choice is the median of
WINDOW = 32
#: one run in this many goes to the path not chosen
RECHECK = 64
#: what a store takes when neither it nor the environment says (the bench's --read-path)
DEFAULT = "auto"


def from_env(value: str | None = None) -> str:
    """The read path asked for: `value`, else $CXLKV_SPILL_READ, else DEFAULT."""
    v = value if value is not None else (os.environ.get(ENV) or DEFAULT)
    if v not in CHOICES:
        src = "read_path" if value is not None else ENV
        raise UsageError(f"{src} must be one of {', '.join(CHOICES)}, not {v!r}")
    return v


class ReadPaths:
    """Picks the path of each run and learns from the timings (thread-safe)."""

    def __init__(self, choice: str = "auto"):
        self.choice = from_env(choice)
        self._mu = threading.Lock()
        self._rates = {p: collections.deque(maxlen=WINDOW) for p in PATHS}
        self._best = "mapped" if self.choice == "auto" else self.choice
        self._runs = 0
        self._fresh = 0                           # timings since the last choice

    def pick(self) -> str:
        if self.choice != "auto":
            return self.choice
        with self._mu:
            self._runs += 1
            m, p = (len(self._rates[k]) for k in PATHS)
            if min(m, p) < TRIAL:                 # trial: the path with fewer timings
                return "mapped" if m <= p else "pread"
            if self._runs % RECHECK == 0:
                return "pread" if self._best == "mapped" else "mapped"
            return self._best

    def record(self, path: str, nbytes: int, seconds: float) -> None:
        """A run of `nbytes` read and verified on `path` in `seconds`."""
        if self.choice != "auto" or nbytes <= 0 or seconds <= 0:
            return
        with self._mu:
            self._rates[path].append(nbytes / seconds)
            self._fresh += 1
            if self._fresh >= TRIAL and all(len(self._rates[k]) >= TRIAL for k in PATHS):
                self._fresh = 0
                med = {k: statistics.median(self._rates[k]) for k in PATHS}
                self._best = max(PATHS, key=med.__getitem__)

    def stats(self) -> dict:
        """The path taken now ("read_path"), and the median bytes/s of each
        over its last runs (0.0: not timed; only with auto)."""
        with self._mu:
            out = {"read_path": self._best}
            for k in PATHS:
                r = self._rates[k]
                out[f"read_{k}_Bps"] = statistics.median(r) if r else 0.0
        return out
