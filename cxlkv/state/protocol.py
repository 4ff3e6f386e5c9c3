"""Sync mode `manager`: where each party's words live, and reading them.

One writer per cache line (see cxlkv.daemons.lockmgr): nodes write node line
0 and lock-entry line 0; the lock manager writes node line 7, lock-entry
line 1 and the lease in the lock header.  Every read of another party's line
is invalidate + load; every write is store + flush.
"""
from __future__ import annotations

import time
import uuid as uuidlib

import numpy as np

from cxlkv.pool import layout

MGR_TOKEN = layout.field_offset(layout.LockHdrStruct, "mgr_token")
MGR_EPOCH = layout.field_offset(layout.LockHdrStruct, "mgr_epoch")
MGR_HEARTBEAT = layout.field_offset(layout.LockHdrStruct, "mgr_heartbeat")
MGR_PID = layout.field_offset(layout.LockHdrStruct, "mgr_pid")
MGR_BOOT = layout.field_offset(layout.LockHdrStruct, "mgr_boot_id")
MGR_HOST = layout.field_offset(layout.LockHdrStruct, "mgr_hostname")
MGR_RECOVERING = layout.field_offset(layout.LockHdrStruct, "mgr_recovering")
MGR_PIDNS = layout.field_offset(layout.LockHdrStruct, "mgr_pidns")

N_CONTROL = layout.field_offset(layout.NodeStruct, "control")
N_HEARTBEAT = layout.field_offset(layout.NodeStruct, "heartbeat")
N_CLAIM = layout.field_offset(layout.NodeStruct, "claim_token")
N_MGR_CONTROL = layout.field_offset(layout.NodeStruct, "mgr_control")
N_MGR_GRANT = layout.field_offset(layout.NodeStruct, "mgr_grant_token")

E_EPOCH = layout.field_offset(layout.LockEntryStruct, "epoch")
E_REQ = layout.field_offset(layout.LockEntryStruct, "req_seq")
E_RELEASE = layout.field_offset(layout.LockEntryStruct, "release_seq")
E_GRANT = layout.field_offset(layout.LockEntryStruct, "grant_seq")
E_REVOKE = layout.field_offset(layout.LockEntryStruct, "revoke_seq")
E_GRANT_EPOCH = layout.field_offset(layout.LockEntryStruct, "grant_epoch")
E_HELD_WHEN_FENCED = layout.field_offset(layout.LockEntryStruct, "held_when_fenced")
E_RECOVERING = layout.field_offset(layout.LockEntryStruct, "recovering")

_NODE_LINES = np.dtype([("control", "<u8"), ("heartbeat", "<u8"), ("claim_token", "<u8"),
                        ("grant_token", "<u8"), ("pad", "V416"), ("mgr_control", "<u8"),
                        ("mgr_grant_token", "<u8"), ("pad7", "V48")])
assert _NODE_LINES.itemsize == layout.NODE_SIZE
#: a node's lock entry (cas mode's ticket words and manager mode's lines)
ENTRY_DTYPE = np.dtype([("state", "<u8"), ("ticket", "<u8"), ("epoch", "<u8"),
                        ("req_seq", "<u8"), ("release_seq", "<u8"), ("freeing", "<u8"),
                        ("held_when_fenced", "<u8"), ("recovering", "<u8"),
                        ("grant_seq", "<u8"), ("revoke_seq", "<u8"), ("grant_epoch", "<u8"),
                        ("pad1", "V40")])
assert ENTRY_DTYPE.itemsize == layout.LOCK_ENTRY_SIZE


def lock_offsets(pool) -> tuple[int, int]:
    """(header offset, first entry offset) of the lock area."""
    off, _ = pool.region("locks")
    return off, off + layout.LOCK_HDR_SIZE


def entry_offset(pool, slot: int) -> int:
    return lock_offsets(pool)[1] + slot * layout.LOCK_ENTRY_SIZE


def lock_header(pool) -> int:
    return pool.region("locks")[0]


def node(pool, slot: int) -> int:
    return pool.region("nodes")[0] + slot * layout.NODE_SIZE


def read_node_lines(pool) -> np.ndarray:
    off, _ = pool.region("nodes")
    n = pool.sb.max_nodes * layout.NODE_SIZE
    pool.mapping.invalidate(off, n)
    return np.frombuffer(pool.mapping.read(off, n), dtype=_NODE_LINES)


