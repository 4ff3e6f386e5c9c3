"""The prefix-aware KV cache API: `pool.kv(...)` returns a KVCache.

    kv = pool.kv(model="llama-3-8b/bf16/paged", block_tokens=16, block_bytes=N)
    kv.match(tokens)                 -> leading tokens covered by published blocks
    kv.store(tokens, blocks)         -> blocks newly stored
    with kv.load(tokens) as views:   -> pinned read-only zero-copy views
    kv.load_into(tokens, out)        -> blocks copied into `out`

Hot paths (hashing, lookup, pin, copies) are single C calls over the whole
sequence; the pool lock is taken twice per store (reserve entries, then
publish) and never by lookups - except that a lookup which brings blocks in
from a lower tier (spill on load, the remote tier on match and load with
remote_read) stores them, as any store does.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import weakref

import numpy as np

from cxlkv import errors
from cxlkv._core import CRASH_ENABLED, crashpoint, gather
from cxlkv.errors import RetiredSlots, StaleViews, UsageError
from cxlkv.kv import journal
from cxlkv.kv import keys as block_keys
from cxlkv.kv import names as block_names
from cxlkv.kv.area import (ENTRY, INLINE_SLACK, LOW_WATERMARK, STATS, Area, KVPoolFull,
                           KVTableFull, QuotaExceeded, TooManyPins, stamp)
from cxlkv.pool import layout
from cxlkv.state import alloc
from cxlkv.state import nodes
from cxlkv.state.nodes import NodeFenced

MIN_BLOCK_BYTES = 64
MAX_BLOCK_BYTES = 1 << 31
#: each counter's word in a STATS record
_STAT_WORD = {name: i for i, name in enumerate(STATS.names)}
#: the head of a namespace record _check_namespace reads: the name, then the state word
_NS_STATE = layout.field_offset(layout.KVNsStruct, "state")
_NS_HEAD = _NS_STATE + 4
_ACTIVE_STATE = layout.KV_REC_ACTIVE.to_bytes(4, "little")
#: stores tried again after their reservation met a chunk retired meanwhile
RETIRED_RETRIES = 2
#: pool object -> {(namespace, its counters' offset): (lock, counter words)}: this
#: node's counters, shared by the KVCaches of the pool object (KVCache._counters)
_SHARED_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

log = logging.getLogger(__name__)


class KVCache:
    """One namespace (model/dtype/layout) of the pool's KV cache, as one tenant."""

    def __init__(self, pool, *, model: str, block_tokens: int, block_bytes: int, salt=None,
                 hash: str = "xxh3_128", hash_seed: str | None = None,
                 quota: int | None = None, spill_dir=None, spill_bytes: int | None = None,
                 hot_bytes: int | None = None, remote_read: bool = False,
                 remote_budget_s: float | None = None):
        if pool.node is None:
            raise UsageError("the KV cache needs an attached node: use cxlkv.open_pool()")
        if not isinstance(model, str) or not model:
            raise UsageError("model (the namespace name) must be a non-empty string")
        name = model.encode("utf-8")
        if len(name) >= layout.KV_NS_NAME or b"\0" in name:
            raise UsageError(f"namespace name must be under {layout.KV_NS_NAME} bytes, without NUL")
        if not isinstance(block_tokens, int) or not 1 <= block_tokens <= 1 << 20:
            raise UsageError("block_tokens must be an integer between 1 and 1048576")
        if not isinstance(block_bytes,
                          int) or not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
            raise UsageError(f"block_bytes must be an integer between {MIN_BLOCK_BYTES} "
                             f"and {MAX_BLOCK_BYTES}")
        if hash not in block_keys.HASHES:
            raise UsageError(f"hash must be one of {', '.join(block_keys.HASHES)}, not {hash!r}")
        if quota is not None and (not isinstance(quota, int) or quota < 0):
            raise UsageError("quota must be a byte count >= 0 (0 = no quota)")
        if not isinstance(remote_read, bool):
            raise UsageError("remote_read must be True or False")
        if remote_budget_s is not None and (isinstance(remote_budget_s, bool) or not isinstance(
                remote_budget_s, (int, float)) or not 0 <= remote_budget_s <= 60):
            raise UsageError("remote_budget_s must be a number of seconds between 0 and 60")
        if spill_dir is not None and (not isinstance(spill_bytes, int) or spill_bytes < 0):
            raise UsageError("spill_dir needs spill_bytes, the spill store's size in bytes")
        self.pool = pool
        self.area = Area(pool)
        self.area.journal.require()
        self._names = block_names.Names.of(pool)
        self.m = pool.mapping
        warm = getattr(pool, "warm_metadata", None)
        if warm is not None:
            warm()                          # the hash and name tables, in the background
        self.name = model
        self._name0 = name + b"\0"           # as the record holds it (NUL-padded)
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.hash = hash
        self.slot_size = alloc.slot_size_for(pool, block_bytes)
        self._none_hash = block_keys.vllm_none_hash(hash_seed) if hash == "sha256_cbor" else None
        self._digest = block_keys.namespace_digest(model)
        self._salt = block_keys.derive_salt(pool.sb.tenant_secret, salt)
        self._prefix = self._digest + self._salt
        self._pin_hint = 0
        self._closed = False
        slot = pool.node.slot
        self._pins_off = self.area.pins_off(slot)
        self._ring_head = self.area.node_base(slot)
        self._ring_off = self.area.ring_off(slot)
        with pool.lock():
            self.ns = self._open_namespace(name, quota)
            self.tenant = self._open_tenant(quota)
        self._stats_off = self.area.stats_off(slot, self.ns)
        # the tiers are the pool object's (pool.tiers); a tier's module is
        # loaded when the tier is enabled: the KV cache alone does not pull
        # in asyncio, Redis or Prometheus (test_architecture's LAZY_CXLKV
        # lists these imports inside a function)
        if spill_dir is not None:
            from cxlkv.kv.tiers import spill

            spill.enable(pool, spill_dir, spill_bytes)
        if hot_bytes is not None:
            from cxlkv.kv.tiers import hot

            hot.enable(pool, hot_bytes)
        # read-through: the remote tier enabled now, for this cache's life
        self._remote = None
        self._remote_budget = None if remote_budget_s is None else float(remote_budget_s)
        if remote_read:
            self._remote = pool.tiers.get("remote")
            if self._remote is None:
                raise UsageError("remote_read needs the pool's remote tier",
                                 hint="cxlkv.kv.tiers.remote.enable(pool, RemoteConfig(...)) first")
            self._remote.register_namespace(self._digest, self.name)

    # -- namespace and tenant records (pool lock held) ------------------------------
    def _open_namespace(self, name: bytes, quota) -> int:
        a = self.area
        free = -1
        kind = layout.KV_HASH_CODES[self.hash]
        for i, r in enumerate(a.ns_records()):
            if r.state == layout.KV_REC_ACTIVE and r.name == name:
                if (r.block_bytes, r.block_tokens, r.hash_kind) != (
                        self.block_bytes, self.block_tokens, kind):
                    raise UsageError(
                        f"namespace {self.name!r} exists with block_bytes={r.block_bytes}, "
                        f"block_tokens={r.block_tokens}, hash="
                        f"{layout.KV_HASH_NAMES.get(r.hash_kind, r.hash_kind)}; it was opened with "
                        f"block_bytes={self.block_bytes}, block_tokens={self.block_tokens}, "
                        f"hash={self.hash}",
                        hint="use the namespace's parameters, or drop it first "
                             "(cxlkv kv drop --namespace NAME)")
                return i
            if free < 0 and r.state == layout.KV_REC_FREE:
                free = i
        if free < 0:
            raise KVTableFull(f"{self.pool.path}: all {a.max_ns} KV namespaces are in use",
                              hint="drop unused ones with `cxlkv kv drop --namespace NAME`")
        r = layout.KVNsStruct()
        r.name = name
        r.state = layout.KV_REC_ACTIVE
        r.hash_kind = kind
        r.block_tokens = self.block_tokens
        r.block_bytes = self.block_bytes
        r.digest[:] = self._digest
        a.write_record(a.ns_off(free), r)
        a.m.zero(a.stats_off(self.pool.node.slot, free), STATS.itemsize)
        return free

    def _open_tenant(self, quota) -> int:
        a = self.area
        if self._salt == bytes(16):
            idx = 0
        else:
            idx = free = idle = -1
            for i, r in enumerate(a.tenant_records()):
                if i and r.state == layout.KV_REC_ACTIVE and bytes(r.salt) == self._salt:
                    idx = i
                    break
                if i and free < 0 and r.state == layout.KV_REC_FREE:
                    free = i
                if i and idle < 0 and r.state == layout.KV_REC_ACTIVE and not r.blocks \
                        and not r.quota:
                    idle = i                  # a tenant with nothing stored and no quota
            if idx < 0:
                free = free if free >= 0 else idle
                if free < 0:
                    raise KVTableFull(f"{self.pool.path}: all {a.max_tenants - 1} tenant "
                                      "records hold blocks or quotas",
                                      hint="drop namespaces or clear quotas of old tenants")
                r = layout.KVTenantStruct()
                r.salt[:] = self._salt
                r.state = layout.KV_REC_ACTIVE
                a.write_record(a.tenant_off(free), r)
                idx = free
        if quota is not None:
            r = a.tenant_record(idx)
            r.quota = quota
            a.write_record(a.tenant_off(idx), r)
        return idx

    def _check_tenant(self) -> None:
        """Under the lock: our tenant record is still ours (an idle record
        may have been handed to another tenant meanwhile)."""
        a = self.area
        if self.tenant and a._read(a.tenant_off(self.tenant), 16) != self._salt:
            self.tenant = self._open_tenant(None)

    def _check_namespace(self) -> None:
        """Under the lock: our record still names us (not dropped meanwhile):
        ACTIVE, and its name is ours followed by a NUL (one read of the name
        and state words)."""
        a = self.area
        raw = a._read(a.ns_off(self.ns), _NS_HEAD)
        if raw[_NS_STATE:] != _ACTIVE_STATE or raw[:len(self._name0)] != self._name0:
            self.ns = self._open_namespace(self.name.encode(), None)
            self._stats_off = self.area.stats_off(self.pool.node.slot, self.ns)
            _SHARED_COUNTERS.get(self.pool, {}).pop((self.ns, self._stats_off), None)

    # -- keys --------------------------------------------------------------------------
    def _chain(self, toks: np.ndarray) -> np.ndarray:
        if self.hash == "xxh3_128":
            return block_keys.xxh3_chain(toks, self.block_tokens)
        return block_keys.sha256_cbor_chain(toks, self.block_tokens, self._none_hash)

    def block_hashes(self, tokens) -> list[bytes]:
        """Chain hashes of the full blocks of `tokens` (vLLM's block hashes
        for hash="sha256_cbor" with the same seed)."""
        return [bytes(r) for r in self._chain(block_keys.tokens_array(tokens))]

    def _keys(self, tokens) -> np.ndarray:
        return self._chain_keys(tokens)[1]

    def _chain_keys(self, tokens) -> tuple[block_names.Named, np.ndarray]:
        """(names, pool keys) of the full blocks of `tokens`: the names are
        the chain hashes and the blocks' token ids (cxlkv.kv.names)."""
        toks = block_keys.tokens_array(tokens)
        chain = self._chain(toks)
        n, bt = len(chain), self.block_tokens
        return (block_names.Named(chain, toks[:n * bt].reshape(n, bt)),
                block_keys.pool_keys(chain, self._digest, self._salt))

    def keys_for_hashes(self, hashes) -> np.ndarray:
        """Pool keys for chain hashes the caller computed (e.g. vLLM's)."""
        return self._hash_keys(hashes)[1]

    def _hash_keys(self, hashes, tokens=None) -> tuple[block_names.Named, np.ndarray]:
        """(names, pool keys) for chain hashes the caller computed; `tokens`,
        when given, are the blocks' token ids (block_tokens a block)."""
        rows = []
        for h in hashes:
            if not isinstance(h, (bytes, bytearray, memoryview)):
                raise UsageError(f"block hashes must be bytes, not {type(h).__name__} "
                                 "(vLLM's BlockHash is bytes; encode integer hashes yourself)")
            rows.append(bytes(h))
        if not rows:
            return (block_names.Named(np.zeros((0, 0), dtype=np.uint8)),
                    np.zeros((0, 16), dtype=np.uint8))
        if len({len(r) for r in rows}) != 1 or not 1 <= len(rows[0]) <= 64:
            raise UsageError("block hashes must all have the same length, 1 to 64 bytes")
        chain = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
        rows_t = None
        if tokens is not None:
            toks = block_keys.tokens_array(tokens)
            if len(toks) != len(rows) * self.block_tokens:
                raise UsageError(f"tokens: {len(toks)} token ids for {len(rows)} blocks of "
                                 f"{self.block_tokens} tokens (expected "
                                 f"{len(rows) * self.block_tokens})")
            rows_t = toks.reshape(len(rows), self.block_tokens)
        return (block_names.Named(chain, rows_t),
                block_keys.pool_keys(chain, self._digest, self._salt))

    # -- lookups -----------------------------------------------------------------------
    def _lookup(self, keys: np.ndarray, stop: bool = True):
        n = len(keys)
        idx = np.empty(n, dtype=np.uint64)
        ctl = np.empty(n, dtype=np.uint64)
        pay = np.empty(n, dtype=np.uint64)
        ln = np.empty(n, dtype=np.uint64)
        found = self.m.kv_lookup(self.area.table, self.area.nslots, self.ns, keys, idx, ctl, pay,
                                 ln, stop) if n else 0
        return found, idx, ctl, pay

    def _counters(self):
        """This node's counters of our namespace: one (lock, array) per pool
        and namespace in the process, shared by every KVCache on it."""
        shared = _SHARED_COUNTERS.setdefault(self.pool, {})
        key = (self.ns, self._stats_off)
        if key not in shared:
            st = np.zeros(1, dtype=STATS)
            st[0] = self.area.node_stats(self.pool.node.slot)[self.ns]
            # one word per counter, in STATS order: scalar adds, no field lookups
            shared[key] = (threading.Lock(), st.view("<u8"))
        return shared[key]

    def _count(self, **delta) -> None:
        """Add to this node's counters (in its per-node area) - a section in
        flight; nothing once the node is fenced: the area may be another's."""
        node = self.pool.node
        try:
            node.enter()
        except NodeFenced:
            return
        try:
            mu, words = self._counters()
            with mu:
                for k, v in delta.items():
                    words[_STAT_WORD[k]] += v
                self.m.write(self._stats_off, words)
        finally:
            node.leave()

    def match(self, tokens) -> int:
        """Leading tokens covered by published blocks (a multiple of block_tokens)."""
        return self._match(*self._chain_keys(tokens)[::-1]) * self.block_tokens

    def match_hashes(self, hashes) -> int:
        """Leading blocks present, for chain hashes the caller computed."""
        return self._match(*self._hash_keys(hashes)[::-1])

    def _match(self, keys: np.ndarray, names=None) -> int:
        found = self._lookup(keys)[0]
        if found < len(keys) and self._remote is not None:
            # read-through: what the remote tier has is brought into the pool now
            self._fill(keys, names)
            found = self._lookup(keys)[0]
        sp = self.pool.tiers.get("spill")
        if sp is not None and found < len(keys):
            found += sp.held(keys[found:])
        self._count(lookups=1, hit_blocks=found, miss_blocks=len(keys) - found)
        return found

    def match_many(self, sequences) -> list[int]:
        return [self.match(t) for t in sequences]

    # -- store -------------------------------------------------------------------------
    def _sources(self, blocks, n: int):
        """(contiguous buffer of n*block_bytes | None, list of n buffers | None)."""
        bb = self.block_bytes
        try:
            mv = memoryview(blocks)
        except TypeError:
            mv = None
        if mv is not None:
            if mv.nbytes != n * bb:
                raise UsageError(f"blocks is one buffer of {mv.nbytes} bytes; {n} full blocks "
                                 f"need {n} x {bb} = {n * bb}")
            if not mv.c_contiguous:
                raise UsageError("blocks must be C-contiguous")
            return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, None
        try:
            items = list(blocks)
        except TypeError:
            raise UsageError("blocks must be a buffer or a sequence of buffers") from None
        if len(items) != n:
            raise UsageError(f"got {len(items)} block buffers for {n} full blocks of tokens")
        out = []
        for i, b in enumerate(items):
            try:
                v = memoryview(b)
            except TypeError:
                raise UsageError(f"block {i} is a {type(b).__name__}, not a buffer") from None
            if v.nbytes != bb:
                raise UsageError(f"block {i} is {v.nbytes} bytes, block_bytes is {bb}")
            if not v.c_contiguous:
                raise UsageError(f"block {i} is not C-contiguous")
            out.append(v)
        return None, out

    def _alloc(self, count: int) -> np.ndarray:
        zero = self.slot_size != self.block_bytes
        for attempt in range(4):
            try:
                return self.pool.alloc_batch(self.block_bytes, count, zero=zero)
            except alloc.PoolFullError:
                lk = self.pool.lock()
                with contextlib.nullcontext() if lk.held_by_me() else lk:
                    got = self.area.evict(need_bytes=(count + INLINE_SLACK) * self.slot_size)[0]
                if not got and attempt:
                    break
        raise KVPoolFull(
            f"{self.pool.path}: pool full: no room for {count} blocks of {self.block_bytes} "
            "bytes and no unpinned block left to evict", path=self.pool.path,
            hint="release loaded views (pins), drop unused namespaces, or use a larger pool")

    def store(self, tokens, blocks) -> int:
        """Store the full blocks of `tokens` (one buffer of block_bytes per
        block, or one buffer of all of them); returns how many were new."""
        names, keys = self._chain_keys(tokens)
        n = len(keys)
        src, items = self._sources(blocks, n)
        if n == 0:
            return 0
        return self._store(keys, src, items, names=names)

    def store_hashes(self, hashes, blocks, tokens=None) -> int:
        """Store blocks keyed by chain hashes the caller computed; `tokens`
        (optional): their token ids, block_tokens a block, kept with the
        hashes as the blocks' names (KV events publish them)."""
        names, keys = self._hash_keys(hashes, tokens)
        src, items = self._sources(blocks, len(keys))
        return self._store(keys, src, items, names=names) if len(keys) else 0

    def store_with(self, tokens, fill) -> int:
        """Store the full blocks of `tokens`, their payloads written in place:
        `fill(which, target)` gets the chain positions of the blocks that are
        new (int64, ascending) and a ReservedBlocks of their pool slots, in the
        same order, and must write every byte of each (one pass from an
        engine's own tensors: cxlkv.integrations.kvcopy).  Present blocks are
        skipped; returns how many were new.  An exception from fill abandons
        the store (nothing published)."""
        names, keys = self._chain_keys(tokens)
        return self._store(keys, None, None, fill, names) if len(keys) else 0

    def store_hashes_with(self, hashes, fill, tokens=None) -> int:
        """store_with for blocks keyed by chain hashes the caller computed
        (`tokens` as for store_hashes)."""
        names, keys = self._hash_keys(hashes, tokens)
        return self._store(keys, None, None, fill, names) if len(keys) else 0

    def store_many(self, pairs) -> int:
        return sum(self.store(t, b) for t, b in pairs)

    def _store(self, keys: np.ndarray, src, items, fill=None, names=None) -> int:
        """names: the blocks' names (cxlkv.kv.names.Named), written with them."""
        n = len(keys)
        for attempt in range(RETIRED_RETRIES + 1):
            lead, lead_idx, _, _ = self._lookup(keys)
            if lead == n:
                self._count(present_blocks=n)
                return 0
            node = self.pool.node
            node.enter()                    # the fencing acknowledgement waits for it
            try:
                return self._store_new(keys, src, items, lead, lead_idx, fill, names)
            except RetiredSlots:
                # a quarantine retired chunks of our reservation after the
                # allocator handed the slots out: it was abandoned, and the
                # slabs of those chunks hand out nothing more
                if attempt == RETIRED_RETRIES:
                    raise
            finally:
                node.leave()
        raise AssertionError("unreachable")  # pragma: no cover

    def _store_new(self, keys: np.ndarray, src, items, lead: int, lead_idx, fill=None,
                   names=None) -> int:
        """Reserve entries and payload slots (pool lock), copy the payloads
        (no lock; each block only while this node is known fresh), publish
        (pool lock).  Every phase is guarded: a node fenced meanwhile writes
        nothing more, and what it reserved stays quarantined until the
        reaper recovers it."""
        n = len(keys)
        node = self.pool.node
        pay = self._alloc(n - lead)
        a, m = self.area, self.m
        slots = np.empty(n, dtype=np.uint64)
        status = np.zeros(n, dtype=np.uint64)
        used_total = 0
        pos = 0
        new = np.zeros(0, dtype=np.int64)
        token = self.pool.node.owner_token
        published = False
        try:
            with self.pool.lock():
                node.guard()
                self._check_namespace()
                self._check_tenant()
                self._make_room(n - lead, keep=lead_idx[:lead])
                parent = 0
                proven = True                   # by the guard() just above
                while pos < n:
                    if not proven:
                        node.guard()
                    proven = False
                    done, used, full = m.kv_insert(
                        a.table, a.nslots, a.hdr, a.max_used, self.ns, self.tenant,
                        self.block_bytes, token, keys[pos:], parent, pay[used_total:],
                        slots[pos:], status[pos:])
                    pos += done
                    used_total += used
                    if pos > 0:
                        parent = int(slots[pos - 1]) + 1
                    if pos >= n or full == 2:
                        # full == 2: another node is storing block `pos`; what
                        # follows it is theirs to store
                        break
                    if full == 4:
                        continue                # stalled: guard() proves us fresh, or raises
                    if full == 3:
                        # tombstones fill the table: clear those no chain
                        # needs, else evict on this key's probe path, else
                        # thin the table out (a sixteenth of it) so that
                        # clusters break up and their tombstones can go
                        key_lo = int.from_bytes(keys[pos][:8].tobytes(), "little")
                        if a.purge_tombstones(key_lo=key_lo) or a.evict_on_path(
                                key_lo, keep=slots[:pos]):
                            continue
                        if a.evict(need_entries=max(n - pos, a.nslots // 16),
                                   keep=slots[:pos])[0]:
                            a.purge_tombstones(force=True)
                            continue
                    if full:
                        # a batch more than this store needs (as for bytes;
                        # at most a sixteenth of the table): the stores after
                        # it find room without evicting
                        more = min(INLINE_SLACK, a.max_used // 16)
                        if not a.evict(need_entries=max(1, n - pos) + more,
                                       keep=slots[:pos])[0]:
                            raise KVTableFull(
                                f"{self.pool.path}: the KV hash table is full "
                                f"({a.max_used} of {a.nslots} entries, the format's maximum "
                                "load) and every block is pinned", path=self.pool.path,
                                hint="release loaded views, or re-format with more --hash-slots")
                    else:                       # more absent blocks than reserved
                        pay = np.concatenate([pay, self._alloc(n - pos)])
                # each new entry took one payload (kv_insert status 0):
                # which ones they are is worked out after the lock
                self._account(used_total)
            new = np.flatnonzero(status[:pos] == 0)
            if used_total < len(pay):
                self.pool.free_batch(pay[used_total:], zero=False)
                pay = pay[:used_total]
            if not len(new):
                self._count(present_blocks=pos)
                return 0
            if CRASH_ENABLED:
                crashpoint("kv.reserved")
            # not a byte into a chunk retired since the allocator handed the
            # slot out (publish checks again, under the lock, for good)
            self.pool.allocator.check_retired(pay)
            if fill is None:
                self._copy(new, pay, src, items)
            else:
                fill(new.astype(np.int64), ReservedBlocks(node, pay, self.block_bytes))
            if self._names is not None and names is not None:
                if CRASH_ENABLED:
                    crashpoint("kv.naming")     # tests: a stall between the copy and the names
                self._names.write(node, slots[new], keys[new], names[new])
            if CRASH_ENABLED:
                crashpoint("kv.copied")
            mine = slots[new]
            publish = self.pool.allocator.publish_guarded
            with self.pool.lock():
                node.guard()
                # pool.publish without its own section and second guard: this
                # store is a section in flight (_store) and guard() just ran
                publish(pay)
                m.kv_set_state(a.table, a.nslots, mine, layout.KV_PENDING, layout.KV_PUBLISHED,
                               token, stamp())
                published = True
                a.journal.append(journal.STORED, mine)
        except BaseException:
            if not published:
                self._abandon(slots[:pos][status[:pos] == 0], pay)
            raise
        self._count(stored_blocks=len(new), present_blocks=pos - len(new),
                    stored_bytes=len(new) * self.block_bytes)
        return len(new)

    def _copy(self, new: np.ndarray, dst: np.ndarray, src, items) -> None:
        """Payloads into their reserved slots, each block only while this node
        is known fresh (Attachment.write_blocks)."""
        bb = self.block_bytes
        node = self.pool.node
        if src is None:
            for j, i in enumerate(new):
                node.guard()
                self.m.write(int(dst[j]), items[int(i)])
            return
        # runs of consecutive blocks go in one C call each
        breaks = np.flatnonzero(np.diff(new) != 1) + 1
        start = 0
        for stop in list(breaks) + [len(new)]:
            i0 = int(new[start])
            node.write_blocks(dst[start:stop], src[i0 * bb:(i0 + stop - start) * bb], bb)
            start = stop

    def _account(self, blocks: int) -> None:
        """Namespace and tenant usage for newly reserved blocks (lock held):
        one C call adds to both records."""
        if not blocks:
            return
        a = self.area
        self.m.kv_account(a.ns_off(self.ns), a.tenant_off(self.tenant), blocks,
                          blocks * self.slot_size)

    def _make_room(self, blocks: int, keep=None) -> None:
        """Quota and low watermark, before reserving `blocks` (lock held).
        The common case (no quota, room above the watermark) is one C pass
        over the tenant records (Mapping.kv_usage)."""
        a = self.area
        need = blocks * self.slot_size
        used, quota, _ = self.m.kv_usage(a.tenant_off(0), a.max_tenants, self.tenant)
        if quota:
            self._within_quota(blocks, need, keep)
            used = self.m.kv_usage(a.tenant_off(0), a.max_tenants, self.tenant)[0]
        size = a.data_size()
        free = size - used - need
        if free < LOW_WATERMARK * size:
            # inline: back to the low watermark and a small batch more; the
            # node agent evicts in the background up to the high watermark
            a.evict(need_bytes=int(LOW_WATERMARK * size) - free + INLINE_SLACK * self.slot_size,
                    keep=keep)

    def _within_quota(self, blocks: int, need: int, keep) -> None:
        """Evict this tenant's blocks until `blocks` more (`need` bytes) fit
        its quota, or QuotaExceeded (lock held)."""
        a = self.area
        t = a.tenant_record(self.tenant)
        if t.quota and need > t.quota:
            t.rejected += 1
            a.write_record(a.tenant_off(self.tenant), t)
            raise QuotaExceeded(
                f"{self.pool.path}: {blocks} blocks ({need} bytes) exceed the tenant's whole "
                f"quota of {t.quota} bytes", path=self.pool.path,
                hint="raise the quota (pool.kv(..., quota=N)) or store shorter prefixes")
        if t.quota and t.used + need > t.quota:
            a.evict(need_bytes=t.used + need - t.quota, tenant=self.tenant, keep=keep)
            t = a.tenant_record(self.tenant)
            if t.used + need > t.quota:
                t.rejected += 1
                a.write_record(a.tenant_off(self.tenant), t)
                raise QuotaExceeded(
                    f"{self.pool.path}: tenant quota of {t.quota} bytes would be exceeded "
                    f"({t.used} in use, {need} more asked for; the rest is pinned)",
                    path=self.pool.path, hint="raise the quota (pool.kv(..., quota=N))")

    def _abandon(self, slots: np.ndarray, pay: np.ndarray) -> None:
        """Undo reserved entries and payloads after an error (best effort; a
        crash here is what recovery handles).  A fenced node undoes nothing:
        what it reserved is quarantined, and the reaper recovers it."""
        if self.pool.node.fenced:
            return
        try:
            with self.pool.lock():
                for s in slots:
                    self.m.kv_remove(self.area.table, self.area.nslots, self.area.hdr, int(s))
                self.area.recount()
            if len(pay):
                # a retired (poisoned) chunk is never written, zeroes included
                bad = self.pool.allocator.retired_mask(pay)
                self.pool.free_batch(pay[~bad], zero=True)
                if bad.any():
                    self.pool.free_batch(pay[bad], zero=False)
        except Exception as e:                        # pragma: no cover - recovery redoes it
            log.warning("could not undo a failed store in %s (%s); the reservations are "
                        "reclaimed when this node detaches", self.pool.path, e)

    # -- load ----------------------------------------------------------------------------
    def _pin(self, keys: np.ndarray, start: int = 0):
        found, idx, ctl, pay = self._lookup(keys)
        if start:
            found = max(0, found - start)
            idx, ctl, pay = idx[start:], ctl[start:], pay[start:]
        if not found:
            return 0, idx[:0], pay[:0], np.zeros(0, dtype=np.uint64), ctl[:0]
        rec = np.empty(found, dtype=np.uint64)
        a = self.area
        pinned, self._pin_hint, full = self.m.kv_pin(a.table, a.nslots, self._pins_off, a.npins,
                                                    self._pin_hint, idx[:found], ctl[:found], rec)
        if full:
            self.m.kv_unpin(self._pins_off, a.npins, rec[:pinned])
            raise TooManyPins(f"this node has {a.npins} blocks pinned: release loaded views "
                              "before loading more", path=self.pool.path)
        if pinned:
            self.m.kv_touch(self._ring_head, self._ring_off, a.nring, idx[:pinned])
        return pinned, idx[:pinned], pay[:pinned], rec[:pinned], ctl[:pinned]

    def _still_valid(self, idx: np.ndarray, ctl: np.ndarray) -> int:
        """How many leading pinned entries are unchanged since they were
        pinned (0 if this node was fenced meanwhile: its pins stopped counting)."""
        try:
            self.pool.node.check()
        except NodeFenced:
            return 0
        m, a = self.m, self.area
        if m.flush_meta:
            now = np.empty(len(idx), dtype=np.uint64)
            for j, i in enumerate(idx):
                off = a.entry_off(int(i))
                m.invalidate(off, 8)
                now[j] = m.load64(off)
        else:
            v = m.view(a.table, a.nslots * layout.HASH_ENTRY_SIZE)
            arr = np.frombuffer(v, dtype=ENTRY)
            now = arr["ctl"][idx.astype(np.int64)]
            del arr
            v.release()
        bad = np.flatnonzero(now != ctl)
        return int(bad[0]) if len(bad) else len(idx)

    def load(self, tokens) -> "Loaded":
        """Pin the matched leading blocks of `tokens`; `with kv.load(t) as views`
        gives read-only zero-copy memoryviews, valid inside the block."""
        return self._load(*self._chain_keys(tokens)[::-1])

    def load_hashes(self, hashes) -> "Loaded":
        return self._load(*self._hash_keys(hashes)[::-1])

    def _fill(self, keys: np.ndarray, names=None) -> None:
        """Bring the blocks the lower tiers hold after the pool's leading run
        of `keys` into the pool: the spill tier's first, then the remote
        tier's (read-through namespaces)."""
        sp = self.pool.tiers.get("spill")
        if sp is not None:
            self._promote(keys, sp, names=names)
        if self._remote is not None:
            self._promote(keys, self._remote, self._remote_budget, names)

    def _promote(self, keys: np.ndarray, tier, budget_s: float | None = None,
                 names=None) -> int:
        """Store the blocks `tier` fetches for the keys after the pool's
        leading run (a leading run of buffers) through the normal store path,
        chained under the run (pinned meanwhile); returns how many were
        stored.  Never raises for a full pool or pins: the caller then gets
        the pool's run only."""
        lead = self._lookup(keys)[0]
        if lead >= len(keys):
            return 0
        got = tier.fetch(keys[lead:], self._digest, self.block_bytes, budget_s)
        if not got:
            return 0
        node = self.pool.node
        node.enter()                          # pins, then a store: a section in flight
        try:
            try:
                base, _, _, rec, _ = self._pin(keys[:lead])
            except TooManyPins:
                return 0
            try:
                if base != lead:              # evicted meanwhile: nothing to chain under
                    return 0
                items = [None] * base + list(got)
                try:
                    n = self._store(keys[:len(items)], None, items,
                                    names=None if names is None else names[:len(items)])
                except (KVPoolFull, KVTableFull, QuotaExceeded) as e:
                    tier.promote_failed(e)
                    return 0
                tier.promoted(n)
                return n
            finally:
                if not node.fenced:           # a fenced node's pins stay with its quarantine
                    self.m.kv_unpin(self._pins_off, self.area.npins, rec)
        finally:
            node.leave()

    def _load(self, keys, names=None) -> "Loaded":
        self._fill(keys, names)
        node = self.pool.node
        node.enter()                        # pins held: a section in flight until release
        rec = None
        try:
            n, idx, pay, rec, ctl = self._pin(keys)
            self._count(lookups=1, hit_blocks=n, miss_blocks=len(keys) - n, loaded_blocks=n,
                        loaded_bytes=n * self.block_bytes)
            hot = self.pool.tiers.get("hot")
            if hot is None or not n:
                return Loaded(self, pay, rec, idx, ctl)
            got = hot.copies(keys, idx, ctl, n, self.block_bytes) or [None] * n
            return Loaded(self, pay, rec, idx, ctl, hot=(hot, keys[:n], idx, ctl, got))
        except BaseException:
            if rec is not None and not node.fenced:
                self.m.kv_unpin(self._pins_off, self.area.npins, rec)
            node.leave()
            raise

    def load_into(self, tokens, out, start: int = 0) -> int:
        """Copy the matched leading blocks into `out` (a writable buffer of at
        least matched x block_bytes); returns the blocks copied.

        start=k skips the first k blocks (out receives block k first): a
        consumer following a producer copies only what appeared since its
        last call."""
        if not isinstance(start, int) or start < 0:
            raise UsageError("start must be a block index >= 0")
        names, keys = self._chain_keys(tokens)
        try:
            mv = memoryview(out)
        except TypeError:
            raise UsageError("out must be a writable buffer") from None
        if mv.readonly or not mv.c_contiguous:
            raise UsageError("out must be a writable C-contiguous buffer")
        self._fill(keys, names)
        node = self.pool.node
        node.enter()                        # pins held: a section in flight
        try:
            n, idx, pay, rec, ctl = self._pin(keys, start)
        except BaseException:
            node.leave()
            raise
        try:
            if n:
                if mv.nbytes < n * self.block_bytes:
                    raise UsageError(f"out holds {mv.nbytes} bytes; {n} matched blocks need "
                                     f"{n * self.block_bytes}")
                bb = self.block_bytes
                dst = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
                hot = self.pool.tiers.get("hot")
                got = None if hot is None else hot.copies(keys[start:start + n], idx, ctl, n, bb)
                if not got or not any(g is not None for g in got):
                    self.m.read_blocks(pay, dst[:n * bb], bb)
                else:
                    _copy_mixed(self.m, pay, got, dst, bb)
                # a node paused past its lease loses its pins: had that
                # happened, the blocks may have been reused under the copy
                n = self._still_valid(idx, ctl)
                if hot is not None and n:
                    hot.keep(keys[start:start + n], idx, ctl,
                               [dst[j * bb:(j + 1) * bb] if got is None or got[j] is None
                                else None for j in range(n)])
        finally:
            # a fenced node's pins are quarantined with it: not ours to drop
            if not node.fenced:
                self.m.kv_unpin(self._pins_off, self.area.npins, rec)
            node.leave()
        if node.fenced:
            raise NodeFenced(f"{self.pool.path}: node {node.slot} was fenced during load_into "
                             "(its lease lapsed); nothing it read is vouched for: reattach",
                             path=self.pool.path)
        self._count(lookups=1, hit_blocks=n, miss_blocks=max(0, len(keys) - start - n),
                    loaded_blocks=n, loaded_bytes=n * self.block_bytes)
        return n

    # -- operators -----------------------------------------------------------------------
    def stats(self) -> dict:
        return namespace_stats(self.area, self.ns)

    def drop(self) -> dict:
        return drop_namespace(self.pool, self.name)

    def evict_hashes(self, hashes) -> int:
        """Evict now the last block of the chain `hashes` (store_hashes's
        form) when it is stored, has no children and no reader pins it: 1
        when it was evicted, else 0.  Under the pool lock; a spill tier on the
        pool takes the block, as it takes evict()'s victims."""
        keys = self.keys_for_hashes(hashes)
        if not len(keys):
            return 0
        node = self.pool.node
        node.enter()
        try:
            with self.pool.lock():
                node.guard()
                found, idx, _, _ = self._lookup(keys)
                if found < len(keys):
                    return 0
                last = idx[found - 1:found]
                if int(self.area._rows(last)["children"][0]):
                    return 0
                return int(self.area._evict_batch(last)[0])
        finally:
            node.leave()

    def __repr__(self) -> str:
        return (f"<cxlkv.KVCache {self.name!r} block_tokens={self.block_tokens} "
                f"block_bytes={self.block_bytes} hash={self.hash}>")


def _copy_mixed(m, pay: np.ndarray, got: list, dst: memoryview, bb: int) -> None:
    """Copy n blocks into dst: the DRAM copies where `got` has one (one C
    call), runs of the others out of the pool (one C call a run)."""

    n, j = len(got), 0
    gather(got, dst, bb)
    while j < n:
        if got[j] is not None:
            j += 1
            continue
        k = j
        while k < n and got[k] is None:
            k += 1
        m.read_blocks(pay[j:k], dst[j * bb:k * bb], bb)
        j = k




class ReservedBlocks:
    """The pool slots a store reserved for its new blocks (KVCache.store_with),
    written in place before the store publishes them.  Only `scatter` writes
    them: each block only while this node is known fresh."""

    def __init__(self, node, offsets: np.ndarray, block_bytes: int):
        self._node = node
        self.offsets = offsets
        self.block_bytes = block_bytes

    def __len__(self) -> int:
        return len(self.offsets)

    def scatter(self, src_offset: int, buf: np.ndarray, buf_offsets: np.ndarray, shape,
                src_strides, buf_strides, run: int) -> int:
        """kv_copy's store walk (byte units; buf_offsets[i]: block i's origin
        in buf) into every reserved slot (Mapping.kv_scatter).  Returns the
        bytes written."""
        self._node.scatter_blocks(self.offsets, self.block_bytes, src_offset, buf,
                                  np.ascontiguousarray(buf_offsets, dtype=np.int64), shape,
                                  src_strides, buf_strides, run)
        per = run
        for x in shape:
            per *= int(x)
        return per * len(self.offsets)


class Loaded:
    """Pinned blocks of one load; a context manager yielding their views.

    The pins are a section in flight of the node (Attachment.enter): if the
    node is fenced while they are held, they stay (quarantined) until the
    views are released, and release() raises StaleViews - a reader is never
    served another block's bytes silently."""

    def __init__(self, kv: KVCache, payloads: np.ndarray, records: np.ndarray,
                 idx: np.ndarray, ctl: np.ndarray, hot=None):
        self._kv = kv
        self.payloads = payloads
        self._records = records
        self._idx, self._ctl = idx, ctl
        self._views: list[memoryview] | None = None
        self._released = False
        # (hot tier, keys, entry indexes, versions, its copy or None per block)
        self._hot = hot

    @property
    def blocks(self) -> int:
        return len(self.payloads)

    @property
    def tokens(self) -> int:
        return len(self.payloads) * self._kv.block_tokens

    def views(self) -> list[memoryview]:
        if self._released:
            raise UsageError("these blocks were released")
        if self._views is None:
            m, bb = self._kv.m, self._kv.block_bytes
            got = self._hot[4] if self._hot else [None] * len(self.payloads)
            if m.flush_meta:
                for p, g in zip(self.payloads, got):
                    if g is None:
                        m.invalidate(int(p), bb)
            self._views = [m.view(int(p), bb) if g is None else memoryview(g)
                           for p, g in zip(self.payloads, got)]
        return self._views

    def __enter__(self) -> list[memoryview]:
        return self.views()

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Drop the views and the pins (the blocks may be evicted afterwards)."""
        if self._released:
            return
        self._released = True
        if self._hot and self._views is not None:
            self._remember()
        for v in self._views or ():
            try:
                v.release()
            except BufferError:
                pass          # an export (np.frombuffer) outlives the block: documented
        self._views = None
        kv, node = self._kv, self._kv.pool.node
        try:
            node.check()
        except NodeFenced:
            pass
        if not node.fenced:
            kv.m.kv_unpin(kv._pins_off, kv.area.npins, self._records)
        node.leave()
        if node.fenced:
            stale = self._changed()
            raise StaleViews(
                f"{kv.pool.path}: node {node.slot} was fenced (its lease lapsed) while it held "
                f"views of {self.blocks} blocks; "
                + (f"blocks {stale} changed meanwhile: their views may have shown other bytes"
                   if stale else "none of them changed, but nothing more is vouched for")
                + "; reattach", stale=stale, path=kv.pool.path)

    def _changed(self) -> list[int]:
        """Indexes of loaded blocks whose hash-table entry is not the one pinned."""
        m, a = self._kv.m, self._kv.area
        out = []
        for j, (i, c) in enumerate(zip(self._idx, self._ctl)):
            off = a.entry_off(int(i))
            m.invalidate(off, 8)
            if m.load64(off) != int(c):
                out.append(j)
        return out

    def _remember(self) -> None:
        """Give the blocks read from the pool to the hot tier (still pinned,
        and only if their entries did not change meanwhile)."""
        hot, keys, idx, ctl, got = self._hot
        try:
            n = self._kv._still_valid(idx, ctl)
            if n:
                hot.keep(keys[:n], idx, ctl,
                           [v if g is None else None for v, g in zip(self._views[:n], got)])
        except Exception:                 # a cache: never fail a release over it
            pass

    def __del__(self):
        if not self._released:
            try:
                self.release()
            except Exception:
                pass


# -- operator views (no KVCache needed) ---------------------------------------------------
def namespace_stats(area: Area, i: int) -> dict:
    r = area.ns_record(i)
    totals = {f: getattr(r.stats, f) for f in layout.KV_STAT_NAMES}

    for n in nodes.read_nodes(area.pool):
        if n.state in ("attached", "claimed", "fenced"):
            st = area.node_stats(n.slot)[i]
            for f in layout.KV_STAT_NAMES:
                totals[f] += int(st[f])
    return {
        "namespace": r.name.decode("utf-8", "replace"), "index": i,
        "hash": layout.KV_HASH_NAMES.get(r.hash_kind, str(r.hash_kind)),
        "block_tokens": r.block_tokens, "block_bytes": r.block_bytes,
        "blocks": r.blocks, "bytes": r.blocks * r.block_bytes,
        "hits": totals["hit_blocks"], "misses": totals["miss_blocks"],
        "stores": totals["stored_blocks"], "present": totals["present_blocks"],
        "stored_bytes": totals["stored_bytes"], "loads": totals["loaded_blocks"],
        "loaded_bytes": totals["loaded_bytes"], "lookups": totals["lookups"],
        "evictions": r.evictions, "evicted_bytes": r.evicted_bytes,
    }


def kv_report(pool) -> dict:
    """KV usage of a pool (for `cxlkv kv stats` and `cxlkv inspect`)."""
    a = Area(pool)
    h = a.header()
    spaces = [namespace_stats(a, i) for i, r in enumerate(a.ns_records())
              if r.state == layout.KV_REC_ACTIVE]
    tenants = [{"index": i, "salted": i != 0, "quota": r.quota, "used": r.used,
                "blocks": r.blocks, "rejected": r.rejected}
               for i, r in enumerate(a.tenant_records()) if r.state == layout.KV_REC_ACTIVE]
    return {
        "hash_slots": a.nslots, "max_load_pct": pool.sb.hash_max_load_pct,
        "max_entries": a.max_used, "entries": h.live, "tombstones": h.tombstones,
        "load_pct": round(100 * h.live / a.nslots, 2),
        "used_bytes": sum(t["used"] for t in tenants),
        "evictions": h.evictions, "evicted_bytes": h.evicted_bytes,
        "namespaces": spaces, "tenants": tenants,
        "pins_per_node": a.npins, "max_namespaces": a.max_ns,
        "journal": journal.report(pool),
        # chunks taken out of use for poison / media errors (quarantine())
        "retired": {k: v for k, v in alloc.retired_summary(pool).items() if k != "entries"},
    }


def drop_namespace(pool, name: str) -> dict:
    """Evict every unpinned block of a namespace; the record is freed once
    no block is left.  Returns what was done and what stayed (pinned).

    The blocks are found in the table (the change journal records changes,
    it is no index of what a namespace holds); each eviction is journaled,
    and the freed record as NS_CLEARED, so journal readers learn of the drop
    without a pass of their own."""
    a = Area(pool)
    with pool.lock():
        idx = [i for i, r in enumerate(a.ns_records())
               if r.state == layout.KV_REC_ACTIVE and r.name == name.encode("utf-8")]
        if not idx:
            raise UsageError(f"{pool.path}: no KV namespace {name!r}")
        i = idx[0]
        blocks, nbytes = a.evict(ns=i, everything=True)
        r = a.ns_record(i)
        left = r.blocks
        t = a.entries()
        pending = int((((t["ctl"] & 0xFF) == layout.KV_PENDING) & (t["ns"] == i)).sum())
        if not left:
            # the state word first: a crash mid-zeroing leaves a free record
            a.m.store64(a.ns_off(i) + layout.field_offset(layout.KVNsStruct, "state"),
                        layout.KV_REC_FREE)
            a.m.flush(a.ns_off(i), layout.KV_NS_SIZE)
            a.m.zero(a.ns_off(i), layout.KV_NS_SIZE)
            a.journal.append(journal.NS_CLEARED, ns=i)
    return {"namespace": name, "evicted": blocks, "evicted_bytes": nbytes,
            "pinned_left": left - pending, "pending_left": pending, "dropped": not left}


def secret_fingerprint(secret: bytes) -> str:
    """A short public name of a tenant secret (compare racks without showing it)."""

    return hashlib.sha256(b"cxlkv-secret-fp\0" + bytes(secret)).hexdigest()[:16]


def set_tenant_secret(pool, secret: bytes, *, why: str = "") -> bool:
    """Replace the pool's tenant secret (the key salted tenants' block keys
    are derived under); returns whether it changed.  Takes the pool lock.

    Refused while another node is attached (its open KV handles hold salts
    derived under the old secret) or while salted tenants hold blocks (they
    would become unreachable)."""

    secret = bytes(secret)
    if len(secret) != 32:
        raise UsageError(f"a tenant secret is 32 bytes, not {len(secret)}")
    lk = pool.lock()
    with contextlib.nullcontext() if lk.held_by_me() else lk:
        if bytes(pool.sb.tenant_secret) == secret:
            return False
        area = Area(pool)
        others = [n for n in nodes.read_nodes(pool) if n.state in ("attached", "claimed")
                  and n.slot != pool.node.slot]
        salted = any(i and r.state == layout.KV_REC_ACTIVE and r.blocks
                     for i, r in enumerate(area.tenant_records()))
        if others or salted:
            raise errors.RefusedError(
                f"{pool.path}: {why or 'the tenant secret'} cannot be replaced now "
                f"({'other nodes are attached' if others else 'salted tenants hold blocks in it'})",
                path=pool.path,
                hint="replace it in a freshly formatted pool before any node attaches, or drop "
                     "the salted tenants' namespaces first")
        pool.update_superblock(tenant_secret=secret)
    return True



# -- poison quarantine -------------------------------------------------------------------
#: how many rounds quarantine() waits for readers that pin a block on the bad range
QUARANTINE_ROUNDS = 50


def blocks_covering(area: Area, offset: int, length: int) -> np.ndarray:
    """Entry indices of the KV blocks (any state but empty/tombstone) whose
    payload slot overlaps [offset, offset+length)."""
    t = area.entries()
    state = t["ctl"] & 0xFF
    live = (state != layout.KV_EMPTY) & (state != layout.KV_TOMBSTONE) & (t["payload"] != 0)
    pay = t["payload"].astype(np.int64)
    end = pay + area.slot_sizes(t["length"].astype(np.int64))
    hit = live & (pay < offset + length) & (end > offset)
    return np.flatnonzero(hit)


def quarantine(pool, offset: int, length: int, reason: str = "poison") -> dict:
    """Take a bad range of the pool (a translated poison record) out of use.

    Under the pool lock: the chunks the range touches are retired in the
    on-media list (cxlkv.state.alloc.retire_range), which the allocator never
    reuses, then every KV block whose payload slot covers the range is evicted
    (no spill: its bytes are not trusted) and so never served again.  A
    range in a metadata region is recorded and returned critical=True: the pool
    must be snapshotted and re-formatted (cxlkv-runbook(7)).  A block pinned by
    a reader is retried for QUARANTINE_ROUNDS rounds, then reported in
    "pinned" (call again: quarantine is idempotent).

    Returns {"offset", "length", "region", "critical", "evicted_blocks",
    "evicted_bytes", "pinned", "retired_chunks", "already_retired"}.
    """
    out = {"offset": offset, "length": length, "evicted_blocks": 0, "evicted_bytes": 0,
           "pinned": 0, "pending": 0}
    with pool.lock():
        # retire first: the slabs' owner becomes RETIRED_OWNER before any slot
        # is freed, so a lock-free slot allocation racing with the evictions
        # below sees a slab that is not its node's when it re-checks the owner
        # after taking a bit, and hands nothing out (the freed, poisoned slot
        # is never reused)
        r = alloc.retire_range(pool, offset, length, reason)
        region = alloc.region_of(pool, offset)
        if region == "data" and pool.sb.compat & layout.COMPAT_KV:
            a = Area(pool)
            for _ in range(QUARANTINE_ROUNDS):
                idx = blocks_covering(a, offset, length)
                if not len(idx):
                    break
                t = a.entries()
                # the covering blocks and their subtrees, leaf first (a child
                # is never left behind its evicted parent)
                sub = np.zeros(a.nslots, dtype=bool)
                sub[idx] = True
                par = t["parent"].astype(np.int64) - 1
                okp = (par >= 0) & (par < a.nslots)
                while True:
                    more = okp & ~sub
                    more[more] = sub[par[more]]
                    if not more.any():
                        break
                    sub |= more
                order = a._victims(t, None, None, None)
                pub = order[sub[order]]
                if not len(pub):
                    break                   # pinned, being written or evicted: retry later
                b, n, _blocked = a._evict_batch(pub.astype(np.uint64), t, spill=False, zero=False)
                out["evicted_blocks"] += b
                out["evicted_bytes"] += n
            left = blocks_covering(a, offset, length)
            st = a.entries()["ctl"][left] & 0xFF
            # published and still there: pinned by readers (call again);
            # reserved, not yet published: their writers' publish refuses
            # them (the chunks are retired now), recovery frees a dead one's
            out["pinned"] = int((st == layout.KV_PUBLISHED).sum())
            out["pending"] = int((st == layout.KV_PENDING).sum())
    out.update(region=r["region"], critical=r["critical"], retired_chunks=r["chunks"],
               already_retired=r["already"])
    if r["critical"]:
        log.critical("%s: %s at pool offset %#x+%#x hits the %s region (metadata): "
                     "snapshot what is readable and re-format (cxlkv-runbook(7))",
                     pool.path, reason, offset, length, r["region"])
    else:
        log.warning("%s: %s at pool offset %#x+%#x: %d KV blocks evicted, chunks %s retired",
                    pool.path, reason, offset, length, out["evicted_blocks"], r["chunks"])
    return out
