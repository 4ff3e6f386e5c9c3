"""KV events for routers: events/s and lag of the publisher at a paced store rate.

A writer process stores blocks at --rate blocks/s (default 10K; 8 blocks a
store) for --seconds; the publisher of `cxlkv serve --kv-events`
(cxlkv.daemons.kv_events) follows the journal in this process and sends
vLLM-format batches over ZeroMQ on loopback to a subscriber process, which
decodes every batch.  Figures:

* events/s the subscriber decoded, as a ratio of the blocks/s the writer
  reached (1.0: every store announced as fast as it came);
* publish lag (journal append to the batch sent) p50/p99, and transport
  lag (batch sent to decoded by the subscriber) p50/p99;
* baseline, same run: a bare JournalReader following the same writer at the
  same poll interval (the journal bench's reader), its lag p50/p99 - the
  ratio is the publisher's p50 over the bare reader's.

    cxlkv bench run kv-events [--rate N] [--seconds S] [--json]

The pool is a file in /dev/shm (or --dir).  Figures on a shared machine are noisy.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import cxlkv
from cxlkv.bench import harness
from cxlkv.bench import journal as journal_bench
from cxlkv.daemons.kv_events import KVEventsPublisher, settings

SUBSCRIBER = r'''
import json, sys, time, msgspec, zmq
ep, seconds = sys.argv[1], float(sys.argv[2])

class Ev(msgspec.Struct, array_like=True, tag=True):
    pass
class BlockStored(Ev):
    block_hashes: list
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
class BlockRemoved(Ev):
    block_hashes: list
    medium: str | None
class AllBlocksCleared(Ev):
    pass
class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None

dec = msgspec.msgpack.Decoder(type=KVEventBatch)
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(ep)
print("ready", flush=True)
blocks, lags, first, last, seqs = 0, [], None, None, []
end = None
while True:
    if not sub.poll(200):
        if end is not None and time.time() > end:
            break
        continue
    _, seq, payload = sub.recv_multipart()
    now = time.time()
    b = dec.decode(payload)
    n = sum(len(e.block_hashes) for e in b.events if isinstance(e, BlockStored))
    if n:
        first = now if first is None else first
        last = now
        blocks += n
    lags.append((now - b.ts) * 1000)
    seqs.append(int.from_bytes(seq, "big"))
    if end is None:
        end = time.time() + seconds + 2
print(json.dumps({"blocks": blocks, "wall": (last or 0) - (first or 0), "lags": lags,
                  "gaps": sum(1 for a, c in zip(seqs, seqs[1:]) if c != a + 1)}), flush=True)
'''


def add_arguments(ap) -> None:
    ap.add_argument("--rate", type=float, default=10_000, help="writer blocks/s")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--poll-ms", type=float, default=5.0, help="the publisher's idle poll")
    ap.add_argument("--dir", default=None, help="where the pool goes (default /dev/shm)")


def publish(path: str, rate: float, seconds: float, poll_ms: float) -> dict:
    journal_bench.fresh(path)
    s = settings("tcp://127.0.0.1:0", {"poll_interval": poll_ms / 1000.0,
                                        "replay_endpoint": "none"})
    pub = KVEventsPublisher(s)
    pub.bind()
    sub = harness.python(SUBSCRIBER, pub.endpoint, seconds, stdout=subprocess.PIPE, text=True)
    w = None
    try:
        if sub.stdout.readline().strip() != "ready":
            raise RuntimeError("kv-events bench: the subscriber did not start")
        with cxlkv.open_pool(path) as pool:
            pub.start(lambda: pool, pool.lock)
            t0 = time.monotonic()
            while not pub.leader and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            time.sleep(0.3)                        # the subscription reaches the publisher
            w = harness.python(journal_bench.WRITER, path, rate, seconds,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("kv-events bench: the writer process did not start")
            pub.lags_ms.clear()
            c0 = time.process_time()
            w.stdin.write("go\n")
            w.stdin.flush()
            achieved = float(w.stdout.readline() or 0)
            w.wait(30)
            got = json.loads(sub.stdout.readline() or "{}")
            cpu = time.process_time() - c0
            pub.stop()
            rep = pub.report()
    finally:
        for p in (w, sub):
            if p is not None:
                harness.stop_process(p)
    lags = got.get("lags") or [0]
    events_s = got["blocks"] / got["wall"] if got.get("wall") else 0.0
    return {"target_blocks_per_s": rate, "writer_blocks_per_s": round(achieved),
            "blocks_received": got.get("blocks", 0), "events_per_s": round(events_s),
            "ratio_events_to_writer": round(events_s / achieved, 3) if achieved else None,
            "seq_gaps": got.get("gaps"), "batches": rep["batches"],
            "blocks_published": rep["stored"],
            # blocks sent under their pool key (no name) and without token ids
            "unnamed": rep["unnamed"], "no_tokens": rep["no_tokens"],
            "publish_lag_ms_p50": rep["lag_ms_p50"], "publish_lag_ms_p99": rep["lag_ms_p99"],
            "transport_lag_ms_p50": round(harness.pct(lags, 50), 3),
            "transport_lag_ms_p99": round(harness.pct(lags, 99), 3),
            "publisher_process_cpu_s": round(cpu, 2)}


def run(a, progress) -> dict:
    with harness.scratch("cxlkv-kv-events-bench-", a.dir) as d:
        path = os.path.join(d, "bench.pool")
        progress("baseline: a bare journal reader")
        base = journal_bench.follow(path, a.rate, a.seconds, a.poll_ms)
        progress("publisher")
        pub = publish(path, a.rate, a.seconds, a.poll_ms)
        p50 = pub["publish_lag_ms_p50"]
        return {"publisher": pub, "baseline_reader": base,
                "lag_ratio_p50": round(p50 / base["lag_ms_p50"], 2)
                if p50 is not None and base["lag_ms_p50"] else None}


def render(out: dict) -> str:
    p, b = out["publisher"], out["baseline_reader"]
    return "\n".join([
        f"writer at {p['target_blocks_per_s']:.0f} blocks/s (reached "
        f"{p['writer_blocks_per_s']}): subscriber decoded {p['events_per_s']} block events/s, "
        f"ratio {p['ratio_events_to_writer']} ({p['blocks_received']} blocks, "
        f"{p['batches']} batches, {p['seq_gaps']} seq gaps; {p['unnamed']} unnamed, "
        f"{p['no_tokens']} without token ids)",
        f"publish lag p50 {p['publish_lag_ms_p50']} ms p99 {p['publish_lag_ms_p99']} ms; "
        f"transport p50 {p['transport_lag_ms_p50']} ms p99 {p['transport_lag_ms_p99']} ms",
        f"baseline, same run: bare journal reader {b['records_per_s']} records/s, lag p50 "
        f"{b['lag_ms_p50']} ms p99 {b['lag_ms_p99']} ms; publisher/reader p50 lag ratio "
        f"{out['lag_ratio_p50']}"])


def ok(out: dict) -> bool:
    """Every block the publisher announced reached the subscriber, without a
    gap, named by its hash and with its token ids."""
    p = out["publisher"]
    return p["blocks_received"] > 0 and p["seq_gaps"] == 0 \
        and p["blocks_received"] == p["blocks_published"] \
        and p["unnamed"] == 0 and p["no_tokens"] == 0
