"""Cross-rack hit: time to first token when a prompt's prefix KV
comes from the remote tier (another rack pushed it) vs recomputing it.

Two pools stand in for two racks and a real Redis Cluster (3 masters on
loopback ports, from the Debian redis-server package; or --nodes for one you
run).  Rack A computes the prompt's KV once, stores it in its pool and
pushes it (cxlkv.kv.tiers.remote.Pusher, as `cxlkv serve` does).  Then, interleaved
run by run:

  recompute    a full prefill of the prompt -> first token
  remote hit   rack B, its pool empty of the prompt: load_prefix reads the
               blocks through the remote tier into B's pool and loads them,
               + a forward of the remaining token -> first token
  local hit    the same once the blocks are in B's pool (for reference)

all timed from having the token ids to having the first token id; the
namespace is dropped from B's pool before every remote hit.  Medians and the
ratio recompute / remote hit.  The first token must agree on every path.

    cxlkv bench run remote-ttft [--contexts 4096] [--runs 5] [--nodes H:P,...] [--json]

Needs torch and transformers (pip install -e '.[transformers]'), the redis
Python client, and redis-server / redis-cli without --nodes.
"""
from __future__ import annotations

import os
import shutil
import time

import cxlkv
from cxlkv.bench import harness
from cxlkv.errors import UsageError
from cxlkv.kv.tiers import remote as kv_remote
from cxlkv.kv.cache import drop_namespace
from cxlkv.remote import RemoteClient, RemoteConfig
from cxlkv.testing.redis import TestCluster

HINT = "pip install -e '.[transformers]'"


def measure(contexts, runs, threads, nodes=None, progress=None) -> dict:
    # optional dependencies: imported here so that the other scenarios run without them
    torch = harness.require_module("torch", HINT)
    harness.require_module("transformers", HINT)
    harness.require_module("redis", "pip install redis hiredis")
    from cxlkv.integrations import transformers as hf
    from cxlkv.testing import models

    if not nodes:
        harness.require_tools("redis-server", "redis-cli")
    torch.set_num_threads(threads)
    cluster = None
    if not nodes:
        cluster = TestCluster(masters=3).start()
        nodes = cluster.addrs
    cfg = RemoteConfig(nodes=tuple(nodes), prefix=f"bench-ttft-{os.getpid()}:")
    model = models.tiny_llama(seed=0, max_position_embeddings=max(16384, max(contexts) + 16))
    kw = hf.cache_kwarg(model)
    lay = hf.block_layout(model)
    size = max(64 << 20, 2 * sum(contexts) * lay.token_bytes + (32 << 20))
    scratch = harness.scratch_dir("cxlkv-rttft-")
    paths = [harness.scratch_pool(os.path.join(scratch, f"{r}.pool"), size) for r in "ab"]
    out = {"model": {"layers": 4, "hidden": 256, "kv_heads": 2, "dtype": "float32",
                     "threads": threads, "kv_bytes_per_token": lay.token_bytes},
           "runs": runs, "contexts": []}
    try:
        with cxlkv.open_pool(paths[0]) as pa, cxlkv.open_pool(paths[1]) as pb, \
                RemoteClient(cfg) as rca, torch.no_grad():
            kv_remote.enable(pb, cfg)
            rcb = kv_remote.client_of(pb)
            kva = hf.kv_for_model(pa, model)
            name = kva.namespace
            for n in contexts:
                ids = torch.randint(0, model.config.vocab_size, (1, n),
                                    generator=torch.Generator().manual_seed(n))
                cache = hf.output_cache(model(ids, use_cache=True, logits_to_keep=1))
                stored = hf.store_prefix(kva, ids, cache)
                del cache
                kv_remote.Pusher(pa, rca, [name], policy="all").scan()
                if not rca.flush(120):
                    raise RuntimeError(f"remote-ttft: the push did not flush: {rca.stats()}")

                def recompute(ids=ids):
                    t = time.perf_counter()
                    tok = int(model(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
                    return time.perf_counter() - t, tok, 0.0

                def hit(kvb, ids=ids):
                    t = time.perf_counter()
                    cache, k = hf.load_prefix(kvb, ids)
                    t1 = time.perf_counter()
                    logits = model(ids[:, k:], **{kw: cache}, use_cache=True,
                                   logits_to_keep=1).logits
                    return time.perf_counter() - t, int(logits[0, -1].argmax()), t1 - t, k

                def remote_hit():
                    hf.kv_for_model(pb, model)                  # so that there is one to drop
                    drop_namespace(pb, name)
                    kvb = hf.kv_for_model(pb, model, remote_read=True, remote_budget_s=10.0)
                    r = hit(kvb)
                    if r[3] < n - 16:                               # the prefix came back
                        raise RuntimeError(f"remote-ttft: {r[3]} of {n} tokens came back: "
                                           f"{rcb.stats()}")
                    return r

                def local_hit():
                    return hit(hf.kv_for_model(pb, model, remote_read=True))

                recompute(), remote_hit(), local_hit()                # warm-up
                rec, rem, loc, rem_load, same = [], [], [], [], True
                for r in range(runs):
                    a = recompute()
                    b = remote_hit()
                    c = local_hit()
                    rec.append(a[0])
                    rem.append(b[0])
                    rem_load.append(b[2])
                    loc.append(c[0])
                    same &= a[1] == b[1] == c[1]
                    if progress:
                        progress(f"{n} tokens: run {r + 1}/{runs}")
                mr, mh, ml = (harness.median(x) for x in (rec, rem, loc))
                out["contexts"].append({
                    "tokens": n, "blocks": stored,
                    "kv_bytes": stored * lay.block_bytes,
                    "recompute_ms": round(mr * 1e3, 2), "remote_hit_ms": round(mh * 1e3, 2),
                    "remote_load_ms": round(harness.median(rem_load) * 1e3, 2),
                    "local_hit_ms": round(ml * 1e3, 2),
                    "ratio": round(mr / mh, 1), "same_first_token": same})
            out["remote_stats"] = rcb.stats()
            kv_remote.disable(pb)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if cluster is not None:
            cluster.stop()
    return out


def render(r: dict) -> str:
    m = r["model"]
    lines = [f"cross-rack TTFT, tiny Llama ({m['layers']} layers, {m['dtype']}, {m['threads']} "
             f"threads; {m['kv_bytes_per_token']} B of KV a token); medians of {r['runs']} runs",
             f"{'context':>8} {'recompute':>12} {'remote hit':>12} {'(load)':>9} "
             f"{'local hit':>11} {'ratio':>7}"]
    for c in r["contexts"]:
        lines.append(f"{c['tokens']:>8} {c['recompute_ms']:>9.1f} ms {c['remote_hit_ms']:>9.1f} ms"
                     f" {c['remote_load_ms']:>6.1f} ms {c['local_hit_ms']:>8.1f} ms "
                     f"{c['ratio']:>6.1f}x" + ("" if c["same_first_token"] else
                                               "  FIRST TOKENS DIFFER"))
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", help="host:port,... of an existing cluster (default: start one)")


def run(a, progress) -> dict:
    try:
        contexts = tuple(int(x) for x in a.contexts.split(","))
    except ValueError:
        raise UsageError("--contexts takes integers, e.g. 1024,4096") from None
    return measure(contexts, a.runs, a.threads,
                   nodes=a.nodes.split(",") if a.nodes else None, progress=progress)


def ok(r: dict) -> bool:
    """The first token agreed on every path in every run."""
    return all(c["same_first_token"] for c in r["contexts"])
