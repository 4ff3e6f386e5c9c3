"""The remote tier's fast path on a Redis Cluster: pipelined GET and SET NX
spoken directly (RESP2) on blocking sockets, one connection per master,
on the calling thread.

    fc = FastCluster(config)
    vals, timed_out, err, unavailable = fc.get_many(names, deadline)
    vals, replicated, failed, err = fc.put_many(items, ttl_s, wait_replicas, wait_s, deadline)
    fc.close()

Why not redis-py here: its pipelines cost the tier a thread hop per call
(the asyncio loop thread), one sendall per argument and two user-space
copies per value read (the socket into the parser's buffer, the parser into
a bytes object).  Here a batch for one master is one sendmsg of an iovec
list (the values are sent from the caller's buffers, never joined), every
master's requests go out before any reply is read, and a value read is
received straight into a bytearray (recv_into: the kernel's copy only),
reused for a later value once nothing refers to it (_Buffers).  What the
slow path keeps: TLS, EXISTS / DEL / HSETNX / INFO and every test seam
(RemoteTier implementations) - RemoteClient uses this path only for its
own plain-TCP RedisClusterTier.

Slots map to masters from CLUSTER SLOTS, asked again after a connection
error or a MOVED answer.  A MOVED / ASK answer is followed once (ASKING
first for ASK) and the slot table refreshed; TRYAGAIN and anything else is
a failed key.  A connection whose pipeline was cut (error, timeout) is
closed, never reused: its unread answers would belong to other commands -
and so is every connection of a call that ended in any other exception.

Connections: a set of one connection per master is taken from a free list
per call (so threads never share one) and given back when it worked.
"""
from __future__ import annotations

import socket
import sys
import threading
import time

from redis.crc import key_slot

from cxlkv.errors import RemoteUnavailable

#: iovec entries per sendmsg (Linux IOV_MAX is 1024)
IOV_MAX = 1024
#: read buffer per connection (replies' headers and small values)
READ_BUF = 1 << 16
#: slot table refreshes at most this often after errors
REFRESH_S = 0.2
NSLOTS = 16384
#: the answer of a command that got none (its connection was cut)
UNANSWERED = object()
#: bulk replies (values) at least this long are received into reused buffers
REUSE_MIN = 16 << 10
#: bytes of such buffers kept for reuse, per FastCluster
REUSE_BYTES = 32 << 20
#: kept buffers of one size looked at per value (from where the last was
#: found): a caller holding many values costs a new buffer, not a long scan
REUSE_SCAN = 32


class ReplyError:
    """An error answer (-ERR ...): a reply value, never raised."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def _cut(why: str) -> ConnectionError:
    """The connection's pipeline was cut (EOF, garbage): never reused."""
    return ConnectionError(why)


class _Buffers:
    """Buffers for large bulk replies, each handed out again once nothing
    refers to it any more (a lookup's values are verified, copied - into the
    pool - and dropped before the next lookup; a value the caller keeps, or
    any view of it, keeps its buffer out of reuse).  A new bytearray per
    value costs more than receiving it: glibc gives a lookup's freed values
    back to the kernel, so every value is fresh pages, faulted in and zeroed
    (256 KiB: 63 faults and ~110 us, against ~60 us for the bytes on the
    wire, 2026-12-07)."""

    def __init__(self, keep_bytes: int = REUSE_BYTES):
        self._mu = threading.Lock()
        self._by_size: dict[int, list] = {}
        self._next: dict[int, int] = {}
        self.kept = 0
        self.keep_bytes = keep_bytes

    def get(self, n: int) -> bytearray:
        """A bytearray of n bytes nothing else refers to (its contents: a
        previous value's, to be overwritten)."""
        with self._mu:
            kept = self._by_size.setdefault(n, [])
            k = len(kept)
            start = self._next.get(n, 0)
            for j in range(min(k, REUSE_SCAN)):
                i = (start + j) % k
                # references: the list, the loop's `a`, getrefcount's argument
                a = kept[i]
                if sys.getrefcount(a) <= 3:
                    self._next[n] = i + 1
                    return a
            a = bytearray(n)
            if self.kept + n <= self.keep_bytes:
                kept.append(a)
                self.kept += n
            return a

    def clear(self) -> None:
        with self._mu:
            self._by_size.clear()
            self._next.clear()
            self.kept = 0


