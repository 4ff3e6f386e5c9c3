"""Device events for `cxlkv inspect --watch`: pyudev on the cxl, dax, nd and memory subsystems.

Listens to udev's netlink messages when a udev daemon runs, else to the
kernel's own uevents (a guest or container without udev still gets them).
Events arriving within `settle` seconds of each other come as one batch, so
a region creation (a burst of cxl + nd + dax events) redraws once.
"""
from __future__ import annotations

import os
import select
from collections.abc import Iterator

SUBSYSTEMS = ("cxl", "dax", "nd", "memory")


def udev_running() -> bool:
    return os.path.exists("/run/udev/control")


def events(subsystems=SUBSYSTEMS, *, settle: float = 0.5,
           source: str | None = None) -> Iterator[list[dict]]:
    """Batches of {"action", "subsystem", "device"}, for ever.

    The monitor is listening when this returns (events after the call are
    not missed), the batches come from the returned iterator."""
    import pyudev

    source = source or ("udev" if udev_running() else "kernel")
    mon = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
    if source == "udev":
        for s in subsystems:
            mon.filter_by(subsystem=s)
    mon.start()
    wanted = set(subsystems)

    return _batches(mon, wanted, settle)


def _batches(mon, wanted: set, settle: float) -> Iterator[list[dict]]:
    def one(timeout):
        dev = mon.poll(timeout=timeout)
        if dev is None:
            return None
        return {"action": dev.action, "subsystem": dev.subsystem, "device": dev.sys_name}

    while True:
        first = one(None)
        if first is None:
            continue
        batch = [first] if first["subsystem"] in wanted else []
        while True:
            r, _, _ = select.select([mon], [], [], settle)
            if not r:
                break
            ev = one(0)
            if ev is not None and ev["subsystem"] in wanted:
                batch.append(ev)
        if batch:
            yield batch
