"""SGLang HiCache: an L3 storage backend (HiCacheStorage) that keeps pages in the pool.

SGLang loads it through its dynamic storage-backend option - nothing in
SGLang changes:

    PYTHONPATH=/path/to/cxlkv python -m sglang.launch_server --model-path MODEL \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "cxlkv",
          "module_path": "cxlkv.integrations.sglang", "class_name": "CxlkvHiCacheStorage",
          "interface_v1": 1, "pool": "/dev/dax0.0"}'

SGLang's factory imports this module and takes CxlkvHiCacheStorage from it;
the class derives from SGLang's own HiCacheStorage, so it is made when it is
first asked for (module __getattr__) and this module imports without SGLang.
"interface_v1": 1 selects the zero-copy forms (batch_get_v1 / batch_set_v1:
SGLang passes host-pool indices, the pages move between the pool and SGLang's
host memory pool directly); without it SGLang calls batch_get / batch_set
with flat page tensors.  Extra config (all optional):

    pool       the pool path (default $CXLKV_POOL, else /dev/shm/cxlkv-default.pool)
    namespace  the namespace's stem, in place of sglang/<model> (default: derived,
               see below); the page format parts always follow it
    salt       the tenant (default none); quota: bytes for it (default none)

Keys.  A pool block is one SGLang page, keyed by SGLang's own page hash (the
hex SHA-256 chain hash HiCache computes, extra keys and cache_salt folded in
by SGLang) as 32 bytes; a key that is not hex is keyed by its SHA-256.  A
batch is stored as one chain in the pool (parent before child, so eviction
takes the batch's tail first).

Payload.  One page as SGLang's host pool lays it out (get_data_page), in
the KV cache dtype.  MHA (MHATokenToKVPoolHost): K and V,
[2][layers][page tokens][heads][head dim] in layout "layer_first",
[2][page tokens][layers][heads][head dim] in "page_first" (and SGLang's
"page_first_direct" / "page_head" pages).  MLA (MLATokenToKVPoolHost): one
latent tensor per layer, no K/V split, [layers][page tokens][1][kv dim] in
"layer_first", [page tokens][layers][1][kv dim] in "page_first".  The
attention kind and the layout are part of the namespace, so MLA pages never
meet MHA pages, nor pages of another layout.

Namespace.  sglang/<model>/<dtype>/<kind>/<layout>/<page shape>/p<page size>/
tp<rank>of<size> (then pp<rank>of<size> with pipeline parallelism, cp<rank>of
<size> with attention context parallelism): instances share pages when they
serve the same model id with the same kind, geometry and layout.  <kind> is
"mha" or "mla" by SGLang's host pool class (another pool class: its name).
MLA KV is the same on every TP rank (SGLang's is_mla_model: rank-replicated):
one copy for all of them (no tp part), stored only by the storage-writer
rank, as SGLang's own file and Mooncake backends do.  Extra config
"namespace" replaces the sglang/<model> stem only.

Copies.  Zero-copy get: the pages are pinned in the pool and copied once,
straight into SGLang's host pool (torch.frombuffer on the pool mapping).
Set: a page is mostly not contiguous in SGLang's host pool (MHA: K and V
halves lie apart; layer_first: layers lie apart; only an MLA page_first page
is one run), so a batch is gathered into one staging buffer (kept between
calls), then stored (the C core's non-temporal copy) - two copies.

Scope: one KV pool (the v2 interface's extra pools - Mamba, SWA, DSA
sidecars - are refused, hit 0); decode-context parallelism shards
are keyed like TP shards.
"""
from __future__ import annotations

import hashlib
import logging
import os
import warnings

from cxlkv import api
from cxlkv.errors import CxlkvError, UsageError

log = logging.getLogger(__name__)

__all__ = ["CLASS_NAME", "DEFAULT_POOL", "HiCacheCore", "namespace_for", "page_hash_bytes",
           "page_kind"]

DEFAULT_POOL = "/dev/shm/cxlkv-default.pool"
#: the class name SGLang's extra config names
CLASS_NAME = "CxlkvHiCacheStorage"
#: the v2 interface's KV pool name (SGLang's PoolName.KV)
_KV_POOL = "kv"


