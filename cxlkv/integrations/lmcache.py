"""LMCache: a storage plugin (StoragePluginInterface) that keeps LMCache's chunks in the pool.

LMCache loads it through its storage-plugin configuration - nothing in
LMCache changes.  In the LMCache config (YAML, or LMCACHE_* variables):

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    storage_plugins: ["cxlkv"]
    extra_config:
      storage_plugin.cxlkv.module_path: cxlkv.integrations.lmcache
      storage_plugin.cxlkv.class_name: CxlkvLMCacheBackend
      cxlkv.pool: /dev/dax0.0            # default $CXLKV_POOL, else /dev/shm/cxlkv-default.pool
      cxlkv.namespace: my-model          # optional (default: derived, see below)
      cxlkv.salt: tenant-a               # optional tenant; cxlkv.quota: bytes for it

LMCache's plugin loader imports this module and takes CxlkvLMCacheBackend from
it; the class derives from LMCache's own StoragePluginInterface, so it is made
when first asked for (module __getattr__) and this module imports without
LMCache.  LMCache keeps its API (store / retrieve / lookup) and puts its chunks
in the rack's pool, shared by every host, crash-safe and evictable.

Keys.  A pool block is one LMCache chunk, keyed by the SHA-256 of LMCache's
CacheEngineKey string (model@world size@worker@chunk hash@dtype[@tags]) -
the chunk hash LMCache computed over the token prefix, so the same prefix
finds the same block from any host.  Namespace
lmcache/<model>/<dtype>/tp<worker>of<world>/c<chunk size> (or cxlkv.namespace,
with the tp part kept): workers of other ranks or models never share blocks.

Payload.  A block of HEADER_BYTES + LMCache's full-chunk size: the header
(CHUNK_HEADER: magic, LMCache MemoryFormat, shape, payload bytes), then the
chunk's bytes as LMCache's MemoryObj holds them (a last, partial chunk is
shorter).  Single-tensor chunks only (multi-tensor allocations are refused
and logged, as LMCache's DAX plugin does).

Copies.  Store: the chunk and its header are staged into one buffer, then
stored with the C core's non-temporal copy.  Retrieve: the block is pinned
and copied once into a MemoryObj from LMCache's local CPU allocator.  Puts
are synchronous (batched_submit_put_task returns None): a chunk is in the
pool, visible to every node, when the call returns.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct

import numpy as np

from cxlkv import api
from cxlkv.errors import CxlkvError, UsageError

log = logging.getLogger(__name__)

__all__ = ["CLASS_NAME", "CHUNK_HEADER", "HEADER_BYTES", "LMCacheCore", "chunk_hash_bytes",
           "namespace_for", "pack_header", "unpack_header"]

DEFAULT_POOL = "/dev/shm/cxlkv-default.pool"
#: the class name LMCache's storage_plugin.<name>.class_name names
CLASS_NAME = "CxlkvLMCacheBackend"

#: the header in front of each chunk in its block: magic, LMCache MemoryFormat
#: value, number of dimensions, up to six dimensions, payload bytes
CHUNK_HEADER = struct.Struct("<8sII6QQ")
HEADER_MAGIC = b"CXLKVLMC"
#: the header's room in a block: the payload starts 64-byte aligned
HEADER_BYTES = 128
_MAX_DIMS = 6


def pack_header(fmt: int, shape, nbytes: int) -> bytes:
    dims = [int(d) for d in shape]
    if len(dims) > _MAX_DIMS:
        raise UsageError(f"an LMCache chunk of {len(dims)} dimensions (at most {_MAX_DIMS})")
    raw = CHUNK_HEADER.pack(HEADER_MAGIC, int(fmt), len(dims),
                            *(dims + [0] * (_MAX_DIMS - len(dims))), int(nbytes))
    return raw + bytes(HEADER_BYTES - len(raw))


def unpack_header(buf) -> tuple[int, tuple[int, ...], int]:
    """(format, shape, payload bytes) of a block's header; UsageError if it is none."""
    magic, fmt, ndim, *rest = CHUNK_HEADER.unpack_from(buf, 0)
    if magic != HEADER_MAGIC or ndim > _MAX_DIMS:
        raise UsageError("not a cxlkv LMCache chunk (bad header)")
    return fmt, tuple(rest[:ndim]), rest[_MAX_DIMS]


