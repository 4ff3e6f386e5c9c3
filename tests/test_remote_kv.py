"""The cross-rack tier end to end: two pools stand in for two racks and a
real Redis Cluster on loopback for the store the racks already run.  A
prefix stored in rack A's pool is pushed (write-behind, version-checked) and
matched and loaded bit-exact by a node of rack B (read-through, published
into B's pool); salted tenants need the racks' shared secret; a down cluster
costs a lookup at most its budget."""
from __future__ import annotations

import time

import numpy as np
import pytest

import cxlkv
from cxlkv.errors import UsageError
from cxlkv.kv.tiers import remote
from cxlkv.ops.init import init_pool
from cxlkv.remote import RemoteClient, RemoteConfig
from cxlkv.testing.data import pattern_bytes
from cxlkv.testing.redis import TestCluster, skip_reason

MiB = 1 << 20
BB = 16 * 1024
SKIP = skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def mkpool(path):
    init_pool(str(path), {"size": 32 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                          "lease_ms": 2000})
    return str(path)


def data(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n * BB, dtype=np.uint8).tobytes()


def drain(rc, timeout=30.0):
    assert rc.flush(timeout), rc.stats()


def test_a_prefix_stored_in_rack_a_is_loaded_bit_exact_in_rack_b(tmp_path, cluster):
    a, b = mkpool(tmp_path / "a.pool"), mkpool(tmp_path / "b.pool")
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t1-{time.monotonic_ns()}:")
    toks = list(range(16 * 8))
    blob = data(8, 1)
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        kva = pa.kv(model="llama/t", block_bytes=BB)
        assert kva.store(toks, blob) == 8
        push = remote.Pusher(pa, rca, ["llama/*"], policy="all")
        got = push.scan()
        assert got["queued"] == 8 and got["changed"] == 0, got
        drain(rca)
        assert rca.stats()["pushed"] == 8
        assert push.scan()["queued"] == 0              # nothing twice
    with cxlkv.open_pool(b) as pb:
        rcb = remote.enable(pb, cfg)
        try:
            plain = pb.kv(model="llama/t", block_bytes=BB)
            assert plain.match(toks) == 0              # not opted in: pool only
            kvb = pb.kv(model="llama/t", block_bytes=BB, remote_read=True, remote_budget_s=5.0)
            assert kvb.match(toks) == len(toks)
            assert rcb.stats()["hits"] == 8
            # published into rack B's pool: the next host of the rack hits locally
            assert plain.match(toks) == len(toks)
            out = bytearray(8 * BB)
            assert kvb.load_into(toks, out) == 8 and bytes(out) == blob
            assert rcb.stats()["lookups"] == 1         # the load did not ask again
            # a longer request: the pool's run, then the remote tier has nothing more
            assert kvb.match(toks + list(range(1000, 1016))) == len(toks)
        finally:
            remote.disable(pb)


def test_load_reads_through_and_partial_prefixes_chain(tmp_path, cluster):
    a, b = mkpool(tmp_path / "a.pool"), mkpool(tmp_path / "b.pool")
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t2-{time.monotonic_ns()}:")
    toks = list(range(16 * 6))
    blob = data(6, 2)
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        pa.kv(model="m", block_bytes=BB).store(toks, blob)
        remote.Pusher(pa, rca, "m", policy="all").scan()
        drain(rca)
    with cxlkv.open_pool(b) as pb:
        remote.enable(pb, cfg)
        try:
            kvb = pb.kv(model="m", block_bytes=BB, remote_read=True, remote_budget_s=5.0)
            # rack B already holds the first two blocks; the rest come from the cluster
            kvb.store(toks[:32], blob[:2 * BB])
            with kvb.load(toks) as views:
                assert b"".join(bytes(v) for v in views) == blob
            assert remote.client_of(pb).stats()["hits"] == 4
        finally:
            remote.disable(pb)


