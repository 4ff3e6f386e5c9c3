"""Block names: the chain hash each block was keyed by, kept in the pool.

A block's pool key is xxh3-128(namespace digest || tenant salt || chain hash)
(cxlkv.kv.keys): one-way.  Routers index blocks by the engines' own hashes
(vLLM's block hashes), so the KV events publisher needs the chain hash back.
On media (cxlkv_format.h, "Block names"; compat feature NAMES): one 64-byte
name record per hash entry (key, length, up to NAME_MAX bytes of name) and,
per journal ring, two per journal record (the block's and its parent's, copied
by journal_append inside the record's seqlock, so an eviction's record still
names the block after its entry was reused).

A record names a block only when its key is the block's key: the key is a
hash of the name, so such a record holds that block's name, whoever wrote it
and whenever.  Anything else - a pool formatted without NAMES, a block stored
by a cxlkv that does not know the feature, a name longer than NAME_MAX bytes
- leaves the block unnamed, and it is published under its pool key.

Who writes: the node that reserved an entry writes its name before it
publishes it (KVCache's store path), with the write path's freshness checks
(Attachment.write_blocks), so a fenced node never writes into an entry it no
longer owns.
"""
from __future__ import annotations

import numpy as np

from cxlkv.pool import layout

NAME_MAX = layout.NAME_MAX
#: a name record (BlockNameStruct)
NAME = np.dtype([("key_lo", "<u8"), ("key_hi", "<u8"), ("len", "<u4"), ("reserved", "<u4"),
                 ("name", "u1", (NAME_MAX,))])
assert NAME.itemsize == layout.NAME_SIZE


def has_names(pool) -> bool:
    return bool(pool.sb.compat & layout.COMPAT_NAMES)


class Names:
    """The block names of an open pool (None from of() for a pool without)."""

    def __init__(self, pool):
        sb = pool.sb
        kv_off, kv_size = sb.regions["kv"]
        g = layout.names_geometry(sb.max_nodes, sb.hash_slots)
        if kv_size < g["end"]:                    # the superblock check refuses this first
            raise ValueError("the KV region is too small for the block names")
        self.pool, self.m = pool, pool.mapping
        self.nslots = sb.hash_slots
        self.max_nodes = sb.max_nodes
        self.table = kv_off + g["table_off"]
        self.rings = kv_off + g["ring_off"]
        self.ring_stride = g["ring_stride"]
        self.flush_meta = sb.sync == "manager" or self.m.noncoherent

    @classmethod
    def of(cls, pool) -> "Names | None":
        return cls(pool) if has_names(pool) else None

    def ring(self, slot: int) -> int:
        """Pool offset of the ring names of node slot `slot`."""
        return self.rings + slot * self.ring_stride

    def write(self, node, slots: np.ndarray, keys: np.ndarray, chain: np.ndarray) -> None:
        """The table names of entries `slots` (this node reserved them): the
        keys (rows of 16 bytes) and their chain hashes (rows of any one
        length; longer than NAME_MAX: left unnamed).  Each record only while
        this node is known fresh."""
        n = len(slots)
        if not n:
            return
        rec = np.zeros(n, dtype=NAME)
        k = np.ascontiguousarray(keys, dtype=np.uint8).view("<u8").reshape(n, 2)
        rec["key_lo"], rec["key_hi"] = k[:, 0], k[:, 1]
        width = chain.shape[1] if chain.ndim == 2 else 0
        if 0 < width <= NAME_MAX:
            rec["len"] = width
            rec["name"][:, :width] = chain
        self.write_records(node, slots, rec)

    def write_records(self, node, slots: np.ndarray, rec: np.ndarray) -> None:
        """NAME records (their keys the entries' keys) into the table names of
        entries `slots`, each only while this node is known fresh."""
        if not len(slots):
            return
        offsets = self.table + np.asarray(slots, dtype=np.uint64) * np.uint64(layout.NAME_SIZE)
        node.write_blocks(offsets, np.ascontiguousarray(rec, dtype=NAME).view(np.uint8),
                          layout.NAME_SIZE)

    def read_at(self, idx: np.ndarray) -> np.ndarray:
        """The table names of entries `idx` (NAME records)."""
        out = np.empty(len(idx), dtype=NAME)
        if len(idx):
            offsets = self.table + np.asarray(idx, dtype=np.uint64) * np.uint64(layout.NAME_SIZE)
            self.m.read_blocks(offsets, out.view(np.uint8), layout.NAME_SIZE)
        return out

    def read_table(self) -> np.ndarray:
        """Every table name (NAME records, one per hash entry)."""
        size = self.nslots * layout.NAME_SIZE
        if self.flush_meta:
            self.m.invalidate(self.table, size)
        return np.frombuffer(self.m.read(self.table, size), dtype=NAME)

    def read_ring(self, slot: int, pos: int, count: int) -> np.ndarray:
        """The ring names of records [pos, pos + count) of a ring (no wrap):
        shape (count, 2), the block's and its parent's."""
        off = self.ring(slot) + pos * 2 * layout.NAME_SIZE
        size = count * 2 * layout.NAME_SIZE
        if self.flush_meta:
            self.m.invalidate(off, size)
        return np.frombuffer(self.m.read(off, size), dtype=NAME).reshape(count, 2)


def valid(rec: np.ndarray, key_lo, key_hi) -> np.ndarray:
    """Which name records name the blocks with these keys."""
    return ((rec["key_lo"] == key_lo) & (rec["key_hi"] == key_hi) & (rec["len"] > 0)
            & (rec["len"] <= NAME_MAX))


def name_bytes(rec) -> bytes:
    """The name a (valid) record holds."""
    return bytes(rec["name"][:int(rec["len"])])
