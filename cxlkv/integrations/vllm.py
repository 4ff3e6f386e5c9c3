"""vLLM: a KV connector (KVConnectorBase_V1) that shares prefix KV blocks through the pool.

Load it into vLLM with the connector's module path - nothing in vLLM changes:

    PYTHONPATH=/path/to/cxlkv vllm serve MODEL --prefix-caching-hash-algo sha256_cbor \\
      --kv-transfer-config '{"kv_connector": "CxlkvConnector",
                             "kv_connector_module_path": "cxlkv.integrations.vllm",
                             "kv_role": "kv_both",
                             "kv_connector_extra_config": {"pool": "/dev/daxX.Y"}}'

kv_role: "kv_producer" only stores (a prefill instance), "kv_consumer" only
loads (a decode instance), "kv_both" does both (a prefix cache shared by every
instance of the rack).  kv_connector_extra_config:

    pool        the pool path (default $CXLKV_POOL, else /dev/shm/cxlkv-default.pool)
    namespace   the namespace name (default: derived, see below)
    salt        a tenant salt for every request (default none); a request's own
                cache_salt, when it has one, is its tenant instead
    quota       bytes per tenant (default none)
    remote      a TOML file whose [remote] table names the remote tier's cluster
                (cxlkv.remote.RemoteConfig): lookups that miss in the pool read
                through it, and what they find is stored in the pool (blocks
                are pushed there by the racks' `cxlkv serve --remote-push`)
    remote_budget_s  how long a lookup may wait for the cluster (default 0.05)
    layerwise   true: loads copy layer by layer on a thread, and each attention
                layer waits (wait_for_layer_load) only for its own layer
                (default false: start_load_kv copies every layer first)

Keys.  A pool block is one vLLM block (block_size tokens), keyed by the block
hash vLLM computed for it (request.block_hashes) - the chain hash that names
the whole prefix up to that block, with vLLM's extra keys (LoRA, multimodal
inputs, cache_salt) folded in by vLLM.  With --prefix-caching-hash-algo
sha256_cbor those hashes are reproducible anywhere: cxlkv's own
`pool.kv(..., hash="sha256_cbor").block_hashes(tokens)` gives the same bytes
for the same tokens and seed (PYTHONHASHSEED, or vLLM's fixed default seed),
so another host or tool can find the blocks.  Other algorithms work between
vLLM instances that hash alike ("sha256" pickles; "xxhash" needs a shared
PYTHONHASHSEED) and are named in the namespace so they never mix.

Payload.  One block holds, for every attention layer of the KV cache group
in the group's layer order, vLLM's logical page of that block:

    [layers][head slots][block_size tokens][C]      (C: the backend's content
                                                     per token, K then V for
                                                     dense attention)

in the KV cache dtype, whatever the physical layout and kernel block size of
the backend (kernel blocks of one vLLM block are put back in token order).

Namespace.  vllm/<model>/<digest>/<kv dtype>/<L>x<H>x<C>/t<block_size>/<hash
algo>/tp<rank>of<size>: the digest covers the model id or path, revision,
the HF config and the dtypes.  Instances share blocks only if they run the
same weights under the same id and the same attention backend (the content
layout is the backend's); set `namespace` explicitly otherwise.

Scope.  One KV cache group of full-attention layers (FullAttentionSpec or
MLA); tensor parallelism by one namespace per TP rank (the scheduler counts a
block present only when every rank has it); pipeline and decode-context
parallelism are refused.  Loads copy from the pinned pool views straight
into the paged KV, one strided pass per layer in C with the GIL released
(cxlkv.integrations.kvcopy; CPU caches - a GPU cache goes through one CPU
staging copy); start_load_kv does every layer before the forward, or with
layerwise=true starts them on a thread and wait_for_layer_load waits for its
layer only.  Saves copy each layer's newly completed blocks in save_kv_layer
(one pass into staging blocks) and publish them in wait_for_save.
Blocks evicted between the scheduler's match and the worker's load are
reported through get_block_ids_with_load_errors (vLLM recomputes them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata,
                                                                   KVConnectorRole)
    from vllm.logger import init_logger
except ImportError as e:                                  # pragma: no cover - needs vLLM
    raise ImportError(f"cxlkv.integrations.vllm needs vLLM (import failed: {e})") from e

from cxlkv import api
from cxlkv.errors import CxlkvError, UsageError
from cxlkv.integrations import kvcopy
from cxlkv.kv.tiers import remote
from cxlkv.remote import RemoteConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["CxlkvConnector", "CxlkvConnectorMetadata", "CxlkvTransfer", "DEFAULT_POOL"]

DEFAULT_POOL = "/dev/shm/cxlkv-default.pool"
_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "use_cache",
             "_commit_hash", "_attn_implementation", "_attn_implementation_autoset"}


@dataclasses.dataclass
class CxlkvTransfer:
    """Blocks of one request to load into, or store from, vLLM's paged KV."""

    req_id: str
    salt: str | None
    block_hashes: list[bytes]
    block_ids: list[int]


