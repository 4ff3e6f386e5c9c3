"""The remote tier's fast path (cxlkv.remote.fastpath, the default: the client's
GETs and SETs with fast = true) against a real Redis Cluster on loopback: the same
verification as the redis-py path (a corrupt value, a value of another
namespace or another tenant's block is a miss, never a wrong block);
lookups pipelined in windows sized by bytes come back whole and in order,
into value buffers reused only once nothing refers to them;
the writer's batches are sized by bytes; AUTH; no exception for a cluster
that refuses; a call cut by any exception never hands its connections (and
their unread answers) to the next call.  Skipped with the reason when
redis-server is missing (the fake-server test runs without it)."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest
import xxhash

from cxlkv.remote import Batch, RemoteClient, RemoteConfig, RemoteTier, key_name, value
from cxlkv.remote import fastpath
from cxlkv.remote.fastpath import FastCluster, command
from cxlkv.testing.checks import wait_for
from cxlkv.testing.data import random_blocks
from cxlkv.testing.redis import TestCluster, skip_reason

KiB = 1 << 10
SKIP = skip_reason()
NS = xxhash.xxh3_128_digest(b"cxlkv-namespace\0fast-model")
OTHER_NS = xxhash.xxh3_128_digest(b"cxlkv-namespace\0another-model")
needs_redis = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def cfg_of(c, **kw) -> RemoteConfig:
    return RemoteConfig(nodes=tuple(c.addrs), ttl_s=600, fast=True, **kw)


def raw_set(c, name: bytes, val: bytes) -> None:
    c.client(c.master_of_key(name)).set(name, val)


def test_command_encoding():
    assert command(b"GET", "k", 12) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$2\r\n12\r\n"


@needs_redis
def test_value_buffers_are_reused_only_once_nothing_refers_to_them(cluster):
    size = 32 * KiB
    keys, data = random_blocks(24, size, seed=5)
    with RemoteClient(cfg_of(cluster)) as rc:
        for k, d in zip(keys, data):
            assert rc.push(k, NS, d)
        assert rc.flush(30)
        a, b, c = keys[:8], keys[8:16], keys[16:]
        held = rc.lookup(NS, a, size, budget_s=10.0)
        held_bufs = {id(g.obj) for g in held}
        assert len(held_bufs) == 8
        got = rc.lookup(NS, b, size, budget_s=10.0)     # a's values are still referred to
        assert [bytes(g) for g in got] == data[8:16]
        assert not {id(g.obj) for g in got} & held_bufs
        assert [bytes(g) for g in held] == data[:8]      # untouched by b's lookup
        b_bufs = {id(g.obj) for g in got}
        del got                                         # b's values dropped: reused for c
        got = rc.lookup(NS, c, size, budget_s=10.0)
        assert [bytes(g) for g in got] == data[16:]
        assert {id(g.obj) for g in got} == b_bufs
        assert [bytes(g) for g in held] == data[:8]
        # a view kept of one value (a numpy array over it) keeps that buffer out
        arr = np.frombuffer(got[0], dtype=np.uint8)
        kept = id(got[0].obj)
        del got
        got = rc.lookup(NS, b, size, budget_s=10.0)
        assert kept not in {id(g.obj) for g in got}
        assert arr.tobytes() == data[16] and [bytes(g) for g in got] == data[8:16]


@needs_redis
def test_lookups_in_windows_sized_by_bytes_come_back_whole_and_in_order(cluster):
    size = 16 * KiB
    keys, data = random_blocks(40, size, seed=1)
    # chunk_bytes fits 3 values: each master's pipeline goes in windows of 3
    with RemoteClient(cfg_of(cluster), chunk_bytes=3 * (size + value.HEADER_SIZE)) as rc:
        assert rc.fast is not None
        for k, d in zip(keys, data):
            assert rc.push(k, NS, d)
        assert rc.flush(30)
        per_master: dict = {}
        for k in keys:
            m = cluster.master_of_key(key_name("cxlkv:", NS, k))
            per_master[m] = per_master.get(m, 0) + 1
        before = rc.fast.windows
        got = rc.lookup(NS, keys, size, budget_s=10.0)
        assert [bytes(g) for g in got] == data
        assert rc.fast.windows - before == sum(-(-n // 3) for n in per_master.values())
        # absent keys between present ones keep their places
        absent = [os.urandom(16) for _ in range(3)]
        mixed = [absent[0], keys[5], absent[1], keys[6], absent[2]]
        got = rc.lookup(NS, mixed, size, budget_s=10.0)
        assert got[0] is None and got[2] is None and got[4] is None
        assert bytes(got[1]) == data[5] and bytes(got[3]) == data[6]
        st = rc.stats()
        assert st["errors"] == 0 and st["timeouts"] == 0 and st["corrupt"] == 0


@needs_redis
def test_corrupt_or_foreign_values_are_misses_never_wrong_blocks(cluster):
    size = 8 * KiB
    keys, data = random_blocks(6, size, seed=2)
    with RemoteClient(cfg_of(cluster)) as rc:
        assert rc.fast is not None
        names = [key_name("cxlkv:", NS, k) for k in keys]
        good = [value.encode(k, NS, d) for k, d in zip(keys, data)]
        payload_flip = bytearray(good[0])
        payload_flip[value.HEADER_SIZE + 100] ^= 0x01                # checksum mismatch
        header_flip = bytearray(good[1])
        header_flip[20] ^= 0x80                                       # header checksum
        bad = {
            0: bytes(payload_flip),
            1: bytes(header_flip),
            # another namespace's value of the same block key, under our name
            2: value.encode(keys[2], OTHER_NS, data[2]),
            # another tenant: its key for these tokens differs (the salt is in
            # the key), so its value names another block
            3: value.encode(os.urandom(16), NS, data[3]),
            4: b"not a cxlkv value at all",
        }
        for i, v in bad.items():
            raw_set(cluster, names[i], v)
        raw_set(cluster, names[5], good[5])
        got = rc.lookup(NS, keys, size, budget_s=10.0)
        assert got[:5] == [None] * 5
        assert bytes(got[5]) == data[5]
        st = rc.stats()
        assert st["corrupt"] == 5 and st["hits"] == 1 and st["misses"] == 5
        # damaged values are deleted (read again and still damaged first)
        assert wait_for(lambda: rc.stats()["deleted"] == 5)


class Recorder:
    """A RemoteTier that records the writer's batches (sizes in value bytes)."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.store: dict = {}

    async def put_many(self, items, ttl_s, *, wait_replicas=0, wait_timeout_s=1.0):
        await self.gate.wait()
        self.batches.append([len(v) for _, v in items])
        for k, v in items:
            self.store[k] = v
        return Batch([True] * len(items))

    async def get_many(self, keys):
        return Batch([self.store.get(k) for k in keys])

    async def exists_many(self, keys):
        return Batch([k in self.store for k in keys])

    async def set_names(self, hash_key, mapping):
        pass

    async def close(self):
        pass


