"""The pool's change journal: what every node published and evicted.

    from cxlkv.kv.journal import JournalReader
    r = JournalReader(pool)              # any process with the pool open
    ch = r.poll()                        # Changes: records (CHANGE dtype), resync flag
    for rec in ch.records: ...           # op: STORED / EVICTED / NS_CLEARED

On media (cxlkv_format.h, "Change journal"; feature INCOMPAT_JOURNAL): one
ring of 64-byte records per node slot at the end of the KV region.  Who
writes: the node on the slot, under the pool lock, from two places - the
store path where its blocks become PUBLISHED (cache.KVCache._store_new) and
the eviction loop once a victim's free has begun (area.Area._evict_batch) -
plus `kv drop` when it frees a namespace record.  The append is one C call
(journal_append) that checks the node's freshness first, as every write
primitive does: a fenced node appends nothing.

Every record carries a rack-wide sequence number (taken under the pool
lock), so readers (lock-free, any number, each with its own cursors) get
every record exactly once and in the order the changes were made across
all nodes, unless one of these is seen, and then they fall back to one full
pass over the hash table (a *resync*, counted by reason):

* ``overrun``: a ring advanced more than its size past the cursor (the
  reader was too slow), or records it copied were overwritten meanwhile;
* ``torn``: a record's sequence number does not rise from the ring's
  previous one (a record of the previous lap: written by a node that died or
  lost its line before flushing it, or damaged);
* ``writer``: another node now appends to a ring a node appended to before
  (the slot was reused after a detach or a death; records a dying node
  never appended - a crash between its publish or free and its append -
  are found this way);
* ``reset``: a ring's head went backwards (the pool was re-formatted).

A resync returns the published entries of the table as STORED records
(``Changes.resync`` true): the reader's whole state, to replace what it
knew.  It reads the ring heads before the table, so records appended
meanwhile come again in the next poll: after a resync, delivery is at least
once (apply records idempotently).  A block whose eviction was undone while
the resync read the table (pinned at the last moment) is missed until the
next resync.

The head of a ring is never reset (it counts on across the nodes that use
the slot), so a cursor stays valid when a slot is reused.
"""
from __future__ import annotations

import ctypes
import dataclasses
import time

import numpy as np

from cxlkv._core import fence
from cxlkv.errors import MetadataCorrupt, PoolIncompatible, UsageError
from cxlkv.kv import names
from cxlkv.pool import layout

STORED = layout.JOURNAL_STORED
EVICTED = layout.JOURNAL_EVICTED
NS_CLEARED = layout.JOURNAL_NS_CLEARED

REC = np.dtype([("seq", "<u8"), ("key_lo", "<u8"), ("key_hi", "<u8"), ("parent_lo", "<u8"),
                ("parent_hi", "<u8"), ("length", "<u4"), ("ns", "<u2"), ("tenant", "<u2"),
                ("time_us", "<u8"), ("entry", "<u4"), ("op", "u1"), ("reserved", "u1", (3,))])
assert REC.itemsize == layout.JOURNAL_REC_SIZE
#: what poll() returns: a record, without its padding, with the node slot of its ring and
#: the names of the block and of its parent (cxlkv.kv.names; length 0: unnamed)
CHANGE = np.dtype([(n, REC.fields[n][0]) for n in REC.names if n != "reserved"]
                  + [("node", "<u2"), ("name_len", "u1"), ("name", "u1", (names.NAME_MAX,)),
                     ("parent_name_len", "u1"), ("parent_name", "u1", (names.NAME_MAX,))])
_ENTRY = np.dtype(layout.HashEntryStruct)
_RING_HDR = ctypes.sizeof(layout.JournalRingStruct)
_NEXT_SEQ = layout.field_offset(layout.JournalHdrStruct, "next_seq")
_RESYNC_REASONS = ("start", "overrun", "torn", "writer", "reset")


def has_journal(pool) -> bool:
    return bool(pool.sb.incompat & layout.INCOMPAT_JOURNAL)