def test_salted_tenants_share_only_with_the_racks_secret(tmp_path, cluster, cli):
    a, b, c = (mkpool(tmp_path / f"{n}.pool") for n in "abc")
    f = tmp_path / "secret"
    assert cli("kv", "secret", "--pool", a, "--export", f).code == 0
    assert cli("kv", "secret", "--pool", b, "--import", f).code == 0
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t3-{time.monotonic_ns()}:")
    toks = list(range(16 * 3))
    blob = data(3, 3)
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        pa.kv(model="m", block_bytes=BB, salt="alice").store(toks, blob)
        remote.Pusher(pa, rca, "m", policy="all").scan()
        drain(rca)
    for path, want in ((b, len(toks)), (c, 0)):
        with cxlkv.open_pool(path) as p:
            remote.enable(p, cfg)
            try:
                kv = p.kv(model="m", block_bytes=BB, salt="alice", remote_read=True,
                          remote_budget_s=5.0)
                assert kv.match(toks) == want, path
                assert p.kv(model="m", block_bytes=BB, salt="bob", remote_read=True,
                            remote_budget_s=5.0).match(toks) == 0
            finally:
                remote.disable(p)


def test_the_reused_policy_pushes_blocks_loaded_after_they_were_seen(tmp_path, cluster):
    a = mkpool(tmp_path / "a.pool")
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t4-{time.monotonic_ns()}:")
    hot_toks, cold_toks = list(range(32)), list(range(500, 532))
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        kv = pa.kv(model="m", block_bytes=BB)
        kv.store(hot_toks, data(2, 4))
        kv.store(cold_toks, data(2, 5))
        push = remote.Pusher(pa, rca, ["m"], policy="reused")
        assert push.scan()["queued"] == 0              # first sight: nothing reused yet
        kv.load_into(hot_toks, bytearray(2 * BB))
        got = push.scan()
        assert got["queued"] == 2, got
        drain(rca)
        assert rca.exists(kv._digest, list(kv._keys(hot_toks)), 5.0) == [True, True]
        assert rca.exists(kv._digest, list(kv._keys(cold_toks)), 5.0) == [False, False]


def test_a_block_that_changes_while_copied_is_not_pushed(tmp_path, cluster, monkeypatch):
    a = mkpool(tmp_path / "a.pool")
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t5-{time.monotonic_ns()}:")
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        kv = pa.kv(model="m", block_bytes=BB)
        kv.store(list(range(16)), data(1, 6))
        push = remote.Pusher(pa, rca, ["m"], policy="all")
        real = push.read_block

        def read_then_evict(off, n):
            out = real(off, n)
            with pa.lock():                            # evicted under the copy
                kv.area.evict(need_bytes=1 << 40)
            return out

        monkeypatch.setattr(push, "read_block", read_then_evict)
        got = push.scan()
        assert got["changed"] == 1 and got["queued"] == 0, got


def test_a_down_cluster_costs_a_lookup_at_most_its_budget(tmp_path):
    b = mkpool(tmp_path / "b.pool")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                          # nothing listens there
    cfg = RemoteConfig(nodes=(f"127.0.0.1:{port}",), timeout_s=0.5)
    with cxlkv.open_pool(b) as pb:
        try:
            remote.enable(pb, cfg)
        except Exception as e:                         # a client may refuse at once
            pytest.fail(f"enable raised {e!r}: the serving path must not fail")
        try:
            kv = pb.kv(model="m", block_bytes=BB, remote_read=True, remote_budget_s=0.2)
            toks = list(range(64))
            t0 = time.monotonic()
            assert kv.match(toks) == 0
            assert kv.load_into(toks, bytearray(4 * BB)) == 0
            spent = time.monotonic() - t0
            assert spent < 2 * 0.2 + 0.5, spent
            kv.store(toks, data(4, 7))                 # the pool keeps working
            assert kv.match(toks) == len(toks)
        finally:
            remote.disable(pb)


def test_remote_read_needs_the_tier_and_sane_budgets(tmp_path):
    b = mkpool(tmp_path / "b.pool")
    with cxlkv.open_pool(b) as pb:
        with pytest.raises(UsageError, match="remote tier"):
            pb.kv(model="m", block_bytes=BB, remote_read=True)
        with pytest.raises(UsageError):
            pb.kv(model="m", block_bytes=BB, remote_read="yes")
        for bad in (-1, 61, True, "1"):
            with pytest.raises(UsageError):
                pb.kv(model="m", block_bytes=BB, remote_budget_s=bad)
        with pytest.raises(UsageError):
            remote.Pusher(pb, None, ["m"], policy="sometimes")


