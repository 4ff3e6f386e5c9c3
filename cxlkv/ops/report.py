"""What `inspect` reports about a pool: superblock, layout, usage, nodes."""
from __future__ import annotations

import numpy as np

from cxlkv import _core
from cxlkv.api import Pool
from cxlkv.host.discovery import discover
from cxlkv.kv.area import Area, quarantine_report
from cxlkv.kv.cache import kv_report
from cxlkv.ops.doctor import host_mode
from cxlkv.pool import layout
from cxlkv.state import nodes as node_table


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


__all__ = ["pool_report", "used_chunks", "host_report", "full_report", "kv_blocks"]


def host_report() -> dict:
    """What `inspect` shows of this host: discovery, and which CXL setup it is
    in (a devdax pool or kernel tiering)."""
    host = discover()
    host["cxl_mode"] = host_mode(host)
    return host


def full_report(path: str, force: bool = False) -> dict:
    """`inspect`'s pool document: pool_report, the KV cache's usage (None on a
    pool formatted before the KV region) and the quarantine.  Read-only."""
    with Pool.open(path, writable=False, force=force) as p:
        rep = pool_report(p)
        rep["kv"] = kv_report(p) if p.sb.compat & layout.COMPAT_KV else None
        rep["quarantine"] = quarantine_report(p)
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
