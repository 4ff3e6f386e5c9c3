"""vLLM: a KV connector (KVConnectorBase_V1) that shares prefix KV blocks through the pool.

Load it into vLLM with the connector's module path - nothing in vLLM changes:

    PYTHONPATH=/path/to/cxlkv vllm serve MODEL --prefix-caching-hash-algo sha256_cbor \\
      --kv-transfer-config '{"kv_connector": "CxlkvConnector",
                             "kv_connector_module_path": "cxlkv.integrations.vllm",
                             "kv_role": "kv_both",
                             "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"pool": "/dev/daxX.Y"}}'

kv_role: "kv_producer" only stores (a prefill instance), "kv_consumer" only
loads (a decode instance), "kv_both" does both (a prefix cache shared by every
instance of the rack).  kv_load_failure_policy "recompute": a block evicted
from the pool between the scheduler's match and the load is recomputed (vLLM's
default, "fail", fails the request).  kv_connector_extra_config:

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
    layerwise   true: synchronous loads copy layer by layer on a thread, and
                each attention layer waits (wait_for_layer_load) only for its
                own layer (default false: start_load_kv copies every layer first)
    async_load  true: loads never hold up a step (vLLM's asynchronous loads: the
                request waits in WAITING_FOR_REMOTE_KVS while a thread copies
                its blocks, get_finished reports it, the next step schedules it)
    async_save  true: a step's saves are copied out of the paged KV into the
                pool and published on a thread behind the next steps' compute;
                vLLM keeps a finished request's blocks until get_finished
                reports them
    async       true: both of the above

Keys.  A pool block is one vLLM block (block_size tokens), keyed by the block
hash vLLM computed for it (request.block_hashes) - the chain hash that names
the whole prefix up to that block, with vLLM's extra keys (LoRA, multimodal
inputs, cache_salt) folded in by vLLM.  With --prefix-caching-hash-algo
sha256_cbor those hashes are reproducible anywhere: cxlkv's own
`pool.kv(..., hash="sha256_cbor").block_hashes(tokens)` gives the same bytes
for the same tokens and seed (PYTHONHASHSEED, or vLLM's fixed default seed),
so another host or tool can find the blocks.  Other algorithms work between
vLLM instances that hash alike ("sha256" pickles; "xxhash" needs a shared
PYTHONHASHSEED) and are named in the namespace so they never mix.  Blocks
stored in a later step than their parent (chunked prefill, decode, a prefix
that came from the pool) are stored with the parent in front, so the pool
links them to it and evicts leaf first.

Payload.  One block holds, for every attention layer of the transferred KV
cache groups (in group order, each group's layers in its order), vLLM's
logical page of that block:

    [layers][head slots][block_size tokens][C]      (C: the backend's content
                                                     per token, K then V for
                                                     dense attention)

in the KV cache dtype, whatever the physical layout and kernel block size of
the backend (kernel blocks of one vLLM block are put back in token order).

Hybrid models.  Several KV cache groups (full attention beside sliding-window
or chunked-local attention; vLLM's hybrid allocator, which this connector
declares it supports) share one pool block per vLLM block, every group's
layers in it.  Groups must have the same block size and page shape.  A group
whose window no longer holds a block has vLLM's null block there: loads skip
those pages (vLLM needs only the window), and a block is stored only while
every group still holds it.  Loads of hybrid models are always asynchronous:
vLLM takes a failed block only as a failed request there (failed_recving).
Mamba and other state groups are refused.

Namespace.  vllm/<model>/<digest>/<kv dtype>/<L>x<H>x<C>/t<block_size>/<hash
algo>[/g<groups digest>]/tp<rank>of<size>: the digest covers the model id or
path, revision, the HF config and the dtypes; the groups digest (hybrid models
only) the groups' kinds, windows and layers.  Instances share blocks only if
they run the same weights under the same id and the same attention backend
(the content layout is the backend's); set `namespace` explicitly otherwise.

Scope.  Attention KV cache groups; tensor parallelism by one namespace per TP
rank (the scheduler counts a block present only when every rank has it);
pipeline and decode-context parallelism are refused.  Loads copy from the
pinned pool views straight into the paged KV, one strided pass per layer in C
with the GIL released (cxlkv.integrations.kvcopy; CPU caches - a GPU cache
goes through one CPU staging copy).  Synchronous loads: start_load_kv does
every layer before the forward, or with layerwise=true starts them on a thread
and wait_for_layer_load waits for its layer only.  Synchronous saves store the
step's completed blocks in wait_for_save, written in place into the pool slots
the store reserved (KVCache.store_hashes_with), one strided pass per layer from
the paged KV, only for blocks the pool lacks (a GPU cache: staged per layer in
save_kv_layer, then stored).  Asynchronous ones: see async_load and async_save
above.  Blocks evicted between the scheduler's match and the
worker's load are reported through get_block_ids_with_load_errors (vLLM
recomputes them), or for hybrid models as failed loads of their requests.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.logger import init_logger
except ImportError as e:                                  # pragma: no cover - needs vLLM
    raise ImportError(f"cxlkv.integrations.vllm needs vLLM (import failed: {e})") from e
try:                                                      # vLLM with the hybrid allocator API
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:                                       # pragma: no cover - older vLLM
    SupportsHMA = object
try:                                                      # failed_recving (vLLM >= 0.33)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:                                       # pragma: no cover - older vLLM
    KVConnectorTransferResults = None

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
#: KV cache spec kinds whose groups drop blocks that leave their window
_WINDOWED = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec")
#: spec kinds that are not one page of attention KV per block
_REFUSED = ("SlidingWindowMLASpec", "CircularBufferSpec", "HiSparse", "EncoderOnly",
            "CrossAttention", "HiddenState")


@dataclasses.dataclass
class CxlkvTransfer:
    """Blocks of one request to load into, or store from, vLLM's paged KV.

    block_ids are the first transferred KV cache group's block ids;
    group_block_ids, for hybrid models, every transferred group's (-1 where
    the group holds vLLM's null block).  A store with lead=1 starts with the
    request's already-stored parent block (linked to, copied only if the pool
    lost it); async_load: reported through get_finished."""

    req_id: str
    salt: str | None
    block_hashes: list[bytes]
    block_ids: list[int]
    group_block_ids: list[list[int]] | None = None
    lead: int = 0
    async_load: bool = False
    #: stores: the blocks' token ids (block_size a block), kept with their
    #: hashes for the pool's KV events (None: the request did not say)
    token_ids: list[int] | None = None

    def ids(self, group: int) -> list[int]:
        """Block ids of transferred group `group` (its position in the layout)."""
        return self.block_ids if self.group_block_ids is None else self.group_block_ids[group]


@dataclasses.dataclass
class CxlkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: what to load (before the forward,
    or asynchronously), what to store after it, and the requests vLLM
    preempted in this step (their blocks may be reused at once)."""

    loads: list[CxlkvTransfer] = dataclasses.field(default_factory=list)
    stores: list[CxlkvTransfer] = dataclasses.field(default_factory=list)
    preempted: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _Tracked:
    """Scheduler-side state of one running request."""

    request: Any
    block_ids: list[int]
    saved: int = 0                       # leading blocks already stored (or loaded)
    hold: bool = False                   # an asynchronous save of it since its admission
    stopped: bool = False                # a group dropped a block before it was stored