class _Conn:
    """One blocking connection to one master, with a read buffer."""

    def __init__(self, addr: tuple[str, int], timeout: float, auth: tuple | None,
                 bufs: _Buffers | None = None):
        self.addr = addr
        self.bufs = bufs
        self.sock = socket.create_connection(addr, timeout=max(1e-3, timeout))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(READ_BUF)
        self.view = memoryview(self.buf)
        self.r = self.w = 0
        if auth is not None:
            self.sendv([command(b"AUTH", *auth)])
            rep = self.reply()
            if isinstance(rep, ReplyError):
                self.close()
                raise ConnectionRefusedError(f"AUTH refused by {addr[0]}:{addr[1]}: "
                                             f"{str(rep).split(' ', 1)[0]}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def settimeout(self, s: float) -> None:
        self.sock.settimeout(max(1e-3, s))

    def sendv(self, bufs: list) -> None:
        """Send every buffer, in order (sendmsg, IOV_MAX at a time).  Empty
        buffers are left out: a sendmsg of only empty ones sends 0 bytes,
        and a pending list left holding just those would never drain."""
        i, n = 0, len(bufs)
        pending: list = []
        while i < n or pending:
            if not pending:
                pending = [m for m in (memoryview(b).cast("B") for b in bufs[i:i + IOV_MAX])
                           if m.nbytes]
                i += IOV_MAX
                if not pending:
                    continue
            sent = self.sock.sendmsg(pending)
            while sent and pending:
                k = pending[0].nbytes
                if sent >= k:
                    sent -= k
                    pending.pop(0)
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0

    def _fill(self) -> None:
        if self.r == self.w:
            self.r = self.w = 0
        elif self.w == len(self.buf):
            # compact what is unread to the front
            k = self.w - self.r
            self.buf[:k] = self.buf[self.r:self.w]
            self.r, self.w = 0, k
            if k == len(self.buf):
                raise _cut(f"a reply line over {READ_BUF} bytes")
        got = self.sock.recv_into(self.view[self.w:])
        if not got:
            raise _cut("the server closed the connection")
        self.w += got

    def _line(self) -> bytes:
        while True:
            j = self.buf.find(b"\r\n", self.r, self.w)
            if j >= 0:
                out = bytes(self.buf[self.r:j])
                self.r = j + 2
                return out
            self._fill()

    def _bulk(self, n: int) -> bytearray:
        out = self.bufs.get(n) if self.bufs is not None and n >= REUSE_MIN else bytearray(n)
        have = min(n, self.w - self.r)
        mv = memoryview(out)
        mv[:have] = self.view[self.r:self.r + have]
        self.r += have
        while have < n:                      # straight from the socket into the value
            got = self.sock.recv_into(mv[have:])
            if not got:
                raise _cut("the server closed the connection")
            have += got
        while self.w - self.r < 2:
            self._fill()
        if self.buf[self.r:self.r + 2] != b"\r\n":
            raise _cut("a bulk reply not ended by CRLF")
        self.r += 2
        return out

    def reply(self):
        """One RESP2 reply: bytes (+), ReplyError (-), int (:), bytearray or
        None ($), list (*)."""
        line = self._line()
        if not line:
            raise _cut("an empty reply line")
        t, rest = line[:1], line[1:]
        if t == b"$":
            n = int(rest)
            return None if n < 0 else self._bulk(n)
        if t == b"+":
            return rest
        if t == b":":
            return int(rest)
        if t == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise _cut(f"an unknown reply type {t!r}")


def command(*args) -> bytes:
    """A RESP2 command of bytes / str / int arguments."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


def _redirect(rep) -> tuple[str, tuple[str, int]] | None:
    """("MOVED" | "ASK", address) of a redirection answer, else None."""
    if not isinstance(rep, ReplyError):
        return None
    parts = str(rep).split()
    if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
        host, _, port = parts[2].rpartition(":")
        try:
            return parts[0], (host, int(port))
        except ValueError:
            return None
    return None


class FastCluster:
    """Pipelined GET / SET NX on a cluster's masters (see the module doc).
    Safe for any number of threads."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.endpoints = cfg.endpoints()
        secret = cfg.secret()
        self.auth = None if secret is None else (
            (cfg.username, secret) if cfg.username else (secret,))
        self._mu = threading.Lock()
        self._free: list[dict] = []
        self._slots: list | None = None
        self._refresh_at = 0.0
        self._closed = False
        self._bufs = _Buffers()
        #: pipelined windows sent (a figure for tests and benches)
        self.windows = 0

    # -- connections ----------------------------------------------------------------------
    def _take(self) -> dict:
        with self._mu:
            return self._free.pop() if self._free else {}

    def _give(self, conns: dict) -> None:
        with self._mu:
            if not self._closed and len(self._free) < 16:
                self._free.append(conns)
                return
        for c in conns.values():
            c.close()

    def _conn(self, conns: dict, addr, deadline: float) -> _Conn:
        c = conns.get(addr)
        if c is None:
            c = conns[addr] = _Conn(addr, min(self.cfg.timeout_s, deadline - time.monotonic()),
                                    self.auth, self._bufs)
        c.settimeout(deadline - time.monotonic())
        return c

    def close(self) -> None:
        with self._mu:
            self._closed = True
            free, self._free = self._free, []
        self._bufs.clear()
        for conns in free:
            for c in conns.values():
                c.close()

    # -- the slot table -------------------------------------------------------------------
    def _table(self, conns: dict, deadline: float) -> list:
        slots = self._slots
        if slots is not None:
            return slots
        err: BaseException | None = None
        tried = list(self.endpoints)
        for addr in tried:
            if time.monotonic() >= deadline:
                raise TimeoutError("no time left to read the slot table")
            try:
                c = self._conn(conns, addr, deadline)
                c.sendv([command(b"CLUSTER", b"SLOTS")])
                rep = c.reply()
            except (OSError, ValueError) as e:
                c = conns.pop(addr, None)
                if c is not None:
                    c.close()
                if isinstance(e, TimeoutError):
                    raise
                err = e
                continue
            if isinstance(rep, ReplyError) or not isinstance(rep, list):
                err = ConnectionError(f"CLUSTER SLOTS on {addr[0]}:{addr[1]}: {rep}")
                continue
            table: list = [None] * NSLOTS
            for row in rep:
                lo, hi, master = int(row[0]), int(row[1]), row[2]
                host = bytes(master[0]).decode() or addr[0]
                table[lo:hi + 1] = [(host, int(master[1]))] * (hi - lo + 1)
            self._slots = table
            return table
        raise ConnectionError(f"no node answered CLUSTER SLOTS ({err})")

    def _stale(self) -> None:
        """Ask for the slot table again (at most every REFRESH_S)."""
        now = time.monotonic()
        if now - self._refresh_at >= REFRESH_S:
            self._refresh_at = now
            self._slots = None

    # -- one pipelined batch -----------------------------------------------------------------
    def _send(self, c: _Conn, cmds, wins, k: int, extra) -> None:
        bufs = [b for i in wins[k] for b in cmds[i][1]]
        if extra is not None and k + 1 == len(wins):
            bufs.append(extra[1])
        c.sendv(bufs)
        self.windows += 1

    def _run(self, cmds: list, deadline: float, extra: tuple | None = None,
             window: int | None = None):
        """Send cmds (each (key, list of buffers): one command) to the master
        of its key, in windows of `window` commands per master (None: one
        window), then read every answer.  Returns (answers, cut, timed_out,
        err, extra_answers): answers[i] is the reply or UNANSWERED;
        cut: how many got no answer; `extra`: (None, buffer) of a command
        ending each master's pipeline whose answer goes to
        extra_answers[addr]."""
        n = len(cmds)
        answers: list = [UNANSWERED] * n
        got_extra: dict = {}
        conns = self._take()
        timed_out, err, cut = False, None, 0
        finished = False
        try:
            try:
                slots = self._table(conns, deadline)
            except TimeoutError:
                self._drop_all(conns)
                return answers, n, True, None, got_extra
            except (OSError, ValueError) as e:
                self._drop_all(conns)
                return answers, n, False, f"{type(e).__name__}: {e}", got_extra
            groups: dict = {}
            for i, (key, _) in enumerate(cmds):
                groups.setdefault(slots[key_slot(key)], []).append(i)
            active = []                          # [addr, windows, next to read]
            for addr, idx in groups.items():
                if addr is None:
                    err = err or "a slot no master serves"
                    cut += len(idx)
                    continue
                per = len(idx) if window is None else max(1, window)
                wins = [idx[j:j + per] for j in range(0, len(idx), per)]
                try:
                    c = self._conn(conns, addr, deadline)
                    self._send(c, cmds, wins, 0, extra)
                    active.append([addr, wins, 0])
                except (OSError, ValueError) as e:
                    timed_out |= isinstance(e, TimeoutError)
                    err = err or (None if isinstance(e, TimeoutError)
                                  else f"{type(e).__name__}: {e}")
                    cut += len(idx)
                    self._drop(conns, addr)
            # each master has at most two windows in flight: the next one is
            # sent before the current one's answers are read
            while active:
                for st in list(active):
                    addr, wins, k = st
                    c = conns[addr]
                    read = 0
                    try:
                        if k + 1 < len(wins):
                            self._send(c, cmds, wins, k + 1, extra)
                        c.settimeout(deadline - time.monotonic())
                        for i in wins[k]:
                            answers[i] = c.reply()
                            read += 1
                        if extra is not None and k + 1 == len(wins):
                            got_extra[addr] = c.reply()
                        st[2] = k + 1
                        if st[2] == len(wins):
                            active.remove(st)
                    except (OSError, ValueError) as e:
                        timed_out |= isinstance(e, TimeoutError)
                        err = err or (None if isinstance(e, TimeoutError)
                                      else f"{type(e).__name__}: {e}")
                        cut += sum(len(w) for w in wins[k:]) - read
                        self._drop(conns, addr)
                        active.remove(st)
            finished = True
        finally:
            if cut:
                self._stale()
            if not finished:
                # an exception left some pipeline half sent or half read
                self._drop_all(conns)
            self._give(conns)
        return answers, cut, timed_out, err, got_extra

    def _drop(self, conns: dict, addr) -> None:
        c = conns.pop(addr, None)
        if c is not None:
            c.close()

    def _drop_all(self, conns: dict) -> None:
        for addr in list(conns):
            self._drop(conns, addr)

    def _follow(self, cmds: list[list], answers: list, deadline: float) -> list[int]:
        """Follow MOVED / ASK answers once (one command at a time, on their own
        connections); returns the positions retried."""
        redo = [(i, r) for i, r in ((i, _redirect(a)) for i, a in enumerate(answers)) if r]
        if not redo:
            return []
        self._stale()
        conns = self._take()
        finished = False
        try:
            for i, (kind, addr) in redo:
                try:
                    c = self._conn(conns, addr, deadline)
                    bufs = ([command(b"ASKING")] if kind == "ASK" else []) + cmds[i][1]
                    c.sendv(bufs)
                    if kind == "ASK":
                        c.reply()
                    answers[i] = c.reply()
                except (OSError, ValueError) as e:
                    answers[i] = ReplyError(f"{type(e).__name__}: {e}")
                    self._drop(conns, addr)
            finished = True
        finally:
            if not finished:
                self._drop_all(conns)
            self._give(conns)
        return [i for i, _ in redo]

    # -- the operations ---------------------------------------------------------------------
    def get_many(self, names: list[bytes], deadline: float, window: int | None = None):
        """GET each name within `deadline` (monotonic), pipelined in windows of
        `window` names per master (None: one window).  Returns (values,
        timed_out, err, unavailable): values[i] a bytearray, or None (absent,
        not a string, unanswered); unavailable: nothing answered and a
        connection failed (not a timeout)."""
        cmds = [(nm, [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(nm), nm)]) for nm in names]
        answers, cut, timed_out, err, _ = self._run(cmds, deadline, window=window)
        self._follow(cmds, answers, deadline)
        out: list = []
        for a in answers:
            if a is UNANSWERED:
                out.append(None)
                continue
            if isinstance(a, ReplyError):
                err = err or str(a)
                out.append(None)
            else:
                out.append(a if isinstance(a, bytearray) else None)
        unavailable = bool(names) and cut == len(names) and not timed_out and err is not None
        return out, timed_out, err, unavailable

    def put_many(self, items: list[tuple[bytes, bytes]], ttl_s: int, wait_replicas: int = 0,
                 wait_timeout_s: float = 1.0, deadline: float | None = None):
        """SET NX [EX ttl_s] each (name, value); a value is a buffer or a tuple
        of buffers (header, payload) sent one after the other, from their own
        memory.  With wait_replicas, WAIT ends each master's pipeline.
        Returns (results, replicated, failed, err): results[i] True (stored),
        False (present: NX) or None (failed); replicated[i] per key.  Raises
        RemoteUnavailable when no write got an answer for a connection failure."""
        if deadline is None:
            deadline = time.monotonic() + self.cfg.timeout_s + (
                wait_timeout_s if wait_replicas else 0.0)
        tail = (b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n$2\r\nNX\r\n" % (len(str(int(ttl_s))), int(ttl_s))
                if ttl_s else b"\r\n$2\r\nNX\r\n")
        argc = 6 if ttl_s else 4
        cmds = []
        for nm, val in items:
            parts = list(val) if isinstance(val, tuple) else [val]
            nbytes = sum(memoryview(p).nbytes for p in parts)
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(nm), nm, nbytes)
            cmds.append((nm, [head, *parts, tail]))
        extra = None
        if wait_replicas:
            ms = max(1, int(wait_timeout_s * 1000))
            extra = (None, command(b"WAIT", wait_replicas, ms))
        answers, cut, timed_out, err, waits = self._run(cmds, deadline, extra)
        slots = self._slots
        redone = set(self._follow(cmds, answers, deadline))
        results, replicated, failed = [], [], 0
        for i, a in enumerate(answers):
            if isinstance(a, ReplyError):
                err = err or str(a)
                results.append(None)
                failed += 1
            elif a is UNANSWERED:
                results.append(None)
                failed += 1
            else:
                results.append(a == b"OK")
            ok = False
            if wait_replicas and results[-1] is not None and i not in redone and slots:
                w = waits.get(slots[key_slot(items[i][0])])
                ok = isinstance(w, int) and w >= wait_replicas
            replicated.append(ok)
        if items and cut == len(items):
            why = err or ("no answer within " f"{self.cfg.timeout_s:g} s" if timed_out else "")
            raise RemoteUnavailable(f"cluster unavailable: {why}")
        if failed and err is None:
            err = "no answer within the timeout" if timed_out else "some writes failed"
        return results, replicated, failed, err
