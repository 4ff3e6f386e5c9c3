"""The KV cache's side of the cross-rack remote tier (cxlkv.remote: a Redis
Cluster / Valkey the racks already run).

    from cxlkv.kv.tiers import remote
    remote.enable(pool, RemoteConfig.from_toml("/etc/cxlkv/serve.toml"))
    kv = pool.kv(model=..., block_bytes=..., remote_read=True)   # opt-in per namespace
    kv.match(tokens)     # pool, spill, then the remote tier within its budget

* Keys in the cluster are the blocks' pool keys: content-addressed, with the
  namespace and the tenant's salt inside, so blocks are immutable and need no
  invalidation.  Salted tenants' keys are derived under the pool's tenant
  secret: racks that share blocks hold the same secret (`cxlkv kv secret
  --export/--import`); unsalted blocks match regardless.
* Read-through (serving processes, opt-in per namespace with `remote_read`):
  when `match`, `load` or `load_into` find the pool's (and the spill tier's)
  run ending before the request does, the following blocks are fetched
  within `remote_budget_s`, verified, and stored into the pool through the
  normal store path (published like any other block, so the next host of the
  rack hits locally).  A slow or down cluster costs at most the budget and
  is a miss, never an error.
* The tier is a `RemoteKV` (a cxlkv.kv.tiers.base.Tier) owned by the pool
  object's tiers (`pool.tiers.get("remote")`); `client_of(pool)` is its client.
* Write-behind (`Pusher`, run by `cxlkv serve`): published blocks of the
  chosen namespaces, learnt from the pool's change journal, are read out of
  the pool with a version check (never a block that changed while copied)
  and queued on the client's bounded queue; the client's writer thread
  sends them.  A full queue or a down cluster
  drops the work, counted and logged once, never an error.
"""
from __future__ import annotations

import fnmatch
import time

import numpy as np

from cxlkv._core import fence
from cxlkv.errors import UsageError
from cxlkv.kv.area import ENTRY, Area
from cxlkv.kv.journal import EVICTED, NS_CLEARED, STORED, JournalReader
from cxlkv.kv.tiers.base import Tier
from cxlkv.pool import layout
from cxlkv.remote import RemoteClient, RemoteConfig
from cxlkv.remote.metrics import Collector

#: how long a read-through may wait for the cluster by default
DEFAULT_BUDGET_S = 0.05
POLICIES = ("all", "reused")