@dataclasses.dataclass(frozen=True)
class _Layout:
    layer_names: tuple[str, ...]
    heads: int
    block_size: int
    content_bytes: int                    # C in bytes, per (head slot, token)
    dtype: torch.dtype
    groups: tuple[int, ...] = (0,)        # the transferred KV cache groups (their indices)
    layer_group: tuple[int, ...] = ()     # each layer's position in `groups`
    windowed: bool = False                # a group frees blocks that leave its window
    signature: str = ""                   # the grouping, for the namespace (hybrid only)

    @property
    def layer_bytes(self) -> int:
        return self.heads * self.block_size * self.content_bytes

    @property
    def block_bytes(self) -> int:
        return len(self.layer_names) * self.layer_bytes

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1


class _Jobs:
    """One daemon thread running submitted callables in order; drain() waits
    for every job submitted before it."""

    def __init__(self, name: str):
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], object]) -> None:
        with self._cv:
            self._submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:                         # the jobs record their own failures
                logger.exception("cxlkv: %s job failed", self._name)
            finally:
                with self._cv:
                    self._done += 1
                    self._cv.notify_all()

    @property
    def pending(self) -> int:
        with self._cv:
            return self._submitted - self._done

    def drain(self) -> None:
        with self._cv:
            target = self._submitted
            self._cv.wait_for(lambda: self._done >= target)

    def stop(self) -> None:
        self.drain()
        t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            t.join()


