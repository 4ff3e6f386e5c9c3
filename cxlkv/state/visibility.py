"""Proof that this host sees the same pool memory as the other nodes' hosts.

Nothing else proves that `/dev/dax0.0` on host A is the same physical memory
as on host B: a wrong region, or a mapping of a pool since re-formatted, looks
healthy from each host alone and silently splits the rack.  `probe()` proves
it from this host, for every other attached node, two ways:

- its heartbeat is seen advancing *here*: its writes reach this host (read
  after an invalidate, so on non-coherent memory too);
- it echoes a challenge written here: a random nonce, for its incarnation
  (epoch), in its node slot's line 4, which only probers write; its heartbeat
  thread echoes it into line 5, which only it writes (state.nodes
  Attachment._answer), so this host's writes reach it, flushes included.

A node whose heartbeat advances but that does not echo is either older
than the challenge (its sw_version says) or does not see this host's writes;
one whose heartbeat does not advance within a lease is dead, paused, or on
memory this host does not see - from one host these look alike, which is
why `cxlkv doctor --pool` runs on every host.
"""
from __future__ import annotations

import os
import random
import struct
import time
from dataclasses import dataclass

from cxlkv.pool import layout
from cxlkv.state import nodes, protocol

_HEARTBEAT = layout.field_offset(layout.NodeStruct, "heartbeat")
_CHALLENGE = layout.field_offset(layout.NodeStruct, "challenge")
_ANSWER = layout.field_offset(layout.NodeStruct, "answer")
_RNG = random.SystemRandom()
#: how often the probe re-reads what it waits for
POLL_S = 0.01

ANSWERED, UNANSWERED, NOT_ASKED = "answered", "unanswered", "not asked"


@dataclass
class Sight:
    """What this host saw of one other node during a probe."""
    slot: int
    epoch: int
    pid: int
    hostname: str
    boot_id: str
    sw_version: str
    same_host: bool           # the same boot as this host's
    advanced: bool            # its heartbeat advanced, read from here
    heartbeat_ms: float | None  # when, after the probe began
    challenge: str            # answered / unanswered / not asked
    answer_ms: float | None   # when the echo was read here
    why_not_asked: str = ""

    @property
    def proven(self) -> bool:
        """Shared memory proven both ways."""
        return self.advanced and self.challenge == ANSWERED

    def to_json(self) -> dict:
        return {"slot": self.slot, "epoch": self.epoch, "pid": self.pid,
                "hostname": self.hostname, "boot_id": self.boot_id,
                "sw_version": self.sw_version, "same_host": self.same_host,
                "heartbeat_advanced": self.advanced, "heartbeat_ms": self.heartbeat_ms,
                "challenge": self.challenge, "answer_ms": self.answer_ms,
                "why_not_asked": self.why_not_asked or None, "proven": self.proven}

    def describe(self) -> str:
        who = f"node {self.slot} ({self.hostname} pid {self.pid}, {self.sw_version})"
        if self.proven:
            return (f"{who}: heartbeat seen advancing here, challenge echoed in "
                    f"{self.answer_ms:.0f} ms")
        if not self.advanced:
            return f"{who}: heartbeat not seen advancing from this host"
        if self.challenge == NOT_ASKED:
            return f"{who}: heartbeat seen advancing here (not challenged: {self.why_not_asked})"
        return (f"{who}: heartbeat seen advancing here, but the challenge written here was "
                "not echoed (a cxlkv without challenges, or this host's writes do not reach it)")


@dataclass
class Probe:
    sights: list[Sight]
    seconds: float
    manager: str | None       # manager mode: "advancing" / "not advancing"; None in cas mode

    def to_json(self) -> dict:
        return {"nodes": [s.to_json() for s in self.sights], "seconds": round(self.seconds, 3),
                "lock_manager_heartbeat": self.manager}


def _line(m, off: int, nbytes: int) -> bytes:
    m.invalidate(off, nbytes)
    return m.read(off, nbytes)