RemoteTier.register(Recorder)


def test_writer_batches_are_sized_by_bytes():
    sizes = [1000, 3000, 500, 9000, 200, 200, 200, 4000, 50]
    limit = 4000 + 2 * value.HEADER_SIZE
    rec = Recorder()
    cfg = RemoteConfig(nodes=("127.0.0.1:1",))
    with RemoteClient(cfg, tier=rec, batch_bytes=limit) as rc:
        assert rc.fast is None                      # a tier passed in: no fast path
        keys = [os.urandom(16) for _ in sizes]
        # the first batch is taken at once (and held at the gate): the rest queue
        assert rc.push(keys[0], NS, os.urandom(sizes[0]))
        for k, n in zip(keys[1:], sizes[1:]):
            assert rc.push(k, NS, os.urandom(n))
        rc.loop.call_soon_threadsafe(rec.gate.set)
        assert rc.flush(30)
    got = [n - value.HEADER_SIZE for b in rec.batches for n in b]
    assert got == sizes                             # every block, in push order
    full = [n + value.HEADER_SIZE for n in sizes]
    pos = 0
    for b in rec.batches:
        pos += len(b)
        # within the limit unless one block alone is larger; and greedy: the
        # next block would not have fitted
        assert sum(b) <= limit or len(b) == 1
        if pos < len(full) and b is not rec.batches[0]:
            assert sum(b) + full[pos] > limit