def _flag(extra: dict, key: str, default: bool = False) -> bool:
    v = extra.get(key, default)
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


class CxlkvConnector(KVConnectorBase_V1, SupportsHMA):
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
        self._layerwise = _flag(extra, "layerwise")
        both = _flag(extra, "async")
        self._async_load = _flag(extra, "async_load", both)
        self._async_save = _flag(extra, "async_save", both)
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
        if self._layout is not None and self._layout.hybrid:
            # vLLM takes a failed block of a several-group model only as a
            # failed asynchronous load of its request
            if KVConnectorTransferResults is None:
                raise UsageError("CxlkvConnector: hybrid models (several KV cache groups) "
                                 "need vLLM >= 0.33 (failed_recving)")
            self._async_load = True
        self._pool = None
        self._kvs: dict[tuple[int, str | None], Any] = {}
        self._kv_lock = threading.Lock()
        self._mu = threading.Lock()            # the state the worker threads share
        # scheduler side
        self._matched: dict[str, tuple[int, int, bool]] = {}   # req_id -> (local, ext, async)
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[CxlkvTransfer] = []
        # worker side
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._staged: dict[int, tuple[torch.Tensor, set[int]]] = {}
        self._load_errors: set[int] = set()
        self._failed_recv: set[str] = set()
        self._layer_load: kvcopy.LayerLoad | None = None
        self._cpu = True                       # every registered cache is a CPU tensor
        self._rank = 0
        self._loader = _Jobs("cxlkv-load")     # asynchronous loads
        self._saver = _Jobs("cxlkv-save")      # asynchronous saves
        self._recv_done: dict[str, list[int] | None] = {}   # req -> failed block ids
        self._holds: dict[str, int] = {}       # req -> saves still to read its blocks
        self._saving: set[str] = set()         # reqs with an async save since admission
        self._finishing: set[str] = set()      # ... that vLLM has finished
        self.stats = {"loaded_blocks": 0, "stored_blocks": 0, "missed_blocks": 0,
                      "store_failures": 0, "async_loads": 0, "async_saves": 0,
                      "unlinked_stores": 0}

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
        groups = f"g{lay.signature}/" if lay.signature else ""
        return (f"vllm/{name}/{digest}/{dt}/{len(lay.layer_names)}x{lay.heads}x{c}/"
                f"t{lay.block_size}/{self._hash_algo}/{groups}tp{rank}of{self._tp_size}")

    def _open_pool(self):
        with self._kv_lock:
            if self._pool is None:
                pool = api.open_pool(self._pool_path)
                if self._remote is not None:
                    remote.enable(pool, self._remote)
                self._pool = pool
            return self._pool

    def _kv(self, rank: int, salt: str | None):
        key = (rank, salt)
        kv = self._kvs.get(key)
        if kv is not None:
            return kv
        if self._layout is None:
            raise UsageError("CxlkvConnector needs the KV cache config (vLLM >= 0.11)")
        pool = self._open_pool()
        with self._kv_lock:                    # the worker threads open tenants too
            kv = self._kvs.get(key)
            if kv is None:
                kv = pool.kv(model=self._namespace(rank), block_tokens=self._block_size,
                             block_bytes=self._layout.block_bytes, salt=salt,
                             hash="sha256_cbor", hash_seed=_none_hash_seed(),
                             quota=self._quota, remote_read=self._remote is not None,
                             remote_budget_s=self._remote_budget)
                if len(self._kvs) > 256:        # many tenants: keep the open set bounded
                    self._kvs.pop(next(iter(self._kvs)))
                self._kvs[key] = kv
        return kv

    def _salt_of(self, request) -> str | None:
        return getattr(request, "cache_salt", None) or self._salt

    def _hashes(self, request) -> list[bytes]:
        """vLLM's hash of each full block of the request (the groups share
        one block size, the hash block size)."""
        return [bytes(h) for h in (getattr(request, "block_hashes", None) or ())]

    def _count(self, **delta) -> None:
        with self._mu:
            for k, v in delta.items():
                self.stats[k] += v

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond num_computed_tokens whose blocks are in the pool (on
        every TP rank), leaving at least the prompt's last token to compute;
        and whether they load asynchronously."""
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
        is_async = self._async_load and ext > 0
        self._matched[request.request_id] = (num_computed_tokens, ext, is_async)
        return ext, is_async

    def _group_ids(self, blocks, start: int, end: int) -> list[list[int]] | None:
        """Every transferred group's block ids [start, end) of a KVCacheBlocks
        (-1 for the null block); None if it has no per-group blocks."""
        per = getattr(blocks, "blocks", None)
        if per is None or self._layout is None:
            return None
        return [[-1 if b.is_null else int(b.block_id) for b in per[g][start:end]]
                for g in self._layout.groups]

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        rid = request.request_id
        local, _, is_async = self._matched.pop(rid, (0, 0, False))
        bs = self._block_size
        first, last = local // bs, (local + num_external_tokens) // bs
        groups = self._group_ids(blocks, 0, None)
        if groups is not None:
            ids = groups[0]
        else:
            try:
                ids = list(blocks.get_block_ids()[0])
            except (AttributeError, IndexError, TypeError):
                ids = []
        if num_external_tokens > 0 and self._do_load:
            hybrid = groups is not None and self._layout.hybrid
            self._loads.append(CxlkvTransfer(
                rid, self._salt_of(request), self._hashes(request)[first:last],
                ids[first:last], [g[first:last] for g in groups] if hybrid else None,
                async_load=is_async))
        prev = self._tracked.get(rid)
        # called again once an asynchronous load is done (nothing to load then)
        saved = max(last, prev.saved if prev is not None else 0)
        self._tracked[rid] = _Tracked(request, ids, saved=saved,
                                      hold=prev.hold if prev is not None else False)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = CxlkvConnectorMetadata(loads=self._loads)
        self._loads = []
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for rid in meta.preempted:             # its blocks are gone: nothing to hold
            t = self._tracked.get(rid)
            if t is not None:
                t.hold = False
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
        """Store the blocks this step completes (full, hashed by vLLM, not
        stored yet), behind their parent when it was stored before."""
        if not self._do_save or t.stopped:
            return
        hashes = self._hashes(t.request)
        lo = t.saved
        full = min(done // self._block_size, len(hashes))
        if full <= lo:
            return
        start = max(lo - 1, 0)
        groups = None
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is not None:                   # vLLM's own view: null where a window left
            groups = self._group_ids(manager.get_blocks(rid), start, full)
        if groups is None:
            groups = [t.block_ids[start:full]]
        if any(len(g) < full - start for g in groups):
            return                                # blocks not allocated: nothing to plan
        gone = [j for j in range(lo - start, full - start) if any(g[j] < 0 for g in groups)]
        if gone:                                   # a window dropped it before it was stored
            full = start + gone[0]
            t.stopped = True
            if full <= lo:
                return
        lead = 1 if lo > 0 and all(g[0] >= 0 for g in groups) else 0
        if lo > 0 and not lead:
            self.stats["unlinked_stores"] += 1
        first = lo - lead
        sel = [g[first - start:full - start] for g in groups]
        bs = self._block_size
        toks = getattr(t.request, "all_token_ids", None)
        token_ids = (list(toks[first * bs:full * bs])
                     if toks is not None and len(toks) >= full * bs else None)
        meta.stores.append(CxlkvTransfer(rid, self._salt_of(t.request), hashes[first:full],
                                         sel[0], sel if self._layout.hybrid else None,
                                         lead=lead, token_ids=token_ids))
        t.saved = full
        if self._async_save:
            t.hold = True

    def _finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """With asynchronous saves, vLLM keeps the blocks of a request with a
        save since its admission until get_finished reports it."""
        t = self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return bool(self._async_save and t is not None and t.hold), None

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

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

    def _copy_in(self, li: int, views, ids: list[int]) -> None:
        """Layer li of pool blocks `views` into its paged blocks `ids` (-1: the
        group's null block there, skipped)."""
        lay = self._layout
        if any(i < 0 for i in ids):
            keep = [j for j, i in enumerate(ids) if i >= 0]
            views, ids = [views[j] for j in keep], [ids[j] for j in keep]
        if not ids:
            return
        if self._cpu:
            kvcopy.paged_layer(views, lay.block_bytes, li, self._caches[li], ids,
                               lay.heads, lay.block_size)
            return
        c = lay.content_bytes // _itemsize(lay.dtype)          # one CPU staging copy
        pages = torch.empty((len(ids), lay.heads, lay.block_size, c), dtype=lay.dtype)
        kvcopy.copy_blocks(views, lay.block_bytes, pages, np.arange(len(ids)) * pages.stride(0),
                           (lay.heads, lay.block_size, c), (lay.block_size * c, c, 1),
                           pages.stride()[1:], src_offset=li * lay.layer_bytes)
        self._scatter(li, ids, pages)

    def _settle(self, meta) -> None:
        """Before a step may reuse blocks: the asynchronous saves still
        reading blocks vLLM freed (preempted requests; blocks that left a
        sliding window) finish first."""
        if not isinstance(meta, CxlkvConnectorMetadata):
            return
        if self._saver.pending and (meta.preempted or self._layout.windowed):
            self._saver.drain()
        if meta.preempted:                     # the scheduler holds nothing of them now
            with self._mu:
                self._saving -= meta.preempted

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._settle(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._settle(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copy this step's matched blocks from the pool into the paged KV:
        synchronous loads every layer before returning, or (layerwise) on a
        thread that wait_for_layer_load follows; asynchronous loads on the
        load thread, reported through get_finished."""
        self._finish_layer_load()                        # a previous step's, if any
        meta = self._connector_metadata
        if not isinstance(meta, CxlkvConnectorMetadata) or not meta.loads:
            return
        sync = []
        for t in meta.loads:
            if t.async_load:
                self._count(async_loads=1)
                self._loader.submit(functools.partial(self._load_async, t))
            else:
                sync.append(t)
        pinned = []                                      # (loaded, transfer) per request
        try:
            for t in sync:
                if not t.block_hashes:
                    continue
                loaded = self._kv(self._rank, t.salt).load_hashes(t.block_hashes)
                n = loaded.blocks
                if n:
                    loaded.views()                       # made here, used by the copy steps
                    pinned.append((loaded, t, n))
                else:
                    loaded.release()
                self._count(loaded_blocks=n)
                if n < len(t.block_hashes):
                    # evicted since the scheduler matched them: vLLM recomputes these
                    bad = [i for i in t.block_ids[n:] if i >= 0]
                    self._count(missed_blocks=len(t.block_hashes) - n)
                    self._load_errors.update(bad)
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
        g = self._layout.layer_group[li]

        def step():
            for loaded, t, n in pinned:
                self._copy_in(li, loaded.views(), t.ids(g)[:n])
        return step

    def _load_async(self, t: CxlkvTransfer) -> None:
        """One asynchronous load, on the load thread: pin, copy every layer,
        release; the outcome waits for get_finished."""
        n = done = 0
        try:
            if t.block_hashes:
                loaded = self._kv(self._rank, t.salt).load_hashes(t.block_hashes)
                try:
                    n = loaded.blocks
                    if n:
                        views = loaded.views()
                        for li, g in enumerate(self._layout.layer_group):
                            self._copy_in(li, views, t.ids(g)[:n])
                finally:
                    loaded.release()
            done = n
        except Exception as e:                  # any failure: vLLM recomputes what is missing
            logger.warning("cxlkv: asynchronous load of request %s failed: %s", t.req_id, e)
        finally:                                # always reported: vLLM waits for it
            bad = sorted({i for g in range(len(self._layout.groups)) for i in t.ids(g)[done:]
                          if i >= 0}) if done < len(t.block_hashes) else []
            with self._mu:
                self.stats["loaded_blocks"] += done
                self.stats["missed_blocks"] += len(t.block_hashes) - done
                self._recv_done[t.req_id] = bad

    def _finish_layer_load(self) -> None:
        ll, self._layer_load = self._layer_load, None
        if ll is not None:
            ll.finish()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once layer_name's blocks are in the paged KV (layerwise loads;
        otherwise start_load_kv has copied every layer already; asynchronous
        loads are for requests not in this forward)."""
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
        """GPU caches: copy this layer's newly completed blocks out of the paged
        KV into staging blocks.  CPU caches: nothing (wait_for_save, or the
        save thread, copies them straight into their pool slots)."""
        meta = self._connector_metadata
        li = self._layer_index.get(layer_name)
        if li is None or not isinstance(meta, CxlkvConnectorMetadata) or not meta.stores:
            return
        if self._cpu:
            return
        for i, t in enumerate(meta.stores):
            buf, done = self._staging(i, t)
            self._save_layer(li, t, buf, kv_layer)
            done.add(li)

    def _save_layer(self, li: int, t: CxlkvTransfer, buf: torch.Tensor,
                    cache: torch.Tensor | None = None) -> None:
        """Layer li's pages of the transfer's blocks into the staging blocks `buf`."""
        cache = self._caches[li] if cache is None else cache
        buf[:, li].copy_(self._gather(li, t.ids(self._layout.layer_group[li]), cache))

    def _staging(self, i: int, t: CxlkvTransfer):
        if i not in self._staged:
            lay = self._layout
            c = lay.content_bytes // _itemsize(lay.dtype)
            buf = torch.empty((len(t.block_hashes), len(lay.layer_names), lay.heads,
                               lay.block_size, c), dtype=lay.dtype)
            self._staged[i] = (buf, set())
        return self._staged[i]

    def _store(self, t: CxlkvTransfer, buf: torch.Tensor | None = None) -> None:
        """Store a transfer's blocks: from the staging blocks `buf`, or (CPU
        caches) written in place into the pool slots the store reserved, one
        strided pass per layer from the paged KV - only the blocks the pool
        lacks (a parent in front is linked to, not copied)."""
        lay = self._layout

        def fill(which, target):
            for li, g in enumerate(lay.layer_group):
                ids = t.ids(g)
                kvcopy.paged_layer(target, lay.block_bytes, li, self._caches[li],
                                   [ids[int(w)] for w in which], lay.heads, lay.block_size,
                                   to_blocks=True)
        try:
            kv = self._kv(self._rank, t.salt)
            if buf is None:
                new = kv.store_hashes_with(t.block_hashes, fill, tokens=t.token_ids)
            else:
                new = kv.store_hashes(t.block_hashes, buf.view(torch.uint8).numpy().reshape(-1),
                                      tokens=t.token_ids)
            self._count(stored_blocks=new)
        except CxlkvError as e:                  # full pool, quota: a cache, not an error
            self._count(store_failures=1)
            logger.warning("cxlkv: could not store %d blocks of request %s: %s",
                           len(t.block_hashes) - t.lead, t.req_id, e)

    def wait_for_save(self):
        """Store this step's completed blocks in the pool; asynchronous saves:
        hand them to the save thread (GPU caches: staged first, here)."""
        meta = self._connector_metadata
        try:
            self._finish_layer_load()           # layers the forward did not wait for
            if not isinstance(meta, CxlkvConnectorMetadata) or not meta.stores:
                return
            if self._async_save:                # vLLM now holds these requests' blocks for us
                with self._mu:
                    self.stats["async_saves"] += len(meta.stores)
                    self._saving.update(t.req_id for t in meta.stores)
            bufs = [None] * len(meta.stores)
            if not self._cpu:                   # layers save_kv_layer did not see
                for i, t in enumerate(meta.stores):
                    buf, done = self._staging(i, t)
                    for li in range(len(self._caches)):
                        if li not in done:
                            self._save_layer(li, t, buf)
                    bufs[i] = buf
            if not self._async_save:
                for t, buf in zip(meta.stores, bufs):
                    self._store(t, buf)
                return
            if self._cpu:                        # the save thread reads the paged KV
                with self._mu:
                    for t in meta.stores:
                        self._holds[t.req_id] = self._holds.get(t.req_id, 0) + 1
            self._saver.submit(functools.partial(self._save_job, list(meta.stores), bufs))
        finally:
            self._staged.clear()

    def _save_job(self, stores: list[CxlkvTransfer], bufs: list) -> None:
        """On the save thread: store each transfer; once a store no longer
        reads the paged KV, vLLM may have its blocks back."""
        for t, buf in zip(stores, bufs):
            try:
                self._store(t, buf)
            except Exception as e:
                self._count(store_failures=1)
                logger.warning("cxlkv: could not store %d blocks of request %s: %s",
                               len(t.block_hashes) - t.lead, t.req_id, e)
            finally:
                if buf is None:
                    with self._mu:
                        left = self._holds.get(t.req_id, 1) - 1
                        if left > 0:
                            self._holds[t.req_id] = left
                        else:
                            self._holds.pop(t.req_id, None)

    def get_finished(self,
                     finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose asynchronous saves no longer read their blocks,
        requests whose asynchronous loads are done) - each reported once."""
        with self._mu:
            self._finishing |= set(finished_req_ids or ()) & self._saving
            sending = {r for r in self._finishing if not self._holds.get(r)}
            self._finishing -= sending
            self._saving -= sending
            recving = set(self._recv_done)
            for rid, bad in self._recv_done.items():
                if not bad:
                    continue
                if self._layout.hybrid:          # block ids are per group: the request fails
                    self._failed_recv.add(rid)
                else:
                    self._load_errors.update(bad)
            self._recv_done.clear()
        return sending or None, recving or None

    if KVConnectorTransferResults is not None:
        def get_transfer_results(self, finished_req_ids: set[str]):
            sending, recving = self.get_finished(finished_req_ids)
            with self._mu:
                failed, self._failed_recv = self._failed_recv, set()
            return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                              finished_recving=set(recving or ()),
                                              failed_recving=failed)

    def flush(self) -> None:
        """Wait for every asynchronous load and save in flight (their outcomes
        are still reported through get_finished)."""
        self._loader.drain()
        self._saver.drain()

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._mu:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self):
        self._finish_layer_load()
        for jobs in (self._loader, self._saver):
            jobs.stop()
        self._kvs.clear()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if self._remote is not None:
                remote.disable(pool)
            pool.close()


def _release_all(pinned) -> None:
    """Release every pinned load (the first error raised after all are released)."""
    err = None
    for loaded, *_ in pinned:
        try:
            loaded.release()
        except BaseException as e:
            err = err or e
    if err is not None:
        raise err


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _layout_of(kv_cache_config, block_size: int) -> _Layout:
    """The pool block's layout from vLLM's KV cache groups (the attention
    groups that take part in KV transfer; one page shape and block size)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    use = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
    if not use:
        raise UsageError("CxlkvConnector: this model has no KV cache group to share")
    hbs = getattr(kv_cache_config, "hash_block_size", None)
    if hbs not in (None, block_size):
        raise UsageError(f"CxlkvConnector: vLLM hashes blocks of {hbs} tokens, the cache "
                         f"blocks are {block_size}; they must be the same")
    names, layer_group, shape, kinds = [], [], None, []
    windowed = False
    for pos, gi in enumerate(use):
        g = groups[gi]
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if not hasattr(spec, "num_kv_heads") or any(r in kind for r in _REFUSED) \
                or not getattr(spec, "prefix_cacheable", True):
            raise UsageError(f"CxlkvConnector: {kind} layers cannot be shared through the pool")
        if getattr(spec, "tokens_per_state", 1) != 1:
            raise UsageError(f"CxlkvConnector: {kind} with compressed states is not supported")
        heads = int(getattr(spec, "num_heads", spec.num_kv_heads))
        content = getattr(spec, "state_content_size_bytes", None)
        if content is None:
            content = (spec.head_size + getattr(spec, "head_size_v", spec.head_size)) \
                * _itemsize(spec.dtype)
        if spec.block_size != block_size:
            raise UsageError(f"CxlkvConnector: KV cache group {gi} ({kind}) has blocks of "
                             f"{spec.block_size} tokens, the cache config {block_size}")
        this = (heads, int(content), spec.dtype)
        if shape is None:
            shape = this
        elif this != shape:
            raise UsageError(f"CxlkvConnector: KV cache groups with different page shapes "
                             f"({shape} and {this} as heads, content bytes, dtype)")
        win = kind in _WINDOWED
        windowed = windowed or win
        kinds.append((kind, getattr(spec, "sliding_window", None),
                      getattr(spec, "attention_chunk_size", None), list(g.layer_names)))
        names.extend(g.layer_names)
        layer_group.extend([pos] * len(g.layer_names))
    sig = ""
    if len(use) > 1:
        sig = hashlib.sha256(json.dumps(kinds, default=str).encode()).hexdigest()[:12]
    heads, content, dtype = shape
    return _Layout(tuple(names), heads, block_size, content, dtype, tuple(use),
                   tuple(layer_group), windowed, sig)


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
