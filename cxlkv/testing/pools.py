"""Test pools: the small geometry most tests format, and where things are in one."""
from __future__ import annotations

import os

from cxlkv.pool.format import FormatParams
from cxlkv.api import Pool

MiB = 1 << 20

#: a small pool used across tests (fast to format)
SMALL = dict(size=8 * MiB, chunk_size=64 * 1024, max_nodes=8, hash_slots=256)


def small_params(**kw) -> FormatParams:
    """FormatParams of SMALL, fields overridden by kw."""
    return FormatParams(**{**SMALL, **kw})


def data_word(path: str) -> int:
    """Offset of the data region's first word (tests use it as a shared counter)."""
    with Pool.open(path) as p:
        return p.region("data")[0]


def mode_of(path: str) -> int:
    """A file's permission bits."""
    return os.stat(path).st_mode & 0o7777
