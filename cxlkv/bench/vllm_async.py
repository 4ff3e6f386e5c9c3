"""vLLM connector: per-step time with synchronous vs asynchronous loads and saves.

One vLLM instance in miniature - vLLM's real Scheduler (the connector loaded
by module path) and the worker-side connector over CPU paged KV caches,
called in the order of vLLM's model runner - runs the same workload twice in
the same run, the order alternating run by run:

  sync    the connector's defaults: a step loads its matched blocks before
          the forward and publishes its completed blocks after it
  async   "async": true - loads on the load thread (vLLM's asynchronous-load
          protocol: the request waits until get_finished reports its load),
          saves copied out and published on threads behind the next steps

Every step admits two requests of --mib MiB of KV each (16 layers, 8 KV
heads of 128, bf16: 64 KiB a token): one whose prefix another instance stored
in the pool (a load of --mib MiB, then 8 tokens computed), one with a new
prompt (a save of --mib MiB); each generates one token.  The forward is a stand-in of --compute-ms: "sleep" (a GPU forward: the
host thread waits and the cores are free) or "spin" (torch matmuls on the
calling thread for that long: a CPU-bound forward that competes with the copy
threads).  Per-step time is the median wall time of an engine step
(schedule, connector calls, forward, update) over the steady-state steps;
the ratio async / sync is of the same run.

    cxlkv bench run vllm-async [--mib 16] [--steps 24] [--compute-ms 30]
                               [--compute sleep|spin] [--runs 3] [--json]

Needs vLLM: run from the main venv it runs itself under .venv-vllm
(scripts/setup --vllm; or --python PATH).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time

from cxlkv.bench import harness
from cxlkv.errors import Unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
LAYERS, HEADS, HEAD_DIM, BS = 16, 8, 128, 16
TOKEN_BYTES = LAYERS * HEADS * 2 * HEAD_DIM * 2          # K and V, bf16: 64 KiB
WARMUP = 4


def _model_dir(d: str) -> str:
    from transformers import LlamaConfig
    path = os.path.join(d, "model")
    LlamaConfig(vocab_size=32000, hidden_size=HEADS * HEAD_DIM, intermediate_size=2048,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=HEADS, head_dim=HEAD_DIM, max_position_embeddings=8192,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def _config(model: str, pool: str, role: str, extra: dict):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    mc = ModelConfig(model=model, dtype="bfloat16", seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=8192, max_model_len=4096,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor")
    kt = KVTransferConfig(kv_connector="CxlkvConnector",
                          kv_connector_module_path="cxlkv.integrations.vllm", kv_role=role,
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"pool": pool, **extra})
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


class Engine:
    """The real Scheduler and a worker-side connector over CPU paged KV,
    stepped as vLLM's model runner steps them (forward = a stand-in)."""

    def __init__(self, model: str, pool: str, role: str, extra: dict, num_blocks: int):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        cfg = _config(model, pool, role, extra)
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                 dtype=torch.bfloat16)
        kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)])
        cfg.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kvc,
                                   structured_output_manager=StructuredOutputManager(cfg),
                                   block_size=BS, log_stats=False)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        self.caches = {n: torch.zeros(num_blocks, HEADS, BS, 2 * HEAD_DIM, dtype=torch.bfloat16)
                       for n in self.layers}
        self.worker.register_kv_caches(self.caches)

    def fill(self, rid: str, start: int, n: int) -> None:
        """The KV of tokens [start, start+n) of rid: a value per block (cheap)."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        for b in range(start // BS, (start + n + BS - 1) // BS):
            for li, name in enumerate(self.layers):
                self.caches[name][ids[b]].fill_(float((hash(rid) + b * 31 + li) % 97))

    def step(self, forward=None) -> set[str]:
        """One step; returns the requests scheduled."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        sync_first = getattr(out, "has_sync_kv_loads", True)
        if sync_first:
            w.start_load_kv(None)
        cached = out.scheduled_cached_reqs
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        reqs = list(starts)
        if forward is not None and reqs:
            forward()
        for rid in reqs:
            self.fill(rid, starts[rid], out.num_scheduled_tokens[rid])
        for n in self.layers:
            w.save_kv_layer(n, self.caches[n], None)
        if not sync_first:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                failed_recving=res.failed_recving,
                                invalid_block_ids=w.get_block_ids_with_load_errors())
        w.clear_connector_metadata()
        sampled = [[] if getattr(self.scheduler.requests[r], "is_prefill_chunk", False) else [7]
                   for r in reqs]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled, kv_connector_output=kvo))
        return set(reqs)

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def _request(rid: str, tokens: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    sp.update_from_generation_config({}, 2)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256_cbor))


def _tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 32000) for _ in range(n)]


def _forward(kind: str, ms: float):
    """The forward stand-in: sleep (a GPU forward) or torch matmuls (a CPU one)."""
    import torch
    s = ms / 1000

    def sleep():
        time.sleep(s)

    a = torch.randn(256, 256)

    def spin():
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            torch.mm(a, a)
    return sleep if kind == "sleep" else spin