class RemoteKV(Tier):
    """The remote tier of one pool object: its RemoteClient (`client`), closed
    with the tier when `owned` (made from a RemoteConfig by `enable`)."""

    kind = "remote"

    def __init__(self, client: RemoteClient, owned: bool):
        self.client, self.owned = client, owned

    def register_namespace(self, ns_digest: bytes, name: str) -> None:
        self.client.register_namespace(ns_digest, name)

    def fetch(self, keys, ns_digest: bytes, block_bytes: int,
              budget_s: float | None = None) -> list:
        got = self.client.lookup(ns_digest, keys, block_bytes,
                                 DEFAULT_BUDGET_S if budget_s is None else budget_s)
        for i, b in enumerate(got):
            if b is None:
                return got[:i]
        return got

    def promoted(self, blocks: int) -> None:
        self.client.count("promoted", blocks)

    def promote_failed(self, err: Exception) -> None:
        self.client.count("promote_failed")

    def stats(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        if self.owned:
            self.client.close()


def enable(pool, remote):
    """Give this process's `pool` a remote tier: a RemoteConfig (a client is
    made, and closed by `disable`) or a RemoteClient (the caller's).  One per
    pool object; enabling it again with the same client is a no-op.  Returns
    the client."""
    cur = pool.tiers.get(RemoteKV.kind)
    if cur is not None:
        if remote is cur.client or remote == cur.client.config:
            return cur.client
        raise UsageError("this pool already has a remote tier", hint="disable it first")
    if isinstance(remote, RemoteConfig):
        tier = RemoteKV(RemoteClient(remote), owned=True)
    elif isinstance(remote, RemoteClient):
        tier = RemoteKV(remote, owned=False)
    else:
        raise UsageError("remote must be a cxlkv.remote.RemoteConfig or RemoteClient, "
                         f"not {type(remote).__name__}")
    pool.tiers.enable(tier)
    return tier.client


def disable(pool) -> None:
    """Drop the pool's remote tier (closing the client `enable` made)."""
    pool.tiers.disable(RemoteKV.kind)


def tier_of(pool) -> RemoteKV | None:
    return pool.tiers.get(RemoteKV.kind)


def client_of(pool) -> RemoteClient | None:
    tier = tier_of(pool)
    return None if tier is None else tier.client


class Pusher:
    """Write-behind of published blocks to the remote tier (see the module
    doc).  `namespaces`: names or shell patterns of the namespaces to push;
    `policy`: "all" (every published block) or "reused" (blocks loaded at
    least once after the pusher first saw them).

    The pusher learns what is published and evicted from the pool's change
    journal (cxlkv.kv.journal), not from the table: a pass reads the records
    appended since the last one and the entries of the blocks it still has
    to push, so its cost follows the rack's store rate, not the table's
    size.  Its first pass, and any pass after the journal overran or tore
    (the reader's resync, counted in totals["resyncs"]), reads the table
    once instead.  The "reused" policy still applies the nodes' touch rings
    under the pool lock each pass and reads the LRU stamps of the blocks not
    pushed yet."""

    def __init__(self, pool, client, namespaces, policy: str = "reused",
                 max_blocks: int = 4096, lock_timeout: float | None = None, stop=None):
        if policy not in POLICIES:
            raise UsageError(f"push policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        pats = [namespaces] if isinstance(namespaces, str) else list(namespaces)
        if not pats or not all(isinstance(p, str) and p for p in pats):
            raise UsageError("push namespaces: a list of namespace names or patterns")
        self.pool, self.client, self.patterns, self.policy = pool, client, pats, policy
        self.max_blocks = max_blocks
        self.lock_timeout = lock_timeout
        self.stop = stop                         # a threading.Event: end a pass early
        self.area = Area(pool)
        self.journal = JournalReader(pool)       # its first poll: the whole table
        self._live: dict[bytes, tuple[int, int]] = {}  # key -> (entry, ns): published, chosen
        self._done: dict[bytes, int] = {}        # key -> ctl the cluster has (seen present)
        self._pending: dict[bytes, int] = {}     # key -> ctl queued, not known written yet
        self._seen: dict[bytes, int] = {}        # key -> lru stamp when first seen
        self.exists_budget_s = 1.0
        self.totals = dict.fromkeys(("scans", "present", "queued", "changed", "refused",
                                     "records", "resyncs"), 0)

    def _namespaces(self) -> dict[int, tuple[bytes, str, int]]:
        out = {}
        for i, r in enumerate(self.area.ns_records()):
            if r.state != layout.KV_REC_ACTIVE:
                continue
            name = r.name.decode("utf-8", "replace")
            if any(fnmatch.fnmatchcase(name, p) for p in self.patterns):
                out[i] = (bytes(r.digest), name, r.block_bytes)
        return out

    def _forget(self, k: bytes) -> None:
        for d in (self._live, self._done, self._seen, self._pending):
            d.pop(k, None)

    def _follow(self, spaces) -> tuple[int, int]:
        """Apply the journal's records since the last pass to the set of
        published blocks of the chosen namespaces.  Returns (records, 1 if
        this was a resync else 0)."""
        ch = self.journal.poll()
        recs = ch.records
        self.totals["records"] += len(recs)
        if ch.resync:
            self.totals["resyncs"] += 1
            self._live.clear()
        keys = [int(lo).to_bytes(8, "little") + int(hi).to_bytes(8, "little")
                for lo, hi in zip(recs["key_lo"].tolist(), recs["key_hi"].tolist())]
        for k, op, ns, entry in zip(keys, recs["op"].tolist(), recs["ns"].tolist(),
                                    recs["entry"].tolist()):
            if op == STORED:
                if ns in spaces and entry:
                    self._live[k] = (entry - 1, ns)
            elif op == EVICTED:
                self._forget(k)
            elif op == NS_CLEARED:
                for k2 in [k2 for k2, v in self._live.items() if v[1] == ns]:
                    self._forget(k2)
        if ch.resync:                            # forget what left the table (bounded memory)
            for d in (self._done, self._seen, self._pending):
                for k in [k for k in d if k not in self._live]:
                    del d[k]
        return len(recs), int(ch.resync)

    def _entries(self, idx: np.ndarray) -> np.ndarray:
        """The current hash entries at `idx` (a copy)."""
        a, m = self.area, self.pool.mapping
        if m.flush_meta:
            return np.frombuffer(b"".join(a._read(a.entry_off(int(i)), layout.HASH_ENTRY_SIZE)
                                          for i in idx), dtype=ENTRY)
        v = m.view(a.table, a.nslots * layout.HASH_ENTRY_SIZE)
        try:
            t = np.frombuffer(v, dtype=ENTRY)
            out = t[idx]
            del t
        finally:
            v.release()
        return out

    def scan(self) -> dict:
        """One pass: follow the journal, then queue what the policy selects
        and was not pushed yet (at most max_blocks).  Returns this pass's
        figures."""
        t0 = time.monotonic()
        spaces = self._namespaces()
        got = {"candidates": 0, "present": 0, "queued": 0, "changed": 0, "refused": 0,
               "records": 0, "resyncs": 0, "seconds": 0.0}
        if not spaces:
            return got
        got["records"], got["resyncs"] = self._follow(spaces)
        if self.policy == "reused":
            with self.pool.lock(self.lock_timeout):
                self.area.drain_rings()
        # queued blocks are known written only once seen present: when the
        # client's queue is empty they were written or dropped, and the
        # exists() below tells which (dropped ones are pushed again)
        if not self.client.stats()["queued_bytes"]:
            self._pending.clear()
        for d_ns, name, _ in spaces.values():
            self.client.register_namespace(d_ns, name)
        todo = []                                # (key, entry) in the order they were published
        cand = [(k, i) for k, (i, ns) in self._live.items()
                if ns in spaces and k not in self._pending]
        for c0 in range(0, len(cand), 4096):
            if len(todo) >= self.max_blocks:
                break
            part = cand[c0:c0 + 4096]
            ents = self._entries(np.array([i for _, i in part], dtype=np.int64))
            for (k, i), e in zip(part, ents):
                if len(todo) >= self.max_blocks:
                    break
                if (int(e["ctl"]) & 0xFF != layout.KV_PUBLISHED
                        or int(e["key_lo"]).to_bytes(8, "little")
                        + int(e["key_hi"]).to_bytes(8, "little") != k):
                    continue                     # its eviction's record is on its way
                if self._done.get(k) == int(e["ctl"]):
                    continue
                if self.policy == "reused":
                    first = self._seen.setdefault(k, int(e["lru"]))
                    if int(e["lru"]) == first:
                        continue
                todo.append((k, i, e))
        got["candidates"] = len(todo)
        # what another rack (or an earlier run) already pushed is not sent again
        by_ns: dict[int, list] = {}
        for k, i, e in todo:
            by_ns.setdefault(int(e["ns"]), []).append((k, i, e))
        for ns, items in by_ns.items():
            digest = spaces[ns][0]
            there = self.client.exists(digest, [k for k, _, _ in items], self.exists_budget_s)
            for (k, i, e), present in zip(items, there):
                if self.stop is not None and self.stop.is_set():
                    break
                ctl = int(e["ctl"])
                if present:
                    got["present"] += 1
                    self._done[k] = ctl
                    continue
                data = self._copy(i, ctl, int(e["payload"]), int(e["length"]))
                if data is None:
                    got["changed"] += 1
                    continue
                if not self.client.push(k, digest, data):
                    # dropped (full queue, cluster down or over budget: counted
                    # by the client) - stop here, the next scan tries again
                    got["refused"] += 1
                    break
                got["queued"] += 1
                self._pending[k] = ctl
            else:
                continue
            break
        for f in ("present", "queued", "changed", "refused"):
            self.totals[f] += got[f]
        self.totals["scans"] += 1
        got["seconds"] = round(time.monotonic() - t0, 4)
        return got

    def read_block(self, payload: int, length: int) -> bytes:
        """A block's bytes out of the pool, between the two reads of its
        entry's version (a seam: tests change the entry under it)."""
        m = self.pool.mapping
        if m.flush_meta:
            m.invalidate(payload, length)
        return m.read(payload, length)

    def _copy(self, i: int, ctl: int, payload: int, length: int) -> bytes | None:
        """The block's bytes, or None if its entry changed while they were
        copied (a seqlock read: the version is read again after the copy)."""
        m, off = self.pool.mapping, self.area.entry_off(i)
        if m.flush_meta:
            m.invalidate(off, 8)
        if m.load64(off) != ctl:
            return None
        data = self.read_block(payload, length)

        fence()
        if m.flush_meta:
            m.invalidate(off, 8)
        return data if m.load64(off) == ctl else None


def collector(pool):
    """A Prometheus collector of `pool`'s remote tier (cxlkv.remote.metrics)."""
    return Collector(lambda: client_of(pool))
