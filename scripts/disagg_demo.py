"""Disaggregated prefill -> decode through the pool, with a real model runtime.

Two processes, each attached to the pool as its own node, as two hosts of a
rack would be:

  prefill   runs prompt A through a small Llama (transformers, CPU), stores
            its KV blocks in the pool (store_prefix), and - for the checks -
            computes on the KV it holds in memory the decode steps the decode
            worker will run, and a full recomputation of each whole sequence;
  decode    matches and loads the prefix from the pool (load_prefix) and
            generates greedily from it:
              1. prompt A: every full block from the pool, the tail recomputed;
              2. prompt B, sharing only A's first K blocks: those K from the
                 pool, the rest recomputed (and then published);
              3. prompt A as another tenant (another salt): no reuse.

Checks (exit 1 if one fails): the loaded KV equals the prefill's in-memory
KV bit for bit; the decode logits equal, bit for bit, the same steps run on
the prefill's in-memory KV; they are within 1e-5 of a full recomputation of
the sequence (one-token decode and full prefill use different matmul shapes,
so not bit-equal there); greedy tokens are identical; the other tenant
matches nothing.

    .venv/bin/python scripts/disagg_demo.py            # scratch pool in /dev/shm
    .venv/bin/python scripts/disagg_demo.py --json --pool /dev/shm/cxlkv-default.pool

Needs torch and transformers (pip install -e '.[transformers]'); the model
is built from a config with a fixed seed, nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TOLERANCE = 1e-5
TENANT, OTHER_TENANT = "tenant-a", "tenant-b"


# -- the workers (each imports torch; the parent does not) --------------------------------
def _setup(args):
    import torch

    torch.set_num_threads(args.threads)
    from cxlkv.integrations import transformers as hf
    from cxlkv.testing.models import tiny_llama

    return torch, hf, tiny_llama(seed=args.seed)


def _prompts(torch, args, vocab: int):
    g = torch.Generator().manual_seed(args.prompt_seed)
    a = torch.randint(0, vocab, (1, args.prompt_tokens), generator=g)
    k = args.reuse_blocks * args.block_tokens
    tail = torch.randint(0, vocab, (1, args.prompt_tokens - k), generator=g)
    tail[0, 0] = (a[0, k] + 1) % vocab                # B leaves A exactly at block K
    return a, torch.cat([a[:, :k], tail], dim=1)


def _greedy(torch, hf, model, ids, cache, steps: int):
    """`steps` greedy decode steps from ids (the tokens not in `cache`); returns
    (logits [steps, vocab], tokens [steps], cache)."""
    kw = hf.cache_kwarg(model)
    logits, toks, x = [], [], ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(x, **{kw: cache}, use_cache=True, logits_to_keep=1)
            cache = hf.output_cache(out)
            row = out.logits[0, -1]
            logits.append(row)
            toks.append(int(row.argmax()))
            x = torch.tensor([[toks[-1]]])
    return torch.stack(logits), toks, cache


def _recompute(torch, model, ids, toks):
    """Logits of the same positions by one full forward pass over the whole sequence."""
    seq = torch.cat([ids, torch.tensor([toks[:-1]])], dim=1)
    with torch.no_grad():
        return model(seq).logits[0, ids.shape[1] - 1:]


def _expected_tokens(total: int, matched_blocks: int, block_tokens: int) -> int:
    return min(matched_blocks * block_tokens, total - 1)


def prefill_worker(args) -> int:
    torch, hf, model = _setup(args)
    import cxlkv

    a, b = _prompts(torch, args, model.config.vocab_size)
    with cxlkv.open_pool(args.pool) as pool:
        kv = hf.kv_for_model(pool, model, salt=TENANT, block_tokens=args.block_tokens)
        t0 = time.perf_counter()
        with torch.no_grad():
            cache = hf.output_cache(model(a, use_cache=True))
        t1 = time.perf_counter()
        stored = hf.store_prefix(kv, a, cache)
        t2 = time.perf_counter()
        full_blocks = a.shape[1] // args.block_tokens
        in_pool = kv.match(a[0].numpy()) // args.block_tokens
        refs = {"kv": [(k.clone(), v.clone()) for k, v in hf.cache_tensors(cache)],
                "scenarios": {}}
        for name, ids, blocks in (("full", a, full_blocks), ("partial", b, args.reuse_blocks)):
            n = _expected_tokens(ids.shape[1], blocks, args.block_tokens)
            # the decode steps on the KV this process computed, cut to what the pool holds
            logits, toks, _ = _greedy(torch, hf, model, ids[:, n:], hf.cache_prefix(cache, n),
                                      args.new_tokens)
            refs["scenarios"][name] = {"n": n, "logits": logits, "tokens": toks,
                                       "recompute": _recompute(torch, model, ids, toks)}
        torch.save(refs, os.path.join(args.work, "refs.pt"))
        print(json.dumps({"event": "stored", "node": pool.node.slot, "pid": os.getpid(),
                          "namespace": kv.namespace, "block_bytes": kv.block_bytes,
                          "prompt_tokens": a.shape[1], "blocks": full_blocks, "stored": stored,
                          "in_pool": in_pool,
                          "prefill_ms": round((t1 - t0) * 1e3, 2),
                          "store_ms": round((t2 - t1) * 1e3, 2)}), flush=True)
        sys.stdin.read()                # stay attached while the decode worker runs
    return 0


def decode_worker(args) -> int:
    torch, hf, model = _setup(args)
    import cxlkv

    a, b = _prompts(torch, args, model.config.vocab_size)
    with cxlkv.open_pool(args.pool) as pool:
        print(json.dumps({"event": "ready", "node": pool.node.slot, "pid": os.getpid()}),
              flush=True)
        sys.stdin.readline()            # the prefill worker has stored its prompt
        refs = torch.load(os.path.join(args.work, "refs.pt"))
        kv = hf.kv_for_model(pool, model, salt=TENANT, block_tokens=args.block_tokens)
        out = {"event": "done", "node": pool.node.slot, "namespace": kv.namespace,
               "scenarios": {}}
        for name, ids in (("full", a), ("partial", b)):
            ref = refs["scenarios"][name]
            t0 = time.perf_counter()
            cache, n = hf.load_prefix(kv, ids)
            t1 = time.perf_counter()
            same_kv = cache is not None and all(
                torch.equal(k, rk[:, :, :n]) and torch.equal(v, rv[:, :, :n])
                for (k, v), (rk, rv) in zip(hf.cache_tensors(cache), refs["kv"]))
            logits, toks, cache = _greedy(torch, hf, model, ids[:, n:], cache, args.new_tokens)
            t2 = time.perf_counter()
            rec = ref["recompute"]
            s = {"prompt_tokens": ids.shape[1], "loaded_tokens": n,
                 "recomputed_tokens": ids.shape[1] - n, "expected_loaded_tokens": ref["n"],
                 "kv_bit_identical": bool(same_kv),
                 "logits_bit_identical": bool(torch.equal(logits, ref["logits"])),
                 "max_abs_diff_vs_recompute": float((logits - rec).abs().max()),
                 "tokens": toks, "tokens_match_in_memory": toks == ref["tokens"],
                 "tokens_match_recompute": toks == rec.argmax(-1).tolist(),
                 "load_ms": round((t1 - t0) * 1e3, 3),
                 "generate_ms": round((t2 - t1) * 1e3, 2)}
            if name == "partial":
                # publish what this worker recomputed, for the next request
                seq = torch.cat([ids, torch.tensor([toks[:-1]])], dim=1)
                s["published_blocks"] = hf.store_prefix(kv, seq, cache)
            out["scenarios"][name] = s
        other = hf.kv_for_model(pool, model, salt=OTHER_TENANT, block_tokens=args.block_tokens)
        cache, n = hf.load_prefix(other, a)
        logits, toks, _ = _greedy(torch, hf, model, a, cache, args.new_tokens)
        ref = refs["scenarios"]["full"]
        out["scenarios"]["other_tenant"] = {
            "prompt_tokens": a.shape[1], "loaded_tokens": n, "matched": other.match(a),
            "tokens_match_recompute": toks == ref["tokens"],
            "max_abs_diff_vs_recompute": float((logits - ref["recompute"]).abs().max())}
        print(json.dumps(out), flush=True)
    return 0


# -- the parent: starts both workers, relays the go signal, checks --------------------------
def _read_event(proc, want: str) -> dict:
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            ev = json.loads(line)
            if ev.get("event") == want:
                return ev
    raise RuntimeError(f"a worker exited before reporting {want!r} (exit {proc.wait()})")


def checks(report: dict, tolerance: float = TOLERANCE) -> list[tuple[str, bool]]:
    p, d = report["prefill"], report["decode"]
    sc = d["scenarios"]
    out = [("the two workers are distinct nodes", p["node"] != d["node"]),
           ("every full block of the prompt is in the pool after the prefill",
            p["in_pool"] == p["blocks"] > 0)]
    for name in ("full", "partial"):
        s = sc[name]
        out += [
            (f"{name}: loaded {s['loaded_tokens']} tokens from the pool (expected "
             f"{s['expected_loaded_tokens']}"
             + ("; an earlier run with this --prompt-seed published more of it"
                if s["loaded_tokens"] > s["expected_loaded_tokens"] else "") + ")",
             s["loaded_tokens"] == s["expected_loaded_tokens"] > 0),
            (f"{name}: loaded KV bit-identical to the prefill's in-memory KV",
             s["kv_bit_identical"]),
            (f"{name}: decode logits bit-identical to decoding on the in-memory KV",
             s["logits_bit_identical"]),
            (f"{name}: within {tolerance:g} of full recomputation "
             f"(max |diff| {s['max_abs_diff_vs_recompute']:.2e})",
             s["max_abs_diff_vs_recompute"] <= tolerance),
            (f"{name}: greedy tokens identical (in-memory and recomputation)",
             s["tokens_match_in_memory"] and s["tokens_match_recompute"]),
        ]
    o = sc["other_tenant"]
    out += [("another tenant (salt) reuses nothing", o["loaded_tokens"] == 0 and o["matched"] == 0),
            ("another tenant's recomputation gives the same tokens", o["tokens_match_recompute"])]
    return out


def run(pool: str | None = None, *, prompt_tokens: int = 133, new_tokens: int = 8,
        reuse_blocks: int = 3, block_tokens: int = 16, threads: int = 2, seed: int = 0,
        prompt_seed: int | None = None,
        timeout: float = 240.0) -> dict:
    """Run both workers on `pool` (a scratch pool when None); returns the report."""
    if not 0 < reuse_blocks < prompt_tokens // block_tokens:
        raise SystemExit("--reuse-blocks must be between 1 and the prompt's full blocks - 1")
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"disagg_demo: needs {' and '.join(missing)}: "
                         "pip install -e '.[transformers]'")
    import cxlkv

    if prompt_seed is None:
        prompt_seed = int.from_bytes(os.urandom(4), "little")
    with tempfile.TemporaryDirectory(prefix="cxlkv-disagg-") as work:
        scratch = pool is None
        if scratch:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else work
            pool = os.path.join(base, f"cxlkv-disagg-{os.getpid()}.pool")
            cxlkv.init_pool(pool, {"size": 64 << 20})
        common = [sys.executable, os.path.abspath(__file__), "--pool", pool, "--work", work,
                  "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(new_tokens),
                  "--reuse-blocks", str(reuse_blocks), "--block-tokens", str(block_tokens),
                  "--threads", str(threads), "--seed", str(seed),
                  "--prompt-seed", str(prompt_seed)]
        procs = []
        try:
            kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            pre = subprocess.Popen(common + ["--role", "prefill"], **kw)
            procs.append(pre)
            dec = subprocess.Popen(common + ["--role", "decode"], **kw)
            procs.append(dec)
            t0 = time.monotonic()
            ready = _read_event(dec, "ready")
            stored = _read_event(pre, "stored")
            dec.stdin.write("go\n")
            dec.stdin.flush()
            done = _read_event(dec, "done")
            done["ready_node"] = ready["node"]
            pre.stdin.close()
            for p in procs:
                p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
                if p.returncode:
                    raise RuntimeError(f"a worker failed (exit {p.returncode})")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if scratch and os.path.exists(pool):
                os.remove(pool)
    report = {"prefill": stored, "decode": done,
              "config": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
                         "reuse_blocks": reuse_blocks, "block_tokens": block_tokens,
                         "threads": threads, "seed": seed, "prompt_seed": prompt_seed,
                         "tolerance": TOLERANCE}}
    report["checks"] = [{"check": c, "ok": ok} for c, ok in checks(report)]
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _render(r: dict) -> str:
    p, d = r["prefill"], r["decode"]
    sc = d["scenarios"]
    lines = [
        f"namespace {p['namespace']} ({p['block_bytes']} bytes a block of "
        f"{r['config']['block_tokens']} tokens)",
        f"prefill (node {p['node']}): {p['prompt_tokens']} prompt tokens in {p['prefill_ms']} ms; "
        f"stored {p['stored']} of {p['blocks']} blocks in {p['store_ms']} ms"
        + (f" ({p['blocks'] - p['stored']} were in the pool already)"
           if p["stored"] < p["blocks"] else ""),
    ]
    shared = f"prompt B (shares A's first {r['config']['reuse_blocks']} blocks)"
    for name, what in (("full", "prompt A"), ("partial", shared)):
        s = sc[name]
        lines.append(f"decode  (node {d['node']}) {what}: {s['loaded_tokens']} tokens loaded in "
                     f"{s['load_ms']} ms, {s['recomputed_tokens']} recomputed, "
                     f"{r['config']['new_tokens']} tokens generated in {s['generate_ms']} ms"
                     + (f"; published {s['published_blocks']} new blocks"
                        if "published_blocks" in s else ""))
    o = sc["other_tenant"]
    lines.append(f"decode  (node {d['node']}) prompt A as another tenant: "
                 f"{o['loaded_tokens']} tokens loaded, all recomputed")
    for c in r["checks"]:
        lines.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}")
    lines.append("all checks passed" if r["ok"] else "SOME CHECKS FAILED")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", help="an existing pool (default: a scratch pool, removed after)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--prompt-tokens", type=int, default=133)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reuse-blocks", type=int, default=3,
                    help="blocks prompt B shares with prompt A")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each worker")
    ap.add_argument("--seed", type=int, default=0, help="the model's weights")
    ap.add_argument("--prompt-seed", type=int,
                    help="the prompts (default: new ones each run, so a run on a pool that "
                         "keeps an earlier run's blocks checks the same things)")
    ap.add_argument("--role", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "prefill":
        return prefill_worker(args)
    if args.role == "decode":
        return decode_worker(args)
    try:
        report = run(args.pool, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                     reuse_blocks=args.reuse_blocks, block_tokens=args.block_tokens,
                     threads=args.threads, seed=args.seed, prompt_seed=args.prompt_seed)
    except RuntimeError as e:
        print(f"disagg_demo: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _render(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
