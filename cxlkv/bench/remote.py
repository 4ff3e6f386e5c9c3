"""Remote tier figures: put and get throughput of the tier
(RemoteClient: write-behind push + flush; lookup with verification) against
a plain pipelined redis-py cluster client moving the same bytes (SET / GET
pipelines of the same batch size), on the same cluster, in the same run.
"tier" is the client with the fast path on (cxlkv.remote.fastpath: its own
pipelines on the caller's thread; the default, RemoteConfig.fast); "tier_redispy"
the same client through its redis-py tier (per-node asyncio pipelines on the
loop thread: fast = false, and the path TLS and test seams take).

    cxlkv bench run remote [--mib N] [--batch N] [--reps N] [--nodes H:P,...] [--json]

Without --nodes it starts a 3-master cluster on loopback (cxlkv.testing.redis).
Needs the redis Python client, and redis-server / redis-cli without --nodes.
"""
from __future__ import annotations

import asyncio
import os
import time

from redis.asyncio import cluster as async_cluster
from redis.cluster import ClusterNode, RedisCluster

from cxlkv.bench import harness
from cxlkv.remote import RemoteClient, RemoteConfig
from cxlkv.remote.redis_cluster import RedisClusterTier
from cxlkv.testing.redis import TestCluster

MiB, KiB = harness.MiB, harness.KiB
NS = bytes(range(16))


def cleanup(cfg):
    """Delete this run's keys - and only those: every key the bench writes
    starts with cfg.prefix, unique to the run (between phases, so memory stays
    bounded; never FLUSHALL, --nodes may be a cluster in use)."""
    rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cfg.endpoints()],
                      password=cfg.secret())
    try:
        keys = list(rc.scan_iter(match=cfg.prefix + "*", count=1000))   # every primary
        for i in range(0, len(keys), 1000):
            rc.delete(*keys[i:i + 1000])          # split by slot by redis-py
    finally:
        rc.close()


def data_set(nbytes, bs, seed):
    n = max(1, nbytes // bs)
    rnd = os.urandom(bs + 4096)
    # distinct contents without generating nbytes of randomness
    vals = [rnd[(i * 97) % 4096:(i * 97) % 4096 + bs] for i in range(n)]
    keys = [seed.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(n)]
    return keys, vals


def tier_run(cfg, keys, vals, bs, batch, fast):
    """push everything + flush; then lookup in batches.  Bytes/s each."""
    tier = None if fast else (lambda: RedisClusterTier(cfg))
    with RemoteClient(cfg, tier=tier, batch_bytes=batch * (bs + 72), fast=fast) as rc:
        rc.lookup(NS, keys[:1], bs, 5.0)                       # connect
        if not rc.wait_connected(10.0):                          # and the tier's connection
            raise RuntimeError("remote bench: the client's tier did not connect in 10 s")
        t0 = time.perf_counter()
        for k, v in zip(keys, vals):
            while not rc.push(k, NS, v):                         # queue full: wait a little
                rc.flush(0.001)
        if not rc.flush(600):
            raise RuntimeError(f"remote bench: the tier did not flush: {rc.stats()}")
        put_s = time.perf_counter() - t0
        st = rc.stats()
        if st["pushed"] != len(keys):
            raise RuntimeError(f"remote bench: pushed {st['pushed']} of {len(keys)}: {st}")
        t0 = time.perf_counter()
        hits = 0
        for i in range(0, len(keys), batch):
            got = rc.lookup(NS, keys[i:i + batch], bs, 60.0)
            hits += sum(g is not None for g in got)
        get_s = time.perf_counter() - t0
        if hits != len(keys):
            raise RuntimeError(f"remote bench: {hits} of {len(keys)} hits: {rc.stats()}")
    nbytes = len(keys) * bs
    return nbytes / put_s, nbytes / get_s


def plain_sync(cfg, keys, vals, bs, batch):
    """redis-py's synchronous cluster client: SET / GET pipelines of `batch`."""
    rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cfg.endpoints()],
                      password=cfg.secret())
    names = [cfg.prefix.encode() + b"plain:" + k.hex().encode() for k in keys]
    try:
        rc.ping()
        t0 = time.perf_counter()
        for i in range(0, len(keys), batch):
            p = rc.pipeline(transaction=False)
            for n, v in zip(names[i:i + batch], vals[i:i + batch]):
                p.set(n, v)
            p.execute()
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = 0
        for i in range(0, len(keys), batch):
            p = rc.pipeline(transaction=False)
            for n in names[i:i + batch]:
                p.get(n)
            got += sum(v is not None for v in p.execute())
        get_s = time.perf_counter() - t0
        if got != len(keys):
            raise RuntimeError(f"remote bench: got {got} of {len(keys)} values back")
    finally:
        rc.close()
    nbytes = len(keys) * bs
    return nbytes / put_s, nbytes / get_s


