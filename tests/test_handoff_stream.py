"""Streamed handoff (cxlkv.kv.stream) between a producer process and a
consumer: every block arrives bit-exact and in order while the producer is
still storing; a producer killed mid-stream leaves the consumer a complete
prefix, never a partial or foreign block; the futex word wait (poolwait.c)
is bounds-checked and wakes a sleeper.  No sleeps: the producer is stepped
through a pipe, and the consumer's progress callback drives it."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import cxlkv
from cxlkv.kv import stream

BT = 16                       # tokens per block
BB = 64 * 1024                # bytes per block
N = 24                        # blocks
MODEL = "stream-test"

PRODUCER = r"""
import sys
import numpy as np
import cxlkv
from cxlkv.kv import stream
path, n, bb, bt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(7)
buf = rng.integers(0, 256, n * bb, dtype=np.uint8)
toks = np.arange(n * bt, dtype=np.uint32)
with cxlkv.open_pool(path) as pool:
    kv = pool.kv(model="stream-test", block_tokens=bt, block_bytes=bb)
    print("ready", flush=True)
    for line in sys.stdin:                    # "upto K": store blocks [0, K), wake followers
        op, arg = line.split()
        if op == "exit":
            break
        k = int(arg)
        kv.store(toks[:k * bt], buf[:k * bb])
        stream.notify(pool)
        print("stored", k, flush=True)
"""


def source() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, N * BB, dtype=np.uint8)


class Producer:
    def __init__(self, path):
        self.p = subprocess.Popen([sys.executable, "-c", PRODUCER, path, str(N), str(BB),
                                   str(BT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def store(self, upto: int) -> None:
        self.p.stdin.write(f"upto {upto}\n")
        self.p.stdin.flush()

    def stored(self) -> int:
        line = self.p.stdout.readline().split()
        assert line and line[0] == "stored", line
        return int(line[1])

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("exit 0\n")
            self.p.stdin.close()
            self.p.wait(30)


def test_streamed_blocks_arrive_bit_exact_in_order_while_the_producer_stores(kvpool):
    prod = Producer(kvpool)
    try:
        with cxlkv.open_pool(kvpool) as pool:
            kv = pool.kv(model=MODEL, block_tokens=BT, block_bytes=BB)
            toks = np.arange(N * BT, dtype=np.uint32)
            out = np.zeros(N * BB, dtype=np.uint8)
            seen = []
            steps = iter(range(4, N + 1, 4))

            def on_blocks(done):
                # the producer stores the next step only once the consumer
                # has the previous one: a consumer that did not stream would
                # never get past the first step (and would return short)
                seen.append(done)
                k = next(steps, None)
                if k is not None:
                    prod.store(k)

            prod.store(next(steps))
            got = stream.follow_into(kv, toks, out, idle_s=30.0, on_blocks=on_blocks)
            assert got == N
            assert seen == sorted(seen) and seen[-1] == N and len(seen) >= N // 4
            assert np.array_equal(out, source())
            # start=: only what follows
            part = np.zeros((N - 10) * BB, dtype=np.uint8)
            assert stream.follow_into(kv, toks, part, idle_s=0.0, start=10) == N - 10
            assert np.array_equal(part, source()[10 * BB:])
    finally:
        prod.close()


def test_a_producer_killed_mid_stream_leaves_a_complete_prefix(kvpool):
    prod = Producer(kvpool)
    try:
        with cxlkv.open_pool(kvpool) as pool:
            kv = pool.kv(model=MODEL, block_tokens=BT, block_bytes=BB)
            toks = np.arange(N * BT, dtype=np.uint32)
            out = np.zeros(N * BB, dtype=np.uint8)
            killed = threading.Event()

            def on_blocks(done):
                if done >= 10 and not killed.is_set():
                    prod.p.kill()                 # kill -9 with the consumer following
                    prod.p.wait(30)
                    killed.set()

            prod.store(10)
            t0 = time.monotonic()
            got = stream.follow_into(kv, toks, out, idle_s=0.3, on_blocks=on_blocks)
            took = time.monotonic() - t0
            assert killed.is_set() and got == 10
            assert took < 20                      # it gave up after idle_s, not never
            src = source()
            assert np.array_equal(out[:10 * BB], src[:10 * BB])
            assert not out[10 * BB:].any()        # nothing after the prefix was written
    finally:
        prod.close()


def test_word_wait_wakes_and_is_bounds_checked(kvpool):
    with cxlkv.open_pool(kvpool) as pool:
        m = pool.mapping
        off = stream.word_offset(pool)
        seen = m.load64(off)
        # a changed word: no wait at all; a timeout: the value seen
        assert m.word_wait(off, seen + 1, 10**9) == seen
        t0 = time.monotonic()
        assert m.word_wait(off, seen, 20_000_000) == seen
        assert time.monotonic() - t0 >= 0.015
        assert m.word_wake(off) == 0
        for bad in (m.size, m.size - 4, off + 3, 2**63):
            with pytest.raises((IndexError, ValueError, OverflowError)):
                m.word_wait(bad, 0, 0)
            with pytest.raises((IndexError, ValueError, OverflowError)):
                m.word_wake(bad)
        # a sleeper is woken by a store's notify, long before its timeout
        kv = pool.kv(model=MODEL, block_tokens=BT, block_bytes=BB)
        res = {}

        def sleeper():
            t = time.monotonic()
            res["value"] = m.word_wait(off, seen, 30 * 10**9)
            res["took"] = time.monotonic() - t

        th = threading.Thread(target=sleeper)
        th.start()
        kv.store(np.arange(BT, dtype=np.uint32), np.ones(BB, dtype=np.uint8))
        stream.notify(pool)
        th.join(30)
        assert not th.is_alive() and res["value"] != seen and res["took"] < 29
