"""KV snapshot and restore: the published blocks of a pool to a directory and
back (warm restart after a power cycle, or moving a cache to another pool).

A snapshot directory holds three or four files (mode 0600, directory 0700 - they hold
every tenant's blocks and the pool's tenant secret):

* ``blocks.dat``  the block payloads, back to back, in the order they were copied;
* ``index.bin``   one INDEX record per block: pool key, parent (a position in
  the index, -1 for a chain root), namespace and tenant (positions in the
  manifest's lists), length, LRU stamp, offset in blocks.dat, xxh3-64 of the
  payload;
* ``names.bin``   (from a pool with block names) one name entry per index
  record (cxlkv.kv.names: the chain hash the block was keyed by and its token
  ids), so that a restored block keeps what KV events publish of it;
* ``manifest.json`` written last (so a snapshot without one is incomplete):
  format name and version, the namespaces (name, hash, block_tokens,
  block_bytes) and tenants (derived salt, quota), the source pool's tenant
  secret, sizes and xxh3-64 of the two other files, and an xxh64 of the
  manifest itself.

Snapshot is copy-on-read while nodes keep serving: the table is read once;
then, batch by batch, each block is pinned in this node's pin table (as a
reader does, so eviction passes it by), its entry re-read under the pin,
its payload copied, and its control word (state and version) read again; a
block that changed at any step is skipped and counted, never written torn.
A block whose parent was skipped is left out too (a chain is never cut).
A snapshot does not count as use: LRU stamps are left alone (touches still
in the nodes' rings count as "now").  A snapshot reads the whole table once and
does not follow the change journal (cxlkv.kv.journal): it needs every
published block, and it has no incremental form to feed.

Restore goes through the KV engine's own C insert and publish calls
(kv_insert, publish, kv_set_state), so the table, the namespace and tenant
counters and fsck stay consistent, and records the blocks it publishes in
the change journal as a store does.  It needs a pool with no KV block; blocks
go in most recently used first (a block after its ancestors), so a smaller
pool ends up with the most recent blocks that fit and whole chains; what did
not fit is counted.  Keys are carried as they are: they embed the tenants'
derived salts, which depend on the pool's tenant secret, so when the
snapshot holds salted tenants and the target's secret differs restore
carries the source's secret into the target's superblock - only when no
other node is attached - and refuses otherwise.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import xxhash

from cxlkv import errors
from cxlkv.errors import SnapshotError, SnapshotIncompatible
from cxlkv.kv import journal
from cxlkv.kv import names as block_names
from cxlkv.kv.area import ENTRY, Area, stamp
from cxlkv.kv.cache import set_tenant_secret
from cxlkv.kv.keys import namespace_digest
from cxlkv.pool import layout
from cxlkv.state import alloc
from cxlkv.state import nodes

FORMAT = "cxlkv-kv-snapshot"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.bin"
DATA = "blocks.dat"
NAMES = "names.bin"

INDEX_DTYPE = np.dtype([("key_lo", "<u8"), ("key_hi", "<u8"), ("parent", "<i8"),
                        ("ns", "<u2"), ("tenant", "<u2"), ("length", "<u4"), ("lru", "<u8"),
                        ("offset", "<u8"), ("xxh3", "<u8")])

#: bytes copied per batch (and at most this many blocks)
BATCH_BYTES = 64 << 20
BATCH_BLOCKS = 1024


def _manifest_sum(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return xxhash.xxh64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _file_sum(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def entry_controls(area: Area, idx: np.ndarray) -> np.ndarray:
    """Current control words of entries `idx`: read again after a copy, any
    change means the block changed under it (a seam: tests change them)."""
    m = area.m
    if m.flush_meta:
        out = np.empty(len(idx), dtype=np.uint64)
        for j, i in enumerate(idx):
            off = area.entry_off(int(i))
            m.invalidate(off, 8)
            out[j] = m.load64(off)
        return out
    v = m.view(area.table, area.nslots * layout.HASH_ENTRY_SIZE)
    try:
        arr = np.frombuffer(v, dtype="<u8").reshape(area.nslots, 8)
        out = arr[idx.astype(np.int64), 0].copy()
        del arr
    finally:
        v.release()
    return out


def _entries_at(area: Area, idx: np.ndarray):
    out = np.empty(len(idx), dtype=ENTRY)
    for j, i in enumerate(idx):
        out[j] = np.frombuffer(area._read(area.entry_off(int(i)), layout.HASH_ENTRY_SIZE),
                               dtype=ENTRY)[0]
    return out


def _ring_touched(area: Area) -> np.ndarray:
    """Entries touched by loads not yet applied to their LRU stamps (read only)."""
    out = []
    for n in nodes.read_nodes(area.pool):
        if n.state not in ("attached", "claimed"):
            continue
        raw = area._read(area.node_base(n.slot), 128)
        head = int.from_bytes(raw[0:8], "little")
        drained = int.from_bytes(raw[64:72], "little")
        k = min(head - drained, area.nring) if head > drained else 0
        if k:
            ring = np.frombuffer(area._read(area.ring_off(n.slot), area.nring * 8), dtype="<u8")
            idx = ring[np.arange(head - k, head) % area.nring]
            out.append(idx[(idx > 0) & (idx <= area.nslots)].astype(np.int64) - 1)
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


# -- snapshot ------------------------------------------------------------------------------
def snapshot(pool, dest, progress=None) -> dict:
    """Write the published KV blocks of `pool` (attached, as cxlkv.open_pool
    gives) to the new or empty directory `dest`.  progress(done, total) is
    called with bytes.  Returns a report."""
    if pool.node is None:
        raise errors.UsageError("snapshot needs an attached node: use cxlkv.open_pool()")
    dest = Path(dest)
    if dest.exists():
        if not dest.is_dir():
            raise errors.RefusedError(f"{dest} exists and is not a directory", path=str(dest))
        if any(dest.iterdir()):
            raise errors.RefusedError(f"{dest} is not empty: a snapshot goes into a new or empty "
                                 "directory", path=str(dest),
                                 hint="choose another directory or remove this one")
    else:
        dest.mkdir(parents=True, mode=0o700)
    os.chmod(dest, 0o700)
    t0 = time.monotonic()
    area = Area(pool)
    m = area.m
    nm = block_names.Names.of(pool)
    name_rows: dict[int, bytes] = {}     # entry -> its name record, read under the pin
    t = area.entries()
    now = stamp()
    st = t["ctl"] & 0xFF
    cand = np.flatnonzero(st == layout.KV_PUBLISHED)
    lru = t["lru"].copy()
    touched = _ring_touched(area)
    if len(touched):
        lru[touched] = np.maximum(lru[touched], now)
    nsrec = area.ns_records()
    trec = area.tenant_records()
    # group by length (one read_blocks call per batch), table order inside
    cand = cand[np.argsort(t["length"][cand], kind="stable")]
    total = int(t["length"][cand].sum())
    pins_off = area.pins_off(pool.node.slot)
    batch_n = max(1, min(BATCH_BLOCKS, area.npins // 2))
    rows = []            # (slot, entry fields...) per copied block
    changed = 0
    done_bytes = 0
    hint = 0
    data_path = dest / DATA
    fd = os.open(data_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    off = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as out:
            i = 0
            while i < len(cand):
                ln = int(t["length"][cand[i]])
                j = i
                lim = max(1, min(batch_n, BATCH_BYTES // max(1, ln)))
                while j < len(cand) and j - i < lim and int(t["length"][cand[j]]) == ln:
                    j += 1
                idx = cand[i:j].astype(np.uint64)
                ctl0 = t["ctl"][cand[i:j]].astype(np.uint64)
                i = j
                # pin what is still as the table said; a changed entry stops
                # kv_pin: skip it and go on after it
                ok_idx, ok_ctl, recs = [], [], []
                k = 0
                while k < len(idx):
                    rec = np.empty(len(idx) - k, dtype=np.uint64)
                    n, hint, full = m.kv_pin(area.table, area.nslots, pins_off, area.npins,
                                             hint, idx[k:], ctl0[k:], rec)
                    ok_idx.append(idx[k:k + n])
                    ok_ctl.append(ctl0[k:k + n])
                    recs.append(rec[:n])
                    k += n
                    if full:
                        raise errors.RefusedError("this node's pin table is full", path=pool.path)
                    if k < len(idx):
                        changed += 1          # evicted or replaced since the table was read
                        k += 1
                pidx = np.concatenate(ok_idx)
                pctl = np.concatenate(ok_ctl)
                prec = np.concatenate(recs)
                try:
                    if not len(pidx):
                        continue
                    ent = _entries_at(area, pidx)          # stable while pinned
                    good = (ent["ctl"] == pctl) & (ent["length"] == ln)
                    pay = ent["payload"].astype(np.uint64)
                    buf = np.empty(len(pidx) * ln, dtype=np.uint8)
                    if m.flush_meta:
                        for p in pay:
                            m.invalidate(int(p), ln)
                    m.read_blocks(pay, buf, ln)
                    nrec = nm.read_at(pidx) if nm is not None else None
                    good &= entry_controls(area, pidx) == pctl       # unchanged during the copy
                finally:
                    m.kv_unpin(pins_off, area.npins, prec)
                changed += int((~good).sum())
                for q in np.flatnonzero(good):
                    blk = buf[q * ln:(q + 1) * ln]
                    e = ent[q]
                    out.write(blk)
                    rows.append((int(pidx[q]), int(e["key_lo"]), int(e["key_hi"]),
                                 int(e["parent"]), int(e["ns"]), int(e["tenant"]), ln,
                                 int(lru[int(pidx[q])]), off, xxhash.xxh3_64_intdigest(blk)))
                    if nrec is not None:
                        name_rows[int(pidx[q])] = nrec[q].tobytes()
                    off += ln
                done_bytes += len(idx) * ln
                if progress:
                    progress(done_bytes, total)
            os.fsync(out.fileno())
        # parents by position; a block whose parent was not copied goes
        # (with its descendants): never a child without its parent
        slot_pos = {r[0]: p for p, r in enumerate(rows)}
        parent_pos = [slot_pos.get(r[3] - 1, -2) if r[3] else -1 for r in rows]
        depth = [None] * len(rows)          # None: not known; -1: dropped
        for p in range(len(rows)):
            path, seen = [], set()
            while depth[p] is None:
                path.append(p)
                seen.add(p)
                q = parent_pos[p]
                if q < 0 or q in seen:      # a root, a lost parent (or a corrupt cycle)
                    d = 0 if q == -1 else -1
                    break
                p = q
            else:
                d = depth[p] + 1 if depth[p] >= 0 else -1
            for x in reversed(path):
                depth[x] = d
                d = d + 1 if d >= 0 else -1
        orphans = depth.count(-1)
        order = sorted((p for p in range(len(rows)) if depth[p] >= 0), key=lambda p: depth[p])
        newpos = {p: k for k, p in enumerate(order)}
        used_ns = sorted({rows[p][4] for p in order})
        used_t = sorted({rows[p][5] for p in order})
        ns_map = {n: i for i, n in enumerate(used_ns)}
        t_map = {n: i for i, n in enumerate(used_t)}
        idx_arr = np.zeros(len(order), dtype=INDEX_DTYPE)
        for k, p in enumerate(order):
            r = rows[p]
            q = parent_pos[p]
            idx_arr[k] = (r[1], r[2], newpos[q] if q >= 0 else -1, ns_map[r[4]],
                          t_map[r[5]], r[6], r[7], r[8], r[9])
        ipath = dest / INDEX
        fd = os.open(ipath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(idx_arr.tobytes())
            f.flush()
            os.fsync(f.fileno())
        names_doc = None
        if nm is not None:
            npath = dest / NAMES
            raw = b"".join(name_rows[rows[p][0]] for p in order)
            fd = os.open(npath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            names_doc = {"file": NAMES, "size": len(raw), "xxh3_64": _file_sum(npath),
                         "name_tokens": nm.name_tokens}
        namespaces = [{"name": nsrec[n].name.decode("utf-8", "replace"),
                       "hash": layout.KV_HASH_NAMES.get(nsrec[n].hash_kind,
                                                        str(nsrec[n].hash_kind)),
                       "block_tokens": nsrec[n].block_tokens,
                       "block_bytes": nsrec[n].block_bytes,
                       "digest": bytes(nsrec[n].digest).hex()} for n in used_ns]
        tenants = [{"salt": bytes(trec[x].salt).hex(), "quota": trec[x].quota}
                   for x in used_t]
        nbytes = int(idx_arr["length"].sum())
        doc = {
            "format": FORMAT, "version": VERSION, "created_us": now,
            "source": {"pool": pool.path, "uuid": str(pool.sb.uuid),
                       "pool_size": pool.sb.pool_size, "hash_slots": area.nslots},
            "tenant_secret": bytes(pool.sb.tenant_secret).hex(),
            "namespaces": namespaces, "tenants": tenants,
            "blocks": len(idx_arr), "bytes": nbytes,
            "skipped_changed": changed, "skipped_orphans": orphans,
            "data": {"file": DATA, "size": off},
            "index": {"file": INDEX, "size": idx_arr.nbytes, "xxh3_64": _file_sum(ipath)},
        }
        if names_doc is not None:
            doc["names"] = names_doc
        doc["checksum"] = _manifest_sum(doc)
        tmp = dest / (MANIFEST + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest / MANIFEST)
    except BaseException:
        for name in (DATA, INDEX, NAMES, MANIFEST + ".tmp"):
            try:
                (dest / name).unlink()
            except FileNotFoundError:
                pass
        raise
    return {"pool": pool.path, "to": str(dest), "format_version": VERSION,
            "blocks": len(idx_arr), "bytes": nbytes, "namespaces": len(namespaces),
            "tenants": len(tenants), "skipped_changed": changed, "skipped_orphans": orphans,
            "seconds": round(time.monotonic() - t0, 3)}


# -- reading a snapshot ----------------------------------------------------------------------
def read_manifest(src) -> dict:
    """The manifest of snapshot directory `src`, checked (format, version, checksum)."""
    src = Path(src)
    if not src.is_dir():
        raise errors.PoolNotFound(f"{src}: no such snapshot directory", path=str(src))
    mp = src / MANIFEST
    if not mp.exists():
        raise SnapshotError(f"{src}: no {MANIFEST}: not a snapshot, or an incomplete one "
                            "(the snapshot was interrupted)", path=str(src))
    try:
        doc = json.loads(mp.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{mp}: unreadable manifest ({e})", path=str(mp)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError(f"{mp}: not a cxlkv KV snapshot manifest", path=str(mp))
    v = doc.get("version")
    if not isinstance(v, int) or v < 1:
        raise SnapshotError(f"{mp}: invalid format version {v!r}", path=str(mp))
    if v > VERSION:
        raise SnapshotIncompatible(
            f"{src}: snapshot format version {v} is newer than this cxlkv understands "
            f"(version {VERSION})", path=str(src),
            hint="restore it with the cxlkv release that wrote it, or a newer one")
    if doc.get("checksum") != _manifest_sum(doc):
        raise SnapshotError(f"{mp}: manifest checksum mismatch (the file is corrupt)",
                            path=str(mp))
    return doc


def read_index(src, doc: dict) -> np.ndarray:
    src = Path(src)
    ip = src / doc["index"]["file"]
    dp = src / doc["data"]["file"]
    for p, want in ((ip, doc["index"]["size"]), (dp, doc["data"]["size"])):
        if not p.exists():
            raise SnapshotError(f"{p}: missing", path=str(p))
        if p.stat().st_size != want:
            raise SnapshotError(f"{p}: {p.stat().st_size} bytes, the manifest says {want} "
                                "(truncated or replaced)", path=str(p))
    if _file_sum(ip) != doc["index"]["xxh3_64"]:
        raise SnapshotError(f"{ip}: checksum mismatch (the index is corrupt)", path=str(ip))
    idx = np.fromfile(ip, dtype=INDEX_DTYPE)
    n = len(idx)
    bad = ((idx["parent"] < -1) | (idx["parent"] >= np.arange(n))
           | (idx["ns"] >= len(doc["namespaces"])) | (idx["tenant"] >= len(doc["tenants"]))
           | (idx["offset"] + idx["length"] > doc["data"]["size"]))
    if bad.any():
        raise SnapshotError(f"{ip}: {int(bad.sum())} invalid records", path=str(ip))
    return idx


def read_names(src, doc: dict, idx: np.ndarray) -> np.ndarray | None:
    """The block names of a snapshot (one per index record), or None for a
    snapshot without them (of a pool without names, or by an older cxlkv)."""
    d = doc.get("names")
    if d is None:
        return None
    p = Path(src) / d["file"]
    t = d.get("name_tokens")
    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= layout.NAME_TOKENS_MAX:
        raise SnapshotError(f"{p}: the manifest's name_tokens {t!r} is invalid", path=str(p))
    dtype = block_names.entry_dtype(t)
    want = len(idx) * dtype.itemsize
    if not p.exists():
        raise SnapshotError(f"{p}: missing", path=str(p))
    if p.stat().st_size != d["size"] or d["size"] != want:
        raise SnapshotError(f"{p}: {p.stat().st_size} bytes, expected {want} (one name per "
                            "block; truncated or replaced)", path=str(p))
    if _file_sum(p) != d["xxh3_64"]:
        raise SnapshotError(f"{p}: checksum mismatch (the names are corrupt)", path=str(p))
    return np.fromfile(p, dtype=dtype)


def restore_order(idx: np.ndarray) -> np.ndarray:
    """Positions in restore order: most recently used first, every block after
    its ancestors (its key: the newest stamp in its subtree, so a parent never
    sorts after a child; ties in depth-first order, so chains stay together)."""
    n = len(idx)
    par = idx["parent"].astype(np.int64)
    eff = idx["lru"].astype(np.int64).copy()
    for p in range(n - 1, -1, -1):                 # parents precede children in the index
        q = par[p]
        if q >= 0 and eff[p] > eff[q]:
            eff[q] = eff[p]
    # depth-first preorder
    kids: dict[int, list[int]] = {}
    roots = []
    for p in range(n):
        (kids.setdefault(int(par[p]), []) if par[p] >= 0 else roots).append(p)
    pre = np.empty(n, dtype=np.int64)
    stack = list(reversed(roots))
    k = 0
    while stack:
        p = stack.pop()
        pre[p] = k
        k += 1
        stack.extend(reversed(kids.get(p, ())))
    return np.lexsort((pre, -eff))


# -- restore ------------------------------------------------------------------------------
def _ns_index(area: Area, ns: dict) -> int:
    """The target's record for a snapshot namespace, made if needed (lock held)."""

    name = ns["name"].encode("utf-8")
    kind = layout.KV_HASH_CODES.get(ns["hash"])
    if kind is None:
        raise SnapshotError(f"namespace {ns['name']!r}: unknown hash {ns['hash']!r}")
    if namespace_digest(ns["name"]).hex() != ns["digest"]:
        raise SnapshotError(f"namespace {ns['name']!r}: digest does not match its name")
    free = -1
    for i, r in enumerate(area.ns_records()):
        if r.state == layout.KV_REC_ACTIVE and r.name == name:
            if (r.block_bytes, r.block_tokens, r.hash_kind) != (
                    ns["block_bytes"], ns["block_tokens"], kind):
                raise errors.RefusedError(
                    f"namespace {ns['name']!r} exists in the target with other parameters "
                    f"(block_bytes={r.block_bytes}, block_tokens={r.block_tokens})",
                    hint="drop it first (cxlkv kv drop --namespace NAME)")
            return i
        if free < 0 and r.state == layout.KV_REC_FREE:
            free = i
    if free < 0:
        raise errors.RefusedError(f"all {area.max_ns} KV namespaces of the target are in use")
    r = layout.KVNsStruct()
    r.name = name
    r.state = layout.KV_REC_ACTIVE
    r.hash_kind = kind
    r.block_tokens = ns["block_tokens"]
    r.block_bytes = ns["block_bytes"]
    r.digest[:] = bytes.fromhex(ns["digest"])
    area.write_record(area.ns_off(free), r)
    area.m.zero(area.stats_off(area.pool.node.slot, free), layout.KV_NSTATS * 8)
    return free


