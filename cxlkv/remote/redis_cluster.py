"""The remote tier on a Redis Cluster or Valkey cluster (redis-py's asyncio
cluster client with the hiredis parser).

Batches are pipelined per node: each key's slot is mapped to its master
from the client's slot table and each master gets one pipeline on one
connection, all masters at once (`strategy="node"`, the default).  redis-py's
own cluster pipeline (`strategy="pipeline"`) does the same grouping with more
work per command; bench/remote.py measures both.  A MOVED / ASK / TRYAGAIN
answer is retried through the cluster client (which follows the redirect and
updates its slot table); a connection error refreshes the slot table before
the next batch.  With wait_replicas, `WAIT n timeout` ends each master's
pipeline, on the connection that carried the writes (WAIT counts the writes
of its own connection).
"""
from __future__ import annotations

import asyncio
import time

import redis.exceptions as redis_errors
from redis._parsers.helpers import parse_info
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import SlotNotCoveredError
from redis.retry import Retry

from cxlkv.errors import RemoteError, RemoteUnavailable
from cxlkv.remote.config import RemoteConfig
from cxlkv.remote.base import Batch, RemoteTier

__all__ = ["RedisClusterTier", "RemoteConfig", "client_kwargs"]

#: a topology refresh after errors happens at most this often
REFRESH_S = 0.2


def client_kwargs(cfg: RemoteConfig) -> dict:
    """redis-py connection settings of `cfg` (the password included: keep
    the result away from logs)."""
    kw = {"username": cfg.username, "password": cfg.secret(),
          "socket_timeout": cfg.timeout_s, "socket_connect_timeout": cfg.timeout_s}
    if cfg.tls:
        kw.update(ssl=True, ssl_ca_certs=cfg.tls_ca, ssl_certfile=cfg.tls_cert,
                  ssl_keyfile=cfg.tls_key,
                  ssl_cert_reqs="required" if cfg.tls_verify else "none",
                  ssl_check_hostname=cfg.tls_verify)
    return kw


def _conn_errors():
    return (redis_errors.ConnectionError, redis_errors.TimeoutError,
            redis_errors.ClusterDownError, redis_errors.SlotNotCoveredError,
            redis_errors.MasterDownError, redis_errors.AuthenticationError,
            redis_errors.RedisClusterException, OSError, asyncio.TimeoutError)