def read_entries(pool) -> np.ndarray:
    """Every node's lock entry (both modes' words), read after an invalidate."""
    _, first = lock_offsets(pool)
    n = pool.sb.max_nodes * layout.LOCK_ENTRY_SIZE
    pool.mapping.invalidate(first, n)
    return np.frombuffer(pool.mapping.read(first, n), dtype=ENTRY_DTYPE)


def mgr_state(line) -> tuple[int, int]:
    return layout.node_state(int(line["mgr_control"]))


def set_mgr(pool, slot: int, control: int, grant_token: int) -> None:
    m, off = pool.mapping, node(pool, slot)
    m.store64(off + N_MGR_GRANT, grant_token)
    m.store64(off + N_MGR_CONTROL, control)
    m.flush(off + N_MGR_CONTROL, 16)


def grant(pool, slot: int, req: int, epoch: int) -> None:
    m, off = pool.mapping, entry_offset(pool, slot)
    m.store64(off + E_GRANT_EPOCH, epoch)
    m.store64(off + E_GRANT, req)
    m.flush(off + E_GRANT, 24)


def revoke(pool, slot: int, seq: int) -> None:
    m, off = pool.mapping, entry_offset(pool, slot)
    m.store64(off + E_REVOKE, seq)
    m.flush(off + E_REVOKE, 8)


def mark_held_when_fenced(pool, slot: int, token: int) -> None:
    """Whoever fences node `slot` while it holds the pool lock records it (its
    owner token) in the node's lock entry: what the node was doing under the
    lock - releasing a slab, finishing a free - it may still be doing when it
    resumes, so no recovery finishes other nodes' half-done work (and hands
    that memory out) until this node's quarantine ends (nodes.fenced_holders).
    token 0 clears it (at the end of its recovery)."""
    m, off = pool.mapping, entry_offset(pool, slot) + E_HELD_WHEN_FENCED
    m.store64(off, token)
    m.flush(off, 8)


def mark_recovering(pool, slot: int, token: int) -> None:
    """Node `slot` records, under the pool lock, the token of the node it is
    about to recover (0 when done): fenced in the middle, it may still zero
    that node's memory when it resumes, so that node is not recovered again
    until this one's quarantine ends (nodes.recovered_by_fenced)."""
    m, off = pool.mapping, entry_offset(pool, slot) + E_RECOVERING
    m.store64(off, token)
    m.flush(off, 8)


def current_holder(pool) -> int:
    """The slot the pool's lock entries say holds the lock, -1 if none."""
    ents = read_entries(pool)
    held = np.flatnonzero(ents["grant_seq"] > np.maximum(ents["release_seq"], ents["revoke_seq"]))
    return int(held[0]) if len(held) else -1


def describe_manager(pool) -> str:
    m, h = pool.mapping, lock_header(pool)
    m.invalidate(h + MGR_TOKEN, 128)
    pid = m.load64(h + MGR_PID)
    host = m.read(h + MGR_HOST, 64).split(b"\0", 1)[0].decode("utf-8", "replace")
    boot = str(uuidlib.UUID(bytes=m.read(h + MGR_BOOT, 16)))
    return f"pid {pid} on {host or '?'} (boot {boot[:8]})"


def heartbeating(pool, token: int, lease: float | None = None) -> bool:
    """Watch the lease for up to one lease: True if `token`'s manager beats."""
    m, h = pool.mapping, lock_header(pool)
    lease = pool.sb.lease_ms / 1000.0 if lease is None else lease
    m.invalidate(h + MGR_TOKEN, 64)
    beat0 = m.load64(h + MGR_HEARTBEAT)
    end = time.monotonic() + lease
    while time.monotonic() < end:
        time.sleep(min(0.01, lease / 20))
        m.invalidate(h + MGR_TOKEN, 64)
        if m.load64(h + MGR_TOKEN) != token:
            return m.load64(h + MGR_TOKEN) != 0
        if m.load64(h + MGR_HEARTBEAT) != beat0:
            return True
    return False


def manager_alive(pool) -> bool:
    m, h = pool.mapping, lock_header(pool)
    m.invalidate(h + MGR_TOKEN, 8)
    token = m.load64(h + MGR_TOKEN)
    return bool(token) and heartbeating(pool, token)
