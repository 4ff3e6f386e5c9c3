"""What `inspect` reports about a pool: superblock, layout, usage, nodes."""
from __future__ import annotations

import time
import uuid as uuidlib

import numpy as np

from cxlkv import _core
from cxlkv.api import Pool
from cxlkv.errors import CxlkvError
from cxlkv.host.discovery import discover
from cxlkv.kv.area import Area, pins_by_node, quarantine_report
from cxlkv.kv.cache import kv_report
from cxlkv.ops.doctor import host_mode
from cxlkv.pool import layout
from cxlkv.state import nodes as node_table
from cxlkv.state import protocol


def used_chunks(pool) -> int:
    """Chunks marked allocated in the global bitmap."""
    off, _ = pool.region("bitmap")
    nbytes = (pool.sb.nchunks + 7) // 8
    pool.mapping.invalidate(off, nbytes)
    bits = int.from_bytes(pool.mapping.read(off, nbytes), "little")
    return (bits & ((1 << pool.sb.nchunks) - 1)).bit_count()


def pool_report(pool) -> dict:
    sb = pool.sb
    attached = node_table.read_nodes(pool)
    used = used_chunks(pool)
    data_off, data_size = sb.regions["data"]
    return {
        "path": pool.path,
        "target": pool.target.to_json(),
        "read_only": pool.read_only,
        "superblock_copy": pool.superblock_copy,
        "superblock_problems": pool.superblock_problems,
        "superblock": sb.to_json(),
        "memory_model": "noncoherent-emulated" if pool.mapping.noncoherent else "coherent",
        "cpu": _core.cpu_info(),
        "usage": {
            "data_bytes": data_size,
            "metadata_bytes": data_off,
            "chunks_total": sb.nchunks,
            "chunks_used": used,
            "chunks_free": sb.nchunks - used,
            "bytes_used": used * sb.chunk_size,
            "nodes_max": sb.max_nodes,
            "nodes_in_table": len(attached),
        },
        "nodes": [n.to_json() for n in attached],
        # software / format version -> nodes: more than one key during a
        # rolling upgrade (see cxlkv-runbook(7))
        "versions": _versions(attached),
        "warnings": list(pool.warnings),
    }


def _versions(nodes) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in nodes:
        key = f"{n.sw_version or 'unknown'}/format {n.format_version}"
        out[key] = out.get(key, 0) + 1
    return out


__all__ = ["pool_report", "used_chunks", "host_report", "full_report", "kv_blocks",
           "node_liveness", "manager_state"]


def host_report() -> dict:
    """What `inspect` shows of this host: discovery, and which CXL setup it is
    in (a devdax pool or kernel tiering)."""
    host = discover()
    host["cxl_mode"] = host_mode(host)
    return host


#: how long inspect watches heartbeats of nodes of other hosts at most (a
#: longer lease leaves them "unknown": health --timeout judges them)
LIVENESS_WATCH_MAX_S = 3.0


def node_liveness(pool, watch_s: float | None = None, clock=time.monotonic,
                  sleep=time.sleep) -> dict[int, dict]:
    """Per non-free slot: is the node alive, and how that was judged.

    liveness   alive | dead | unknown (not watched long enough)
    judged_by  process (same host and pid namespace: its process is looked
               up), heartbeat (another host: its heartbeat word watched on
               this clock), state (fenced: dead by the pool's own record)
    heartbeat_age_s  for judged_by heartbeat: the heartbeat changed within
               this many seconds of watching (alive: an upper bound), or has
               not changed for that long (dead / unknown: a lower bound)
    Nodes of other hosts are watched until decided, for at most
    min(1.25 x lease + 0.1, watch_s or LIVENESS_WATCH_MAX_S) seconds."""
    obs = node_table.Observer(pool, clock=clock)
    lease = pool.sb.lease_ms / 1000.0
    limit = LIVENESS_WATCH_MAX_S if watch_s is None else watch_s
    start = clock()
    deadline = start + min(1.25 * lease + 0.1, limit)
    out: dict[int, dict] = {}
    first: dict[int, int] = {}
    for n in node_table.read_nodes(pool):
        v = obs.verdict(n, start)
        how = ("state" if n.state == "fenced" else
               "process" if n.same_process_space(obs.boot_id, obs.pidns) else "heartbeat")
        out[n.slot] = {"liveness": v, "judged_by": how, "heartbeat_age_s": None}
        first[n.slot] = n.heartbeat
    pending = {s for s, x in out.items() if x["liveness"] == "unknown"}
    while pending and clock() < deadline:
        sleep(min(0.02, max(0.0, deadline - clock())))
        now = clock()
        for slot in list(pending):
            n = node_table.read_slot(pool, slot)
            v = obs.verdict(n, now)
            if v != "unknown" or n.heartbeat != first[slot]:
                pending.discard(slot)
                out[slot]["liveness"] = "alive" if n.heartbeat != first[slot] else v
                out[slot]["heartbeat_age_s"] = round(now - start, 3)
    for slot in pending:
        out[slot]["heartbeat_age_s"] = round(clock() - start, 3)
    return out


