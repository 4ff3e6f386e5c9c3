"""KV events for routers: the pool's block events in vLLM's KV-events wire format.

`cxlkv serve --kv-events tcp://HOST:PORT` (or a [kv_events] table in
--config) makes the agent a candidate publisher.  Exactly one candidate of
the pool publishes (the *leader*, below); it follows the pool's change
journal (cxlkv.kv.journal) and announces every block any node of the rack
stored or evicted, once, in the order the rack made the changes.

Wire format (vLLM's vllm/distributed/kv_events.py, ZmqEventPublisher):

* a ZeroMQ PUB socket bound at the endpoint sends multipart messages
  [topic, seq, payload]: topic (default empty), seq an 8-byte big-endian
  counter starting at 0 for this publisher, payload msgpack of
  ``KVEventBatch(ts, events, data_parallel_rank)``;
* events are msgspec tagged unions (tag field "type", the class name):
  ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium)``, ``BlockRemoved(block_hashes, medium)``,
  ``AllBlocksCleared()``, inside a batch that is a msgpack array in every
  vLLM; wire "array" encodes the events as arrays too (array_like=True, the
  layout of vLLM's documented subscriber), wire "map" as maps with the newer
  fields (lora_name ...) of vLLM versions whose KVCacheEvent is not
  array_like (0.33, for one);
* a ROUTER socket at the replay endpoint (default: the PUB port + 1, as
  vLLM's 5557/5558) answers a request [empty, start seq as 8-byte
  big-endian] with every buffered batch from that seq on, each as [empty,
  seq, payload], then [empty, -1 as 8-byte signed big-endian, empty].  The
  last `buffer_steps` batches are kept.  A request for a seq older than the
  buffer also gets what the buffer has (the first reply's seq shows the
  gap) and makes the next published batch a *resync*.

What is published.  block_hashes are the blocks' names (cxlkv.kv.names):
the chain hash each block was keyed by - for the vLLM connector's blocks
(and any namespace keyed with hash="sha256_cbor"), vLLM's own block hash,
32 bytes; for xxh3_128 namespaces the 16-byte xxh3-128 chain hash; for the
SGLang and LMCache backends the page or chunk hash they were given.  With
hashes = "int" a name is sent as vLLM sends it with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: its last 8 bytes as a big-endian
unsigned int.  A block without a name (a pool formatted without the NAMES
feature, a block stored by a cxlkv without it, a name longer than 40
bytes) is published under its pool key instead (16 bytes: key_lo then key_hi
little-endian; the same int conversion), and counted as "unnamed"; a router
maps its hashes to pool keys with ``KVCache.keys_for_hashes``.
parent_block_hash is the parent block's name (None for a first block);
token_ids are the blocks' token ids, kept with their names (up to the
pool's name_tokens a block, `cxlkv format --name-tokens`; read from the hash
entry when the event is sent: a block evicted and its entry reused by then,
one with more tokens, or one stored by hashes without tokens goes out with
token_ids empty, in a BlockStored of its own, counted as "no_tokens"); block_size is the namespace's block_tokens; lora_id
None; medium the configured tier name ("cxl").  Consecutive stores of one
chain in one namespace go into one BlockStored (its token_ids those of all
its blocks, in order, as vLLM sends them).

Resyncs.  The publisher never loses a change silently: when the journal
reader resyncs (a ring overrun, torn or reused ring, a re-formatted pool),
when a namespace is dropped (`kv drop`: the journal says only "namespace
cleared"), when a subscriber asks to replay a seq older than the buffer, and
when this agent becomes the leader, it publishes AllBlocksCleared followed by
a BlockStored for every block published in the pool (the whole state, to
replace what subscribers knew; parents before their children).  Delivery after a resync is at least once.

Leader.  Candidates mark their node slot with the flag NODE_FLAG_KV_EVENTS
(the node's identity line, written only by the node itself).  A candidate
that sees no attached node with the flag sets its own under the pool lock
(after checking again), so at most one attached node holds it; when the
leader detaches or dies its slot leaves the attached state (detach, or
fencing by the reaper) and another candidate takes over within
LEADER_CHECK_S, starting with a resync.  A re-attach rewrites the identity
without the flag: a fenced leader that resumes has lost its place.

Threads: one publisher thread owns the sockets, the journal reader and the
replay buffer; suspended() lets the agent close or replace its pool while
the thread is outside it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import threading
import time
from collections import deque

import msgspec
import numpy as np
import zmq

from cxlkv.errors import CxlkvError, NodeFenced, RefusedError, UsageError
from cxlkv.kv import journal, names
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.state import nodes as node_table

log = logging.getLogger(__name__)

#: how often a candidate looks at the node table for the leader
LEADER_CHECK_S = 0.25
END_SEQ = (-1).to_bytes(8, "big", signed=True)
WIRES = ("array", "map")
HASH_FORMATS = ("bytes", "int")
_FLAGS = layout.field_offset(layout.NodeStruct, "flags")


# -- the wire types ----------------------------------------------------------------------
def wire_types(wire: str):
    """(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared) msgspec
    types of a wire format: the batch is always an array (vLLM's EventBatch);
    its events are arrays ("array": array_like=True) or maps ("map")."""
    if wire not in WIRES:
        raise UsageError(f"kv_events wire must be one of {', '.join(WIRES)}, not {wire!r}")
    arr = wire == "array"

    class KVCacheEvent(msgspec.Struct, array_like=arr, omit_defaults=True, gc=False, tag=True):
        pass

    if arr:
        class BlockStored(KVCacheEvent):
            block_hashes: list
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
    else:
        class BlockStored(KVCacheEvent):        # the newer vLLM's fields, by name
            block_hashes: list
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None               # no default: always sent (vLLM requires it)

    class BlockRemoved(KVCacheEvent):
        block_hashes: list
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    # the batch is an array in every vLLM (EventBatch is array_like); the
    # wire chooses how the events inside it are encoded
    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


# -- settings ------------------------------------------------------------------------------
#: the longest the publisher waits on its replay socket before looking at stop()
STOP_SLICE_S = 0.1


@dataclasses.dataclass(frozen=True)
class KVEventsSettings:
    endpoint: str                        # tcp://HOST:PORT (port 0: any free one)
    replay_endpoint: str | None          # None: no replay socket
    topic: str = ""
    medium: str = "cxl"
    wire: str = "array"
    hashes: str = "bytes"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_events: int = 1024               # events per KVEventBatch
    poll_interval: float = 0.005         # seconds between journal polls when idle
    data_parallel_rank: int = 0


_TABLE_KEYS = {f.name for f in dataclasses.fields(KVEventsSettings)}


def check_endpoint(text: str, what: str = "--kv-events") -> tuple[str, str, int]:
    """(scheme, host, port) of tcp://HOST:PORT (HOST an IP address, [IPv6],
    `*` or localhost; port 0 picks a free one), or UsageError naming it."""
    example = "e.g. tcp://127.0.0.1:5557"
    if not isinstance(text, str) or "://" not in text:
        raise UsageError(f"{what} {text!r}: expected tcp://HOST:PORT ({example})")
    scheme, _, rest = text.partition("://")
    if scheme != "tcp":
        raise UsageError(f"{what} {text!r}: only tcp:// endpoints are supported ({example})")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{what} {text!r}: expected tcp://HOST:PORT with a port in 0-65535 "
                         f"({example})")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare not in ("*", "localhost"):
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            raise UsageError(f"{what} {text!r}: the host must be an IP address of this "
                             f"machine, [IPv6], * or localhost ({example})") from None
    return scheme, host, int(port)


def settings(endpoint: str | None, table: dict | None,
             where: str = "[kv_events]") -> KVEventsSettings | None:
    """The publisher's settings from --kv-events and the [kv_events] table
    (the flag wins over the table's `endpoint`), or None when neither names
    an endpoint; UsageError for anything that does not fit."""
    table = dict(table or {})
    bad = sorted(set(k.replace("-", "_") for k in table) - _TABLE_KEYS)
    if bad:
        raise UsageError(f"{where}: unknown setting(s) {', '.join(bad)} (known: "
                         f"{', '.join(sorted(_TABLE_KEYS))})")
    table = {k.replace("-", "_"): v for k, v in table.items()}
    ep = endpoint or table.pop("endpoint", None)
    table.pop("endpoint", None)
    if not ep:
        if table:
            raise UsageError(f"{where} needs endpoint = \"tcp://HOST:PORT\" (or --kv-events)")
        return None
    what = "--kv-events" if endpoint else f"{where} endpoint"
    _, host, port = check_endpoint(ep, what)
    if "replay_endpoint" in table:
        replay = table.pop("replay_endpoint")
        if replay in ("", "none", None):
            replay = None
        else:
            check_endpoint(replay, f"{where} replay_endpoint")
            if replay == ep:
                raise UsageError(f"{where} replay_endpoint is the PUB endpoint {ep}")
    else:
        replay = f"tcp://{host}:{port + 1 if port else 0}"
        if port == 65535:
            raise UsageError(f"{what} {ep!r}: the replay socket takes the next port; "
                             "choose another port or set replay_endpoint")
    kinds = {"topic": str, "medium": str, "wire": str, "hashes": str, "buffer_steps": int,
             "hwm": int, "max_events": int, "poll_interval": (int, float),
             "data_parallel_rank": int}
    for k, v in table.items():
        if isinstance(v, bool) or not isinstance(v, kinds[k]):
            raise UsageError(f"{where} {k} = {v!r} has the wrong type")
    s = KVEventsSettings(endpoint=ep, replay_endpoint=replay, **table)
    if s.wire not in WIRES:
        raise UsageError(f"{where} wire must be one of {', '.join(WIRES)}, not {s.wire!r}")
    if s.hashes not in HASH_FORMATS:
        raise UsageError(f"{where} hashes must be one of {', '.join(HASH_FORMATS)}, "
                         f"not {s.hashes!r}")
    if s.buffer_steps < 1 or s.hwm < 1 or s.max_events < 1 or s.data_parallel_rank < 0:
        raise UsageError(f"{where}: buffer_steps, hwm and max_events must be positive, "
                         "data_parallel_rank not negative")
    if not 0 < s.poll_interval <= 10:
        raise UsageError(f"{where} poll_interval must be in (0, 10] seconds")
    return s


# -- the leader flag -----------------------------------------------------------------------
def flagged_slots(pool) -> list[int]:
    """Attached node slots whose identity (for their current epoch) carries
    NODE_FLAG_KV_EVENTS."""
    m = pool.mapping
    out = []
    for n in node_table.read_nodes(pool):           # invalidates the node region
        if n.state != "attached" or n.ident_epoch != n.epoch:
            continue
        off = node_table.node_offset(pool, n.slot) + _FLAGS
        if int.from_bytes(m.read(off, 4), "little") & layout.NODE_FLAG_KV_EVENTS:
            out.append(n.slot)
    return out


def _set_flag(pool, on: bool) -> None:
    """Set or clear this node's flag (its identity line: written by the node only)."""
    off = node_table.node_offset(pool, pool.node.slot) + _FLAGS
    m = pool.mapping
    m.invalidate(off, 4)
    v = int.from_bytes(m.read(off, 4), "little")
    v = v | layout.NODE_FLAG_KV_EVENTS if on else v & ~layout.NODE_FLAG_KV_EVENTS
    m.write(off, v.to_bytes(4, "little"))
    m.flush(off, 4)


def parents_first(recs: np.ndarray) -> np.ndarray:
    """A resync's records (the table, in slot order) ordered by depth in their
    chains, so that a block comes after its parent (routers that keep a tree
    drop a child whose parent they do not know).  Vectorised: parents found by
    key (a sorted search on key_lo, hi checked), depths by pointer doubling
    (log2 of the longest chain rounds)."""
    n = len(recs)
    if n < 2:
        return recs
    lo, hi = recs["key_lo"], recs["key_hi"]
    plo, phi = recs["parent_lo"], recs["parent_hi"]
    srt = np.argsort(lo, kind="stable")
    pos = np.minimum(np.searchsorted(lo[srt], plo), n - 1)
    cand = srt[pos]
    found = (lo[cand] == plo) & (hi[cand] == phi) & ((plo != 0) | (phi != 0))
    anc = np.where(found & (cand != np.arange(n)), cand, -1)
    dist = (anc >= 0).astype(np.int64)
    for _ in range(64):                            # 2**64 > any chain; a cycle (damage) stops
        m = anc >= 0
        if not m.any():
            break
        up = anc[m]
        dist[m] = dist[m] + dist[up]
        anc[m] = anc[up]
    return recs[np.argsort(dist, kind="stable")]


# -- the publisher -------------------------------------------------------------------------
class KVEventsPublisher:
    """One agent's candidate publisher (see the module doc).

    bind() opens the sockets (RefusedError when an address is taken), start(
    pool_of, lock) runs the thread: pool_of() returns the agent's attached
    pool or None; lock() is a context manager holding the pool lock."""

    def __init__(self, s: KVEventsSettings, logger: logging.Logger | None = None):
        self.s = s
        self.log = logger or log
        self.types = wire_types(s.wire)
        self._extra = {"lora_name": None} if s.wire == "map" else {}
        self._enc = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        self.endpoint = self.replay_endpoint = None
        self.leader = False
        self._seq = 0
        self._buffer: deque = deque(maxlen=s.buffer_steps)
        self._reader: journal.JournalReader | None = None
        self._resync_wanted = ""
        self._block_tokens: dict[int, int] = {}
        self._area: Area | None = None
        self._busy = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool_of = self._lock = None
        self.error = ""
        self._last_failure = ""
        self._said_unnamed = False
        self._names: names.Names | None = None
        self.lags_ms: deque = deque(maxlen=100_000)
        self.stats = {"batches": 0, "events": 0, "stored": 0, "removed": 0, "cleared": 0,
                      "unnamed": 0, "no_tokens": 0,
                      "resyncs": 0, "replays": 0, "replayed_batches": 0, "leader_changes": 0,
                      "failures": 0}

    # -- sockets ---------------------------------------------------------------------
    def bind(self) -> None:
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self.s.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = self._bind(self._pub, self.s.endpoint)
            if self.s.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._replay, self.s.replay_endpoint)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _bind(sock, ep: str) -> str:
        _, host, port = check_endpoint(ep)
        addr = f"tcp://{host}:{port if port else '*'}"
        if host.startswith("[") or host == "*":
            sock.setsockopt(zmq.IPV6, 1)               # [IPv6], and * on both families
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            raise RefusedError(f"--kv-events: cannot bind {ep}: {e.strerror}",
                               hint="choose a free port on an address of this host") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if not self._ctx.closed:
            self._ctx.term()

    # -- the thread ------------------------------------------------------------------
    def start(self, pool_of, lock) -> None:
        self._pool_of, self._lock = pool_of, lock
        self._thread = threading.Thread(target=self._run, name="cxlkv-kv-events", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """Give up the leader flag (another candidate takes over at once), stop
        the thread and close the sockets."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
        if t is None or not t.is_alive():
            self.close()

    @contextlib.contextmanager
    def suspended(self):
        """The thread stays out of the pool meanwhile (the agent detaches or
        re-attaches); it starts again from the leader check afterwards."""
        with self._busy:
            self._reader, self._area, self._names = None, None, None
            self._block_tokens.clear()
            if self.leader:
                self.leader = False
                self.stats["leader_changes"] += 1
            yield

    def _run(self) -> None:
        next_check = 0.0
        try:
            while not self._stop.is_set():
                sent = 0
                with self._busy:
                    try:
                        sent, next_check = self._round(next_check)
                    except Exception as e:     # noqa: BLE001 - a daemon keeps going
                        self._failed(e)
                self._serve_replay(0 if sent else self.s.poll_interval)
            with self._busy:
                pool = self._pool_of()
                if self.leader and pool is not None and pool.node is not None:
                    with contextlib.suppress(CxlkvError, NodeFenced):
                        _set_flag(pool, False)
                self.leader = False
        except BaseException as e:      # noqa: BLE001 - reported by the agent's health
            self.error = f"{type(e).__name__}: {e}"
            self.leader = False
            self.log.error("kv events publisher died: %s", self.error)

    def _round(self, next_check: float) -> tuple[int, float]:
        """One round: the leader check when due, then (as leader) one journal
        poll published.  Returns (events sent, when the next check is due)."""
        pool = self._pool_of()
        if pool is None or pool.node is None:
            return 0, next_check
        if time.monotonic() >= next_check:
            self._check_leader(pool)
            next_check = time.monotonic() + LEADER_CHECK_S
        if not self.leader:
            return 0, next_check
        try:
            pool.node.check()                 # a fenced leader (paused, resumed) stops at once
        except NodeFenced:
            self._step_down("this node was fenced")
            return 0, next_check
        return self._pump(pool), next_check

    def _failed(self, e: Exception) -> None:
        """A round failed (the pool lock timed out, the agent is stopping, the
        pool could not be read): what the journal reader had advanced past may
        not have been sent, so the next round starts with a resync."""
        msg = str(e) if isinstance(e, CxlkvError) else f"{type(e).__name__}: {e}"
        if msg != self._last_failure and not self._stop.is_set():
            self.log.warning("kv events: a round failed (%s); the next one resyncs", msg)
        self._last_failure = msg
        self.stats["failures"] += 1
        self._reader = None
        self._stop.wait(min(1.0, 10 * self.s.poll_interval))

    def _check_leader(self, pool) -> None:
        me = pool.node.slot
        try:
            pool.node.check()
        except NodeFenced:
            self._step_down("this node was fenced")
            return
        flagged = flagged_slots(pool)
        if me in flagged:
            if not self.leader:
                self._become_leader()
            return
        if self.leader:
            self._step_down("the flag is gone (re-attached)")
        if flagged:
            return
        with self._lock():
            if flagged_slots(pool):
                return
            _set_flag(pool, True)
        self._become_leader()

    def _become_leader(self) -> None:
        self.leader = True
        self.stats["leader_changes"] += 1
        self._reader = None                       # the first poll is a resync
        self.log.info("kv events: this agent publishes the pool's block events on %s",
                      self.endpoint)

    def _step_down(self, why: str) -> None:
        if self.leader:
            self.log.warning("kv events: no longer the publisher (%s)", why)
            self.stats["leader_changes"] += 1
        self.leader = False
        self._reader = None

    # -- journal -> events -------------------------------------------------------------
    def _external(self, b: bytes):
        """A hash as vLLM puts it in an event: bytes, or (hashes = "int") the
        big-endian int of its last 8 bytes (vLLM's maybe_convert_block_hash)."""
        return b if self.s.hashes == "bytes" else int.from_bytes(b[-8:], "big")

    def _key(self, lo: int, hi: int):
        return self._external(int(lo).to_bytes(8, "little") + int(hi).to_bytes(8, "little"))

    def _bsize(self, pool, ns: int) -> int:
        bt = self._block_tokens.get(ns)
        if bt is None:
            if self._area is None:
                self._area = Area(pool)
            bt = int(self._area.ns_record(ns).block_tokens)
            self._block_tokens[ns] = bt
        return bt

    def _pump(self, pool) -> int:
        """One journal poll, published; returns how many events were sent."""
        if self._reader is None or self._resync_wanted:
            if not names.has_names(pool) and not self._said_unnamed:
                self._said_unnamed = True
                self.log.warning("kv events: %s was formatted without block names (feature "
                                 "NAMES): blocks are published under their pool keys, not the "
                                 "engines' hashes", pool.path)
            if self._resync_wanted:
                self.log.info("kv events: resync (%s)", self._resync_wanted)
            self._reader = journal.JournalReader(pool, start="resync")
            self._resync_wanted = ""
        ch = self._reader.poll()
        if ch.resync:
            self._block_tokens.clear()
            self.stats["resyncs"] += 1
            for r in ch.reasons:                  # start, overrun, torn, writer, reset
                self.stats[f"resync_{r}"] = self.stats.get(f"resync_{r}", 0) + 1
            return self._send(pool, parents_first(ch.records), clear=True)
        recs = ch.records
        if not len(recs):
            return 0
        cleared = np.flatnonzero(recs["op"] == journal.NS_CLEARED)
        if len(cleared):                            # what came before, then the whole state
            sent = self._send(pool, recs[:cleared[0]])
            self._resync_wanted = "a namespace was dropped"
            return sent + self._pump(pool)
        return self._send(pool, recs)

    def _send(self, pool, recs: np.ndarray, clear: bool = False) -> int:
        batch_t, stored_t, removed_t, cleared_t = self.types
        medium = self.s.medium
        events: list = [cleared_t()] if clear else []
        if clear:
            self.stats["cleared"] += 1
        prev = None                                  # (ns, key) of the last stored block
        now_us = time.time_ns() // 1000
        cols = [recs[f].tolist() for f in ("op", "key_lo", "key_hi", "parent_lo", "parent_hi",
                                           "ns", "tenant", "time_us", "name_len",
                                           "parent_name_len")]
        name, pname = recs["name"], recs["parent_name"]
        toks = self._tokens(pool, recs)
        has_toks = False                             # does the last BlockStored carry tokens
        sent = 0
        for i, (op, klo, khi, plo, phi, ns, tenant, t_us, nlen, plen) in enumerate(zip(*cols)):
            if op not in (journal.STORED, journal.EVICTED):
                continue
            if nlen:
                key = self._external(name[i, :nlen].tobytes())
            else:
                key = self._key(klo, khi)
                self.stats["unnamed"] += 1
            if op == journal.STORED:
                if not (plo or phi):
                    parent = None
                elif plen:
                    parent = self._external(pname[i, :plen].tobytes())
                else:
                    parent = self._key(plo, phi)
                last = events[-1] if events else None
                tk = toks[i]
                if tk is None:
                    self.stats["no_tokens"] += 1
                if (prev is not None and prev == (ns, tenant, parent)
                        and isinstance(last, stored_t) and has_toks == (tk is not None)):
                    last.block_hashes.append(key)
                    if tk is not None:
                        last.token_ids.extend(tk)
                else:
                    events.append(stored_t(block_hashes=[key], parent_block_hash=parent,
                                           token_ids=tk or [], block_size=self._bsize(pool, ns),
                                           lora_id=None, medium=medium, **self._extra))
                    has_toks = tk is not None
                prev = (ns, tenant, key)
                self.stats["stored"] += 1
            elif op == journal.EVICTED:
                last = events[-1] if events else None
                if isinstance(last, removed_t):
                    last.block_hashes.append(key)
                else:
                    events.append(removed_t(block_hashes=[key], medium=medium))
                prev = None
                self.stats["removed"] += 1
            if not clear:
                self.lags_ms.append((now_us - t_us) / 1000.0)
            if len(events) >= self.s.max_events:
                sent += self._emit(events[:-1])
                events = events[-1:]
        if events:
            sent += self._emit(events)
        return sent

    def _tokens(self, pool, recs: np.ndarray) -> list:
        """The token ids of the STORED records' blocks, read from their hash
        entries' names (None where the entry no longer keeps them for that
        block, or never did), in slices."""
        out: list = [None] * len(recs)
        if self._names is None or self._names.pool is not pool:
            self._names = names.Names.of(pool)
        nm = self._names
        if nm is None:
            return out
        entry = recs["entry"].astype(np.int64)
        sel = np.flatnonzero((recs["op"] == journal.STORED) & (entry > 0)
                             & (entry <= nm.nslots))
        for a in range(0, len(sel), 4096):
            part = sel[a:a + 4096]
            got = nm.tokens(entry[part] - 1, recs["key_lo"][part], recs["key_hi"][part])
            for i, t in zip(part.tolist(), got):
                out[i] = t
        return out

    def _emit(self, events: list) -> int:
        if not events:
            return 0
        batch_t = self.types[0]
        payload = self._enc.encode(batch_t(ts=time.time(), events=events,
                                           data_parallel_rank=self.s.data_parallel_rank))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self.s.topic.encode(), seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats["batches"] += 1
        self.stats["events"] += len(events)
        return len(events)

    # -- replay ----------------------------------------------------------------------
    def _serve_replay(self, timeout_s: float) -> None:
        if self._replay is None:
            self._stop.wait(timeout_s)
            return
        # in slices, so that stop() is seen within one (a poll_interval of
        # seconds otherwise outlived the stop's timeout, thread and sockets too)
        end = time.monotonic() + timeout_s
        while not self._replay.poll(int(min(STOP_SLICE_S, max(0.0, end - time.monotonic()))
                                        * 1000)):
            if self._stop.is_set() or time.monotonic() >= end:
                return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self.log.warning("kv events: ignored a malformed replay request (%d frames)",
                                 len(frames))
                continue
            client, _, start = frames
            start = int.from_bytes(start, "big")
            self.stats["replays"] += 1
            oldest = self._buffer[0][0] if self._buffer else self._seq
            if start < oldest:
                self._resync_wanted = (f"a subscriber asked to replay from seq {start}, "
                                       f"older than the buffer (from {oldest})")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                    self.stats["replayed_batches"] += 1
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def report(self) -> dict:
        lags = np.array(self.lags_ms) if self.lags_ms else None
        return {**self.stats, "leader": self.leader, "next_seq": self._seq,
                "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "lag_ms_p50": None if lags is None else round(float(np.percentile(lags, 50)), 3),
                "lag_ms_p99": None if lags is None else round(float(np.percentile(lags, 99)), 3)}
