"""KV block contents a reader can check: each block is its chain hash
repeated, so whoever loads a block can tell whether it holds what its key
says (the node processes of cxlkv.testing.nodes write and verify the same)."""
from __future__ import annotations

import random


def pattern(kv, toks) -> list[bytes]:
    """The blocks of `toks` in namespace kv (one bytes object per full block)."""
    return [h * (kv.block_bytes // len(h)) for h in kv.block_hashes(toks)]


def pattern_bytes(kv, toks) -> bytes:
    """pattern() as one buffer, the way kv.store takes a prefix's blocks."""
    return b"".join(pattern(kv, toks))


def verify(kv, toks) -> tuple[int, int]:
    """(blocks loaded, how many of them differ from pattern())."""
    want = pattern(kv, toks)
    with kv.load(toks) as views:
        return len(views), sum(bytes(v) != want[i] for i, v in enumerate(views))


def random_blocks(n: int, size: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    """n random 16-byte keys and n random values of `size` bytes (seeded)."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(n)]
    return keys, [rng.randbytes(size) for _ in range(n)]