def _tenant_index(area: Area, ten: dict) -> int:
    salt = bytes.fromhex(ten["salt"])
    if salt == bytes(16):
        return 0
    free = -1
    for i, r in enumerate(area.tenant_records()):
        if i and r.state == layout.KV_REC_ACTIVE and bytes(r.salt) == salt:
            return i
        if i and free < 0 and r.state == layout.KV_REC_FREE:
            free = i
    if free < 0:
        raise errors.RefusedError(f"all {area.max_tenants - 1} tenant records of the target "
                                  "are in use")
    r = layout.KVTenantStruct()
    r.salt[:] = salt
    r.state = layout.KV_REC_ACTIVE
    r.quota = int(ten.get("quota", 0))
    area.write_record(area.tenant_off(free), r)
    return free


def _prepare_target(pool, area: Area, doc: dict) -> bool:
    """Refuse a target holding KV blocks; carry the tenant secret.  Returns
    whether the secret was carried (pool lock held)."""
    h = area.header()
    if h.live:
        raise errors.RefusedError(
            f"{pool.path} holds {h.live} KV entries: restore goes into a pool without KV "
            "blocks", path=pool.path,
            hint="restore into a freshly formatted pool (cxlkv format --force), or drop the "
                 "namespaces first (cxlkv kv drop)")
    secret = bytes.fromhex(doc["tenant_secret"])
    salted = any(t["salt"] != "00" * 16 for t in doc["tenants"])
    if not salted or bytes(pool.sb.tenant_secret) == secret:
        return False

    return set_tenant_secret(pool, secret,
                             why="the snapshot's tenants were keyed under another pool "
                                 "secret, and this pool's secret")