@needs_redis
def test_auth_and_a_wrong_password():
    with TestCluster(masters=3, password="s3cret-fast") as c:
        keys, data = random_blocks(8, 4 * KiB, seed=3)
        with RemoteClient(RemoteConfig(nodes=tuple(c.addrs), password="s3cret-fast", fast=True)) as rc:
            assert rc.fast is not None
            for k, d in zip(keys, data):
                rc.push(k, NS, d)
            assert rc.flush(30) and rc.stats()["pushed"] == 8
            assert [bytes(g) for g in rc.lookup(NS, keys, 4 * KiB, 10.0)] == data
        with RemoteClient(RemoteConfig(nodes=tuple(c.addrs), password="wrong", fast=True)) as rc:
            assert rc.lookup(NS, keys, 4 * KiB, 2.0) == [None] * 8
            st = rc.stats()
            assert st["errors"] == 1 and st["hits"] == 0
            assert "wrong" not in (st["last_error"] or "")


@needs_redis
def test_fast_cluster_put_and_get_directly(cluster):
    """The fast path on its own: NX answers, values sent as (header, payload)
    parts, a value larger than the read buffer, absent keys."""
    fc = FastCluster(cfg_of(cluster))
    try:
        big = os.urandom(300 * KiB)
        items = [(b"cxlkv-fast:a", (b"head", big)), (b"cxlkv-fast:b", b"small")]
        res, _, failed, err = fc.put_many(items, 60)
        assert res == [True, True] and failed == 0 and err is None
        res, _, _, _ = fc.put_many(items, 60)
        assert res == [False, False]                       # NX: present
        vals, timed_out, err, unavailable = fc.get_many(
            [b"cxlkv-fast:a", b"cxlkv-fast:none", b"cxlkv-fast:b"], time.monotonic() + 10)
        assert bytes(vals[0]) == b"head" + big and vals[1] is None and vals[2] == b"small"
        assert not timed_out and err is None and not unavailable
    finally:
        fc.close()


@needs_redis
def test_a_moved_slot_is_followed_and_the_table_refreshed(cluster):
    """A slot moved to another master after the fast path read the slot table:
    the MOVED answer is followed (the write lands on the new owner), and the
    next calls use the refreshed table."""
    from redis.crc import key_slot

    name = next(n for n in (f"cxlkv-fast:moved:{i}".encode() for i in range(1000))
                if cluster.client(cluster.master_of_key(n)).execute_command(
                    "CLUSTER", "COUNTKEYSINSLOT", key_slot(n)) == 0)
    slot = key_slot(name)
    owner = cluster.master_of_key(name)
    other = next(p for p in cluster.masters() if p != owner)
    fc = FastCluster(cfg_of(cluster))

    def assign(port):
        nid = cluster.node(port).node_id
        for p in (owner, other):
            cluster.client(p).execute_command("CLUSTER", "SETSLOT", slot, "NODE", nid)

    try:
        assert fc.get_many([name], time.monotonic() + 10)[0] == [None]   # table read
        assign(other)
        res, _, failed, err = fc.put_many([(name, b"moved-value")], 60)
        assert res == [True] and failed == 0
        assert cluster.client(other).get(name) == b"moved-value"
        vals, _, err, _ = fc.get_many([name], time.monotonic() + 10)
        assert vals == [bytearray(b"moved-value")] and err is None
    finally:
        fc.close()
        cluster.client(other).delete(name)
        assign(owner)


class FakeMaster:
    """A one-node "cluster" on loopback speaking just enough RESP2: CLUSTER
    SLOTS (itself, every slot), GET (the value b"v:" + name) and SET (+OK,
    the value kept in `sets`); a GET of b"bad" answers a bulk length no
    buffer can have.  Counts connections."""

    def __init__(self):
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.accepted = 0
        self.sets: dict = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s):
        f = s.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:n])
                if args[0].upper() == b"CLUSTER":
                    out = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" \
                        % self.port
                elif args[0].upper() == b"SET":
                    self.sets[args[1]] = args[2]
                    out = b"+OK\r\n"
                elif args[1] == b"bad":
                    out = b"$99999999999999999999\r\n"
                else:
                    v = b"v:" + args[1]
                    out = b"$%d\r\n%s\r\n" % (len(v), v)
                s.sendall(out)
        except OSError:
            return
        finally:
            s.close()

    def close(self):
        self.lsock.close()