def manager_state(pool, wait_s: float | None = None, clock=time.monotonic,
                  sleep=time.sleep) -> dict | None:
    """The lock manager of a pool in sync mode manager (None in cas mode):
    the active one's pid, host, boot id and epoch from the lock header, and
    whether its heartbeat moves (watched up to min(1.25 x lease, wait_s)).
    Standbys hold nothing in the pool until they take over, so they cannot
    be listed from it (each logs that it stands by)."""
    if pool.sb.sync != "manager":
        return None
    m, h = pool.mapping, protocol.lock_header(pool)

    def words():
        m.invalidate(h + protocol.MGR_TOKEN, 128)
        return m.load64(h + protocol.MGR_TOKEN), m.load64(h + protocol.MGR_HEARTBEAT)

    token, beat = words()
    host = m.read(h + protocol.MGR_HOST, 64).split(b"\0", 1)[0].decode("utf-8", "replace")
    doc = {"state": "none", "pid": m.load64(h + protocol.MGR_PID) or None,
           "hostname": host or None, "boot_id": str(uuidlib.UUID(bytes=m.read(
               h + protocol.MGR_BOOT, 16))), "epoch": m.load64(h + protocol.MGR_EPOCH),
           "heartbeat_age_s": None, "standbys": "not recorded in the pool"}
    if not token:
        return doc                       # handed back, or never started
    lease = pool.sb.lease_ms / 1000.0
    start = clock()
    end = start + min(1.25 * lease + 0.1, LIVENESS_WATCH_MAX_S if wait_s is None else wait_s)
    doc["state"] = "unknown"
    while clock() < end:
        sleep(min(0.02, max(0.0, end - clock())))
        t2, b2 = words()
        if (t2, b2) != (token, beat):
            doc["state"] = "active" if t2 else "none"
            doc["heartbeat_age_s"] = round(clock() - start, 3)
            return doc
    doc["heartbeat_age_s"] = round(clock() - start, 3)
    if doc["heartbeat_age_s"] >= lease:
        doc["state"] = "dead"
    return doc


def pool_fingerprint(path: str, force: bool = False) -> tuple:
    """What `inspect --watch` compares to tell that a pool changed: the
    superblock (uuid, seq), each node slot (state, epoch, pid - not its
    heartbeat, which moves all the time), chunks in use, the KV table's live
    entries and evictions, and the pins per node.  Read-only, cheap."""
    with Pool.open(path, writable=False, force=force) as p:
        kv = None
        if p.sb.compat & layout.COMPAT_KV:
            try:
                h = Area(p).header()
                kv = (h.live, h.evictions)
            except CxlkvError:
                kv = "unreadable"
        return (p.sb.uuid, p.sb.seq,
                tuple((n.slot, n.state, n.epoch, n.pid) for n in node_table.read_nodes(p)),
                used_chunks(p), kv,
                tuple((x["slot"], x["pinned_blocks"]) for x in pins_by_node(p)))


def full_report(path: str, force: bool = False, watch_s: float | None = None) -> dict:
    """`inspect`'s pool document: pool_report, the KV cache's usage (None on a
    pool formatted before the KV region), the quarantine, who pins what, each
    node's liveness (merged into "nodes") and the lock manager.  Read-only."""
    with Pool.open(path, writable=False, force=force) as p:
        rep = pool_report(p)
        rep["kv"] = kv_report(p) if p.sb.compat & layout.COMPAT_KV else None
        rep["quarantine"] = quarantine_report(p)
        pins = pins_by_node(p)
        rep["pins"] = pins
        live = node_liveness(p, watch_s)
        by_slot = {x["slot"]: x for x in pins}
        for n in rep["nodes"]:
            n.update(live.get(n["slot"], {"liveness": "unknown", "judged_by": "heartbeat",
                                          "heartbeat_age_s": None}))
            x = by_slot.get(n["slot"])
            n["pinned_blocks"] = x["pinned_blocks"] if x else 0
            n["pinned_bytes"] = x["pinned_bytes"] if x else 0
        rep["lock_manager"] = manager_state(p, watch_s)
    return rep


def kv_blocks(pool, ns: int, limit: int = 0) -> list[dict]:
    """The live entries of namespace index `ns` (`kv ls --namespace`), in table
    order, at most `limit` (0: all)."""
    t = Area(pool).entries()
    st = t["ctl"] & 0xFF
    sel = np.flatnonzero((t["ns"] == ns) & (st != layout.KV_EMPTY) & (st != layout.KV_TOMBSTONE))
    if limit:
        sel = sel[:limit]
    out = []
    for i in sel:
        e = t[i]
        key = int(e["key_lo"]).to_bytes(8, "little") + int(e["key_hi"]).to_bytes(8, "little")
        out.append({"entry": int(i), "key": key.hex(),
                    "state": layout.KV_STATE_NAMES.get(int(st[i]), str(int(st[i]))),
                    "bytes": int(e["length"]), "payload": int(e["payload"]),
                    "parent": int(e["parent"]) - 1 if e["parent"] else None,
                    "children": int(e["children"]), "tenant": int(e["tenant"]),
                    "last_use_us": int(e["lru"])})
    return out
