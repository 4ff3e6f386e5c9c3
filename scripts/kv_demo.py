"""The main job in miniature: a producer process stores a prompt prefix's KV
blocks in the pool; a consumer process (another "host") matches the prefix
and reads the blocks instead of recomputing them.  Run by scripts/demo."""
from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np

import cxlkv

MODEL = "cxlkv-demo/tiny/f16"          # the namespace: model, dtype, layout
BLOCK_TOKENS = 16
BLOCK_BYTES = 256 * 1024               # one block of K and V for all layers
PROMPT = np.arange(1000, 1000 + 4096)  # a 4,096-token shared system prompt


def producer(path: str, q) -> None:
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model=MODEL, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        n = len(PROMPT) // BLOCK_TOKENS
        blocks = np.random.default_rng(0).integers(0, 256, (n, BLOCK_BYTES), dtype=np.uint8)
        t = time.perf_counter()
        new = kv.store(PROMPT, blocks)
        q.put(("producer", pool.node.slot, new, n, time.perf_counter() - t))


def consumer(path: str, q) -> None:
    with cxlkv.open_pool(path) as pool:
        kv = pool.kv(model=MODEL, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES)
        out = np.empty(len(PROMPT) // BLOCK_TOKENS * BLOCK_BYTES, dtype=np.uint8)
        t = time.perf_counter()
        hit = kv.match(PROMPT)
        got = kv.load_into(PROMPT, out)
        q.put(("consumer", pool.node.slot, hit, got, time.perf_counter() - t))


def main(path: str) -> int:
    from cxlkv.pool import layout
    from cxlkv.api import Pool

    with Pool.open(path, writable=False) as p:
        has_kv = bool(p.sb.compat & layout.COMPAT_KV)
    if not has_kv:
        print(f"demo: {path} was made by a cxlkv from before the KV cache (it has no KV "
              "region). Re-create it - what it holds is lost - with\n"
              f"  .venv/bin/cxlkv format --pool {path} --force\n"
              "or run the demo on another pool: CXLKV_POOL=/dev/shm/other.pool ./scripts/demo",
              file=sys.stderr)
        return 1
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    for role in (producer, consumer):
        p = ctx.Process(target=role, args=(path, q))
        p.start()
        p.join()
        if p.exitcode:
            print(f"demo: the {role.__name__} failed (exit {p.exitcode})", file=sys.stderr)
            return 1
        name, slot, a, b, secs = q.get()
        mib = b * BLOCK_BYTES / 2**20 if name == "consumer" else a * BLOCK_BYTES / 2**20
        if name == "producer":
            print(f"producer (node {slot}): stored {a} of {b} blocks of the prompt prefix "
                  f"({mib:.0f} MiB new) in {secs * 1e3:.1f} ms"
                  + (" - already in the pool from an earlier run" if a == 0 else ""))
        else:
            print(f"consumer (node {slot}): {a} of {len(PROMPT)} prompt tokens matched, "
                  f"{b} blocks ({mib:.0f} MiB) read in {secs * 1e3:.1f} ms instead of "
                  "recomputing them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