class RedisClusterTier(RemoteTier):
    def __init__(self, config: RemoteConfig, *, strategy: str = "node"):
        if strategy not in ("node", "pipeline"):
            raise ValueError("strategy is 'node' or 'pipeline'")
        self.cfg = config.require_nodes()
        self.strategy = strategy
        self._rc = None
        self._connecting: asyncio.Lock | None = None
        self._refresh = False
        self._refreshed_at = 0.0

    def __repr__(self) -> str:
        return f"RedisClusterTier(nodes={list(self.cfg.nodes)!r}, strategy={self.strategy!r})"

    def _err(self, e: BaseException) -> str:
        return self.cfg.scrub(f"{type(e).__name__}: {e}")

    # -- connection ----------------------------------------------------------------------
    async def client(self):
        """The connected redis-py RedisCluster (connecting on first use)."""
        if self._rc is not None:
            return self._rc
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._rc is not None:
                return self._rc

            rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.cfg.endpoints()],
                              require_full_coverage=False, retry=Retry(NoBackoff(), 1),
                              **client_kwargs(self.cfg))
            try:
                await rc.initialize()
            except BaseException as e:
                try:
                    await rc.aclose()
                except Exception:                          # noqa: BLE001
                    pass
                if isinstance(e, Exception):
                    raise RemoteUnavailable(f"cannot reach the cluster at "
                                            f"{', '.join(self.cfg.nodes)}: {self._err(e)}") \
                        from None
                raise
            if self.strategy == "node" and not hasattr(ClusterNode, "execute_pipeline"):
                self.strategy = "pipeline"        # a redis-py without per-node pipelines
            self._rc = rc
            return rc

    async def _maybe_refresh(self, rc) -> None:
        if not self._refresh or time.monotonic() - self._refreshed_at < REFRESH_S:
            return
        self._refreshed_at = time.monotonic()
        try:
            await rc.nodes_manager.initialize()
            self._refresh = False
        except Exception as e:                             # noqa: BLE001
            raise RemoteUnavailable(f"cannot reach the cluster: {self._err(e)}") from None

    # -- one batch of single-key commands ----------------------------------------------------
    async def _run(self, cmds: list[tuple], convert=None, wait_replicas: int = 0,
                   wait_timeout_s: float = 1.0) -> Batch:
        """Run single-key commands (args tuples, key second) pipelined per
        master; a Batch of convert(answer) (None for a failed command) with
        `replicated` per command when wait_replicas."""
        rc = await self.client()
        await self._maybe_refresh(rc)
        if self.strategy == "pipeline":
            results, acked = await self._run_pipeline(rc, cmds, wait_replicas, wait_timeout_s)
        else:
            results, acked = await self._run_nodes(rc, cmds, wait_replicas, wait_timeout_s)
        return self._finish(results, convert, acked, wait_replicas)

    async def _run_nodes(self, rc, cmds, wait_replicas, wait_timeout_s):
        nm = rc.nodes_manager
        results: list = [None] * len(cmds)
        groups: dict[str, tuple] = {}
        for i, args in enumerate(cmds):
            try:
                node = nm.get_node_from_slot(key_slot(args[1]))
            except SlotNotCoveredError as e:
                results[i] = e
                continue
            g = groups.get(node.name)
            if g is None:
                g = groups[node.name] = (node, [])
            g[1].append(PipelineCommand(i, *args))
        if wait_replicas:
            for _, pcs in groups.values():
                pcs.append(PipelineCommand(-1, "WAIT", wait_replicas,
                                           max(1, int(wait_timeout_s * 1000))))
        outs = await asyncio.gather(*(node.execute_pipeline(pcs) for node, pcs in groups.values()),
                                    return_exceptions=True)
        acked: dict[int, bool] = {}
        for (node, pcs), out in zip(groups.values(), outs):
            if isinstance(out, BaseException):
                if isinstance(out, asyncio.CancelledError):
                    raise out
                for pc in pcs:
                    if pc.position >= 0:
                        results[pc.position] = out
                continue
            ok = False
            if wait_replicas:
                w = pcs[-1].result
                ok = isinstance(w, int) and w >= wait_replicas
            for pc in pcs:
                if pc.position >= 0:
                    results[pc.position] = pc.result
                    acked[pc.position] = ok
        for i in await self._redirects(rc, cmds, results):
            acked[i] = False      # written elsewhere than where the WAIT ran: unconfirmed
        return results, acked

    async def _run_pipeline(self, rc, cmds, wait_replicas, wait_timeout_s):
        pipe = rc.pipeline(transaction=False)
        for args in cmds:
            pipe.execute_command(*args)
        nodes = {}
        before: dict[int, str] = {}
        if wait_replicas:
            for i, args in enumerate(cmds):
                try:
                    n = rc.get_node_from_key(args[1])
                except Exception:                          # noqa: BLE001
                    continue
                nodes[n.name] = n
                before[i] = n.name
            for n in nodes.values():
                pipe.execute_command("WAIT", wait_replicas, max(1, int(wait_timeout_s * 1000)),
                                     target_nodes=n)
        try:
            out = await pipe.execute(raise_on_error=False)
        except _conn_errors() as e:
            out = [e] * (len(cmds) + len(nodes))
        results = list(out[:len(cmds)])
        acked = {}
        if wait_replicas:
            ok = {name: isinstance(w, int) and w >= wait_replicas
                  for name, w in zip(nodes, out[len(cmds):])}
            for i, args in enumerate(cmds):
                # confirmed only where the key's owner did not change under
                # the pipeline (a redirected SET ran on a node whose WAIT may
                # have run before it)
                try:
                    now = rc.get_node_from_key(args[1]).name
                except Exception:                          # noqa: BLE001
                    now = None
                acked[i] = now is not None and before.get(i) == now and ok.get(now, False)
        return results, acked

    async def _redirects(self, rc, cmds, results) -> list[int]:
        """Retry MOVED / ASK / TRYAGAIN answers through the cluster client
        (it follows them and fixes its slot table); note connection errors.
        Returns the positions retried."""

        redo = [i for i, r in enumerate(results)
                if isinstance(r, (redis_errors.MovedError, redis_errors.AskError,
                                  redis_errors.TryAgainError))]
        if any(isinstance(r, _conn_errors()) for r in results) or redo:
            self._refresh = True
        if not redo:
            return redo
        outs = await asyncio.gather(*(rc.execute_command(*cmds[i]) for i in redo),
                                    return_exceptions=True)
        for i, out in zip(redo, outs):
            if isinstance(out, asyncio.CancelledError):
                raise out
            results[i] = out
        return redo

    def _finish(self, results: list, convert, acked: dict, wait_replicas: int) -> Batch:
        failed = 0
        error = None
        vals = []
        for r in results:
            if isinstance(r, BaseException):
                failed += 1
                error = error or self._err(r)
                vals.append(None)
            else:
                vals.append(r if convert is None else convert(r))
        if results and failed == len(results) and all(
                isinstance(r, _conn_errors()) for r in results):
            raise RemoteUnavailable(f"cluster unavailable: {error}")
        rep = [acked.get(i, False) for i in range(len(results))] if wait_replicas else None
        return Batch(vals, failed=failed, error=error, replicated=rep)

    # -- RemoteTier ------------------------------------------------------------------------
    async def get_many(self, keys):
        if not keys:
            return Batch()
        # not a string value (WRONGTYPE is an error anyway): not ours, a miss
        return await self._run([("GET", k) for k in keys],
                               lambda v: v if isinstance(v, (bytes, bytearray)) else None)

    async def put_many(self, items, ttl_s, *, wait_replicas=0, wait_timeout_s=1.0):
        """Entries: True stored, False present already (NX), None failed."""
        if not items:
            return Batch(replicated=[] if wait_replicas else None)
        ex = ("EX", int(ttl_s)) if ttl_s else ()
        return await self._run([("SET", k, v, *ex, "NX") for k, v in items],
                               lambda r: r is True or r == b"OK" or r == "OK",
                               wait_replicas=wait_replicas, wait_timeout_s=wait_timeout_s)

    async def exists_many(self, keys):
        if not keys:
            return Batch()
        return await self._run([("EXISTS", k) for k in keys], bool)

    async def delete_many(self, keys) -> int:
        if not keys:
            return 0
        b = await self._run([("DEL", k) for k in keys], int)
        return sum(x or 0 for x in b)

    async def set_names(self, hash_key, mapping) -> None:
        rc = await self.client()
        try:
            for f, name in mapping.items():
                await rc.execute_command("HSETNX", hash_key, f, name)
        except _conn_errors() as e:
            self._refresh = True
            raise RemoteUnavailable(f"cluster unavailable: {self._err(e)}") from None
        except Exception as e:                             # noqa: BLE001
            raise RemoteError(self._err(e)) from None

    async def used_memory(self) -> int:
        rc = await self.client()
        prim = rc.get_primaries()

        async def one(node):
            info = await node.execute_command("INFO", "memory")
            if isinstance(info, (bytes, str)):
                info = parse_info(info.decode() if isinstance(info, bytes) else info)
            return int(info.get("used_memory", 0))

        outs = await asyncio.gather(*(one(n) for n in prim), return_exceptions=True)
        got = [o for o in outs if not isinstance(o, BaseException)]
        if not got:
            self._refresh = True
            raise RemoteUnavailable("no master answered INFO memory")
        return sum(got)

    async def close(self) -> None:
        rc, self._rc = self._rc, None
        if rc is not None:
            await rc.aclose()
