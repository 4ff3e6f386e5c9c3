"""Node table: reading slots and judging whether their holders are alive.

Liveness is never judged by comparing wall clocks across hosts: a node on
this host (same boot id) is alive iff its pid exists with the recorded start
time; a node on another host is alive iff this observer, on its own monotonic
clock, sees its heartbeat counter advance within one lease.
"""
from __future__ import annotations

import socket
import time
import uuid as uuidlib
from dataclasses import dataclass

import psutil

from cxlkv.host import sysfs
from cxlkv.pool import layout as L


@dataclass(frozen=True)
class NodeInfo:
    slot: int
    state: str
    epoch: int
    heartbeat: int
    fence_epoch: int
    pid: int
    start_time_ns: int
    attach_time_ns: int
    format_version: int
    boot_id: str
    hostname: str
    sw_version: str

    def to_json(self) -> dict:
        return {"slot": self.slot, "state": self.state, "epoch": self.epoch,
                "heartbeat": self.heartbeat, "pid": self.pid, "hostname": self.hostname,
                "boot_id": self.boot_id, "sw_version": self.sw_version,
                "format_version": self.format_version, "attach_time_ns": self.attach_time_ns}

    def describe(self) -> str:
        return f"node {self.slot} ({self.hostname} pid {self.pid})"


def local_boot_id() -> str:
    text = sysfs.read_attr(sysfs.proc_path("sys", "kernel", "random", "boot_id"))
    return text or socket.gethostname()


def _decode_str(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def node_offset(pool, slot: int) -> int:
    off, _ = pool.sb.regions["nodes"]
    return off + slot * L.NODE_SIZE


def read_slot(pool, slot: int) -> NodeInfo:
    off = node_offset(pool, slot)
    m = pool.mapping
    m.invalidate(off, L.NODE_SIZE)
    s = L.NodeStruct.from_buffer_copy(m.read(off, L.NODE_SIZE))
    try:
        boot = str(uuidlib.UUID(bytes=bytes(s.boot_id)))
    except ValueError:  # pragma: no cover - 16 bytes always make a UUID
        boot = bytes(s.boot_id).hex()
    return NodeInfo(
        slot=slot, state=L.NODE_STATE_NAMES.get(s.state, f"unknown({s.state})"),
        epoch=s.epoch, heartbeat=s.heartbeat, fence_epoch=s.fence_epoch, pid=s.pid,
        start_time_ns=s.start_time_ns, attach_time_ns=s.attach_time_ns,
        format_version=s.format_version, boot_id=boot, hostname=_decode_str(s.hostname),
        sw_version=_decode_str(s.sw_version))


def read_nodes(pool, include_free: bool = False) -> list[NodeInfo]:
    nodes = [read_slot(pool, i) for i in range(pool.sb.max_nodes)]
    return nodes if include_free else [n for n in nodes if n.state != "free"]


def process_start_ns(pid: int) -> int | None:
    """Start time of a local process in ns (psutil), None if it does not exist."""
    try:
        return int(psutil.Process(pid).create_time() * 1e9)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def local_process_alive(pid: int, start_time_ns: int) -> bool:
    start = process_start_ns(pid)
    # psutil derives create_time from boot time + clock ticks: equal for the
    # same process, different after pid reuse; allow rounding of 1 ms.
    return start is not None and abs(start - start_time_ns) < 1_000_000


def live_nodes(pool, *, observe: bool = True, clock=time.monotonic,
               sleep=time.sleep) -> list[NodeInfo]:
    """Attached nodes that are alive.

    Local nodes are decided at once (pid + start time).  Remote nodes are
    watched for up to one lease: a heartbeat that advances means alive.  With
    observe=False remote nodes count as alive (the cautious answer).
    """
    attached = [n for n in read_nodes(pool) if n.state == "attached"]
    me = local_boot_id()
    alive, remote = [], []
    for n in attached:
        if n.boot_id == me:
            if local_process_alive(n.pid, n.start_time_ns):
                alive.append(n)
        else:
            remote.append(n)
    if remote and observe:
        first = {n.slot: n.heartbeat for n in remote}
        deadline = clock() + pool.sb.lease_ms / 1000.0
        pending = {n.slot: n for n in remote}
        while pending and clock() < deadline:
            sleep(min(0.05, pool.sb.lease_ms / 20000.0))
            for slot in list(pending):
                now = read_slot(pool, slot)
                if now.state != "attached":
                    del pending[slot]
                elif now.heartbeat != first[slot]:
                    alive.append(pending.pop(slot))
    elif remote:
        alive.extend(remote)
    return sorted(alive, key=lambda n: n.slot)
