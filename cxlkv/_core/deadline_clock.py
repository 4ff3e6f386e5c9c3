"""Which clock the C core checks write deadlines with.

A node writes shared memory only while it is known fresh: every copy, free
and insert loop in C checks the node's write deadline before each block or
slot (`Mapping.write_deadline_ns`, CLOCK_MONOTONIC).  With clock_gettime
that check costs about 20 ns here, a third of an allocator free of a 4 KiB
slot.  Where the CPU's TSC is invariant and the kernel keeps its own time
with it, the C core turns a deadline into a TSC value once and then checks
it with one rdtsc (cpu.h: `cxlkv_deadline_passed`); the TSC goes on counting
while a process is stopped, so a stall still ends the deadline.

    CXLKV_DEADLINE_CLOCK=auto   (default) the TSC when the kernel's
                                clocksource is "tsc" and the CPU's TSC is
                                invariant, else clock_gettime
    CXLKV_DEADLINE_CLOCK=clock  always clock_gettime

`_core.cpu_info()["deadline_clock"]` says which is in use.
"""
from __future__ import annotations

import os

from cxlkv._core import _native
from cxlkv.host import sysfs

CLOCKSOURCE = ("devices", "system", "clocksource", "clocksource0", "current_clocksource")


def kernel_clocksource() -> str | None:
    """The kernel's current clocksource ("tsc", "kvm-clock", ...), or None."""
    try:
        return sysfs.sys_path(*CLOCKSOURCE).read_text().strip()
    except OSError:
        return None


def apply() -> str:
    """Pick the deadline clock from CXLKV_DEADLINE_CLOCK and this host;
    -> "tsc" or "clock"."""
    want = (os.environ.get("CXLKV_DEADLINE_CLOCK") or "auto").strip().lower()
    use = want != "clock" and kernel_clocksource() == "tsc"
    return "tsc" if _native.deadline_tsc(use) else "clock"


apply()