def page_hash_bytes(key: str) -> bytes:
    """SGLang's page hash as pool-key bytes: its 32 bytes when it is the
    64-digit hex SHA-256 HiCache computes, else the SHA-256 of the string."""
    if not isinstance(key, str):
        raise UsageError(f"SGLang page keys are str, not {type(key).__name__}")
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode("utf-8")).digest()


def namespace_for(*, model: str, dtype: str, kind: str, layout: str, page_shape,
                  page_size: int, tp_rank: int, tp_size: int, pp_rank: int = 0,
                  pp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
                  replicated: bool = False, stem: str | None = None) -> str:
    """The namespace a HiCache instance stores its pages in (see the module doc).
    kind: the page format ("mha", "mla"); replicated: the pages are the same on
    every TP rank (MLA), so no tp part; stem replaces "sglang/<model>"."""
    if not kind or "/" in kind:
        raise UsageError(f"SGLang page kind {kind!r}: expected a name such as 'mha' or 'mla'")
    if stem is None:
        name = (model or "model").strip("/").replace("/", "-")[:48] or "model"
        stem = f"sglang/{name}"
    shape = "x".join(str(int(d)) for d in page_shape)
    ns = f"{stem}/{dtype}/{kind}/{layout}/{shape}/p{page_size}"
    if not replicated:
        ns += f"/tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        ns += f"/pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        ns += f"/cp{cp_rank}of{cp_size}"
    return ns


#: SGLang's host pool classes and the page kind each names (by class name, so
#: that this module never imports SGLang's pools)
_KINDS = {"MLATokenToKVPoolHost": "mla", "MHATokenToKVPoolHost": "mha"}


def page_kind(mem_pool_host) -> str:
    """The page format of SGLang's host pool: "mla" or "mha" for its MLA and
    MHA pools (and their subclasses), else the pool's class name."""
    for cls in type(mem_pool_host).__mro__:
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return type(mem_pool_host).__name__