def plain_async(cfg, keys, vals, bs, batch):
    """redis-py's asyncio cluster client: the same pipelines."""
    names = [cfg.prefix.encode() + b"aplain:" + k.hex().encode() for k in keys]

    async def run():
        rc = async_cluster.RedisCluster(
            startup_nodes=[async_cluster.ClusterNode(h, p) for h, p in cfg.endpoints()],
            password=cfg.secret())
        try:
            await rc.initialize()
            t0 = time.perf_counter()
            for i in range(0, len(keys), batch):
                p = rc.pipeline(transaction=False)
                for n, v in zip(names[i:i + batch], vals[i:i + batch]):
                    p.set(n, v)
                await p.execute()
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = 0
            for i in range(0, len(keys), batch):
                p = rc.pipeline(transaction=False)
                for n in names[i:i + batch]:
                    p.get(n)
                got += sum(v is not None for v in await p.execute())
            get_s = time.perf_counter() - t0
            if got != len(keys):
                raise RuntimeError(f"remote bench: got {got} of {len(keys)} values back")
        finally:
            await rc.aclose()
        return put_s, get_s

    put_s, get_s = asyncio.run(run())
    nbytes = len(keys) * bs
    return nbytes / put_s, nbytes / get_s


def add_arguments(ap) -> None:
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per phase (MiB)")
    ap.add_argument("--batch", type=int, default=32, help="blocks per pipeline / lookup")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (the median is kept)")
    ap.add_argument("--nodes", default=None,
                    help="an existing cluster, host:port,... (the bench writes and then deletes "
                         "keys under a prefix of its own; nothing else is touched)")


def run(a, progress) -> dict:
    cluster = None
    prefix = f"cxlkv-bench-{os.getpid()}-{os.urandom(4).hex()}:"
    if a.nodes:
        cfg = RemoteConfig(nodes=tuple(a.nodes.split(",")), ttl_s=3600, queue_bytes=1024 * MiB,
                           prefix=prefix)
    else:
        harness.require_tools("redis-server", "redis-cli")
        progress("starting a 3-master cluster")
        cluster = TestCluster(masters=3).__enter__()
        cfg = RemoteConfig(nodes=tuple(cluster.addrs), ttl_s=0, queue_bytes=1024 * MiB,
                           prefix=prefix)
    rep = {"mib": a.mib, "batch": a.batch, "reps": a.reps, "cpus": os.cpu_count(), "sizes": {}}
    G = 1e9
    try:
        for bs in (256 * KiB, 64 * KiB):
            keys, vals = data_set(a.mib * MiB, bs, seed=bs)
            runs = {"tier": [], "tier_redispy": [], "plain_sync": [], "plain_async": []}
            names = list(runs)
            for r in range(a.reps):
                # the order turns each rep: none is always the first after a
                # cleanup (the servers give freed memory back meanwhile)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    progress(f"{bs // KiB} KiB blocks, {name}, rep {r + 1}/{a.reps}")
                    cleanup(cfg)
                    if name.startswith("tier"):
                        x = tier_run(cfg, keys, vals, bs, a.batch, name == "tier")
                    elif name == "plain_sync":
                        x = plain_sync(cfg, keys, vals, bs, a.batch)
                    else:
                        x = plain_async(cfg, keys, vals, bs, a.batch)
                    runs[name].append(x)
            med = {k: (harness.median(x[0] for x in v), harness.median(x[1] for x in v))
                   for k, v in runs.items()}
            best_put = max(med["plain_sync"][0], med["plain_async"][0])
            best_get = max(med["plain_sync"][1], med["plain_async"][1])
            rep["sizes"][bs] = {
                **{f"{k}_put_GBps": v[0] / G for k, v in med.items()},
                **{f"{k}_get_GBps": v[1] / G for k, v in med.items()},
                "tier_vs_plain_put": med["tier"][0] / best_put,
                "tier_vs_plain_get": med["tier"][1] / best_get,
                "fast_vs_redispy_put": med["tier"][0] / med["tier_redispy"][0],
                "fast_vs_redispy_get": med["tier"][1] / med["tier_redispy"][1],
            }
            cleanup(cfg)
    finally:
        if cluster is not None:
            cluster.stop()
    return rep


def render(rep: dict) -> str:
    lines = [f"remote tier vs plain redis-py cluster pipelines, {rep['mib']} MiB per phase, "
             f"{rep['batch']} blocks per batch, median of {rep['reps']}, {rep['cpus']} CPUs"]
    for bs, r in rep["sizes"].items():
        lines.append(f"{int(bs) // KiB} KiB blocks:")
        for what in ("put", "get"):
            lines.append(
                f"  {what}: tier {r[f'tier_{what}_GBps']:.2f} GB/s "
                f"(through redis-py {r[f'tier_redispy_{what}_GBps']:.2f}), "
                f"plain sync {r[f'plain_sync_{what}_GBps']:.2f}, "
                f"plain asyncio {r[f'plain_async_{what}_GBps']:.2f} GB/s -> "
                f"tier / best plain = {r[f'tier_vs_plain_{what}']:.2f}x, "
                f"fast path / redis-py = {r[f'fast_vs_redispy_{what}']:.2f}x")
    return "\n".join(lines)