def probe(pool, *, timeout: float | None = None, challenge_pool=None) -> Probe:
    """Probe every attached node other than this process's own.

    pool: an open pool (read-only will do).  challenge_pool: a writable
    mapping of the same pool to write challenges through (the pool itself
    when it is writable); None and a read-only pool: no challenges, only
    heartbeats.  timeout: how long to wait for heartbeats and echoes
    (default: half the pool's lease and a little: two beats of a node
    beating, as by default, four times a lease; it answers at its next).
    Returns as soon as every node was seen both ways."""
    m, lease = pool.mapping, pool.sb.lease_ms / 1000.0
    timeout = lease / 2 + 0.25 if timeout is None else timeout
    writer = challenge_pool if challenge_pool is not None else (
        None if pool.read_only else pool)
    mine = pool.node.slot if getattr(pool, "node", None) is not None else -1
    boot = nodes.local_boot_id()
    peers = [n for n in nodes.read_nodes(pool)
             if n.state in ("attached", "claimed") and n.slot != mine]
    t0 = time.monotonic()
    before = {n.slot: n.heartbeat for n in peers}
    nonces: dict[int, int] = {}
    why = "" if writer is not None else "no write access to the pool"
    if writer is not None:
        for n in peers:
            nonce = _RNG.getrandbits(63) | 1
            off = nodes.node_offset(pool, n.slot) + _CHALLENGE
            # the whole line: a store to part of it could write back a stale rest
            writer.mapping.write(off, struct.pack("<QQ", nonce, n.epoch).ljust(64, b"\0"))
            writer.mapping.flush(off, 64)
            nonces[n.slot] = nonce
    mgr0 = _mgr_heartbeat(pool)
    mgr = None if mgr0 is None else "not advancing"
    seen: dict[int, float] = {}
    echoed: dict[int, float] = {}
    while True:
        now = time.monotonic()
        for n in peers:
            off = nodes.node_offset(pool, n.slot)
            if n.slot not in seen:
                hb = struct.unpack_from("<Q", _line(m, off + _HEARTBEAT, 8))[0]
                if hb != before[n.slot]:
                    seen[n.slot] = now - t0
            if n.slot in nonces and n.slot not in echoed:
                nonce, epoch = struct.unpack_from("<QQ", _line(m, off + _ANSWER, 16))
                if nonce == nonces[n.slot] and epoch == n.epoch:
                    echoed[n.slot] = now - t0
        if mgr0 is not None and mgr != "advancing" and _mgr_heartbeat(pool) != mgr0:
            mgr = "advancing"
        done = (len(seen) == len(peers) and len(echoed) == len(nonces)
                and mgr in (None, "advancing"))
        if done or now - t0 >= timeout:
            break
        time.sleep(POLL_S)      # waiting on other hosts' heartbeats: nothing to wake us
    sights = [Sight(slot=n.slot, epoch=n.epoch, pid=n.pid, hostname=n.hostname,
                    boot_id=n.boot_id, sw_version=n.sw_version, same_host=n.boot_id == boot,
                    advanced=n.slot in seen, heartbeat_ms=_ms(seen.get(n.slot)),
                    challenge=(ANSWERED if n.slot in echoed else
                               UNANSWERED if n.slot in nonces else NOT_ASKED),
                    answer_ms=_ms(echoed.get(n.slot)), why_not_asked=why)
              for n in peers]
    return Probe(sights, time.monotonic() - t0, mgr)


def _ms(t: float | None) -> float | None:
    return None if t is None else round(t * 1000.0, 1)


def _mgr_heartbeat(pool) -> int | None:
    if pool.sb.sync != "manager":
        return None
    m, h = pool.mapping, protocol.lock_header(pool)
    m.invalidate(h + protocol.MGR_HEARTBEAT, 8)
    return m.load64(h + protocol.MGR_HEARTBEAT)


def writable(path: str) -> bool:
    """May this process write the pool (for challenges)?"""
    return os.access(path, os.W_OK)