@dataclasses.dataclass
class CxlkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to load before the forward
    and what to store after it."""

    loads: list[CxlkvTransfer] = dataclasses.field(default_factory=list)
    stores: list[CxlkvTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    """Scheduler-side state of one running request."""

    request: Any
    block_ids: list[int]
    saved: int = 0                       # leading blocks already stored (or loaded)


@dataclasses.dataclass(frozen=True)
class _Layout:
    layer_names: tuple[str, ...]
    heads: int
    block_size: int
    content_bytes: int                    # C in bytes, per (head slot, token)
    dtype: torch.dtype

    @property
    def layer_bytes(self) -> int:
        return self.heads * self.block_size * self.content_bytes

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * self.layer_bytes


class CxlkvConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a cxlkv pool (see the module doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._pool_path = str(extra.get("pool") or os.environ.get("CXLKV_POOL") or DEFAULT_POOL)
        self._salt = extra.get("salt")
        self._quota = extra.get("quota")
        self._namespace_override = extra.get("namespace")
        self._remote = None
        if extra.get("remote"):
            self._remote = RemoteConfig.from_toml(str(extra["remote"]))   # bad: an error now
        self._remote_budget = extra.get("remote_budget_s")
        self._layerwise = str(extra.get("layerwise", "false")).lower() in ("1", "true", "yes")
        ktc = self._kv_transfer_config
        self._do_load = bool(getattr(ktc, "is_kv_consumer", True))
        self._do_save = bool(getattr(ktc, "is_kv_producer", True))
        pc = vllm_config.parallel_config
        if getattr(pc, "pipeline_parallel_size", 1) != 1:
            raise UsageError("CxlkvConnector: pipeline parallelism is not supported")
        if getattr(pc, "decode_context_parallel_size", 1) != 1:
            raise UsageError("CxlkvConnector: decode context parallelism is not supported")
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1))
        cc = vllm_config.cache_config
        self._block_size = int(cc.block_size)
        self._hash_algo = str(getattr(cc, "prefix_caching_hash_algo", "sha256"))
        self._layout = _layout_of(kv_cache_config, self._block_size) \
            if kv_cache_config is not None else None
        self._pool = None
        self._kvs: dict[tuple[int, str | None], Any] = {}
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}   # req_id -> (local, external tokens)
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[CxlkvTransfer] = []
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._staged: dict[int, tuple[torch.Tensor, set[int]]] = {}
        self._load_errors: set[int] = set()
        self._layer_load: kvcopy.LayerLoad | None = None
        self._cpu = True                       # every registered cache is a CPU tensor
        self._rank = 0
        self.stats = {"loaded_blocks": 0, "stored_blocks": 0, "missed_blocks": 0,
                      "store_failures": 0}

    # -- the pool and namespaces ----------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False                 # a shared cache: a dropped save is a future miss

    def _namespace(self, rank: int) -> str:
        if self._namespace_override:
            base = str(self._namespace_override)
            return base if self._tp_size == 1 else f"{base}/tp{rank}of{self._tp_size}"
        lay = self._layout
        mc = self._vllm_config.model_config
        cfg = getattr(mc, "hf_config", None)
        cfg_d = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
        cfg_d = {k: v for k, v in cfg_d.items() if k not in _VOLATILE}
        ident = json.dumps({"model": str(getattr(mc, "model", "")),
                            "revision": str(getattr(mc, "revision", None)),
                            "dtype": str(getattr(mc, "dtype", "")),
                            "quantization": str(getattr(mc, "quantization", None)),
                            "config": cfg_d}, sort_keys=True, default=str)
        digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
        name = os.path.basename(str(getattr(mc, "model", "model")).rstrip("/"))[:32] or "model"
        dt = str(lay.dtype).replace("torch.", "")
        c = lay.content_bytes // _itemsize(lay.dtype)
        return (f"vllm/{name}/{digest}/{dt}/{len(lay.layer_names)}x{lay.heads}x{c}/"
                f"t{lay.block_size}/{self._hash_algo}/tp{rank}of{self._tp_size}")

    def _open_pool(self):
        if self._pool is None:
            pool = api.open_pool(self._pool_path)
            if self._remote is not None:
                remote.enable(pool, self._remote)
            self._pool = pool
        return self._pool

    def _kv(self, rank: int, salt: str | None):
        key = (rank, salt)
        kv = self._kvs.get(key)
        if kv is None:
            if self._layout is None:
                raise UsageError("CxlkvConnector needs the KV cache config (vLLM >= 0.11)")
            seed = _none_hash_seed()
            kv = self._open_pool().kv(model=self._namespace(rank), block_tokens=self._block_size,
                                      block_bytes=self._layout.block_bytes, salt=salt,
                                      hash="sha256_cbor", hash_seed=seed, quota=self._quota,
                                      remote_read=self._remote is not None,
                                      remote_budget_s=self._remote_budget)
            if len(self._kvs) > 256:            # many tenants: keep the open set bounded
                self._kvs.pop(next(iter(self._kvs)))
            self._kvs[key] = kv
        return kv

    def _salt_of(self, request) -> str | None:
        return getattr(request, "cache_salt", None) or self._salt

    def _hashes(self, request) -> list[bytes]:
        """vLLM's hash of each full block of the request (with one KV cache
        group, vLLM hashes at the block size)."""
        return [bytes(h) for h in (getattr(request, "block_hashes", None) or ())]

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond num_computed_tokens whose blocks are in the pool (on
        every TP rank), leaving at least the prompt's last token to compute."""
        if not self._do_load:
            return 0, False
        hashes = self._hashes(request)
        if not hashes:
            return 0, False
        try:
            found = min(self._kv(r, self._salt_of(request)).match_hashes(hashes)
                        for r in range(self._tp_size))
        except CxlkvError as e:
            logger.warning("cxlkv: lookup failed for request %s (%s); no reuse",
                           request.request_id, e)
            return 0, False
        bs = self._block_size
        limit = (request.num_tokens - 1) // bs * bs
        ext = max(0, min(found * bs, limit) - num_computed_tokens)
        self._matched[request.request_id] = (num_computed_tokens, ext)
        return ext, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        rid = request.request_id
        local, _ = self._matched.pop(rid, (0, 0))
        try:
            ids = list(blocks.get_block_ids()[0])
        except (AttributeError, IndexError, TypeError):
            ids = []
        bs = self._block_size
        first, last = local // bs, (local + num_external_tokens) // bs
        if num_external_tokens > 0 and self._do_load:
            self._loads.append(CxlkvTransfer(rid, self._salt_of(request),
                                             self._hashes(request)[first:last],
                                             ids[first:last]))
        self._tracked[rid] = _Tracked(request, ids, saved=last)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CxlkvConnectorMetadata(loads=self._loads)
        self._loads = []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0]) if new.block_ids else t.block_ids
            self._plan_store(meta, new.req_id, t,
                             new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            nb = cached.new_block_ids[i]
            if nb is not None:
                if rid in resumed:
                    t.block_ids = list(nb[0])
                else:
                    t.block_ids.extend(nb[0])
            self._plan_store(meta, rid, t, cached.num_computed_tokens[i] + sched.get(rid, 0))
        return meta

    def _plan_store(self, meta: CxlkvConnectorMetadata, rid: str, t: _Tracked, done: int) -> None:
        """Store the blocks this step completes (full, hashed by vLLM, not stored yet)."""
        if not self._do_save:
            return
        hashes = self._hashes(t.request)
        full = min(done // self._block_size, len(hashes), len(t.block_ids))
        if full > t.saved:
            meta.stores.append(CxlkvTransfer(rid, self._salt_of(t.request),
                                             hashes[t.saved:full], t.block_ids[t.saved:full]))
            t.saved = full

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (done in the step that computed the blocks),
        so the blocks may be freed at once."""
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Check vLLM's per-layer KV views ([blocks, head slots, tokens, C])
        against the layout and attach to the pool."""
        lay = self._layout
        if lay is None:
            raise UsageError("CxlkvConnector needs the KV cache config (vLLM >= 0.11)")
        missing = [n for n in lay.layer_names if n not in kv_caches]
        if missing:
            raise UsageError(f"CxlkvConnector: no KV cache registered for layers {missing[:4]}")
        self._caches, self._layer_index = [], {}
        for i, name in enumerate(lay.layer_names):
            t = kv_caches[name]
            if t.dim() != 4:
                raise UsageError(f"CxlkvConnector: layer {name} KV cache has shape "
                                 f"{tuple(t.shape)}; expected vLLM's [blocks, heads, tokens, C]")
            b, h, n, c = t.shape
            if h != lay.heads or lay.block_size % n or c * t.element_size() != lay.content_bytes:
                raise UsageError(f"CxlkvConnector: layer {name} KV cache {tuple(t.shape)} "
                                 f"{t.dtype} does not match the spec ({lay.heads} head slots, "
                                 f"blocks of {lay.block_size} tokens, {lay.content_bytes} "
                                 "bytes of content a token)")
            self._caches.append(t)
            self._layer_index[name] = i
        self._rank = _tp_rank(self._tp_size)
        self._cpu = all(t.device.type == "cpu" for t in self._caches)
        kvcopy.prepare()
        self._open_pool()

    def _kernel_ids(self, block_ids: list[int], cache: torch.Tensor) -> torch.Tensor:
        """Indices into `cache`'s block dimension for vLLM blocks `block_ids`
        (several kernel blocks each when the backend splits blocks)."""
        r = self._layout.block_size // cache.shape[2]
        ids = torch.tensor(block_ids, dtype=torch.long)
        if r > 1:
            ids = (ids[:, None] * r + torch.arange(r)).reshape(-1)
        return ids.to(cache.device)

    def _gather(self, li: int, block_ids: list[int],
                cache: torch.Tensor | None = None) -> torch.Tensor:
        """Layer li's pages of `block_ids` as [blocks, heads, block_size, C] (a copy)."""
        cache = self._caches[li] if cache is None else cache
        got = cache.index_select(0, self._kernel_ids(block_ids, cache))
        nb, (_, h, n, c) = len(block_ids), cache.shape
        r = self._layout.block_size // n
        if r > 1:
            got = got.view(nb, r, h, n, c).permute(0, 2, 1, 3, 4)
        return got.reshape(nb, h, r * n, c)

    def _scatter(self, li: int, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write [blocks, heads, block_size, C] pages into layer li's blocks."""
        cache = self._caches[li]
        nb, (_, h, n, c) = len(block_ids), cache.shape
        r = self._layout.block_size // n
        if r > 1:
            pages = pages.view(nb, h, r, n, c).permute(0, 2, 1, 3, 4).reshape(nb * r, h, n, c)
        cache.index_copy_(0, self._kernel_ids(block_ids, cache), pages.to(cache.device))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copy this step's matched blocks from the pool into the paged KV:
        every layer before returning, or (layerwise) on a thread that
        wait_for_layer_load follows."""
        self._finish_layer_load()                        # a previous step's, if any
        meta = self._connector_metadata
        if not isinstance(meta, CxlkvConnectorMetadata) or not meta.loads:
            return
        pinned = []                                      # (loaded, block ids) per request
        try:
            for t in meta.loads:
                if not t.block_hashes:
                    continue
                loaded = self._kv(self._rank, t.salt).load_hashes(t.block_hashes)
                n = loaded.blocks
                if n:
                    loaded.views()                       # made here, used by the copy steps
                    pinned.append((loaded, t.block_ids[:n]))
                else:
                    loaded.release()
                self.stats["loaded_blocks"] += n
                if n < len(t.block_ids):
                    # evicted since the scheduler matched them: vLLM recomputes these
                    self.stats["missed_blocks"] += len(t.block_ids) - n
                    self._load_errors.update(t.block_ids[n:])
        except BaseException:
            _release_all(pinned)
            raise
        if not pinned:
            return
        steps = [self._load_step(li, pinned) for li in range(len(self._caches))]
        if self._layerwise and self._cpu:
            self._layer_load = kvcopy.LayerLoad(steps, done=lambda: _release_all(pinned))
            return
        try:
            for step in steps:
                step()
        finally:
            _release_all(pinned)

    def _load_step(self, li: int, pinned):
        """The copy of layer li of every pinned request into its paged blocks."""
        lay = self._layout

        def step():
            for loaded, ids in pinned:
                views = loaded.views()
                if self._cpu:
                    kvcopy.paged_layer(views, lay.block_bytes, li, self._caches[li], ids,
                                       lay.heads, lay.block_size)
                else:                                   # one CPU staging copy, one transfer
                    c = lay.content_bytes // _itemsize(lay.dtype)
                    pages = torch.empty((len(ids), lay.heads, lay.block_size, c),
                                        dtype=lay.dtype)
                    kvcopy.copy_blocks(views, lay.block_bytes, pages,
                                       np.arange(len(ids)) * pages.stride(0),
                                       (lay.heads, lay.block_size, c),
                                       (lay.block_size * c, c, 1), pages.stride()[1:],
                                       src_offset=li * lay.layer_bytes)
                    self._scatter(li, ids, pages)
        return step

    def _finish_layer_load(self) -> None:
        ll, self._layer_load = self._layer_load, None
        if ll is not None:
            ll.finish()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once layer_name's blocks are in the paged KV (layerwise loads;
        otherwise start_load_kv has copied every layer already)."""
        ll = self._layer_load
        if ll is None:
            return
        li = self._layer_index.get(layer_name)
        if li is None:
            return
        ll.wait(li)
        if li == ll.layers - 1:
            self._finish_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        """Copy this layer's newly completed blocks out of the paged KV."""
        meta = self._connector_metadata
        li = self._layer_index.get(layer_name)
        if li is None or not isinstance(meta, CxlkvConnectorMetadata) or not meta.stores:
            return
        for i, t in enumerate(meta.stores):
            buf, done = self._staging(i, t)
            self._save_layer(li, t, buf, kv_layer)
            done.add(li)

    def _save_layer(self, li: int, t: CxlkvTransfer, buf: torch.Tensor,
                    cache: torch.Tensor | None = None) -> None:
        """Layer li's pages of t.block_ids into the staging blocks `buf`."""
        cache = self._caches[li] if cache is None else cache
        if cache.device.type == "cpu" and cache.dtype == buf.dtype:
            lay = self._layout
            flat = memoryview(buf.view(torch.uint8).numpy().reshape(-1))
            bb = lay.block_bytes
            kvcopy.paged_layer([flat[j * bb:(j + 1) * bb] for j in range(len(t.block_ids))],
                               bb, li, cache, t.block_ids, lay.heads, lay.block_size,
                               to_blocks=True)
        else:
            buf[:, li].copy_(self._gather(li, t.block_ids, cache))

    def _staging(self, i: int, t: CxlkvTransfer):
        if i not in self._staged:
            lay = self._layout
            c = lay.content_bytes // _itemsize(lay.dtype)
            buf = torch.empty((len(t.block_ids), len(lay.layer_names), lay.heads,
                               lay.block_size, c), dtype=lay.dtype)
            self._staged[i] = (buf, set())
        return self._staged[i]

    def wait_for_save(self):
        """Publish this step's completed blocks in the pool (layers that
        save_kv_layer did not see are copied from the registered caches)."""
        meta = self._connector_metadata
        try:
            self._finish_layer_load()           # layers the forward did not wait for
            if not isinstance(meta, CxlkvConnectorMetadata) or not meta.stores:
                return
            for i, t in enumerate(meta.stores):
                buf, done = self._staging(i, t)
                for li in range(len(self._caches)):
                    if li not in done:
                        self._save_layer(li, t, buf)
                try:
                    new = self._kv(self._rank, t.salt).store_hashes(
                        t.block_hashes, buf.view(torch.uint8).numpy().reshape(-1))
                    self.stats["stored_blocks"] += new
                except CxlkvError as e:          # full pool, quota: a cache, not an error
                    self.stats["store_failures"] += 1
                    logger.warning("cxlkv: could not store %d blocks of request %s: %s",
                                   len(t.block_hashes), t.req_id, e)
        finally:
            self._staged.clear()

    def get_finished(self,
                     finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None                                # nothing asynchronous

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self):
        self._finish_layer_load()
        self._kvs.clear()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if self._remote is not None:
                remote.disable(pool)
            pool.close()


def _release_all(pinned) -> None:
    """Release every pinned load (the first error raised after all are released)."""
    err = None
    for loaded, _ in pinned:
        try:
            loaded.release()
        except BaseException as e:
            err = err or e
    if err is not None:
        raise err


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layout_of(kv_cache_config, block_size: int) -> _Layout:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) != 1:
        raise UsageError(f"CxlkvConnector supports one KV cache group of full-attention "
                         f"layers; this model has {len(groups)} groups")
    g = groups[0]
    spec = g.kv_cache_spec
    kind = type(spec).__name__
    if not hasattr(spec, "num_kv_heads") or "Sliding" in kind or "Chunked" in kind:
        raise UsageError(f"CxlkvConnector: {kind} layers cannot be shared through the pool")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UsageError(f"CxlkvConnector: {kind} with compressed states is not supported")
    heads = int(getattr(spec, "num_heads", spec.num_kv_heads))
    content = getattr(spec, "state_content_size_bytes", None)
    if content is None:
        content = (spec.head_size + getattr(spec, "head_size_v", spec.head_size)) \
            * _itemsize(spec.dtype)
    if spec.block_size != block_size:
        raise UsageError(f"CxlkvConnector: KV spec block size {spec.block_size} differs from "
                         f"the cache config's {block_size}")
    return _Layout(tuple(g.layer_names), heads, int(spec.block_size), int(content), spec.dtype)


def _none_hash_seed() -> str:
    """The seed vLLM derived NONE_HASH from (PYTHONHASHSEED, or vLLM's default)."""
    try:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed

        return get_none_hash_seed()
    except ImportError:                                   # pragma: no cover - older vLLM
        return os.environ.get("PYTHONHASHSEED", "vllm-none-hash")


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
