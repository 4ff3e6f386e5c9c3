"""Streaming a prefix from a producer process to a consumer on the same host:
the consumer copies block k while the producer writes block k+1.

    # producer                                  # consumer
    for i in range(0, n, step):                 got = stream.follow_into(kv, toks, buf,
        kv.store(toks[:(i + step) * bt],                                 idle_s=1.0)
                 buf[:(i + step) * bb])         # got == n: all of it, bit-exact
        stream.notify(pool)                     # got < n: a complete prefix

How the consumer waits: the change journal's `next_seq` word (cxlkv.kv.journal)
moves on with every block any node publishes, under the pool lock.  The
consumer reads it, copies what is published (KVCache.load_into with start=,
which pins, verifies and copies only published blocks), and sleeps in the
kernel on that word (a shared futex: `Mapping.word_wait`, poolwait.c) until
it moves; the producer wakes it with one syscall after a store (`notify`).
No CPU is polled away from the producer, and a wake-up that comes before the
sleep is not lost (the word was re-read: the futex compares it first).

Why a futex on the journal's word and not a pipe or the journal's records:
the consumer needs nothing but the pool and the tokens (no side channel to
the producer, any number of consumers); the word exists already (no new
on-media structure); a store already moves it.  Limits: a futex is a kernel
object, so this wakes processes of one host; consumers on other hosts of a
rack see the same word move and poll it (`word_wait` with a short timeout).

What a consumer gets: only published blocks, in order, verified by the
load path; when the producer stops (done, killed, stalled) before every
block is there, follow_into returns after `idle_s` without a new block
with the complete prefix it copied - never a partial or foreign block.
"""
from __future__ import annotations

import time

from cxlkv.errors import UsageError
from cxlkv.kv.journal import require as require_journal
from cxlkv.pool import layout

#: longest single sleep: a consumer looks at the word at least this often
#: (a notify that was never sent, e.g. a producer on another host)
SLICE_S = 0.05


def word_offset(pool) -> int:
    """Pool offset of the word followers sleep on (the journal's next_seq)."""
    require_journal(pool)
    kv_off, _ = pool.sb.regions["kv"]
    g = layout.journal_geometry(pool.sb.max_nodes, pool.sb.hash_slots)
    return kv_off + g["hdr_off"] + layout.field_offset(layout.JournalHdrStruct, "next_seq")


def notify(pool) -> int:
    """Wake every follower of `pool` on this host (after a store); how many
    slept.  One syscall; costs nothing else when nobody waits."""
    return pool.mapping.word_wake(word_offset(pool))


def follow_into(kv, tokens, out, *, idle_s: float = 1.0, start: int = 0,
                on_blocks=None) -> int:
    """Copy the blocks of `tokens` into `out` as they are published (block
    `start` to out's start), until all full blocks of `tokens` are there or
    no new block came for `idle_s` seconds.  Returns how many blocks were
    copied: a complete, verified prefix.  `on_blocks(n)`, if given, is
    called with the running count after each copy."""
    if idle_s < 0:
        raise UsageError("idle_s must be >= 0")
    pool, m = kv.pool, kv.pool.mapping
    off = word_offset(pool)
    total = len(tokens) // kv.block_tokens
    mv = memoryview(out).cast("B")
    bb = kv.block_bytes
    if mv.nbytes < (total - start) * bb:
        raise UsageError(f"out holds {mv.nbytes} bytes; {total - start} blocks need "
                         f"{(total - start) * bb}")
    done = start
    last = time.monotonic()
    while done < total:
        # the word is read before the copy: a block published after this read
        # moves it, so the wait below returns at once instead of sleeping
        seen = m.load64(off) if not m.flush_meta else _fresh(m, off)
        got = kv.load_into(tokens, mv[(done - start) * bb:], start=done)
        if got:
            done += got
            last = time.monotonic()
            if on_blocks is not None:
                on_blocks(done)
            if done >= total:
                break
        left = idle_s - (time.monotonic() - last)
        if left <= 0:
            break
        m.word_wait(off, seen, int(min(left, SLICE_S) * 1e9))
    return done - start


def _fresh(m, off: int) -> int:
    m.invalidate(off, 8)
    return m.load64(off)