class HiCacheCore:
    """The backend's behaviour; CxlkvHiCacheStorage is this with SGLang's
    HiCacheStorage as its second base (made on first use, see __getattr__)."""

    def __init__(self, storage_config, kwargs: dict | None = None):
        cfg = storage_config
        extra = dict(getattr(cfg, "extra_config", None) or {})
        self._config = cfg
        self._pool_path = str(extra.get("pool") or os.environ.get("CXLKV_POOL") or DEFAULT_POOL)
        self._ns_override = extra.get("namespace")
        self._salt = extra.get("salt")
        quota = extra.get("quota")
        self._quota = int(quota) if quota is not None else None
        self._model = str(getattr(cfg, "model_name", None) or "")
        # SGLang's is_mla_model means rank-replicated KV (MLA and compressed-MLA pools)
        self._mla = bool(getattr(cfg, "is_mla_model", False))
        self._writer = bool(getattr(cfg, "is_storage_writer", True))
        self._tp = (int(getattr(cfg, "tp_rank", 0)), int(getattr(cfg, "tp_size", 1)))
        self._pp = (int(getattr(cfg, "pp_rank", 0)), int(getattr(cfg, "pp_size", 1)))
        # attention context parallelism: each CP rank holds its own slice of a page
        self._cp = (int(getattr(cfg, "attn_cp_rank", 0) or 0),
                    int(getattr(cfg, "attn_cp_size", 1) or 1))
        if int(getattr(cfg, "dcp_size", 1) or 1) > 1:
            # a DCP shard holds part of each page: its own namespace, like a TP rank
            self._tp = (int(cfg.dcp_rank), int(cfg.dcp_size))
            self._mla = False
        self._pool = None
        self._kv = None
        self.mem_pool_host = None
        self._page_shape: tuple[int, ...] = ()
        self._kind = ""
        self._staging = None            # the set path's staging buffer (pages)
        self.stats = {"get_pages": 0, "set_pages": 0, "hit_pages": 0, "miss_pages": 0,
                      "store_failures": 0}
        log.info("cxlkv HiCache storage: pool %s", self._pool_path)

    # -- SGLang hands over its host pool ---------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        self._page_shape = tuple(mem_pool_host.get_data_page(0, flat=False).shape)
        self._kind = page_kind(mem_pool_host)
        if self._kind in _KINDS.values() and (self._kind == "mla") != self._mla:
            # SGLang sets both from one device pool: a mismatch is a caller's mistake
            log.warning("cxlkv HiCache: %s host pool with is_mla_model=%s",
                        type(mem_pool_host).__name__, self._mla)
        self._kv = None
        self._staging = None

    def _page_bytes(self) -> int:
        n = 1
        for d in self._page_shape:
            n *= int(d)
        return n * self.mem_pool_host.dtype.itemsize

    def namespace(self) -> str:
        host = self._host()
        return namespace_for(model=self._model, dtype=str(host.dtype).replace("torch.", ""),
                             kind=self._kind, layout=str(host.layout),
                             page_shape=self._page_shape, page_size=int(host.page_size),
                             tp_rank=self._tp[0], tp_size=self._tp[1], pp_rank=self._pp[0],
                             pp_size=self._pp[1], cp_rank=self._cp[0], cp_size=self._cp[1],
                             replicated=self._mla,
                             stem=str(self._ns_override) if self._ns_override else None)

    def _host(self):
        if self.mem_pool_host is None:
            raise UsageError("CxlkvHiCacheStorage: SGLang registered no host memory pool "
                             "(register_mem_pool_host) before the first transfer")
        return self.mem_pool_host

    def kv(self):
        """The pool's KV namespace of this instance (opened on first use)."""
        if self._kv is None:
            host = self._host()
            if self._pool is None:
                self._pool = api.open_pool(self._pool_path)
            self._kv = self._pool.kv(model=self.namespace(), block_tokens=int(host.page_size),
                                     block_bytes=self._page_bytes(), salt=self._salt,
                                     quota=self._quota)
        return self._kv

    # -- lookups -----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys, extra_info=None) -> int:
        """Leading pages of `keys` present in the pool (SGLang's prefix semantics)."""
        if not keys:
            return 0
        n = self.kv().match_hashes([page_hash_bytes(k) for k in keys])
        self.stats["hit_pages"] += n
        self.stats["miss_pages"] += len(keys) - n
        return n

    # -- reads -------------------------------------------------------------------------------
    def _load(self, keys, sink) -> int:
        """Pin the leading present pages of `keys` and hand each to
        sink(i, tensor of the page shape viewing the pool); returns how many."""
        import torch  # SGLang runs on torch; cxlkv itself does not need it

        host = self._host()
        loaded = self.kv().load_hashes([page_hash_bytes(k) for k in keys])
        try:
            n = loaded.blocks
            if n:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    for i, v in enumerate(loaded.views()):
                        sink(i, torch.frombuffer(v, dtype=host.dtype).view(self._page_shape))
        finally:
            loaded.release()
        self.stats["get_pages"] += n
        return n

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Zero-copy get: each present page straight into SGLang's host pool at
        host_indices[i * page_size]; True for the leading pages read."""
        host = self._host()
        ps = int(host.page_size)
        if host_indices is None or int(host_indices.numel()) != len(keys) * ps:
            log.error("batch_get_v1: %d keys need %d host indices, got %s", len(keys),
                      len(keys) * ps, None if host_indices is None else host_indices.numel())
            return [False] * len(keys)
        idx = host_indices[::ps].tolist()

        def sink(i, page):
            host.get_data_page(int(idx[i]), flat=False).copy_(page)

        n = self._load(list(keys), sink)
        return [True] * n + [False] * (len(keys) - n)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Legacy get: copies each present page into its flat target tensor;
        None for the pages after the first miss."""
        keys = list(keys)
        out: list = [None] * len(keys)
        if target_locations is None:
            target_locations = [self._host().get_dummy_flat_data_page() for _ in keys]

        def sink(i, page):
            t = target_locations[i]
            t.view(page.shape).copy_(page) if t.is_contiguous() else t.copy_(page.flatten())
            out[i] = t

        self._load(keys, sink)
        return out

    def get(self, key, target_location=None, target_sizes=None):
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # -- writes ------------------------------------------------------------------------------
    def _store(self, keys, pages) -> bool:
        """Store pages (tensors of the page's element count) under keys, as one chain."""
        import torch

        if not keys:
            return True
        if not self._writer:
            return True          # an MLA replica: the writer rank stores the shared page
        n = len(keys)
        if self._staging is None or self._staging.shape[0] < n:
            # kept between calls: a fresh buffer per batch costs its page faults
            self._staging = torch.empty((max(n, 16),) + self._page_shape,
                                        dtype=self._host().dtype)
        staged = self._staging[:n]
        torch.stack([p.reshape(self._page_shape) for p in pages], out=staged)   # the one copy
        try:
            self.kv().store_hashes([page_hash_bytes(k) for k in keys],
                                   staged.view(torch.uint8).numpy())
        except CxlkvError as e:
            # the pool is a cache: a page that did not fit is a later miss
            self.stats["store_failures"] += len(keys)
            log.warning("cxlkv HiCache: storing %d pages failed: %s", len(keys), e)
            return False
        self.stats["set_pages"] += len(keys)
        return True

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Zero-copy set: the pages at host_indices[i * page_size] of SGLang's host pool."""
        host = self._host()
        ps = int(host.page_size)
        keys = list(keys)
        if host_indices is None or int(host_indices.numel()) != len(keys) * ps:
            log.error("batch_set_v1: %d keys need %d host indices", len(keys), len(keys) * ps)
            return [False] * len(keys)
        pages = [host.get_data_page(int(i), flat=False) for i in host_indices[::ps].tolist()]
        return [self._store(keys, pages)] * len(keys)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keys = list(keys)
        if values is None or len(values) != len(keys):
            log.error("batch_set: %d keys, %s values", len(keys),
                      None if values is None else len(values))
            return False
        return self._store(keys, list(values))

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    # -- the v2 interface: the KV pool only ---------------------------------------------------
    def _refuse_extra_pools(self, transfers) -> list[str]:
        extra = [str(t.name) for t in transfers or () if str(t.name) != _KV_POOL]
        if extra:
            log.warning("cxlkv HiCache stores the KV pool only; not %s", ", ".join(extra))
        return extra

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        n = self.batch_exists(list(keys))
        if self._refuse_extra_pools(pool_transfers):
            n = 0
        return PoolTransferResult(n, {_KV_POOL: n} if n else {}, list(range(1, n + 1)))

    def _batch_v2(self, transfers, op) -> dict:
        out = {}
        for t in transfers:
            keys = list(t.keys or [])
            if str(t.name) != _KV_POOL:
                self._refuse_extra_pools([t])
                out[t.name] = [False] * len(keys)
            else:
                out[t.name] = op(keys, t.host_indices)
        return out

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._batch_v2(transfers, self.batch_get_v1)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._batch_v2(transfers, self.batch_set_v1)

    # -- housekeeping -------------------------------------------------------------------------
    def clear(self) -> bool:
        """Drop this instance's namespace (pinned pages stay; False then)."""
        if self._pool is None and self.mem_pool_host is None:
            return True
        r = self.kv().drop()
        self._kv = None
        return bool(r.get("dropped"))

    def get_stats(self):
        return dict(self.stats)

    def close(self) -> None:
        self._kv = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


_CLASS = None


def __getattr__(name: str):
    """CxlkvHiCacheStorage: HiCacheCore on SGLang's HiCacheStorage, made on first use."""
    global _CLASS
    if name != CLASS_NAME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        try:
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
        except ImportError as e:
            raise ImportError(f"{CLASS_NAME} needs SGLang (import failed: {e})") from e
        _CLASS = type(CLASS_NAME, (HiCacheCore, HiCacheStorage),
                      {"__module__": __name__, "__doc__": HiCacheCore.__doc__})
    return _CLASS
