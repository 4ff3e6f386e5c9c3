"""The remote tier's synchronous facade for ordinary threaded code
(`RemoteClient`) over a `RemoteTier` (cxlkv.remote.base; by default the
Redis Cluster one, cxlkv.remote.redis_cluster).

    from cxlkv.remote import RemoteClient, RemoteConfig

    rc = RemoteClient(RemoteConfig(nodes=("10.0.1.5:6379",), wait_replicas=1))
    rc.register_namespace(ns_digest, "llama-3-8b/bf16/paged16")
    views = rc.lookup(ns_digest, keys, block_bytes, budget_s=0.005)   # memoryview | None each
    rc.exists(ns_digest, keys, budget_s=0.002)                        # bool each
    rc.push(key, ns_digest, payload)        # write-behind: True queued, False dropped / known
    rc.flush(5.0); rc.stats(); rc.close()

RemoteClient never raises to its caller once constructed: a slow cluster is
a timeout, a down one an error, both answered as misses within the caller's
budget and counted in stats(); a full queue, a down cluster and a cluster
over its memory budget drop pushes (counted per kind, one log line per
kind).  One background thread runs an asyncio loop with the tier's
connections (exists, deletes, names, used_memory - and every operation of a
tier passed in); lookups on the default tier run on the caller's thread
through `cxlkv.remote.fastpath` (its own pipelines, no hop), and the writer
hands each batch of pushes to one sender thread that does the same.

Keys in the cluster: `<prefix><ns8>:<key32>` - the namespace digest's first
8 hex digits, then the 16-byte block key in hex - and the hash
`<prefix>ns` maps each namespace digest (32 hex) to its name.  Values are
`cxlkv.remote.value`: a 72-byte header + payload, written with SET NX (blocks
are immutable: content-addressed) and EX ttl_s.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time

from cxlkv.errors import CorruptValue, RemoteError, RemoteUnavailable
from cxlkv.remote import value
from cxlkv.remote.base import Batch, RemoteTier
from cxlkv.remote.config import RemoteConfig
from cxlkv.remote.fastpath import FastCluster

log = logging.getLogger(__name__)

#: the writer sends batches of at most this many value bytes (pipelined)
BATCH_BYTES = 8 << 20
#: lookups split in concurrent chunks of about this many value bytes, so
#: that a budget running out still returns the chunks that arrived
CHUNK_BYTES = 4 << 20
#: how often the writer reads the cluster's used_memory when max_bytes is set
BUDGET_POLL_S = 2.0
#: after the cluster was found unreachable, lookups are misses and pushes are
#: dropped at once for this long (then the next call tries again)
RETRY_S = 1.0
#: reads in a row that got no answer at all within their budget before the
#: cluster is treated as unreachable too (a black-holed network refuses
#: nothing: without this every read would wait its whole budget)
SILENT_READS = 3


def key_name(prefix: str, ns_digest: bytes, key: bytes) -> bytes:
    """The cluster key of block `key` of namespace `ns_digest`."""
    return f"{prefix}{bytes(ns_digest)[:4].hex()}:{bytes(key).hex()}".encode()


def ns_hash_name(prefix: str) -> bytes:
    return f"{prefix}ns".encode()


def _keys16(keys) -> list[bytes]:
    out = [bytes(k) for k in keys]
    for k in out:
        if len(k) != 16:
            raise ValueError(f"a block key is 16 bytes, not {len(k)}")
    return out


def _digest16(d) -> bytes:
    d = bytes(d)
    if len(d) != 16:
        raise ValueError(f"a namespace digest is 16 bytes, not {len(d)}")
    return d


_COUNTERS = ("lookups", "hits", "misses", "hit_bytes", "corrupt", "incompatible", "deleted",
             "timeouts", "errors", "skipped", "exists_checked", "pushed", "pushed_bytes",
             "pushed_replicated", "present", "dropped_queue-full", "dropped_unavailable",
             "dropped_over-budget", "dropped_closed",
             # counted by the KV cache's read-through (cxlkv.kv.cache)
             "promoted", "promote_failed")


def _assemble(chunks: list, arrived: list) -> tuple[list, str | None]:
    """The answers of `chunks` in order, None for each key of a chunk that
    has not arrived; and the first error an arrived chunk reported."""
    res: list = []
    err = None
    for c, r in zip(chunks, list(arrived)):
        if r is None:
            res.extend([None] * len(c))
            continue
        res.extend(r)
        if getattr(r, "failed", 0) and err is None:
            err = getattr(r, "error", None) or "some keys failed"
    return res, err

class RemoteClient:
    """The synchronous facade (see the module doc).  `tier`: a RemoteTier, or
    a callable returning one (called on the client's loop thread); default:
    RedisClusterTier(config).  `fast`: GETs and SETs through
    cxlkv.remote.fastpath when the tier is the default one on plain TCP
    (default: the config's `fast`, on unless the config turns it off)."""

    def __init__(self, config: RemoteConfig | None = None, *, tier=None,
                 batch_bytes: int = BATCH_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 budget_poll_s: float = BUDGET_POLL_S, retry_s: float = RETRY_S,
                 name: str = "cxlkv-remote", on_written=None, logger=None,
                 fast: bool | None = None):
        self.config = config if config is not None else RemoteConfig()
        if tier is None:
            self.config.require_nodes()
            self.config.secret()              # a missing password file: an error now
        self.batch_bytes = max(1, batch_bytes)
        self.chunk_bytes = max(1, chunk_bytes)
        self.budget_poll_s = budget_poll_s
        self.retry_s = retry_s
        #: called on the client's thread with (key, replicated) for each block
        #: the cluster stored (replicated: confirmed on wait_replicas replicas)
        self.on_written = on_written
        #: a logging.Logger for the once-per-kind lines (default: this module's)
        self.logger = logger if logger is not None else log
        self._prefix = self.config.prefix
        self._mu = threading.Lock()           # queue, counters, flags
        self._idle = threading.Condition(self._mu)
        self.counters: collections.Counter = collections.Counter()
        self._logged: set[str] = set()
        self._q: collections.deque = collections.deque()
        self._queued: set[bytes] = set()
        self._pending = 0                     # value bytes queued or being sent
        self._writer_busy = False
        self._wake_sent = False
        self._down_until = 0.0
        #: the last operation's failure, until one succeeds (health: the
        #: cluster is failing even while the back-off has run out)
        self._failing: str | None = None
        self._silent = 0                      # reads in a row with no answer at all
        self._over = False
        self._used: int | None = None         # last used_memory polled (+ pushed since)
        self._polled_at = -1e18
        self._names_done: set[bytes] = set()
        self._naming: set = set()             # name records in flight (close waits)
        self._closed = False
        self._warming: concurrent.futures.Future | None = None
        self.loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        #: the fast path (None: everything goes through the tier) and the
        #: one thread that sends the writer's batches through it
        self._fast: FastCluster | None = None
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        if fast is None:
            fast = self.config.fast
        if tier is None and fast and not self.config.tls:
            self._fast = FastCluster(self.config)
            self._sender = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"{name}-send")
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()
        try:
            self.tier: RemoteTier = self._call(self._make_tier(tier), None)
            self._writer_task = self._call(self._start_writer(), None)
            if self._fast is not None:
                # puts and lookups take the fast path; exists, names and INFO
                # still go through the tier: connect it now, off any caller's
                # budget (its first connection is a cluster discovery)
                self._warming = self._spawn(self._warm())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
            raise

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until the connection made in the background at start (the
        tier's, which exists, names and INFO take while the fast path does
        puts and lookups) is up or has failed; False if `timeout` seconds
        passed first.  Nothing needs to wait for it: a call that needs it
        meanwhile waits itself."""
        fut = self._warming
        if fut is None:
            return True
        try:
            fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    @property
    def fast(self) -> FastCluster | None:
        """The fast path (None: every operation goes through the tier)."""
        return self._fast

    # -- the loop thread ----------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro, timeout):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _spawn(self, coro) -> concurrent.futures.Future | None:
        """Run `coro` on the loop (None when the client is closing: the loop
        may be gone)."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:                       # the loop is closed
            coro.close()
            return None

    async def _warm(self) -> None:
        connect = getattr(self.tier, "client", None)
        if connect is None:
            return
        try:
            await connect()
        except Exception:                          # noqa: BLE001 - the first real call says why
            pass

    async def _make_tier(self, tier):
        if tier is None:
            from cxlkv.remote.redis_cluster import RedisClusterTier

            return RedisClusterTier(self.config)
        return tier() if callable(tier) and not isinstance(tier, RemoteTier) else tier

    async def _start_writer(self):
        self._wake = asyncio.Event()
        return asyncio.get_running_loop().create_task(self._writer())

    # -- bookkeeping --------------------------------------------------------------------
    def _bump(self, name: str, n: int = 1) -> None:
        with self._mu:
            self.counters[name] += n

    def count(self, name: str, n: int = 1) -> None:
        """Add n to the counter `name` of stats() (the KV cache's read-through
        counts `promoted` and `promote_failed` here)."""
        self._bump(name, n)

    def _log_once(self, kind: str, msg: str) -> None:
        with self._mu:
            if kind in self._logged:
                return
            self._logged.add(kind)
        line = f"{self.config.scrub(msg)}; counted in stats(), logged once"
        self.logger.warning(f"remote: {line}", extra={"fields": {"remote": kind}})

    def _drop(self, kind: str, n: int = 1, err: str | None = None) -> None:
        self._bump(f"dropped_{kind}", n)
        self._log_once(f"drop-{kind}", f"dropping pushed blocks ({kind}"
                                       f"{': ' + err if err else ''})")

    def _down(self, err: str) -> None:
        with self._mu:
            self._down_until = time.monotonic() + self.retry_s
        self._log_once("unavailable", f"cluster unavailable ({err}): lookups are misses, "
                                      "pushes are dropped until it answers again")

    def _failed(self, err: str | None) -> None:
        """Record the outcome of a cluster operation (None: it worked)."""
        self._failing = None if err is None else self.config.scrub(str(err))

    def _silence(self, op: str, answered: bool) -> None:
        """Count reads that got no answer at all; SILENT_READS in a row back
        off as an unreachable cluster does."""
        with self._mu:
            self._silent = 0 if answered else self._silent + 1
            n = self._silent
        if n >= SILENT_READS:
            with self._mu:
                self._silent = 0
            self._down(f"{op}: no answer to {n} reads in a row")

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _name(self, ns_digest: bytes, key) -> bytes:
        return key_name(self._prefix, ns_digest, key)

    # -- reads ----------------------------------------------------------------------------
    def lookup(self, ns_digest: bytes, keys, block_bytes: int,
               budget_s: float) -> list[memoryview | None]:
        """The payloads of blocks `keys` (16-byte keys) of namespace
        `ns_digest`, verified; None for each miss.  Returns within budget_s:
        chunks that have not arrived by then are misses (counted `timeouts`);
        an unreachable cluster is all misses (`errors`, then `skipped` for
        RETRY_S).  A damaged value is a miss, counted `corrupt` and deleted
        in the background; an intact one this reader cannot use (a newer
        format, another block size) is a miss counted `incompatible`."""
        start = time.monotonic()
        deadline = start + max(0.0, budget_s)
        keys = _keys16(keys)
        ns_digest = _digest16(ns_digest)
        n = len(keys)
        out: list[memoryview | None] = [None] * n
        if n == 0:
            return out
        self._bump("lookups")
        if self._closed or self._is_down():
            self._bump("skipped")
            self._bump("misses", n)
            return out
        names = [self._name(ns_digest, k) for k in keys]
        per = max(1, self.chunk_bytes // (block_bytes + value.HEADER_SIZE))
        raw = self._fetch(names, per, deadline, "get_many")
        bad = []
        hits = 0
        for i, v in enumerate(raw):
            if v is None:
                continue
            try:
                out[i] = value.decode(keys[i], ns_digest, block_bytes, v)
                hits += 1
            except CorruptValue as e:
                if e.damaged:
                    self._bump("corrupt")
                    bad.append((names[i], keys[i]))
                    self._log_once("corrupt", f"{names[i].decode()}: damaged value ({e}) "
                                              "deleted: a miss")
                else:
                    self._bump("incompatible")
                    self._log_once("incompatible", f"{names[i].decode()}: {e}: a miss, kept")
        with self._mu:
            self.counters["hits"] += hits
            self.counters["misses"] += n - hits
            self.counters["hit_bytes"] += hits * block_bytes
        if bad:
            self._spawn(self._delete_damaged(ns_digest, block_bytes, bad))
        return out

    def exists(self, ns_digest: bytes, keys, budget_s: float) -> list[bool]:
        """Whether each block is in the cluster (values not read nor checked;
        False for a miss, a timeout or an error), within budget_s."""
        deadline = time.monotonic() + max(0.0, budget_s)
        keys = _keys16(keys)
        ns_digest = _digest16(ns_digest)
        if not keys:
            return []
        self._bump("exists_checked", len(keys))
        if self._closed or self._is_down():
            self._bump("skipped")
            return [False] * len(keys)
        names = [self._name(ns_digest, k) for k in keys]
        got = self._fetch(names, 4096, deadline, "exists_many")
        return [bool(x) for x in got]

    def _fetch(self, names: list[bytes], per: int, deadline: float, op: str) -> list:
        """Run tier.<op> over chunks of `names` on the loop; what arrived by
        `deadline` (the rest None).  Counts timeouts and errors."""
        # the loop answers a little before the deadline with what it has; the
        # caller waits until the deadline, and gives up on the loop after it -
        # keeping the chunks that had arrived by then (each is stored in
        # `arrived` as it completes, on the loop thread), since a loaded host
        # can wake the loop later than the margin
        left = deadline - time.monotonic()
        inner = deadline - min(0.005, 0.2 * max(0.0, left))
        chunks = [names[i:i + per] for i in range(0, len(names), per)]
        arrived: list = [None] * len(chunks)
        fut = None
        try:
            if op == "get_many" and self._fast is not None:
                # on this thread: the fast path's own pipelines, within the budget
                res, timed_out, err, unavailable = self._fast.get_many(names, deadline, per)
            else:
                fut = self._spawn(self._gather(op, chunks, arrived, inner))
                if fut is None:
                    return [None] * len(names)
                res, timed_out, err, unavailable = fut.result(
                    max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            res, err = _assemble(chunks, arrived)
            timed_out, unavailable = True, False
        except Exception as e:                     # noqa: BLE001 - never raise to the caller
            if fut is not None:
                fut.cancel()
            self._bump("errors")
            self._log_once("error", f"{op}: {type(e).__name__}: {e}")
            self._failed(f"{op}: {type(e).__name__}: {e}")
            return [None] * len(names)
        if timed_out:
            self._bump("timeouts")
            if all(r is None for r in res):
                self._failed(f"{op}: no answer within the budget")
        self._silence(op, not (timed_out and all(r is None for r in res)))
        if err:
            self._bump("errors")
            self._log_once("error", f"{op}: {err}")
            self._failed(f"{op}: {err}")
            if unavailable:
                self._down(err)
        elif not timed_out:
            self._failed(None)
        return res

    async def _gather(self, op: str, chunks: list, arrived: list, deadline: float):
        """tier.<op> of every chunk at once until `deadline`; each chunk's
        answer goes into arrived[i] the moment it completes."""
        fn = getattr(self.tier, op)

        async def one(i, c):
            arrived[i] = await fn(c)

        tasks = [asyncio.ensure_future(one(i, c)) for i, c in enumerate(chunks)]
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in pending:
            t.cancel()
        res, err = _assemble(chunks, arrived)
        unavailable = False
        for t in tasks:
            if t in done and not t.cancelled() and t.exception() is not None:
                e = t.exception()
                unavailable = unavailable or isinstance(e, RemoteUnavailable)
                err = err or f"{type(e).__name__}: {e}"
        return res, bool(pending), err, unavailable

    async def _delete_damaged(self, ns_digest: bytes, block_bytes: int, bad) -> None:
        """Delete damaged values - after reading each again and finding it
        still damaged (never a value that changed meanwhile, nor one a
        misrouted answer made look damaged)."""
        try:
            names = [nm for nm, _ in bad]
            again = await self.tier.get_many(names)
            gone = []
            for (nm, key), v in zip(bad, again):
                if v is None:
                    continue
                try:
                    value.decode(key, ns_digest, block_bytes, v)
                except CorruptValue as e:
                    if e.damaged:
                        gone.append(nm)
            if gone:
                self._bump("deleted", await self.tier.delete_many(gone))
        except Exception as e:                     # noqa: BLE001 - best effort
            self._log_once("delete", f"could not delete damaged values ({type(e).__name__}: "
                                     f"{e})")

    # -- namespace names ------------------------------------------------------------------
    def register_namespace(self, ns_digest: bytes, name: str) -> None:
        """Record `name` for `ns_digest` in the cluster's `<prefix>ns` hash
        (once per namespace and client, in the background, never overwriting)."""
        field = _digest16(ns_digest).hex()
        with self._mu:
            if field.encode() in self._names_done or self._closed:
                return
            self._names_done.add(field.encode())

        async def put():
            try:
                await self.tier.set_names(ns_hash_name(self._prefix), {field: name})
            except Exception as e:                 # noqa: BLE001 - retried next time
                with self._mu:
                    self._names_done.discard(field.encode())
                self._log_once("names", f"could not record namespace names "
                                        f"({type(e).__name__}: {e})")

        fut = self._spawn(put())
        if fut is not None:
            with self._mu:
                self._naming.add(fut)
            fut.add_done_callback(self._named)

    def _named(self, fut) -> None:
        with self._mu:
            self._naming.discard(fut)

    # -- writes ---------------------------------------------------------------------------
    def push(self, key, ns_digest: bytes, payload) -> bool:
        """Queue block `key` of namespace `ns_digest` for writing (a payload
        that is `bytes` is kept as it is - immutable - any other buffer is
        copied before returning; its header and checksum are made by the
        sender).  False: dropped (counted) or already queued."""
        key = _keys16([key])[0]
        ns_digest = _digest16(ns_digest)
        size = value.HEADER_SIZE + memoryview(payload).nbytes
        with self._mu:
            if self._closed:
                self.counters["dropped_closed"] += 1
                return False
            if key in self._queued:
                return False
            kind = ("unavailable" if time.monotonic() < self._down_until
                    else "over-budget" if self._over
                    else "queue-full" if self._pending + size > self.config.queue_bytes
                    else None)
            if kind is None:
                self._pending += size
                self._queued.add(key)
        if kind is not None:
            self._drop(kind)
            return False
        try:
            # the header (and the payload's checksum) is made by the sender,
            # off the caller's thread
            data = value.payload_bytes(payload)
        except Exception:
            self._release([(None, key, None, size)])
            raise
        with self._mu:
            self._q.append((self._name(ns_digest, key), key, (ns_digest, data), size))
            wake = not self._writer_busy and not self._wake_sent
            self._wake_sent = self._wake_sent or wake
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:                   # closed meanwhile: close() drops it
                pass
        return True

    def _release(self, items) -> None:
        with self._mu:
            for _, key, _, size in items:
                self._pending -= size
                self._queued.discard(key)
            self._idle.notify_all()

    async def _writer(self) -> None:
        while True:
            if self.config.max_bytes and self._over:
                # over budget, pushes are dropped before they are queued: read
                # used_memory every budget_poll_s to notice room again
                try:
                    await asyncio.wait_for(self._wake.wait(), self.budget_poll_s)
                except asyncio.TimeoutError:
                    pass
                await self._poll_budget()
            else:
                await self._wake.wait()
            self._wake.clear()
            with self._mu:
                self._wake_sent = False
            while True:
                with self._mu:
                    if not self._q:
                        self._writer_busy = False
                        self._idle.notify_all()
                        break
                    self._writer_busy = True
                    batch, nbytes = [], 0
                    while self._q and (not batch or nbytes + self._q[0][3]
                                       <= self.batch_bytes):
                        item = self._q.popleft()
                        batch.append(item)
                        nbytes += item[3]
                try:
                    await self._send(batch)
                except asyncio.CancelledError:
                    self._drop("closed", len(batch))
                    self._release(batch)
                    raise
                except Exception as e:             # noqa: BLE001 - pragma: never raise
                    self._drop("unavailable", len(batch), f"{type(e).__name__}: {e}")
                    self._failed(f"put_many: {type(e).__name__}: {e}")
                self._release(batch)
            if self._closed:
                return

    async def _poll_budget(self) -> None:
        now = time.monotonic()
        if now - self._polled_at < self.budget_poll_s:
            return
        self._polled_at = now
        try:
            used = await asyncio.wait_for(self.tier.used_memory(), self.config.timeout_s)
        except Exception as e:                     # noqa: BLE001 - keep the last figure
            self._log_once("budget", f"could not read the cluster's used_memory "
                                     f"({type(e).__name__}: {e})")
            return
        with self._mu:
            self._used = used
            self._over = used >= self.config.max_bytes

    async def _send(self, batch) -> None:
        cfg = self.config
        if cfg.max_bytes:
            await self._poll_budget()
            if self._over:
                self._drop("over-budget", len(batch))
                return
        if self._is_down():
            self._drop("unavailable", len(batch))
            return
        wait_s = min(cfg.timeout_s, 5.0)
        try:
            if self._fast is not None:
                vals, rep, failed, error = await asyncio.get_running_loop().run_in_executor(
                    self._sender, self._put_fast, batch, wait_s)
                res = Batch(vals, failed=failed, error=error,
                            replicated=rep if cfg.wait_replicas else None)
            else:
                items = [(name, b"".join(value.encode_parts(key, nsd, data)))
                         for name, key, (nsd, data), _ in batch]
                res = await self.tier.put_many(items, cfg.ttl_s,
                                               wait_replicas=cfg.wait_replicas,
                                               wait_timeout_s=wait_s)
        except RemoteError as e:
            self._drop("unavailable", len(batch), str(e))
            self._failed(f"put_many: {e}")
            if isinstance(e, RemoteUnavailable):
                self._down(str(e))
            return
        stored = stored_bytes = present = failed = repl = 0
        rep = getattr(res, "replicated", None) or [False] * len(res)
        for (_, key, _, size), ok, r in zip(batch, res, rep):
            if ok is True:
                stored += 1
                stored_bytes += size - value.HEADER_SIZE
                repl += bool(r)
                if self.on_written is not None:
                    try:
                        self.on_written(key, bool(r))
                    except Exception as e:         # noqa: BLE001 - the caller's bug
                        self._log_once("on-written", f"on_written raised {e!r}")
            elif ok is False:
                present += 1
            else:
                failed += 1
        with self._mu:
            self.counters["pushed"] += stored
            self.counters["pushed_bytes"] += stored_bytes
            self.counters["pushed_replicated"] += repl
            self.counters["present"] += present
            if self._used is not None:
                self._used += stored_bytes
                if cfg.max_bytes and self._used >= cfg.max_bytes:
                    self._over = True
        if failed:
            self._drop("unavailable", failed, getattr(res, "error", None))
            self._failed(f"put_many: {getattr(res, 'error', None) or 'writes failed'}")
        else:
            self._failed(None)
        if cfg.wait_replicas and stored > repl:
            self._log_once("replicas", f"{stored - repl} pushed blocks not confirmed on "
                                       f"{cfg.wait_replicas} replica(s) within {wait_s:g} s")

    def _put_fast(self, batch, wait_s: float):
        """The sender thread: the batch's values made (header and payload
        sent from their own buffers) and written by the fast path."""
        items = [(name, value.encode_parts(key, nsd, data))
                 for name, key, (nsd, data), _ in batch]
        return self._fast.put_many(items, self.config.ttl_s, self.config.wait_replicas, wait_s)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written or dropped; False if
        `timeout` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._mu:
            while self._pending > 0 or self._q or self._writer_busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left if left is not None else 1.0)
        return True

    # -- management -----------------------------------------------------------------------
    def stats(self) -> dict:
        with self._mu:
            c = dict(self.counters)
            out = {k: c.get(k, 0) for k in _COUNTERS}
            out["dropped"] = sum(v for k, v in c.items() if k.startswith("dropped_"))
            out["queue_bytes"] = self.config.queue_bytes
            out["queued_bytes"] = self._pending
            out["unavailable"] = time.monotonic() < self._down_until
            out["failing"] = self._failing is not None
            out["last_error"] = self._failing
            out["over_budget"] = self._over
            out["max_bytes"] = self.config.max_bytes
            out["used_memory"] = self._used
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and the namespace names registered (for at
        most `timeout` seconds; the blocks left are dropped, counted
        `dropped_closed`), then release every connection -
        all within about `timeout` (at least 0.1 s for the connections)."""
        if self._closed:
            return
        end = time.monotonic() + max(0.0, timeout)
        self.flush(timeout)
        with self._mu:
            naming = list(self._naming)
        if naming:                                 # namespace names recorded, too
            concurrent.futures.wait(naming, max(0.0, end - time.monotonic()))
        with self._mu:
            self._closed = True
            left = list(self._q)
            self._q.clear()
        if left:
            self._drop("closed", len(left))
            self._release(left)

        def remaining() -> float:
            return max(0.1, end - time.monotonic())

        async def stop():
            me = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not me]
            for t in others:                       # the writer, deletes, name records
                t.cancel()
            await asyncio.wait(others, timeout=remaining()) if others else None
            try:
                await asyncio.wait_for(self.tier.close(), min(5.0, remaining()))
            except BaseException:                  # noqa: BLE001
                pass

        try:
            self._call(stop(), remaining() + 0.5)
        except Exception:                          # noqa: BLE001 - closing regardless
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(remaining())
        if not self._thread.is_alive():
            self.loop.close()
        if self._sender is not None:
            self._sender.shutdown(wait=False)
            self._fast.close()

    def __enter__(self) -> "RemoteClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteClient(nodes={list(self.config.nodes)!r}, prefix={self._prefix!r})"
