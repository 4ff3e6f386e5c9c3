"""Block names: the chain hash each block was keyed by, kept in the pool.

A block's pool key is xxh3-128(namespace digest || tenant salt || chain hash)
(cxlkv.kv.keys): one-way.  Routers index blocks by the engines' own hashes
(vLLM's block hashes), so the KV events publisher needs the chain hash back.
On media (cxlkv_format.h, "Block names"; compat feature NAMES): one name
entry per hash entry - a 64-byte name record (key, length, up to NAME_MAX
bytes of name) and room for the block's token ids (superblock name_tokens,
`cxlkv format --name-tokens`: routers that index by tokens get them in
BlockStored.token_ids) - and, per journal ring, one name record per journal
record (the block's, copied by journal_append inside the record's seqlock,
so an eviction's record still names the block after its entry was reused).

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

import dataclasses

import numpy as np

from cxlkv.pool import layout

NAME_MAX = layout.NAME_MAX
_NAME_FIELDS = [("key_lo", "<u8"), ("key_hi", "<u8"), ("len", "<u4"), ("ntokens", "<u4"),
                ("name", "u1", (NAME_MAX,))]
#: a name record (BlockNameStruct)
NAME = np.dtype(_NAME_FIELDS)
assert NAME.itemsize == layout.NAME_SIZE


def entry_dtype(name_tokens: int) -> np.dtype:
    """A table name entry of a pool keeping name_tokens token ids a block."""
    size = layout.name_entry_size(name_tokens)
    return np.dtype({"names": [n for n, *_ in _NAME_FIELDS] + ["tokens"],
                     "formats": [f if not r else (f, r[0]) for _, f, *r in _NAME_FIELDS]
                     + [("<u4", (name_tokens,))],
                     "offsets": [NAME.fields[n][1] for n, *_ in _NAME_FIELDS]
                     + [layout.NAME_SIZE], "itemsize": size})


@dataclasses.dataclass(frozen=True)
class Named:
    """What names a run of blocks: their chain hashes (rows of one length)
    and, when known, their token ids (rows of block_tokens)."""

    chain: np.ndarray
    tokens: np.ndarray | None = None

    def __getitem__(self, sel) -> "Named":
        return Named(self.chain[sel], None if self.tokens is None else self.tokens[sel])


def has_names(pool) -> bool:
    return bool(pool.sb.compat & layout.COMPAT_NAMES)


class Names:
    """The block names of an open pool (None from of() for a pool without)."""

    def __init__(self, pool):
        sb = pool.sb
        kv_off, kv_size = sb.regions["kv"]
        g = layout.names_geometry(sb.max_nodes, sb.hash_slots, sb.name_tokens)
        if kv_size < g["end"]:                    # the superblock check refuses this first
            raise ValueError("the KV region is too small for the block names")
        self.pool, self.m = pool, pool.mapping
        self.nslots = sb.hash_slots
        self.name_tokens = sb.name_tokens
        self.entry_size = g["entry_size"]
        self.entry = entry_dtype(sb.name_tokens)
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

    def write(self, node, slots: np.ndarray, keys: np.ndarray, named: Named) -> None:
        """The table names of entries `slots` (this node reserved them): the
        keys (rows of 16 bytes), their chain hashes (longer than NAME_MAX:
        left unnamed) and, when known, their token ids (more than the pool's
        name_tokens a block: not kept).  Each entry only while this node is
        known fresh."""
        chain, tokens = named.chain, named.tokens
        n = len(slots)
        if not n:
            return
        # the leading part of each entry, as bytes (what a store pays for
        # names: a few row copies and one C call): key, len, ntokens, name,
        # then the token ids kept (the rest of the entry is never read)
        nt = tokens.shape[1] if tokens is not None and tokens.ndim == 2 else 0
        nt = nt if nt <= self.name_tokens else 0
        width = layout.NAME_SIZE + 4 * nt
        rec = np.zeros((n, width), dtype=np.uint8)
        rec[:, :16] = keys
        w = chain.shape[1] if chain.ndim == 2 else 0
        if 0 < w <= NAME_MAX:
            rec[:, 16] = w                      # len (little-endian, < 256)
            rec[:, 24:24 + w] = chain
        if nt:
            rec[:, 20:22] = np.frombuffer(nt.to_bytes(2, "little"), dtype=np.uint8)  # ntokens
            rec[:, 64:] = np.ascontiguousarray(tokens, dtype="<u4").view(np.uint8)
        offsets = (np.asarray(slots, dtype=np.uint64) * np.uint64(self.entry_size)
                   + np.uint64(self.table))
        node.write_blocks(offsets, rec.reshape(-1), width)

    def write_records(self, node, slots: np.ndarray, rec: np.ndarray) -> None:
        """Name entries (self.entry records; their keys the entries' keys)
        into the table names of entries `slots`, each only while this node
        is known fresh."""
        if not len(slots):
            return
        offsets = self.table + np.asarray(slots, dtype=np.uint64) * np.uint64(self.entry_size)
        node.write_blocks(offsets, np.ascontiguousarray(rec).view(np.uint8).reshape(-1),
                          self.entry_size)

    def read_at(self, idx: np.ndarray) -> np.ndarray:
        """The table names of entries `idx` (self.entry records)."""
        out = np.zeros(len(idx), dtype=self.entry)
        if len(idx):
            offsets = self.table + np.asarray(idx, dtype=np.uint64) * np.uint64(self.entry_size)
            self.m.read_blocks(offsets, out.view(np.uint8), self.entry_size)
        return out

    def names_at(self, idx: np.ndarray) -> np.ndarray:
        """The name records (NAME, without the token ids) of entries `idx`."""
        out = np.empty(len(idx), dtype=NAME)
        if len(idx):
            offsets = self.table + np.asarray(idx, dtype=np.uint64) * np.uint64(self.entry_size)
            self.m.read_blocks(offsets, out.view(np.uint8), layout.NAME_SIZE)
        return out

    def tokens(self, entry: np.ndarray, key_lo, key_hi) -> list:
        """The token ids kept for the blocks now at hash entries `entry`
        (indices) with these keys: a list per block, or None where the entry
        keeps none for that key (evicted and reused meanwhile, more tokens
        than the pool keeps, stored without tokens)."""
        if not self.name_tokens:
            return [None] * len(entry)
        rec = self.read_at(entry)
        ok = ((rec["key_lo"] == key_lo) & (rec["key_hi"] == key_hi) & (rec["ntokens"] > 0)
              & (rec["ntokens"] <= self.name_tokens))
        toks = rec["tokens"]
        return [toks[i, :int(rec["ntokens"][i])].tolist() if ok[i] else None
                for i in range(len(rec))]

    def read_ring(self, slot: int, pos: int, count: int) -> np.ndarray:
        """The ring names of records [pos, pos + count) of a ring (no wrap)."""
        off = self.ring(slot) + pos * layout.NAME_SIZE
        size = count * layout.NAME_SIZE
        if self.flush_meta:
            self.m.invalidate(off, size)
        return np.frombuffer(self.m.read(off, size), dtype=NAME)


def convert(rec: np.ndarray, nm: Names) -> np.ndarray:
    """Name entries of another pool (another name_tokens) as entries of
    `nm`'s pool: the name records as they are, the token ids where they fit."""
    if rec.dtype == nm.entry:
        return rec
    out = np.zeros(len(rec), dtype=nm.entry)
    for f, *_ in _NAME_FIELDS:
        out[f] = rec[f]
    n = min(nm.name_tokens, rec.dtype["tokens"].shape[0] if rec.dtype["tokens"].shape else 0)
    fits = out["ntokens"] <= nm.name_tokens
    out["ntokens"][~fits] = 0
    if n:
        out["tokens"][:, :n] = rec["tokens"][:, :n]
    return out


def valid(rec: np.ndarray, key_lo, key_hi) -> np.ndarray:
    """Which name records name the blocks with these keys."""
    return ((rec["key_lo"] == key_lo) & (rec["key_hi"] == key_hi) & (rec["len"] > 0)
            & (rec["len"] <= NAME_MAX))


def name_bytes(rec) -> bytes:
    """The name a (valid) record holds."""
    return bytes(rec["name"][:int(rec["len"])])
