"""Read-only consistency check of a pool's shared state (`cxlkv fsck`).

Checks the superblock copies, the node table, the lock area, the chunk
bitmap against the slab descriptors, every slab's slot bitmaps and
ownership, and the KV hash table (cxlkv.kv.check).  It maps the pool read-only and writes nothing.  Run it on a
quiescent pool: nodes working while it reads can show transient states
(a slab half created) that are not damage.

Each problem is a Finding with a stable `code` (for scripts) and a message.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cxlkv.errors import MetadataCorrupt
from cxlkv.kv.check import check_kv  # the KV layer's own check (layered above state)
from cxlkv.pool import layout
from cxlkv.state import alloc
from cxlkv.state import locks
from cxlkv.state import nodes


@dataclass
class Finding:
    code: str
    where: str
    message: str
    severity: str = "error"          # error | warning

    def to_json(self) -> dict:
        return {"code": self.code, "where": self.where, "message": self.message,
                "severity": self.severity}


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def error(self, code: str, where: str, message: str) -> None:
        self.findings.append(Finding(code, where, message))

    def warn(self, code: str, where: str, message: str) -> None:
        self.findings.append(Finding(code, where, message, "warning"))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def clean(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        return {"clean": self.clean, "errors": len(self.errors),
                "warnings": len(self.findings) - len(self.errors),
                "findings": [f.to_json() for f in self.findings], "stats": self.stats}


def check(pool) -> Report:
    rep = Report()
    for copy, problem in pool.superblock_problems.items():
        rep.error("superblock-copy", f"superblock {copy}", problem)
    live_tokens = _check_nodes(pool, rep)
    _check_locks(pool, rep, live_tokens)
    _check_allocator(pool, rep, live_tokens)
    _check_retired(pool, rep)

    check_kv(pool, rep, live_tokens)
    return rep


def _check_nodes(pool, rep: Report) -> set[int]:
    """Returns the owner tokens of attached nodes."""
    tokens, states = set(), {}
    me, pidns = nodes.local_boot_id(), nodes.local_pidns()
    for n in nodes.read_nodes(pool, include_free=True):
        states[n.state] = states.get(n.state, 0) + 1
        where = f"node {n.slot}"
        if n.state.startswith("unknown"):
            rep.error("node-state", where, f"invalid state word {n.control:#x}")
        elif n.state == "fenced":
            # quarantined: what it holds is its own until the reaper releases it
            # (fsck --repair recovers it at once)
            rep.warn("node-quarantined", where,
                     f"{n.describe()} is fenced and quarantined"
                     + (" (it acknowledged its fencing)" if n.acknowledged else "")
                     + ": what it held is reused once it is proven gone, acknowledges, or "
                       f"the grace of {pool.sb.quarantine_grace_ms / 1000:g} s passes")
            tokens.add((n.slot + 1) | n.epoch << 16)
        elif n.state == "claimed":
            rep.warn("node-claiming", where, "slot is being claimed (or its claimant died: "
                                            "it is reclaimed after a lease)")
        elif n.state == "attached":
            if n.epoch == 0:
                rep.error("node-epoch", where, "attached with epoch 0")
            elif n.same_process_space(me, pidns) and not nodes.local_process_alive(
                    n.pid, n.start_time_ns):
                rep.error("node-dead", where, f"{n.describe()} is gone from this host but was "
                                             "not reaped")
            else:
                tokens.add((n.slot + 1) | n.epoch << 16)
    rep.stats["nodes"] = states
    return tokens


def _check_locks(pool, rep: Report, live: set[int]) -> None:
    hdr_off, _ = locks.lock_offsets(pool)
    m = pool.mapping
    m.invalidate(hdr_off, 128)
    h = layout.LockHdrStruct.from_buffer_copy(m.read(hdr_off, layout.LOCK_HDR_SIZE))
    if pool.sb.sync == "cas":
        if h.now_serving > h.next_ticket:
            rep.error("lock-tickets", "lock", f"now serving {h.now_serving} is past the next "
                                              f"ticket {h.next_ticket}")
        if h.owner and h.owner not in live:
            rep.error("lock-owner", "lock", f"held by token {h.owner:#x}, which is not an "
                                            "attached node")
    ents = locks.read_entries(pool)
    if pool.sb.sync == "cas":
        queued = np.isin(ents["state"], (layout.LOCK_WAITING, layout.LOCK_LOCKED)).any()
        if h.next_ticket > h.now_serving and not live and not queued:
            rep.error("lock-tickets", "lock", f"{h.next_ticket - h.now_serving} ticket(s) taken "
                      "by nodes that are gone: the next lock waits a lease for each")
    for slot in np.flatnonzero(ents["state"] != layout.LOCK_IDLE):
        st, ep = int(ents["state"][slot]), int(ents["epoch"][slot])
        where = f"lock entry {slot}"
        if st not in (layout.LOCK_WAITING, layout.LOCK_LOCKED, layout.LOCK_ABANDONED):
            rep.error("lock-entry-state", where, f"invalid state {st}")
        elif st != layout.LOCK_ABANDONED and ((int(slot) + 1) | ep << 16) not in live:
            rep.error("lock-entry-dead", where,
                      f"{'holds' if st == layout.LOCK_LOCKED else 'waits for'}"
                                                " the lock but its node is not attached")
    rep.stats["lock"] = {"acquisitions": h.acquisitions, "next_ticket": h.next_ticket,
                         "now_serving": h.now_serving}


def _check_allocator(pool, rep: Report, live: set[int]) -> None:
    data_off, chunk, nchunks, _ = alloc.geometry(pool)
    d = alloc.descriptors(pool)
    try:
        bits = alloc.bitmap(pool)
        try:
            retired = set(alloc.retired_chunks(pool).tolist())
        except MetadataCorrupt:
            retired = set()                  # reported by _check_retired
        kind = d["control"] & 0xFF
        covered = np.zeros(nchunks, dtype=bool)
        slabs = slots_used = slots_pub = 0
        used_bytes = 0
        for i in range(nchunks):
            k = int(kind[i])
            where = f"chunk {i}"
            if k not in (layout.CHUNK_FREE, layout.CHUNK_HEAD, layout.CHUNK_TAIL,
                         layout.CHUNK_RELEASING):
                rep.error("chunk-kind", where, f"invalid descriptor kind {k}")
                continue
            if k == layout.CHUNK_FREE:
                if bits[i] and i not in retired:
                    rep.error("chunk-leaked", where, "marked used in the bitmap but in no slab")
                continue
            if k == layout.CHUNK_TAIL:
                head = int(d["control"][i]) >> 8
                if not covered[i]:
                    rep.error("chunk-orphan-tail", where, f"tail of slab {head}, which does not "
                                                          "cover it")
                continue
            # a slab head (or one being released)
            ss, ns, nc = int(d["slot_size"][i]), int(d["nslots"][i]), int(d["nchunks"][i])
            if k == layout.CHUNK_RELEASING:
                rep.error("slab-releasing", where, "slab left half released")
            if not (ss and ss % 64 == 0 and 0 < ns <= layout.SLAB_MAX_SLOTS and 0 < nc
                    and i + nc <= nchunks and ns * ss <= nc * chunk):
                rep.error("slab-geometry", where, f"bad geometry: slot {ss} x {ns} in {nc} chunks")
                continue
            slabs += 1
            for j in range(i, i + nc):
                if covered[j]:
                    rep.error("slab-overlap", f"chunk {j}", "belongs to two slabs")
                covered[j] = True
                if j > i and not (int(kind[j]) == layout.CHUNK_TAIL
                                  and int(d["control"][j]) >> 8 == i):
                    rep.error("slab-tail", f"chunk {j}", f"should be a tail of slab {i}")
                if not bits[j]:
                    rep.error("slab-bitmap", f"chunk {j}", f"in slab {i} but free in the bitmap")
            a = [int(x) for x in d["alloc_bits"][i]]
            p = [int(x) for x in d["pub_bits"][i]]
            dd = [int(x) for x in d["dirty_bits"][i]]
            valid = [(1 << min(64, max(0, ns - 64 * w))) - 1 for w in range(8)]
            if any(a[w] & ~valid[w] for w in range(8)):
                rep.error("slab-bits", where, "allocated bits past the last slot")
            if any(p[w] & ~a[w] for w in range(8)):
                rep.error("slab-pub", where, "published slots that are not allocated")
            if any(dd[w] & a[w] for w in range(8)):
                rep.error("slab-dirty", where, "a free was interrupted (allocated slots marked "
                                               "dirty)")
            n_alloc = sum(x.bit_count() for x in a)
            n_pub = sum(x.bit_count() for x in p)
            owner = int(d["owner"][i])
            if owner == alloc.RETIRED_OWNER:
                rep.warn("slab-retired", where,
                         f"holds a retired chunk: no new slots; released once its "
                         f"{n_alloc} allocated slot(s) are freed")
            elif owner and owner not in live:
                reserved = n_alloc - n_pub
                rep.error("slab-dead-owner", where,
                          f"owned by token {owner:#x}, not an attached node"
                          + (f"; {reserved} unpublished slot(s) leaked" if reserved else ""))
            slots_used += n_alloc
            slots_pub += n_pub
            used_bytes += n_alloc * ss
        rep.stats["allocator"] = {"chunks": nchunks, "chunks_used": int(bits.sum()),
                                  "slabs": slabs, "slots_allocated": slots_used,
                                  "slots_published": slots_pub, "bytes_allocated": used_bytes}
    finally:
        del d


def _check_retired(pool, rep: Report) -> None:
    """The retired-chunk list (incompat BADCHUNKS): readable, its chunks in
    range and kept out of the allocator (bitmap bit set); a metadata hit is an
    error (the pool needs re-formatting, cxlkv-runbook(7))."""
    try:
        summary = alloc.retired_summary(pool)
    except MetadataCorrupt as e:
        rep.error("retired-list", "lock header", str(e))
        return
    _, chunk, nchunks, _ = alloc.geometry(pool)
    bits = alloc.bitmap(pool)
    for e in summary["entries"]:
        c = e["chunk"]
        if c is None:
            rep.error("retired-metadata", f"offset {e['offset']:#x}",
                      f"{e['reason']} in the {e['region']} region (metadata): snapshot what is "
                      "readable and re-format (cxlkv-runbook(7), 'Poison and media errors')")
        elif c >= nchunks:
            rep.error("retired-range", f"chunk {c}", f"retired chunk beyond the {nchunks} chunks")
        elif not bits[c]:
            rep.error("retired-free", f"chunk {c}",
                      "retired but free in the bitmap: the allocator may hand it out")
    if summary["entries"] and not pool.sb.incompat & layout.INCOMPAT_BADCHUNKS:
        rep.error("retired-feature", "superblock",
                  "retired chunks listed but the badchunks incompat bit is not set: "
                  "an older cxlkv would reuse them")
    rep.stats["retired"] = {k: summary[k] for k in ("chunks", "bytes", "metadata_hits")}