def restore(pool, src, progress=None) -> dict:
    """Restore snapshot directory `src` into `pool` (attached, no KV blocks).
    Returns a report: restored, left_out (no room), corrupt (checksum
    mismatch; their descendants are counted in corrupt_descendants)."""
    if pool.node is None:
        raise errors.UsageError("restore needs an attached node: use cxlkv.open_pool()")
    t0 = time.monotonic()
    src = Path(src)
    doc = read_manifest(src)
    idx = read_index(src, doc)
    names = read_names(src, doc, idx)
    nm = block_names.Names.of(pool) if names is not None else None
    if nm is not None:
        names = block_names.convert(names, nm)
    area = Area(pool)
    n = len(idx)
    with pool.lock():
        pool.node.guard()
        carried = _prepare_target(pool, area, doc)
        ns_of = [_ns_index(area, ns) for ns in doc["namespaces"]]
        t_of = [_tenant_index(area, t) for t in doc["tenants"]]
    order = restore_order(idx)
    data = open(src / doc["data"]["file"], "rb", buffering=0)
    buf = np.empty(0, dtype=np.uint8)            # one buffer, reused by every batch
    slot_of = np.full(n, -1, dtype=np.int64)     # target entry of each restored block
    # 0 not reached (no room), 1 restored, 2 corrupt, 3 under a corrupt block,
    # 4 present already (another node stored it), 5 another node was storing it
    state = np.zeros(n, dtype=np.int8)
    token = pool.node.owner_token
    total = int(idx["length"].sum())
    done_bytes = 0
    stop = None
    pos = 0
    keys_all = np.empty((n, 16), dtype=np.uint8)
    keys_all[:, :8] = idx["key_lo"].astype("<u8").view(np.uint8).reshape(n, 8)
    keys_all[:, 8:] = idx["key_hi"].astype("<u8").view(np.uint8).reshape(n, 8)
    try:
        while pos < n and stop is None:
            # a batch: consecutive blocks (in restore order) of one length
            ln = int(idx["length"][order[pos]])
            lim = max(1, min(BATCH_BLOCKS, BATCH_BYTES // max(1, ln)))
            end = pos
            while end < n and end - pos < lim and int(idx["length"][order[end]]) == ln:
                end += 1
            batch = order[pos:end]
            pos = end
            # verify; a block whose parent is not restored (corrupt) stays out
            if len(buf) < len(batch) * ln:
                buf = np.empty(len(batch) * ln, dtype=np.uint8)
            src_buf = buf[:len(batch) * ln]
            keep: list[int] = []
            kept = set()
            for b in batch.tolist():
                q = int(idx["parent"][b])
                if q >= 0 and state[q] not in (1, 4) and q not in kept:
                    state[b] = 3
                    continue
                blk = src_buf[len(keep) * ln:(len(keep) + 1) * ln]
                if os.preadv(data.fileno(), [blk], int(idx["offset"][b])) != ln \
                        or xxhash.xxh3_64_intdigest(blk) != int(idx["xxh3"][b]):
                    state[b] = 2
                    continue
                keep.append(b)
                kept.add(b)
            keep_a = np.array(keep, dtype=np.int64)
            k = 0
            while k < len(keep_a) and stop is None:
                done, stop = _insert(pool, area, idx, keep_a[k:], src_buf[k * ln:], ln, ns_of,
                                     t_of, keys_all, slot_of, state, token, nm, names)
                k += done
            done_bytes += len(batch) * ln
            if progress:
                progress(done_bytes, total)
    finally:
        data.close()
    if progress:
        progress(total, total)
    restored = state == 1
    return {"pool": pool.path, "from": str(src), "format_version": doc["version"],
            "blocks": n, "restored": int(restored.sum()),
            "restored_bytes": int(idx["length"][restored].sum()),
            "left_out": int((state == 0).sum()), "left_out_bytes":
                int(idx["length"][state == 0].sum()), "left_out_reason": stop,
            "corrupt": int((state == 2).sum()), "corrupt_descendants": int((state == 3).sum()),
            "present": int((state == 4).sum()), "busy": int((state == 5).sum()),
            "tenant_secret_carried": carried, "seconds": round(time.monotonic() - t0, 3)}


def _insert(pool, area, idx, keep_a, src_buf, ln, ns_of, t_of, keys_all, slot_of, state,
            token, nm=None, names=None):
    """Insert and publish verified blocks `keep_a` (restore order, parents
    first) whose payloads are rows of src_buf - all, or a leading part when
    the pool cannot take all; with the target's block names `nm`, the
    snapshot's `names` are written for them.  Returns (blocks dealt with,
    why restore must stop or None)."""
    m = area.m
    stop = None
    want = len(keep_a)
    pay = None
    while want:                          # all at once, or fewer when the pool is full
        try:
            pay = pool.alloc_batch(ln, want, zero=alloc.slot_size_for(pool, ln) != ln)
            break
        except alloc.PoolFullError:
            want //= 2
    if pay is None:
        return 0, "pool full"
    keep_a = keep_a[:want]
    slots = np.zeros(want, dtype=np.uint64)
    status = np.full(want, 9, dtype=np.uint64)      # 0 new, 1 present, 9 not inserted
    used_total = 0
    published = False
    try:
        with pool.lock():
            pool.node.guard()
            s = 0
            while s < want:
                # a segment: a chain (each block the child of the one before)
                e = s + 1
                while e < want and idx["parent"][keep_a[e]] == keep_a[e - 1]:
                    e += 1
                q = int(idx["parent"][keep_a[s]])
                if q >= 0 and slot_of[q] < 0:
                    state[keep_a[s:e]] = 5              # its parent was another node's
                    s = e
                    continue
                done, used, full = m.kv_insert(
                    area.table, area.nslots, area.hdr, area.max_used,
                    ns_of[int(idx["ns"][keep_a[s]])], t_of[int(idx["tenant"][keep_a[s]])], ln,
                    token, keys_all[keep_a[s:e]], int(slot_of[q]) + 1 if q >= 0 else 0,
                    pay[used_total:], slots[s:e], status[s:e])
                used_total += used
                slot_of[keep_a[s:s + done]] = slots[s:s + done].astype(np.int64)
                state[keep_a[s:s + done][status[s:s + done] == 1]] = 4
                if done < e - s:
                    if full == 4:                       # stalled: prove us fresh, go on
                        pool.node.guard()
                        s += done
                        continue
                    if full in (1, 3):
                        stop = "hash table full"
                        break
                    state[keep_a[s + done:e]] = 5      # another node is storing it
                s = e
            new = np.flatnonzero(status == 0)
            _account(area, idx, keep_a[new], ns_of, t_of)
        if used_total < len(pay):
            pool.free_batch(pay[used_total:], zero=False)
            pay = pay[:used_total]
        if len(new):
            # payload j went to the j-th new block, in order
            srcs = src_buf[:want * ln] if len(new) == want else \
                np.ascontiguousarray(src_buf.reshape(-1, ln)[new]).reshape(-1)
            pool.node.write_blocks(pay, srcs, ln)
            if nm is not None:
                nm.write_records(pool.node, slots[new], names[keep_a[new]])
        with pool.lock():
            pool.node.guard()
            pool.publish(pay)
            sl = slots[new]
            m.kv_set_state(area.table, area.nslots, sl, layout.KV_PENDING, layout.KV_PUBLISHED,
                           token,
                           stamp())
            lr = idx["lru"][keep_a[new]]
            for v in np.unique(lr):
                if v:
                    m.kv_stamp(area.table, area.nslots, sl[lr == v], int(v))
            published = True
            area.journal.append(journal.STORED, sl)       # journal readers learn of them
    except BaseException:
        if not published:
            try:
                with pool.lock():
                    for s_ in slots[status == 0]:
                        m.kv_remove(area.table, area.nslots, area.hdr, int(s_))
                    area.recount()
                bad = pool.allocator.retired_mask(pay)    # poisoned: never written
                pool.free_batch(pay[~bad], zero=True)
                if bad.any():
                    pool.free_batch(pay[bad], zero=False)
            except Exception:                   # pragma: no cover - recovery redoes it
                pass
        raise
    state[keep_a[new]] = 1
    return want, stop


def _account(area: Area, idx, blocks, ns_of, t_of) -> None:
    """Namespace and tenant usage for newly inserted blocks (lock held)."""
    if not len(blocks):
        return
    for ns in np.unique(idx["ns"][blocks]):
        sel = blocks[idx["ns"][blocks] == ns]
        i = ns_of[int(ns)]
        r = area.ns_record(i)
        r.blocks += len(sel)
        area.write_record(area.ns_off(i), r)
    for tn in np.unique(idx["tenant"][blocks]):
        sel = blocks[idx["tenant"][blocks] == tn]
        i = t_of[int(tn)]
        r = area.tenant_record(i)
        r.blocks += len(sel)
        r.used += int(area.slot_sizes(idx["length"][sel]).sum())
        area.write_record(area.tenant_off(i), r)
