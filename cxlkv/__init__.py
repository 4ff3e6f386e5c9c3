"""cxlkv: a CXL Type-3 shared-memory pool and a rack-scale, prefix-aware LLM KV cache.

Public API (integrations and users rely only on these names):

    cxlkv.open_pool(path)           open a pool and attach as a node (context manager)
    cxlkv.Pool.open(path)           open a formatted pool without attaching
    cxlkv.format_pool(path, params) format a file or device-dax device
    cxlkv.FormatParams              format parameters
    cxlkv.errors                    the exception tree (CxlkvError and subclasses)

    pool.kv(model=..., block_tokens=16, block_bytes=N, salt=None, hash="xxh3_128")
                                    a KV cache namespace (cxlkv.KVCache): block_hashes,
                                    match, store, load, load_into and the *_hashes / *_many forms
    cxlkv.KVPoolFull, cxlkv.KVTableFull, cxlkv.QuotaExceeded, cxlkv.TooManyPins
                                    what store and load refuse with
"""
from cxlkv.errors import CxlkvError, KVPoolFull, KVTableFull, QuotaExceeded, TooManyPins
from cxlkv.version import __version__


def __getattr__(name):
    # Lazy: importing cxlkv must not need the C core (e.g. for --help).
    if name in ("Pool", "open_pool"):
        from cxlkv import api

        return getattr(api, name)
    if name in ("format_pool", "init_pool", "create_pool_file"):
        from cxlkv.ops import init

        return getattr(init, name)
    if name == "KVCache":
        from cxlkv.kv.cache import KVCache

        return KVCache
    if name == "FormatParams":
        from cxlkv.pool.format import FormatParams

        return FormatParams
    raise AttributeError(f"module 'cxlkv' has no attribute {name!r}")


__all__ = ["__version__", "CxlkvError", "Pool", "open_pool", "format_pool", "init_pool", "create_pool_file",
           "FormatParams", "KVCache", "KVPoolFull", "KVTableFull", "QuotaExceeded", "TooManyPins"]
