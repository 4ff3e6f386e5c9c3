"""Cross-rack hit (issue 9): time to first token when a prompt's prefix KV
comes from the remote tier (another rack pushed it) vs recomputing it.

Two pools stand in for two racks and a real Redis Cluster (3 masters on
loopback ports, from the Debian redis-server package; or --nodes for one you
run).  Rack A computes the prompt's KV once, stores it in its pool and
pushes it (cxlkv.kv.remote.Pusher, as `cxlkv serve` does).  Then, interleaved
run by run:

  recompute    a full prefill of the prompt -> first token
  remote hit   rack B, its pool empty of the prompt: load_prefix reads the
               blocks through the remote tier into B's pool and loads them,
               + a forward of the remaining token -> first token
  local hit    the same once the blocks are in B's pool (for reference)

all timed from having the token ids to having the first token id; the
namespace is dropped from B's pool before every remote hit.  Medians and the
ratio recompute / remote hit.  The first token must agree on every path.

    .venv/bin/python bench/remote_ttft.py [--contexts 4096] [--runs 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def measure(contexts, runs, threads, nodes=None, progress=None) -> dict:
    import torch

    import cxlkv
    from cxlkv.integrations import transformers as hf
    from cxlkv.kv import remote as KR
    from cxlkv.kv.cache import drop_namespace
    from cxlkv.remote import RemoteClient, RemoteConfig

    torch.set_num_threads(threads)
    cluster = None
    if not nodes:
        from cxlkv.remote.testcluster import TestCluster

        cluster = TestCluster(masters=3).start()
        nodes = cluster.addrs
    cfg = RemoteConfig(nodes=tuple(nodes), prefix=f"bench-ttft-{os.getpid()}:")
    model = hf.tiny_llama(seed=0, max_position_embeddings=max(16384, max(contexts) + 16))
    kw = hf.cache_kwarg(model)
    lay = hf.block_layout(model)
    size = max(64 << 20, 2 * sum(contexts) * lay.token_bytes + (32 << 20))
    paths = [f"/dev/shm/cxlkv-rttft-{os.getpid()}-{r}.pool" for r in "ab"]
    for p in paths:
        cxlkv.init_pool(p, {"size": size})
    out = {"model": {"layers": 4, "hidden": 256, "kv_heads": 2, "dtype": "float32",
                     "threads": threads, "kv_bytes_per_token": lay.token_bytes},
           "runs": runs, "contexts": []}
    try:
        with cxlkv.open_pool(paths[0]) as pa, cxlkv.open_pool(paths[1]) as pb, \
                RemoteClient(cfg) as rca, torch.no_grad():
            KR.enable(pb, cfg)
            rcb = KR.client_of(pb)
            kva = hf.kv_for_model(pa, model)
            name = kva.namespace
            for n in contexts:
                ids = torch.randint(0, model.config.vocab_size, (1, n),
                                    generator=torch.Generator().manual_seed(n))
                cache = hf.output_cache(model(ids, use_cache=True, logits_to_keep=1))
                stored = hf.store_prefix(kva, ids, cache)
                del cache
                KR.Pusher(pa, rca, [name], policy="all").scan()
                assert rca.flush(120), rca.stats()

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
                    assert r[3] >= n - 16, (r[3], rcb.stats())       # the prefix came back
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
                        progress(n, r)
                mr, mh, ml = (statistics.median(x) for x in (rec, rem, loc))
                out["contexts"].append({
                    "tokens": n, "blocks": stored,
                    "kv_bytes": stored * lay.block_bytes,
                    "recompute_ms": round(mr * 1e3, 2), "remote_hit_ms": round(mh * 1e3, 2),
                    "remote_load_ms": round(statistics.median(rem_load) * 1e3, 2),
                    "local_hit_ms": round(ml * 1e3, 2),
                    "ratio": round(mr / mh, 1), "same_first_token": same})
            out["remote_stats"] = rcb.stats()
            KR.disable(pb)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", help="host:port,... of an existing cluster (default: start one)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    contexts = tuple(int(x) for x in a.contexts.split(","))
    prog = None if a.json else (lambda n, r: print(f"  {n} tokens: run {r + 1}/{a.runs}",
                                                   file=sys.stderr))
    r = measure(contexts, a.runs, a.threads,
                nodes=a.nodes.split(",") if a.nodes else None, progress=prog)
    print(json.dumps(r, indent=2) if a.json else render(r))
    return 0 if all(c["same_first_token"] for c in r["contexts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
