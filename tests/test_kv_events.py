"""`cxlkv serve --kv-events`: the pool's block events in vLLM's KV-events wire
format.  A subscriber written here from vLLM's documented format (msgspec
types, ZeroMQ SUB + the replay ROUTER) decodes every event; stores and
evictions made by two node processes are announced once each; a missed
range comes back through the replay socket; a journal overrun publishes
AllBlocksCleared and the whole state; of two agents only the leader
publishes, and the other takes over when it stops; bad addresses are usage
errors before anything attaches.  Loopback only."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

import cxlkv
from cxlkv.api import Pool
from cxlkv.daemons.agent import Agent
from cxlkv.daemons.config import AgentConfig
from cxlkv.daemons.kv_events import KVEventsPublisher, flagged_slots, settings
from cxlkv.daemons.service import make_logger
from cxlkv.errors import UsageError
from cxlkv.kv import journal
from cxlkv.ops.init import init_pool
from cxlkv.state import nodes as node_table
from cxlkv.testing.checks import wait_for

MiB = 1 << 20
BT, BB = 4, 4096                     # tokens and bytes per block


# -- vLLM's documented wire format, written here (vllm/distributed/kv_events.py) ----------
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


# the newer vLLM's format (0.33: events as maps in an array batch; BlockStored.lora_name
# required)
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A router's side: SUB on the endpoint, REQ on the replay endpoint; keeps
    the batches by seq and fills gaps through the replay socket."""

    def __init__(self, endpoint, replay, topic=b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_ep = replay
        self.batches: dict[int, KVEventBatch] = {}
        self.raw: dict[int, bytes] = {}
        self.replayed: list[int] = []

    def request_replay(self, start: int) -> list[int]:
        """Ask for every batch from `start` on.  A DEALER with the empty
        delimiter frame a REQ would add: the answer is several messages (each
        [empty, seq, payload], then [empty, -1, empty]), which a REQ socket
        would not take after the first."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_ep)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                assert req.poll(10_000), "no replay answer"
                empty, seq_b, payload = req.recv_multipart()
                assert empty == b""
                if int.from_bytes(seq_b, "big", signed=True) == -1:
                    assert payload == b""
                    return got
                seq = int.from_bytes(seq_b, "big")
                got.append(seq)
                self.keep(seq, payload)
                self.replayed.append(seq)
        finally:
            req.close()

    def keep(self, seq, payload):
        self.batches[seq] = DECODE.decode(payload)      # every event decodes
        self.raw[seq] = payload

    def pump(self, timeout_ms=50) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq_b, payload = self.sub.recv_multipart()
            assert len(seq_b) == 8
            self.keep(int.from_bytes(seq_b, "big"), payload)
            timeout_ms = 0

    def complete(self) -> bool:
        """Fill the gaps (and the start) through the replay socket."""
        top = max(self.batches, default=-1)
        missing = [s for s in range(top + 1) if s not in self.batches]
        if missing:
            self.request_replay(missing[0])
        return all(s in self.batches for s in range(top + 1))

    def events(self):
        return [e for s in sorted(self.batches) for e in self.batches[s].events]

    def state(self):
        """The blocks a router would believe the pool holds, and how often each
        was announced since the last AllBlocksCleared."""
        held: dict = {}
        for e in self.events():
            if isinstance(e, AllBlocksCleared):
                held = {}
            elif isinstance(e, BlockStored):
                for h in e.block_hashes:
                    held[h] = held.get(h, 0) + 1
            else:
                for h in e.block_hashes:
                    assert h in held, "removed a block never announced"
                    del held[h]
        return held

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


NODE = r'''
import json, sys
import numpy as np, cxlkv
path = sys.argv[1]
with cxlkv.open_pool(path) as pool:
    kv = pool.kv(model="events", block_tokens=%d, block_bytes=%d)
    print(json.dumps({"slot": pool.node.slot}), flush=True)
    for line in sys.stdin:                     # {"base": B, "n": N} stores; {"evict": 1} evicts
        cmd = json.loads(line)
        if "evict" in cmd:
            with pool.lock():
                evicted, _ = kv.area.evict(everything=True)
            print(json.dumps({"evicted": evicted}), flush=True)
            continue
        toks = np.arange(cmd["base"], cmd["base"] + cmd["n"] * %d, dtype=np.int64)
        kv.store(toks, bytes(cmd["n"] * %d))
        # what routers see: the blocks' names, their chain hashes
        print(json.dumps({"hashes": [h.hex() for h in kv.block_hashes(toks)]}), flush=True)
''' % (BT, BB, BT, BB)


class Node:
    """A node process that stays attached (its slot is not reused meanwhile)."""

    def __init__(self, path):
        self.p = subprocess.Popen([sys.executable, "-c", NODE, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.slot = self._reply()["slot"]

    def _reply(self):
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()
        return json.loads(line)

    def store(self, base, n):
        self.p.stdin.write(json.dumps({"base": base, "n": n}) + "\n")
        self.p.stdin.flush()
        return [bytes.fromhex(k) for k in self._reply()["hashes"]]

    def evict(self):
        self.p.stdin.write('{"evict": 1}\n')
        self.p.stdin.flush()
        return self._reply()["evicted"]

    def close(self):
        self.p.stdin.close()
        assert self.p.wait(30) == 0, self.p.stderr.read()
        self.p.stderr.close()
        self.p.stdout.close()


def node(path, base, n):
    """Store n blocks from a node process of their own; their hashes."""
    nd = Node(path)
    try:
        return {"hashes": nd.store(base, n), "slot": nd.slot}
    finally:
        nd.close()


@pytest.fixture
def epool(pool_path):
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 64 * 1024, "max_nodes": 8,
                          "lease_ms": 1000, "hash_slots": 1024})
    return pool_path


@pytest.fixture
def agents(epool):
    made = []

    def make(**kw):
        a = Agent(AgentConfig(pool=epool, interval=0.2, kv_events="tcp://127.0.0.1:0", **kw),
                  make_logger(True, io.StringIO()))
        a.start()
        made.append(a)
        return a

    yield make
    for a in made:
        a.shutdown()


def subscribe(agent):
    ev = agent.kv_events
    assert ev.endpoint.startswith("tcp://127.0.0.1:")
    assert ev.replay_endpoint.startswith("tcp://127.0.0.1:")
    return Subscriber(ev.endpoint, ev.replay_endpoint)


def until(sub, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sub.pump()
        if sub.complete() and pred():
            return
    raise AssertionError(f"timed out; events: {sub.events()[-5:]}")


def test_stores_and_evictions_of_two_nodes_are_announced_once(agents, epool):
    a = agents()
    wait_for(lambda: a.kv_events.leader, timeout=10)
    sub = subscribe(a)
    one, two = Node(epool), Node(epool)                # both attached throughout
    try:
        keys_one = one.store(0, 6)
        keys_two = two.store(10_000, 5)
        assert two.evict() == 11                         # node 2 evicts node 1's blocks too
        assert len({one.slot, two.slot, a.pool.node.slot}) == 3
        every = keys_one + keys_two
        until(sub, lambda: len({h for e in sub.events() if isinstance(e, BlockRemoved)
                                for h in e.block_hashes}) == 11)
        evs = sub.events()
        assert isinstance(evs[0], AllBlocksCleared)       # a new leader starts with the state
        assert sum(isinstance(e, AllBlocksCleared) for e in evs) == 1
        stored = [h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert sorted(stored) == sorted(every)            # once each, from both nodes
        assert sorted(removed) == sorted(every)
        assert sub.state() == {}
        tokens_of = {h: list(range(base + i * BT, base + (i + 1) * BT))
                     for base, hs in ((0, keys_one), (10_000, keys_two))
                     for i, h in enumerate(hs)}
        for e in evs:
            if isinstance(e, BlockStored):
                assert e.block_size == BT and e.medium == "cxl"
                assert e.token_ids == [t for h in e.block_hashes for t in tokens_of[h]]
                assert e.lora_id is None
            elif isinstance(e, BlockRemoved):
                assert e.medium == "cxl"
        # one chain: the first BlockStored of each node names no parent, the rest chain on
        for keys in (keys_one, keys_two):
            first = next(e for e in evs if isinstance(e, BlockStored)
                         and e.block_hashes[0] == keys[0])
            assert first.parent_block_hash is None
            assert first.block_hashes == keys             # consecutive stores: one event
        assert {b.data_parallel_rank for b in sub.batches.values()} == {0}
    finally:
        sub.close()
        one.close()
        two.close()


def test_blocks_are_announced_by_the_hashes_the_engine_keyed_them_with(agents, epool):
    """vLLM's block hashes (a sha256_cbor namespace, and hashes given as the
    vLLM connector gives them) come out as block_hashes and parent hashes, in
    stores, evictions and the resync of a new leader, with the blocks' token
    ids where the store gave them; a hash too long to keep goes out as the
    pool key, counted as unnamed."""
    a = agents()
    wait_for(lambda: a.kv_events.leader, timeout=10)
    sub = subscribe(a)
    try:
        with cxlkv.open_pool(epool) as pool:                 # another node, in this process
            kv = pool.kv(model="vllm-model", block_tokens=BT, block_bytes=BB,
                         hash="sha256_cbor", hash_seed="0")
            toks = list(range(3 * BT))
            assert kv.store(toks, bytes(3 * BB)) == 3
            vllm = kv.block_hashes(toks)                     # vLLM's own, for this seed
            assert {len(h) for h in vllm} == {32}
            given = [bytes([0xA0 + i]) * 32 for i in range(2)]
            given_toks = list(range(500, 500 + 2 * BT))
            assert kv.store_hashes(given, bytes(2 * BB), tokens=given_toks) == 2
            bare = [bytes([0xC0]) * 32]                       # no tokens given
            assert kv.store_hashes(bare, bytes(BB)) == 1
            long = [bytes([0xB0]) * 48]
            assert kv.store_hashes(long, bytes(BB)) == 1
            pool_key = bytes(kv.keys_for_hashes(long)[0])
            until(sub, lambda: set(vllm + given + bare + [pool_key]) <= set(sub.state()))
            stored = [e for e in sub.events() if isinstance(e, BlockStored)]
            chain = next(e for e in stored if e.block_hashes[0] == vllm[0])
            assert chain.block_hashes == vllm and chain.parent_block_hash is None
            assert chain.token_ids == toks
            ev = next(e for e in stored if e.block_hashes[0] == given[0])
            assert ev.block_hashes == given and ev.token_ids == given_toks
            assert next(e for e in stored if e.block_hashes[0] == bare[0]).token_ids == []
            # counted (a round that failed under load resends the state: at least)
            assert a.kv_events.stats["unnamed"] >= 1
            assert a.kv_events.stats["no_tokens"] >= 2           # bare and the 48-byte one
            with pool.lock():
                assert kv.area.evict(everything=True)[0] == 7
            until(sub, lambda: sub.state() == {})
            removed = {h for e in sub.events() if isinstance(e, BlockRemoved)
                       for h in e.block_hashes}
            assert removed == set(vllm + given + bare + [pool_key])
            assert kv.store(toks[:2 * BT], bytes(2 * BB)) == 2
            until(sub, lambda: set(vllm[:2]) <= set(sub.state()))
        b = agents()                                         # a new leader: its resync
        sub2 = subscribe(b)
        try:
            assert not b.kv_events.leader
            a.shutdown()
            wait_for(lambda: b.kv_events.leader, timeout=10)
            until(sub2, lambda: set(vllm[:2]) <= set(sub2.state()))
            evs = sub2.events()
            assert isinstance(evs[0], AllBlocksCleared)
            second = next(e for e in evs if isinstance(e, BlockStored)
                          and vllm[1] in e.block_hashes)
            i = second.block_hashes.index(vllm[1])
            assert (second.block_hashes[i - 1] if i else second.parent_block_hash) == vllm[0]
            assert second.token_ids[i * BT:(i + 1) * BT] == toks[BT:2 * BT]
        finally:
            sub2.close()
    finally:
        sub.close()


def test_a_missed_range_comes_back_through_the_replay_socket(agents, epool):
    a = agents()
    wait_for(lambda: a.kv_events.leader, timeout=10)
    sub = subscribe(a)
    try:
        with cxlkv.open_pool(epool) as pool:                 # another node, in this process
            kv = pool.kv(model="events", block_tokens=BT, block_bytes=BB)
            for i in range(4):                                 # one batch each
                kv.store(list(range(1000 * i, 1000 * i + 2 * BT)), bytes(2 * BB))
                until(sub, lambda: sum(isinstance(e, BlockStored)
                                       for e in sub.events()) > i)
        seqs = sorted(sub.raw)
        assert seqs == list(range(len(seqs))) and len(seqs) >= 5
        lost = {s: sub.raw.pop(s) for s in seqs[1:4]}      # a router that missed three
        for s in lost:
            del sub.batches[s]
        sub.replayed.clear()
        assert sub.complete()                                 # the gap is asked for
        assert sub.replayed[:3] == seqs[1:4]
        for s, payload in lost.items():
            assert sub.raw[s] == payload                        # the same bytes again
        # a start beyond what was published: only the end marker
        assert sub.request_replay(10_000) == []
    finally:
        sub.close()


def test_a_journal_overrun_publishes_all_blocks_cleared_and_the_state(agents, epool):
    # a publisher that polls every 10 s (or when a replay request wakes it)
    # falls a whole ring behind a node that stores more than the ring holds
    a = agents(kv_events_table={"poll_interval": 10})
    wait_for(lambda: a.kv_events.stats["resyncs"] == 1, timeout=10)     # its reader is set
    sub = subscribe(a)
    try:
        with Pool.open(epool) as p:
            ring = journal.report(p)["records_per_node"]
        mine = node(epool, 0, ring + 8)
        sub.request_replay(0)                                # wakes the publisher
        until(sub, lambda: len(sub.state()) >= ring + 8)
        evs = sub.events()
        clears = [i for i, e in enumerate(evs) if isinstance(e, AllBlocksCleared)]
        assert len(clears) == 2                          # the start, then the resync
        assert a.kv_events.stats["resync_overrun"] == 1
        after = {h for e in evs[clears[-1]:] if isinstance(e, BlockStored)
                 for h in e.block_hashes}
        assert set(mine["hashes"]) == after == set(sub.state())
    finally:
        sub.close()


def test_one_publisher_per_pool_and_a_takeover(agents, epool):
    a, b = agents(), agents()
    wait_for(lambda: a.kv_events.leader or b.kv_events.leader, timeout=10)
    wait_for(lambda: a.kv_events.stats["leader_changes"] + b.kv_events.stats["leader_changes"]
             >= 1 and len(flagged_slots(a.pool)) == 1, timeout=10)
    lead, other = (a, b) if a.kv_events.leader else (b, a)
    assert not other.kv_events.leader
    assert flagged_slots(lead.pool) == [lead.pool.node.slot]
    s_lead, s_other = subscribe(lead), subscribe(other)
    try:
        first = node(epool, 0, 3)
        until(s_lead, lambda: set(first["hashes"]) <= set(s_lead.state()))
        s_other.pump(200)
        assert s_other.batches == {}                   # the follower publishes nothing
        assert not other.kv_events.leader
        lead.shutdown()                                # gives the flag up; the other takes over
        wait_for(lambda: other.kv_events.leader, timeout=10)
        second = node(epool, 5000, 2)
        until(s_other, lambda: set(first["hashes"] + second["hashes"]) <= set(s_other.state()))
        assert isinstance(s_other.events()[0], AllBlocksCleared)
        assert flagged_slots(other.pool) == [other.pool.node.slot]
    finally:
        s_lead.close()
        s_other.close()


@pytest.mark.parametrize("addr", ["127.0.0.1:5557", "udp://127.0.0.1:5557",
                                  "tcp://127.0.0.1", "tcp://127.0.0.1:99999",
                                  "tcp://example.com:5557", "tcp://:5557"])
def test_bad_addresses_are_usage_errors_before_attaching(cli, epool, addr):
    r = cli("serve", "--pool", epool, "--kv-events", addr)
    assert r.code == 2, r.err
    assert "--kv-events" in r.err and "tcp://" in r.err and len(r.err.strip().splitlines()) == 1
    with Pool.open(epool, writable=False) as p:
        assert [n for n in node_table.read_nodes(p) if n.state != "free"] == []


def test_an_address_in_use_is_refused_before_attaching(cli, epool):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    try:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        r = cli("serve", "--pool", epool, "--kv-events", f"tcp://127.0.0.1:{port}")
        assert r.code == 1 and "cannot bind" in r.err
        with Pool.open(epool, writable=False) as p:
            assert [n for n in node_table.read_nodes(p) if n.state != "free"] == []
    finally:
        s.close(linger=0)
        ctx.term()


def test_kv_events_table_settings(tmp_path, cli, epool):
    s = settings(None, {"endpoint": "tcp://127.0.0.1:5557", "medium": "cxl-rack1",
                        "wire": "map", "replay_endpoint": "none"})
    assert (s.medium, s.wire, s.replay_endpoint) == ("cxl-rack1", "map", None)
    assert settings("tcp://127.0.0.1:7000", None).replay_endpoint == "tcp://127.0.0.1:7001"
    assert settings(None, None) is None
    for table in ({"endpoint": "tcp://127.0.0.1:1", "wire": "json"},
                  {"endpoint": "tcp://127.0.0.1:1", "buffer-steps": 0},
                  {"endpoint": "tcp://127.0.0.1:1", "colour": "red"},
                  {"medium": "cxl"}):
        with pytest.raises(UsageError):
            settings(None, table)
    conf = tmp_path / "serve.toml"
    conf.write_text(f'pool = "{epool}"\n[kv_events]\nendpoint = "tcp://127.0.0.1:1"\n'
                    'hashes = "sha1"\n')
    r = cli("serve", "--config", str(conf))
    assert r.code == 2 and "hashes" in r.err


def test_map_wire_int_hashes_and_a_dropped_namespace(epool):
    """wire "map" decodes with the newer vLLM's structs; hashes "int" are the
    names' last 8 bytes, big-endian (vLLM's maybe_convert_block_hash); `kv drop` (the journal says only "namespace cleared")
    publishes AllBlocksCleared and the state without that namespace."""

    pub = KVEventsPublisher(settings("tcp://127.0.0.1:0", {"wire": "map", "hashes": "int",
                                                            "topic": "kv"}))
    pub.bind()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    dec = msgspec.msgpack.Decoder(type=MapKVEventBatch)
    got = []

    def receive(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sub.poll(20):
                topic, _, payload = sub.recv_multipart()
                assert topic == b"kv"
                got.extend(dec.decode(payload).events)
                return

    def until(pred):
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, got[-5:]
            receive(0.05)

    try:
        with cxlkv.open_pool(epool) as pool:
            pub.start(lambda: pool, pool.lock)
            wait_for(lambda: pub.leader, timeout=10)
            keep = pool.kv(model="keep", block_tokens=BT, block_bytes=BB)
            gone = pool.kv(model="gone", block_tokens=BT, block_bytes=BB)
            # the subscription reaches the publisher some time after connect():
            # one-block stores until the first event arrives
            kept = []
            while not got:
                toks = list(range(len(kept) * BT, (len(kept) + 1) * BT))
                keep.store(toks, bytes(BB))
                kept += keep.block_hashes(toks)
                receive(0.2)
            want = [int.from_bytes(h[-8:], "big") for h in kept]   # vLLM's int conversion
            toks = list(range(3 * BT))
            gone.store(toks, bytes(3 * BB))
            gone_keys = {int.from_bytes(h[-8:], "big") for h in gone.block_hashes(toks)}
            until(lambda: gone_keys <= {h for e in got if isinstance(e, MapBlockStored)
                                        for h in e.block_hashes})
            n = len(got)
            gone.drop()
            until(lambda: any(isinstance(e, MapAllBlocksCleared) for e in got[n:])
                  and any(isinstance(e, MapBlockStored) for e in got[n:]))
            after = got[n:]
            i = next(i for i, e in enumerate(after) if isinstance(e, MapAllBlocksCleared))
            state = [h for e in after[i:] if isinstance(e, MapBlockStored)
                     for h in e.block_hashes]
            assert sorted(state) == sorted(want)              # only the kept namespace
            assert all(e.lora_name is None and e.medium == "cxl" for e in after
                       if isinstance(e, MapBlockStored))
            pub.stop()
    finally:
        sub.close(linger=0)
        ctx.term()


def test_a_killed_leader_is_replaced_with_a_resync(agents, epool):
    """kill -9 of the leading `cxlkv serve`: once its node is reaped, the
    other agent publishes, starting with AllBlocksCleared and the pool's
    blocks (those stored before the kill included)."""
    child = subprocess.Popen([sys.executable, "-m", "cxlkv", "serve", "--pool", epool,
                              "--interval", "0.2", "--log-json",
                              "--kv-events", "tcp://127.0.0.1:0"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        for line in child.stderr:                       # its log, until it leads
            if "this agent publishes" in json.loads(line)["msg"]:
                break
        else:
            raise AssertionError("the child agent never became the publisher")
        b = agents()
        with Pool.open(epool, writable=False) as p:
            assert len(flagged_slots(p)) == 1 and not b.kv_events.leader
        before = node(epool, 0, 3)
        sub = subscribe(b)
        try:
            child.kill()
            child.wait(30)
            wait_for(lambda: b.kv_events.leader, timeout=15)
            until(sub, lambda: set(before["hashes"]) <= set(sub.state()))
            assert isinstance(sub.events()[0], AllBlocksCleared)
            assert flagged_slots(b.pool) == [b.pool.node.slot]
        finally:
            sub.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        child.stderr.close()


def test_a_resync_announces_parents_before_children():
    import numpy as np

    from cxlkv.daemons.kv_events import parents_first

    rng = np.random.default_rng(7)
    n = 5000
    r = np.zeros(n, dtype=journal.CHANGE)
    r["key_lo"] = rng.integers(1, 2**63, n, dtype=np.uint64)
    r["key_hi"] = rng.integers(1, 2**63, n, dtype=np.uint64)
    starts = np.sort(rng.choice(np.arange(1, n), 300, replace=False))
    first = np.zeros(n, dtype=bool)
    first[0], first[starts] = True, True
    prev = np.arange(n) - 1                           # chains of random lengths
    r["parent_lo"] = np.where(first, 0, r["key_lo"][prev])
    r["parent_hi"] = np.where(first, 0, r["key_hi"][prev])
    r["parent_lo"][5] = 12345                         # a parent not in the table: a root
    shuffled = r[rng.permutation(n)]
    out = parents_first(shuffled)
    assert sorted(out["key_lo"].tolist()) == sorted(r["key_lo"].tolist())
    at = {k: i for i, k in enumerate(zip(out["key_lo"].tolist(), out["key_hi"].tolist()))}
    for k, p in zip(zip(out["key_lo"].tolist(), out["key_hi"].tolist()),
                    zip(out["parent_lo"].tolist(), out["parent_hi"].tolist())):
        if p in at:
            assert at[p] < at[k]