def test_a_master_killed_mid_run_loses_no_replicated_block(tmp_path):
    """Rack A stores and pushes (WAIT 1) while rack B reads through; a master
    is killed -9 in the middle.  Rack B's lookups never wait past their
    budget, and after the replica took over every block the cluster had
    confirmed on a replica is matched and loaded bit-exact in rack B."""
    import threading

    a, b = mkpool(tmp_path / "a.pool"), mkpool(tmp_path / "b.pool")
    with TestCluster(masters=3, replicas=1) as c:
        cfg = RemoteConfig(nodes=tuple(c.addrs), wait_replicas=1, timeout_s=1.0)
        acked: set[bytes] = set()
        stored: list[list[int]] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def on_written(key, replicated):
            if replicated:
                acked.add(bytes(key))

        def rack_a(pa, rca):
            try:
                kv = pa.kv(model="m", block_bytes=BB)
                push = remote.Pusher(pa, rca, ["m"], policy="all")
                i = 0
                while not stop.is_set():
                    toks = [7_000_000 + i * 100 + j for j in range(32)]
                    kv.store(toks, pattern_bytes(kv, toks))
                    stored.append(toks)
                    push.scan()
                    i += 1
            except BaseException as e:               # noqa: BLE001 - reported below
                errors.append(e)

        budget, worst = 0.2, 0.0
        with cxlkv.open_pool(a) as pa, RemoteClient(cfg, on_written=on_written) as rca, \
                cxlkv.open_pool(b) as pb:
            remote.enable(pb, RemoteConfig(nodes=tuple(c.addrs), timeout_s=1.0))
            try:
                kvb = pb.kv(model="m", block_bytes=BB, remote_read=True, remote_budget_s=budget)
                t = threading.Thread(target=rack_a, args=(pa, rca), daemon=True)
                t.start()

                def lookups(until):
                    nonlocal worst
                    while not until():
                        if stored:
                            t0 = time.monotonic()
                            kvb.match(stored[len(stored) // 2])
                            worst = max(worst, time.monotonic() - t0)

                deadline = time.monotonic() + 60
                lookups(lambda: len(acked) >= 40 or time.monotonic() > deadline)
                assert len(acked) >= 40, (errors, len(stored), rca.stats())
                victim = c.master_of_key(remote.client_of(pb)._name(kvb._digest, next(iter(acked))))
                c.kill(victim)
                promoted = []
                th = threading.Thread(target=lambda: promoted.append(c.wait_failover(victim)))
                th.start()
                lookups(lambda: not th.is_alive())
                th.join()
                stop.set()
                t.join(60)
                assert not errors, errors
                assert rca.flush(30)
                assert worst < budget + 0.5, worst        # the serving path never blocked
                # every block confirmed on a replica is in the cluster and comes
                # through to rack B bit-exact
                kva = pa.kv(model="m", block_bytes=BB)
                keyed = {}
                for toks in stored:
                    for j, k in enumerate(kva._keys(toks)):
                        keyed[bytes(k)] = (toks, j)
                replicated = [keyed[k] for k in acked if k in keyed]
                assert len(replicated) == len(acked)
                # rack B's client backs off after errors: read with a fresh one
                remote.disable(pb)
                remote.enable(pb, RemoteConfig(nodes=tuple(c.addrs)))
                kvb_slow = pb.kv(model="m", block_bytes=BB, remote_read=True,
                                 remote_budget_s=10.0)
                by_seq: dict[tuple, set] = {}
                for tk, j in replicated:
                    by_seq.setdefault(tuple(tk), set()).add(j)
                checked = 0
                for toks, js in by_seq.items():
                    if 0 not in js:
                        continue                          # its first block was not confirmed
                    toks = list(toks)
                    n = kvb_slow.match(toks) // 16
                    assert n >= (2 if 1 in js else 1), (toks[0], n, js)
                    out = bytearray(n * BB)
                    assert kvb_slow.load_into(toks, out) == n
                    assert bytes(out) == pattern_bytes(kvb_slow, toks)[:n * BB]
                    checked += 1
                assert checked >= 20
                fresh = RemoteClient(RemoteConfig(nodes=tuple(c.addrs)))
                try:
                    got = fresh.exists(kvb._digest, list(acked), 10.0)
                finally:
                    fresh.close()
                assert all(got), f"{got.count(False)} of {len(got)} replicated blocks lost"
            finally:
                stop.set()
                remote.disable(pb)


def test_serving_processes_export_remote_and_hot_metrics(tmp_path, cluster):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cxlkv.kv.tiers import hot

    a, b = mkpool(tmp_path / "a.pool"), mkpool(tmp_path / "b.pool")
    cfg = RemoteConfig(nodes=tuple(cluster.addrs), prefix=f"t6-{time.monotonic_ns()}:")
    toks = list(range(16 * 4))
    with cxlkv.open_pool(a) as pa, RemoteClient(cfg) as rca:
        pa.kv(model="m", block_bytes=BB).store(toks, data(4, 8))
        remote.Pusher(pa, rca, "m", policy="all").scan()
        drain(rca)
    with cxlkv.open_pool(b) as pb:
        remote.enable(pb, cfg)
        try:
            reg = CollectorRegistry()
            reg.register(remote.collector(pb))
            reg.register(hot.collector(pb))
            kv = pb.kv(model="m", block_bytes=BB, remote_read=True, remote_budget_s=5.0,
                       hot_bytes=1 << 20)
            assert kv.match(toks) == len(toks)
            kv.load_into(toks, bytearray(4 * BB))
            kv.load_into(toks, bytearray(4 * BB))
            got = {s.name: s.value for f in
                   text_string_to_metric_families(generate_latest(reg).decode())
                   for s in f.samples}
        finally:
            remote.disable(pb)
    assert got["cxlkv_remote_hit_blocks_total"] == 4
    assert got["cxlkv_remote_promoted_blocks_total"] == 4
    assert got["cxlkv_remote_hit_bytes_total"] == 4 * BB
    assert got["cxlkv_hot_hit_blocks_total"] == 4 and got["cxlkv_hot_blocks"] == 4


def test_serve_pushes_behind_and_rack_b_reads_through(tmp_path, cluster):
    """`cxlkv serve --remote-push` in rack A pushes what a serving process
    stores; a serving process of rack B loads it bit-exact; the agent's
    metrics count it; a config [remote] table and an unreachable cluster."""
    from test_serve import Serve, sample, wait_for

    a, b = mkpool(tmp_path / "a.pool"), mkpool(tmp_path / "b.pool")
    prefix = f"t7-{time.monotonic_ns()}:"
    conf = tmp_path / "serve.toml"
    conf.write_text("remote-push = ['hf/*']\nremote-push-policy = 'all'\n"
                    "remote-push-interval = 0.1\n"
                    f"[remote]\nnodes = {list(cluster.addrs)!r}\nprefix = '{prefix}'\n")
    s = Serve(a, "--config", str(conf))
    try:
        toks = list(range(16 * 5))
        blob = data(5, 9)
        with cxlkv.open_pool(a) as pa:
            pa.kv(model="hf/tiny", block_bytes=BB).store(toks, blob)
            pa.kv(model="other", block_bytes=BB).store(toks, blob)     # not pushed

            def pushed():
                m = s.metrics()
                return m if sample(m, "cxlkv_remote_pushed_blocks_total") == 5 else None

            m = wait_for(pushed, what="the agent's pushes")
            assert sample(m, "cxlkv_remote_push_selected_blocks_total", outcome="queued") == 5
            assert sample(m, "cxlkv_remote_dropped_blocks_total", reason="unavailable") == 0
        with cxlkv.open_pool(b) as pb:
            remote.enable(pb, RemoteConfig(nodes=tuple(cluster.addrs), prefix=prefix))
            try:
                kv = pb.kv(model="hf/tiny", block_bytes=BB, remote_read=True,
                           remote_budget_s=5.0)
                out = bytearray(5 * BB)
                assert kv.load_into(toks, out) == 5 and bytes(out) == blob
                other = pb.kv(model="other", block_bytes=BB, remote_read=True,
                              remote_budget_s=5.0)
                assert other.match(toks) == 0
            finally:
                remote.disable(pb)
        code, body = s.get("/healthz")
        assert code == 200 and "remote" not in body, body
    finally:
        assert s.stop() == 0
    # a cluster nobody answers: the agent runs, drops (counted) and says WARNING
    import socket

    so = socket.socket()
    so.bind(("127.0.0.1", 0))
    port = so.getsockname()[1]
    so.close()
    s = Serve(a, "--remote-nodes", f"127.0.0.1:{port}", "--remote-push", "hf/*",
              "--remote-push-policy", "all", "--remote-push-interval", "1.5")
    try:
        with cxlkv.open_pool(a) as pa:
            pa.kv(model="hf/tiny", block_bytes=BB).store(list(range(16 * 9)), data(9, 10))

        def dropped():
            m = s.metrics()
            return m if (sample(m, "cxlkv_remote_dropped_blocks_total", reason="unavailable")
                         or 0) >= 1 else None

        wait_for(dropped, what="a drop counted")
        code, body = wait_for(lambda: (lambda r: r if "unreachable" in r[1] else None)(
            s.get("/healthz")), what="/healthz to say the cluster is unreachable")
        assert code == 200 and body.startswith("CXLKV WARNING"), body
        # and it stays so between passes (after the client's 1 s back-off)
        ticks = sample(s.metrics(), "cxlkv_agent_ticks_total")
        wait_for(lambda: sample(s.metrics(), "cxlkv_agent_ticks_total") >= ticks + 12,
                 what="1.2 s of ticks")
        code, body = s.get("/healthz")
        assert code == 200 and body.startswith("CXLKV WARNING"), body
        assert sample(s.metrics(), "cxlkv_remote_failing") == 1
        assert any(isinstance(d, dict) and "remote" in d.get("msg", "") and
                   d.get("level") == "warning" for d in s.drain())
    finally:
        assert s.stop() == 0


def test_serve_remote_usage_errors(cli, tmp_path):
    a = mkpool(tmp_path / "a.pool")
    r = cli("serve", "--pool", a, "--remote-push", "x")
    assert r.code == 2 and "--remote-nodes" in r.err
    conf = tmp_path / "bad.toml"
    conf.write_text("[remote]\nnodes = ['nohost']\n")
    r = cli("serve", "--pool", a, "--config", str(conf))
    assert r.code == 2 and "[remote]" in r.err
    conf.write_text("remote-push = 5\n")
    r = cli("serve", "--pool", a, "--config", str(conf))
    assert r.code == 2 and "remote-push" in r.err


def test_pushes_the_writer_dropped_are_pushed_again(tmp_path):
    """An outage that drops a queued batch: the next passes find the blocks
    missing in the cluster and push them again."""
    from cxlkv.remote.tier import Batch, RemoteTier, RemoteUnavailable

    class Flaky(RemoteTier):
        def __init__(self):
            self.store, self.puts = {}, 0

        async def get_many(self, keys):
            return Batch([self.store.get(k) for k in keys])

        async def exists_many(self, keys):
            return Batch([k in self.store for k in keys])

        async def put_many(self, items, ttl_s, *, wait_replicas=0, wait_timeout_s=1.0):
            self.puts += 1
            if self.puts == 1:
                raise RemoteUnavailable("connection reset (an outage)")
            out = [k not in self.store for k, _ in items]
            for k, v in items:
                self.store.setdefault(k, v)
            return Batch(out)

        async def set_names(self, h, m):
            pass

        async def close(self):
            pass

    tier = Flaky()
    a = mkpool(tmp_path / "a.pool")
    with RemoteClient(RemoteConfig(), tier=tier, retry_s=0.0) as rc, cxlkv.open_pool(a) as pa:
        pa.kv(model="m", block_bytes=BB).store(list(range(16 * 10)), data(10, 11))
        push = remote.Pusher(pa, rc, ["m"], policy="all")
        for _ in range(4):
            push.scan()
            assert rc.flush(10)
        assert len(tier.store) == 10, (len(tier.store), rc.stats())
        assert rc.stats()["dropped_unavailable"] >= 1
        assert push.scan()["queued"] == 0                   # and then nothing more