def test_a_call_cut_by_any_exception_never_hands_its_connections_on():
    """A reply the parser cannot take (a bulk length over any buffer: an
    OverflowError, neither OSError nor ValueError) ends the call with the
    rest of its pipeline unread: its connections are closed, so the next
    call reads its own answer, not the previous call's."""
    srv = FakeMaster()
    fc = FastCluster(RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",)))
    try:
        with pytest.raises(OverflowError):
            fc.get_many([b"bad", b"k1"], time.monotonic() + 10)
        vals, timed_out, err, _ = fc.get_many([b"k2"], time.monotonic() + 10)
        assert vals == [bytearray(b"v:k2")] and not timed_out and err is None
        assert srv.accepted == 2                     # the cut connection was not reused
    finally:
        fc.close()
        srv.close()


def test_a_pipeline_ending_a_sendmsg_on_an_empty_value_is_sent_whole(monkeypatch):
    """SET of empty values (plain bytes: the command's head, the value, its
    tail - three buffers each) on one master: the second sendmsg of IOV_MAX
    buffers ends on an empty value.  Every write is answered; sendmsg is
    never asked to send nothing (it sends 0 bytes, and the pipeline spun on
    the empty buffer left pending, holding the writer forever)."""
    calls = []
    real = socket.socket.sendmsg

    def sendmsg(self, bufs, *a):
        sizes = [memoryview(b).nbytes for b in bufs]
        calls.append(sum(sizes))
        if len(calls) > 1000:
            raise AssertionError(f"sendmsg called {len(calls)} times; last sizes {sizes[-3:]}")
        return real(self, bufs, *a)

    srv = FakeMaster()
    fc = FastCluster(RemoteConfig(nodes=(f"127.0.0.1:{srv.port}",)))
    try:
        fc.get_many([b"k"], time.monotonic() + 10)          # the slot table, outside the count
        monkeypatch.setattr(socket.socket, "sendmsg", sendmsg)
        items = [(b"empty:%d" % i, b"") for i in range(700)]
        assert (2 * fastpath.IOV_MAX - 1) % 3 == 1           # the second sendmsg ends on a value
        res, _, failed, err = fc.put_many(items, 0, deadline=time.monotonic() + 10)
        assert res == [True] * 700 and failed == 0 and err is None
        assert srv.sets == {nm: b"" for nm, _ in items}
        assert 0 not in calls
    finally:
        fc.close()
        srv.close()


@needs_redis
def test_wait_connected_returns_once_the_background_connection_is_up(cluster):
    """The tier's connection (exists, names, INFO) is made in the background
    at start; wait_connected() returns when it is up - what a bench or a
    serving process waits for before its first timed call."""
    with RemoteClient(cfg_of(cluster)) as rc:
        assert rc.wait_connected(30.0)
        assert rc.tier._rc is not None                  # connected, not connecting
        assert rc.wait_connected(0.0)                   # and at once from then on


def test_wait_connected_without_a_background_connection_returns_at_once():
    """With a tier of the caller's (no fast path) nothing connects in the
    background: nothing to wait for."""
    class Quiet(RemoteTier):
        async def put_many(self, items, ttl_s, wait_replicas=0, wait_timeout_s=1.0):
            return Batch([True] * len(items))

        async def get_many(self, names, budget_s):
            return Batch([None] * len(names))

        async def exists_many(self, names, budget_s):
            return Batch([False] * len(names))

        async def used_memory(self):
            return 0

        async def close(self):
            pass

    with RemoteClient(RemoteConfig(nodes=("127.0.0.1:1",)), tier=Quiet()) as rc:
        assert rc.wait_connected(0.0)
