"""What `inspect` reports about a pool: superblock, layout, usage, nodes."""
from __future__ import annotations

from cxlkv import _core
from cxlkv.pool import layout as L
from cxlkv.state import nodes as N


def used_chunks(pool) -> int:
    """Chunks marked allocated in the global bitmap."""
    off, _ = pool.region("bitmap")
    nbytes = (pool.sb.nchunks + 7) // 8
    pool.mapping.invalidate(off, nbytes)
    bits = int.from_bytes(pool.mapping.read(off, nbytes), "little")
    return (bits & ((1 << pool.sb.nchunks) - 1)).bit_count()


def pool_report(pool) -> dict:
    sb = pool.sb
    attached = N.read_nodes(pool)
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


__all__ = ["pool_report", "used_chunks", "L"]