def _one(mode: str, run: int, a, d: str, progress) -> dict:
    """One workload in one mode on a fresh pool: per-step wall times."""
    blocks = a.mib * (1 << 20) // (BS * TOKEN_BYTES)
    tail = BS // 2                               # computed after the prefix: no new block
    n = a.steps + WARMUP
    pool = os.path.join(d, f"{mode}.pool")
    harness.scratch_pool(pool, (2 * n + 8) * a.mib * (1 << 20) + (256 << 20))
    model = os.path.join(d, "model")
    prefixes = [_tokens(1000 * run + i, blocks * BS) for i in range(n)]
    prod = Engine(model, pool, "kv_producer", {}, num_blocks=(blocks + 2) * 9)
    try:
        for i in range(0, n, 8):                 # another instance stored the prefixes
            for j in range(i, min(n, i + 8)):
                prod.scheduler.add_request(_request(f"p{j}", prefixes[j] + [1]))
            while prod.scheduler.has_requests():
                prod.step()
    finally:
        prod.close()
    extra = {"async": True} if mode == "async" else {}
    eng = Engine(model, pool, "kv_both", extra, num_blocks=(blocks + 2) * 12)
    fwd = _forward(a.compute, a.compute_ms)
    times, admitted, waited = [], {}, []
    try:
        for i in range(n):
            hit = f"h{i}"
            eng.scheduler.add_request(_request(hit, prefixes[i] + _tokens(7 + 1000 * run + i,
                                                                          tail)))
            eng.scheduler.add_request(_request(f"m{i}", _tokens(500000 + 1000 * run + i,
                                                                blocks * BS + 1)))
            admitted[hit] = i
            t0 = time.perf_counter()
            ran = eng.step(fwd)
            times.append(time.perf_counter() - t0)
            for r in ran & set(admitted):
                waited.append(i - admitted.pop(r))
        while eng.scheduler.has_requests():
            eng.step(fwd)
        eng.worker.flush()
        st = dict(eng.worker.stats)
    finally:
        eng.close()
        os.unlink(pool)
    steady = times[WARMUP:]
    return {"step_s": harness.median(steady), "mean_s": sum(steady) / len(steady),
            "p90_s": harness.pct(steady, 90), "hit_wait_steps": harness.median(waited),
            "loaded_blocks": st["loaded_blocks"], "stored_blocks": st["stored_blocks"],
            "missed_blocks": st["missed_blocks"]}


def _measure(a, progress) -> dict:
    d = harness.scratch_dir("cxlkv-vllm-async-")
    try:
        _model_dir(d)
        per = {"sync": [], "async": []}
        for r in range(a.runs):
            order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
            for mode in order:
                progress(f"run {r + 1} of {a.runs}: {mode}")
                per[mode].append(_one(mode, r, a, d, progress))
        med = {m: harness.median(x["step_s"] for x in v) for m, v in per.items()}
        fwd = _forward(a.compute, a.compute_ms)
        t0 = time.perf_counter()
        for _ in range(10):
            fwd()
        floor = (time.perf_counter() - t0) / 10
        progress("memcpy baseline")
        return {"mib": a.mib, "steps": a.steps, "runs": a.runs, "compute": a.compute,
                "compute_ms": a.compute_ms, "forward_s": floor,
                "step_s": med, "ratio": med["async"] / med["sync"],
                "hit_wait_steps": {m: harness.median(x["hit_wait_steps"] for x in v)
                                   for m, v in per.items()},
                "runs_detail": per, "load1": os.getloadavg()[0],
                "memcpy_gbps": harness.memcpy_gbps(total=a.mib << 20)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _have_vllm() -> bool:
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
        return True
    except Exception:
        return False


def add_arguments(ap) -> None:
    ap.add_argument("--mib", type=int, default=16, help="MiB of KV each request loads or saves")
    ap.add_argument("--steps", type=int, default=24, help="measured steps a run (after 4)")
    ap.add_argument("--compute-ms", type=float, default=30.0, help="the forward stand-in, ms")
    ap.add_argument("--compute", choices=("sleep", "spin"), default="sleep",
                    help="sleep: a GPU forward (the cores are free); spin: a CPU-bound one")
    ap.add_argument("--runs", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--python", default=os.environ.get("CXLKV_VLLM_PYTHON", "").split(
        os.pathsep)[0] or VENV_PYTHON, help="an interpreter with vLLM, when this one has none")


def run(a, progress) -> dict:
    if _have_vllm():
        return _measure(a, progress)
    if not os.path.exists(a.python):
        raise Unavailable(f"vLLM is not importable here and there is no {a.python} "
                          "(scripts/setup --vllm makes it)")
    progress(f"running under {a.python}")
    r = subprocess.run([a.python, "-m", "cxlkv.bench.vllm_async", "--mib", str(a.mib),
                        "--steps", str(a.steps), "--compute-ms", str(a.compute_ms),
                        "--compute", a.compute, "--runs", str(a.runs)],
                       env=harness.child_env(), capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise Unavailable(f"{a.python}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def render(r: dict) -> str:
    s, w = r["step_s"], r["hit_wait_steps"]
    return "\n".join([
        f"vLLM connector, {r['mib']} MiB loaded + {r['mib']} MiB saved a step, forward "
        f"stand-in {r['compute']} {r['compute_ms']:g} ms ({r['forward_s'] * 1000:.1f} ms "
        f"measured); medians of {r['runs']} runs x {r['steps']} steps",
        f"{'':7} {'step':>9} {'hit waits':>10}",
        f"{'sync':7} {s['sync'] * 1000:>6.1f} ms {w['sync']:>4g} steps",
        f"{'async':7} {s['async'] * 1000:>6.1f} ms {w['async']:>4g} steps",
        f"async / sync (same run): {r['ratio']:.2f}x; memcpy {r['memcpy_gbps']:.2f} GB/s; "
        f"load average {r['load1']:.2f}"])


def ok(r: dict) -> bool:
    return all(x["missed_blocks"] == 0 and x["loaded_blocks"] > 0
               for v in r["runs_detail"].values() for x in v)


if __name__ == "__main__":              # the run under the vLLM venv
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args()
    print(json.dumps(harness.jsonable(_measure(args, lambda m: print(m, file=sys.stderr)))))