def chunk_hash_bytes(key) -> bytes:
    """The 32-byte pool hash of an LMCache CacheEngineKey (its to_string())."""
    s = key.to_string() if hasattr(key, "to_string") else str(key)
    return hashlib.sha256(s.encode("utf-8")).digest()


def namespace_for(*, model: str, dtype: str, worker: int, world: int, chunk_size: int,
                  name: str | None = None) -> str:
    base = name or f"lmcache/{(model or 'model').strip('/').replace('/', '-')[:48]}/{dtype}"
    return f"{base}/tp{worker}of{world}/c{chunk_size}"


class LMCacheCore:
    """The plugin's behaviour; CxlkvLMCacheBackend is this with LMCache's
    StoragePluginInterface as its second base (made on first use)."""

    def _setup(self) -> None:
        cfg, md = self.config, self.metadata
        if cfg is None or md is None:
            raise UsageError("CxlkvLMCacheBackend needs LMCache's config and metadata")
        if self.local_cpu_backend is None:
            raise UsageError("CxlkvLMCacheBackend needs LMCache's local CPU backend "
                             "(local_cpu: true) to allocate what it retrieves")
        extra = dict(cfg.extra_config or {})
        self._pool_path = str(extra.get("cxlkv.pool") or os.environ.get("CXLKV_POOL")
                              or DEFAULT_POOL)
        quota = extra.get("cxlkv.quota")
        dtype = str(md.kv_dtype).replace("torch.", "")
        self.namespace = namespace_for(model=str(md.model_name), dtype=dtype,
                                       worker=int(md.worker_id), world=int(md.world_size),
                                       chunk_size=int(cfg.chunk_size),
                                       name=extra.get("cxlkv.namespace"))
        self.chunk_bytes = int(self.local_cpu_backend.get_full_chunk_size_bytes())
        self._pool = api.open_pool(self._pool_path)
        self._kv = self._pool.kv(model=self.namespace, block_tokens=int(cfg.chunk_size),
                                 block_bytes=HEADER_BYTES + self.chunk_bytes,
                                 salt=extra.get("cxlkv.salt"),
                                 quota=int(quota) if quota is not None else None)
        self._block = np.zeros(HEADER_BYTES + self.chunk_bytes, dtype=np.uint8)
        self.stats = {"stored": 0, "retrieved": 0, "missed": 0, "removed": 0,
                      "store_failures": 0}
        log.info("cxlkv LMCache plugin: pool %s, namespace %s", self._pool_path, self.namespace)

    def __str__(self) -> str:
        return "CxlkvLMCacheBackend"

    # -- lookups -----------------------------------------------------------------------------
    def contains(self, key, pin: bool = False) -> bool:
        return self._kv.match_hashes([chunk_hash_bytes(key)]) == 1

    def batched_contains(self, keys, pin: bool = False) -> int:
        """Leading keys present (LMCache's prefix semantics)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    async def batched_async_contains(self, lookup_id, keys, pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key) -> bool:
        return False                    # puts are synchronous

    def pin(self, key) -> bool:
        return self.contains(key)       # the pool pins a block only while it is copied out

    def unpin(self, key) -> bool:
        return self.contains(key)

    # -- store -------------------------------------------------------------------------------
    def batched_submit_put_task(self, keys, objs, transfer_spec=None,
                                on_complete_callback=None):
        if len(keys) != len(objs):
            raise UsageError(f"{len(keys)} keys for {len(objs)} memory objects")
        for key, obj in zip(keys, objs):
            if self._put(key, obj) and on_complete_callback is not None:
                try:
                    on_complete_callback(key)
                except Exception:               # LMCache's contract: logged, not raised
                    log.exception("cxlkv LMCache plugin: put callback failed for %s", key)
        return None

    async def async_batched_submit_put_task(self, keys, objs, transfer_spec=None,
                                            on_complete_callback=None) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    def _put(self, key, obj) -> bool:
        if len(obj.get_shapes()) > 1:
            log.error("cxlkv LMCache plugin: multi-tensor chunk %s refused", key)
            return False
        data = np.frombuffer(obj.byte_array, dtype=np.uint8)
        if data.nbytes > self.chunk_bytes:
            log.error("cxlkv LMCache plugin: chunk %s of %d bytes exceeds the full chunk "
                      "(%d)", key, data.nbytes, self.chunk_bytes)
            return False
        block = self._block                  # kept between puts: no page faults per chunk
        block[HEADER_BYTES + data.nbytes:] = 0
        block[:HEADER_BYTES] = np.frombuffer(
            pack_header(obj.metadata.fmt.value, obj.get_shape(), data.nbytes), dtype=np.uint8)
        block[HEADER_BYTES:HEADER_BYTES + data.nbytes] = data
        try:
            self._kv.store_hashes([chunk_hash_bytes(key)], block)
        except CxlkvError as e:
            self.stats["store_failures"] += 1
            log.warning("cxlkv LMCache plugin: storing %s failed: %s", key, e)
            return False
        self.stats["stored"] += 1
        return True

    # -- retrieve ----------------------------------------------------------------------------
    def get_blocking(self, key):
        import torch  # LMCache runs on torch

        from_fmt = type(self)._memory_format
        loaded = self._kv.load_hashes([chunk_hash_bytes(key)])
        try:
            if not loaded.blocks:
                self.stats["missed"] += 1
                return None
            view = loaded.views()[0]
            fmt, shape, nbytes = unpack_header(view)
            obj = self.local_cpu_backend.allocate(torch.Size(shape), key.dtype, from_fmt(fmt))
            if obj is None:
                log.warning("cxlkv LMCache plugin: no local CPU memory for %s", key)
                return None
            dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
            if dst.nbytes != nbytes:
                obj.ref_count_down()
                raise UsageError(f"chunk {key}: {nbytes} bytes stored, {dst.nbytes} allocated")
            dst[:] = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=HEADER_BYTES)
        finally:
            loaded.release()
        self.stats["retrieved"] += 1
        return obj

    def batched_get_blocking(self, keys):
        return [self.get_blocking(k) for k in keys]

    async def batched_get_non_blocking(self, lookup_id, keys, transfer_spec=None):
        out = []
        for k in keys:
            obj = self.get_blocking(k)
            if obj is None:
                break
            out.append(obj)
        return out

    # -- remove ------------------------------------------------------------------------------
    def remove(self, key, force: bool = True) -> bool:
        """Evict the chunk's block now (False if absent or pinned by a reader)."""
        # LMCache's chunks are stored one a chain, so each is a leaf
        gone = self._kv.evict_hashes([chunk_hash_bytes(key)])
        self.stats["removed"] += gone
        return bool(gone)

    # -- housekeeping -------------------------------------------------------------------------
    def get_allocator_backend(self):
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None          # the pool keeps its own LRU, touched on every load

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._kv = None
            self._pool.close()
            self._pool = None


_CLASS = None


def __getattr__(name: str):
    """CxlkvLMCacheBackend: LMCacheCore on LMCache's StoragePluginInterface, made on first use."""
    global _CLASS
    if name != CLASS_NAME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        try:
            from lmcache.v1.memory_management import MemoryFormat
            from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
        except ImportError as e:
            raise ImportError(f"{CLASS_NAME} needs LMCache (import failed: {e})") from e

        def __init__(self, config=None, metadata=None, local_cpu_backend=None, loop=None,
                     dst_device: str = "cpu"):
            StoragePluginInterface.__init__(self, dst_device=dst_device, config=config,
                                            metadata=metadata,
                                            local_cpu_backend=local_cpu_backend, loop=loop)
            self._setup()

        _CLASS = type(CLASS_NAME, (LMCacheCore, StoragePluginInterface),
                      {"__module__": __name__, "__doc__": LMCacheCore.__doc__,
                       "__init__": __init__, "_memory_format": staticmethod(MemoryFormat)})
    return _CLASS