def require(pool) -> None:
    """PoolIncompatible, by name, for a pool formatted without the journal."""
    if not has_journal(pool):
        raise PoolIncompatible(
            f"{pool.path} was formatted without the feature JOURNAL (the change journal; "
            "by cxlkv 0.1): its KV cache cannot be used by this version", path=pool.path,
            hint="snapshot its KV blocks with the cxlkv that formatted it, re-format with "
                 "`cxlkv format --force`, then restore them")


class _Geometry:
    """The journal of an open pool: where its rings lie (checked against the
    header format wrote)."""

    def __init__(self, pool):
        require(pool)
        sb = pool.sb
        self.pool, self.m = pool, pool.mapping
        self.flush_meta = sb.sync == "manager" or self.m.noncoherent
        kv_off, kv_size = sb.regions["kv"]
        g = layout.journal_geometry(sb.max_nodes, sb.hash_slots)
        self.nrec = g["records_per_node"]
        self.max_nodes = sb.max_nodes
        self.stride = g["ring_stride"]
        self.rings = kv_off + g["ring_off"]
        self.hdr = hdr = kv_off + g["hdr_off"]
        raw = self._read(hdr, ctypes.sizeof(layout.JournalHdrStruct))
        h = layout.JournalHdrStruct.from_buffer_copy(raw)
        if (h.magic != layout.JOURNAL_MAGIC or h.records_per_node != self.nrec
                or h.rec_size != layout.JOURNAL_REC_SIZE or h.ring_off != g["ring_off"]
                or h.ring_stride != self.stride or h.max_nodes != sb.max_nodes
                or kv_size < g["end"]):
            raise MetadataCorrupt(f"{pool.path}: the change journal's header is corrupt "
                                  "(magic or geometry)", path=pool.path,
                                  hint="run `cxlkv fsck` on the pool")
        self.table, _ = sb.regions["hash"]
        self.nslots = sb.hash_slots
        self.names = names.Names.of(pool)

    def ring_off(self, slot: int) -> int:
        if not 0 <= slot < self.max_nodes:
            raise UsageError(f"node slot {slot} out of range")
        return self.rings + slot * self.stride

    def _read(self, off: int, size: int) -> bytes:
        if self.flush_meta:
            self.m.invalidate(off, size)
        return self.m.read(off, size)

    def next_seq(self) -> int:
        """The sequence number the next record will get."""
        return int.from_bytes(self._read(self.hdr + _NEXT_SEQ, 8), "little")

    def heads(self) -> tuple[np.ndarray, np.ndarray]:
        """(head, writer) of every ring."""
        if not self.flush_meta:                 # one strided copy out of a view
            v = self.m.view(self.rings, self.max_nodes * self.stride)
            try:
                w = np.frombuffer(v, dtype="<u8").reshape(self.max_nodes, self.stride // 8)
                heads, writers = w[:, 0].copy(), w[:, 1].copy()
                del w
            finally:
                v.release()
            return heads, writers
        heads = np.empty(self.max_nodes, dtype=np.uint64)
        writers = np.empty(self.max_nodes, dtype=np.uint64)
        for s in range(self.max_nodes):
            raw = self._read(self.ring_off(s), 16)
            heads[s] = int.from_bytes(raw[:8], "little")
            writers[s] = int.from_bytes(raw[8:16], "little")
        return heads, writers


class Writer:
    """This node's appends to the ring of its slot.  Pool lock held by the
    caller (appends of the whole rack are serialised by it).  Made with
    every Area; the journal's header is read at the first append, and a pool
    without the journal is refused then (KVCache refuses it up front)."""

    def __init__(self, pool):
        self.pool = pool
        self._geo: _Geometry | None = None
        self._none = np.zeros(0, dtype=np.uint64)
        # journal_append's fixed arguments for the node that appends
        # (owner token first: a node re-attached on another slot gets new ones)
        self._args: tuple | None = None

    def require(self) -> None:
        require(self.pool)

    def append(self, op: int, idx=None, *, ns: int = 0) -> int:
        """Record entries `idx` (entry indices; an int or an array) as STORED
        or EVICTED - the entries must still hold their key and fields - or
        namespace `ns` as cleared.  Returns the ring's head."""
        node = self.pool.node
        a = self._args
        if a is None or a[0] != node.owner_token:
            g = self._geo
            if g is None:
                g = self._geo = _Geometry(self.pool)
            nm = g.names
            a = self._args = (node.owner_token, g.m, g.hdr, g.ring_off(node.slot), g.nrec,
                              g.table, g.nslots, nm.table if nm else 0,
                              nm.ring(node.slot) if nm else 0, nm.entry_size if nm else 0)
        if idx is None:
            idx = self._none
        elif not isinstance(idx, np.ndarray) or idx.dtype != np.uint64 or idx.ndim != 1:
            idx = np.ascontiguousarray(np.atleast_1d(idx), dtype=np.uint64)
        return a[1].journal_append(a[2], a[3], a[4], a[5], a[6], op, a[0],
                                   max(1, time.time_ns() // 1000), idx, ns, a[7], a[8], a[9])


@dataclasses.dataclass
class Changes:
    """What one poll saw.  records: CHANGE array (op, key, parent key, length,
    namespace, tenant, time, entry index + 1, node slot, the block's and its
    parent's names: cxlkv.kv.names, length 0 where unnamed).
    resync: the records are the table's published entries, the reader's whole
    state (reasons: why it resynced)."""

    records: np.ndarray
    resync: bool = False
    reasons: tuple[str, ...] = ()


class JournalReader:
    """A cursor per ring over the journal of `pool` (see the module doc).
    start="resync": the first poll returns the whole table (a resync counted
    as "start"); start="now": only what is appended after the reader was made.
    Not thread-safe: one reader per consumer."""

    def __init__(self, pool, *, start: str = "resync"):
        if start not in ("resync", "now"):
            raise UsageError(f"start must be 'resync' or 'now', not {start!r}")
        self.geo = _Geometry(pool)
        self.pool = pool
        self.cursors: np.ndarray | None = None     # ring position of the next record to read
        self.writers: np.ndarray | None = None     # ring writer when last read
        self.last = np.zeros(self.geo.max_nodes, dtype=np.uint64)  # seq of the last record read
        if start == "now":
            self._mark(*self.geo.heads())
        self.stats = {"polls": 0, "records": 0, "resyncs": 0, "resync_entries": 0,
                      **{f"resync_{r}": 0 for r in _RESYNC_REASONS}}

    @property
    def resyncs(self) -> int:
        return self.stats["resyncs"]

    def lag(self) -> int:
        """Records appended and not yet returned (all rings)."""
        if self.cursors is None:
            return 0
        heads, _ = self.geo.heads()
        return int(np.maximum(heads.astype(np.int64) - self.cursors.astype(np.int64), 0).sum())

    def _mark(self, heads: np.ndarray, writers: np.ndarray) -> None:
        """Cursors at `heads`; each ring's last sequence number is that of
        the record before its head."""
        self.cursors, self.writers = heads.copy(), writers.copy()
        rec = self.geo.rings + _RING_HDR
        for s in np.flatnonzero(heads).tolist():
            pos = (int(heads[s]) - 1) % self.geo.nrec
            self.last[s] = int.from_bytes(self.geo._read(
                rec + s * self.geo.stride + pos * layout.JOURNAL_REC_SIZE, 8), "little")

    def poll(self) -> Changes:
        """Everything appended since the last poll, in sequence order, or a
        resync.  Records numbered from the header's next_seq read first are
        left for the next poll, so a record never comes before one that was
        appended earlier (in another ring)."""
        self.stats["polls"] += 1
        if self.cursors is None:
            return self._resync(("start",))
        limit = self.geo.next_seq()
        fence()
        heads, writers = self.geo.heads()
        out, reasons = [], []
        for s in np.flatnonzero((heads != self.cursors) | (writers != self.writers)):
            s = int(s)
            cur, head = int(self.cursors[s]), int(heads[s])
            if int(self.writers[s]) not in (0, int(writers[s])):
                reasons.append("writer")
            if head < cur:
                reasons.append("reset")
            elif head - cur > self.geo.nrec:
                reasons.append("overrun")
            if reasons:
                break
            self.writers[s] = writers[s]
            if head == cur:
                continue
            recs, why = self._records(s, cur, head)
            if why:
                reasons.append(why)
                break
            recs = recs[recs["seq"] < limit]         # the rest: next poll
            if len(recs):
                out.append(recs)
                self.cursors[s] = cur + len(recs)
                self.last[s] = recs["seq"][-1]
        if reasons:
            return self._resync(tuple(sorted(set(reasons))))
        if not out:
            return Changes(np.zeros(0, dtype=CHANGE))
        recs = np.concatenate(out)
        if len(out) > 1:
            recs = recs[np.argsort(recs["seq"], kind="stable")]
        if self.geo.names is not None:
            self._parent_names(recs)
        self.stats["records"] += len(recs)
        return Changes(recs)

    def _parent_names(self, recs: np.ndarray) -> None:
        """The parent names of STORED records: the name of the record before
        when it is the parent (a chain stored in one go), else the name of
        the parent's entry (the child's entry names it: both read now, each
        checked by key - a parent or child evicted meanwhile leaves the
        parent unnamed)."""
        st = np.flatnonzero((recs["op"] == STORED)
                            & ((recs["parent_lo"] != 0) | (recs["parent_hi"] != 0)))
        if not len(st):
            return
        prev = st - 1
        chained = prev >= 0
        chained[chained] = ((recs["key_lo"][prev[chained]] == recs["parent_lo"][st[chained]])
                            & (recs["key_hi"][prev[chained]] == recs["parent_hi"][st[chained]])
                            & (recs["name_len"][prev[chained]] > 0))
        c, p = st[chained], prev[chained]
        recs["parent_name_len"][c] = recs["name_len"][p]
        recs["parent_name"][c] = recs["name"][p]
        rest = st[~chained]
        entry = recs["entry"][rest].astype(np.int64)
        rest = rest[(entry > 0) & (entry <= self.geo.nslots)]
        if not len(rest):
            return
        ent = self._entries_at(recs["entry"][rest].astype(np.int64) - 1)
        mine = (ent["key_lo"] == recs["key_lo"][rest]) & (ent["key_hi"] == recs["key_hi"][rest])
        par = ent["parent"].astype(np.int64)
        mine &= (par > 0) & (par <= self.geo.nslots)
        rest, par = rest[mine], par[mine]
        if len(rest):
            got = self.geo.names.names_at(par - 1)
            _set_names_at(recs, rest, got, recs["parent_lo"][rest], recs["parent_hi"][rest],
                          "parent_")

    def _entries_at(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty(len(idx), dtype=_ENTRY)
        offsets = self.geo.table + idx.astype(np.uint64) * np.uint64(layout.HASH_ENTRY_SIZE)
        self.geo.m.read_blocks(offsets, out.view(np.uint8), layout.HASH_ENTRY_SIZE)
        return out

    def _records(self, slot: int, cur: int, head: int) -> tuple[np.ndarray | None, str]:
        """Records [cur, head) of a ring, each read as a seqlock: the ring is
        copied twice (with a fence between) and the records count only when
        their sequence numbers agree in both copies and rise from the ring's
        last one (a record from the ring's previous lap, or being written,
        does not)."""
        n, nrec = head - cur, self.geo.nrec
        base = self.geo.ring_off(slot) + _RING_HDR
        first = cur % nrec
        spans = [(first, min(n, nrec - first))]
        if spans[0][1] < n:
            spans.append((0, n - spans[0][1]))

        def copy():
            return np.concatenate([np.frombuffer(
                self.geo._read(base + a * layout.JOURNAL_REC_SIZE,
                               k * layout.JOURNAL_REC_SIZE), dtype=REC)
                for a, k in spans])

        a = copy()
        fence()
        # the names between the two copies: a record whose seq is the same in
        # both was not rewritten meanwhile, and neither were its names
        nm = self.geo.names
        ring_names = (np.concatenate([nm.read_ring(slot, p, k) for p, k in spans])
                      if nm is not None else None)
        fence()
        b = copy()
        seq = a["seq"]
        if not (np.array_equal(seq, b["seq"]) and seq[0] > self.last[slot]
                and (n == 1 or bool((np.diff(seq.astype(np.int64)) > 0).all()))):
            now, _ = self.geo.heads()
            return None, "overrun" if int(now[slot]) - cur > nrec else "torn"
        out = np.zeros(n, dtype=CHANGE)
        for f in REC.names:
            if f != "reserved":
                out[f] = a[f]
        out["node"] = slot
        if ring_names is not None:
            _set_names(out, ring_names, a["key_lo"], a["key_hi"], "")
        return out, ""

    def _table(self) -> np.ndarray:
        return np.frombuffer(self.geo._read(self.geo.table,
                                            self.geo.nslots * layout.HASH_ENTRY_SIZE),
                             dtype=_ENTRY)

    def _resync(self, reasons: tuple[str, ...]) -> Changes:
        """The table's published entries as STORED records (seq 0); cursors
        at the heads read before the table.  With block names: the table is
        read again after the names, and an entry that changed in between is
        left out (it was evicted or reused meanwhile: its records come in
        the next poll)."""
        heads, writers = self.geo.heads()
        self._mark(heads, writers)
        t = self._table()
        nm = self.geo.names
        if nm is not None:
            pub = np.flatnonzero((t["ctl"] & 0xFF) == layout.KV_PUBLISHED)
            par = t["parent"][pub].astype(np.int64)
            want = np.unique(np.concatenate([pub, par[(par > 0) & (par <= self.geo.nslots)] - 1]))
            fence()
            got = nm.names_at(want)
            fence()
            t2 = self._table()
            stable = ((t["ctl"] == t2["ctl"]) & (t["key_lo"] == t2["key_lo"])
                      & (t["key_hi"] == t2["key_hi"]) & (t["parent"] == t2["parent"]))
            idx = pub[stable[pub]]
        else:
            idx = np.flatnonzero((t["ctl"] & 0xFF) == layout.KV_PUBLISHED)
        e = t[idx]
        out = np.zeros(len(idx), dtype=CHANGE)
        for f in ("key_lo", "key_hi", "length", "ns", "tenant"):
            out[f] = e[f]
        par = e["parent"].astype(np.int64)
        ok = (par > 0) & (par <= self.geo.nslots)
        out["parent_lo"][ok] = t["key_lo"][par[ok] - 1]
        out["parent_hi"][ok] = t["key_hi"][par[ok] - 1]
        if nm is not None:
            # names of idx and of their parents: positions in `want` (sorted)
            _set_names(out, got[np.searchsorted(want, idx)], out["key_lo"], out["key_hi"], "")
            pidx = np.where(ok, par - 1, 0)
            pos = np.minimum(np.searchsorted(want, pidx), max(len(want) - 1, 0))
            found = ok & (want[pos] == pidx) if len(want) else ok & False
            _set_names(out, got[pos] if len(want) else np.zeros(len(out), dtype=names.NAME),
                       out["parent_lo"], out["parent_hi"], "parent_", found & stable[pidx])
        out["time_us"] = e["lru"]
        out["entry"] = idx + 1
        out["op"] = STORED
        slot = (e["owner"] & 0xFFFF).astype(np.int64) - 1
        out["node"] = np.where(slot >= 0, slot, 0xFFFF)
        self.stats["resyncs"] += 1
        self.stats["resync_entries"] += len(out)
        for r in reasons:
            self.stats[f"resync_{r}"] += 1
        return Changes(out, True, reasons)


def _set_names_at(out: np.ndarray, at: np.ndarray, rec: np.ndarray, key_lo, key_hi,
                  prefix: str) -> None:
    """_set_names for the records of `out` at positions `at`."""
    ok = names.valid(rec, key_lo, key_hi)
    out[prefix + "name_len"][at] = np.where(ok, rec["len"], 0)
    out[prefix + "name"][at[ok]] = rec["name"][ok]


def _set_names(out: np.ndarray, rec: np.ndarray, key_lo, key_hi, prefix: str,
               mask: np.ndarray | None = None) -> None:
    """The names of `rec` (NAME records) that name the blocks with these
    keys into out's `prefix`name fields (the others stay unnamed)."""
    ok = names.valid(rec, key_lo, key_hi)
    if mask is not None:
        ok &= mask
    out[prefix + "name_len"] = np.where(ok, rec["len"], 0)
    out[prefix + "name"][ok] = rec["name"][ok]


def report(pool) -> dict | None:
    """The journal's rings for `cxlkv inspect` / `kv stats` (None: a pool
    without the journal)."""
    if not has_journal(pool):
        return None
    g = _Geometry(pool)
    heads, writers = g.heads()
    return {"records_per_node": g.nrec,
            "appended": int(heads.sum()), "next_seq": g.next_seq(),
            "rings": [{"slot": s, "head": int(heads[s]),
                       "writer_slot": (int(writers[s]) & 0xFFFF) - 1,
                       "writer_epoch": int(writers[s]) >> 16}
                      for s in np.flatnonzero(heads).tolist()]}


# -- fsck ----------------------------------------------------------------------------------
def _problems(pool) -> tuple[bool, int, list[tuple[str, str, str]]]:
    """(header corrupt, next_seq a repair sets, [(code, where, message)])."""
    sb, m = pool.sb, pool.mapping
    kv_off, _ = sb.regions["kv"]
    g = layout.journal_geometry(sb.max_nodes, sb.hash_slots)
    hdr = kv_off + g["hdr_off"]
    m.invalidate(hdr, 128)
    h = layout.JournalHdrStruct.from_buffer_copy(m.read(hdr,
                                                        ctypes.sizeof(layout.JournalHdrStruct)))
    out = []
    corrupt = (h.magic != layout.JOURNAL_MAGIC or h.records_per_node != g["records_per_node"]
               or h.rec_size != layout.JOURNAL_REC_SIZE or h.ring_off != g["ring_off"]
               or h.ring_stride != g["ring_stride"] or h.max_nodes != sb.max_nodes)
    if corrupt:
        out.append(("kv-journal-header", "change journal", "its header is corrupt (magic or "
                                                           "geometry): readers refuse it"))
    top = 0
    for s in range(sb.max_nodes):
        ring = kv_off + g["ring_off"] + s * g["ring_stride"]
        m.invalidate(ring, 64)
        head, writer = m.load64(ring), m.load64(ring + 8)
        if writer and (writer & 0xFFFF) != s + 1:
            out.append(("kv-journal-ring", f"journal ring {s}",
                        f"names writer {writer:#x}, a token of another node slot"))
        if head:
            last = ring + _RING_HDR + ((head - 1) % g["records_per_node"]) * layout.JOURNAL_REC_SIZE
            m.invalidate(last, 8)
            top = max(top, m.load64(last))
    if not corrupt and h.next_seq <= top:
        out.append(("kv-journal-seq", "change journal", f"next sequence number {h.next_seq} "
                                                        f"is not above a record's ({top})"))
    return corrupt, max(h.next_seq if not corrupt else 0, top + 1, 1), out


def check(pool, rep) -> None:
    """fsck: the journal's header, ring writers and sequence numbers."""
    if not has_journal(pool):
        return
    for code, where, msg in _problems(pool)[2]:
        rep.error(code, where, msg)


def repair(pool, rep) -> None:
    """fsck --repair: rewrite a corrupt header or a sequence number that is
    not above every record's (readers resync on what they then see; ring
    heads are left alone, so their cursors stay meaningful)."""
    if not has_journal(pool):
        return
    corrupt, next_seq, found = _problems(pool)
    codes = {c for c, _, _ in found}
    if corrupt or "kv-journal-seq" in codes:
        sb, m = pool.sb, pool.mapping
        g = layout.journal_geometry(sb.max_nodes, sb.hash_slots)
        hdr = sb.regions["kv"][0] + g["hdr_off"]
        h = layout.JournalHdrStruct(magic=layout.JOURNAL_MAGIC,
                                    records_per_node=g["records_per_node"],
                               rec_size=layout.JOURNAL_REC_SIZE, ring_off=g["ring_off"],
                               ring_stride=g["ring_stride"], max_nodes=sb.max_nodes,
                               next_seq=next_seq)
        m.write(hdr, bytes(h))
        rep.did("kv-journal-header", "change journal",
                f"header rewritten (next sequence number {next_seq})")
