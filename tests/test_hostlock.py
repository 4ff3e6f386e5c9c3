"""The host-local tier of the pool lock: processes of one host take
a futex lock in a per-host file first, so at most one of them competes for
the pool lock.  Mutual exclusion, dead and paused holders, timeouts, simulated
hosts, the file itself; in sync modes cas and manager."""
from __future__ import annotations

import os
import signal
import stat
import threading
import time

import pytest

import cxlkv
from cxlkv.ops.init import init_pool
from cxlkv.api import Pool
from cxlkv.state import hostlock
from cxlkv.state import locks
from cxlkv.state import nodes

from cxlkv.testing.checks import wait_for
from cxlkv.testing.damage import fake_node
from cxlkv.testing.nodes import NodeProc, incr_together, lock_manager
from cxlkv.testing.pools import data_word

LEASE_MS = 300


@pytest.fixture(params=["cas", "manager"])
def rack(request, pool_path):
    """A pool in one sync mode (with its lock manager in manager mode)."""
    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 8,
                          "sync": request.param, "lease_ms": LEASE_MS})
    mgr = lock_manager(pool_path) if request.param == "manager" else None
    yield pool_path
    if mgr is not None:
        mgr.terminate()
        mgr.wait(10)


@pytest.fixture
def cas_pool(pool_path):
    init_pool(pool_path, {"size": 8 << 20, "chunk_size": 64 << 10, "max_nodes": 8,
                          "lease_ms": LEASE_MS})
    return pool_path


def host_word(path: str) -> int:
    """The lock word of this host's lock file for the pool at `path`."""
    with Pool.open(path, writable=False) as p:
        uuid = str(p.sb.uuid)
    name, = [f for f in host_files() if f.startswith(uuid) and nodes.local_boot_id() in f]
    with open(os.path.join(hostlock.lock_dir(), name), "rb") as f:
        f.seek(hostlock.WORD)
        return int.from_bytes(f.read(8), "little")


def host_files() -> list[str]:
    return sorted(os.listdir(hostlock.lock_dir()))


def test_mutual_exclusion_of_processes_sharing_the_host_lock(rack):
    off = data_word(rack) + 64
    assert incr_together(rack, off, 1500) == [{"done": 1500}] * 4
    with Pool.open(rack) as pool:
        assert pool.mapping.load64(off) == 4 * 1500
    assert len(host_files()) == 1                   # one host: one lock file
    assert host_word(rack) & hostlock.HOLDER == 0          # and nobody holds it


def test_threads_of_one_process_keep_mutual_exclusion(rack):
    off = data_word(rack) + 128
    with cxlkv.open_pool(rack) as pool:
        m = pool.mapping

        def work():
            for _ in range(2000):
                with pool.lock():
                    m.store64(off, m.load64(off) + 1)

        ts = [threading.Thread(target=work) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert m.load64(off) == 8000
        assert pool.lock()._host.holder() & hostlock.HOLDER == 0


def test_the_file_is_per_pool_and_host_mode_0660(cas_pool):
    old = os.umask(0o077)                           # a strict umask does not narrow it
    try:
        with cxlkv.open_pool(cas_pool) as pool:
            with pool.lock():
                hl = pool.lock()._host
                assert hl.holder() & hostlock.HOLDER == hostlock.word_of(pool.node.slot,
                                                                         pool.node.epoch)
            path = hl.path
            name = os.path.basename(path)
            assert name.startswith(str(pool.sb.uuid)) and hl.node.observer.boot_id in name
            assert os.path.dirname(path) == os.environ[hostlock.ENV_DIR]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
            # this node's record: who holds what, for the waiters' checks
            assert hl.record(pool.node.slot) == (pool.node.epoch, *nodes.my_identity())
    finally:
        os.umask(old)


def test_no_usable_host_lock_file_falls_back_to_the_pool_lock(cas_pool, monkeypatch, tmp_path):
    (tmp_path / "f").write_text("")
    monkeypatch.setenv(hostlock.ENV_DIR, str(tmp_path / "f" / "sub"))   # cannot be made
    with cxlkv.open_pool(cas_pool) as pool:
        assert pool.lock()._host is None
        with pool.lock(timeout=5):
            pass


def test_simulated_hosts_get_separate_host_locks(rack, remote_env):
    far = NodeProc(env=remote_env())
    near = NodeProc()
    try:
        far.attach(rack)
        near.attach(rack)
        assert far.call(op="lock") == {"locked": True}
        # the holder is on another host: ours is free, we wait in tier 2
        with cxlkv.open_pool(rack) as pool:
            with pytest.raises(locks.LockTimeout) as e:
                with pool.lock(timeout=0.1):
                    pass
            assert "this host's lock" not in str(e.value)
            assert pool.lock()._host.holder() & hostlock.HOLDER == 0
            assert far.call(op="unlock") == {"unlocked": True}
            # a holder of this host: the wait is in the host lock, named
            assert near.call(op="lock") == {"locked": True}
            t0 = time.monotonic()
            with pytest.raises(locks.LockTimeout, match=f"this host's lock .* held by node "
                                                    f"{near.slot} "):
                with pool.lock(timeout=0.2):
                    pass
            assert 0.2 <= time.monotonic() - t0 < 2.0
            assert near.call(op="unlock") == {"unlocked": True}
            with pool.lock(timeout=5):
                pass
        assert len(host_files()) == 2
    finally:
        far.close()
        near.close()


def test_killed_holder_of_the_host_lock_is_taken_over(rack):
    holder, waiter = NodeProc(), NodeProc()
    try:
        holder.attach(rack)
        waiter.attach(rack)
        assert holder.call(op="lock") == {"locked": True}
        waiter.send(op="lock", timeout=30)
        holder.kill()                                   # dies holding both tiers
        assert waiter.reply() == {"locked": True}
        assert host_word(rack) & hostlock.HOLDER == hostlock.word_of(waiter.slot, waiter.epoch)
        assert waiter.call(op="unlock") == {"unlocked": True}
    finally:
        waiter.close()


def test_a_dead_process_holding_only_the_host_lock_is_taken_over(cas_pool):
    """Died after taking the host lock, before its pool-lock ticket: nothing
    in the pool names it, only the host lock file."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fake_node(cas_pool, 6, pid=dead.pid, start_time_ns=nodes.process_start_ns(os.getpid()),
              boot_id=nodes.local_boot_id())
    with cxlkv.open_pool(cas_pool, heartbeat=False) as pool:
        hl = pool.lock()._host
        epoch = nodes.read_slot(pool, 6).epoch
        off = hostlock.RECORDS + 6 * hostlock.RECORD_SIZE
        for o, v in ((8, dead.pid), (16, 1), (0, epoch)):
            hl.m.store64(off + o, v)
        hl.m.store64(hostlock.WORD, hostlock.word_of(6, epoch))
        t0 = time.monotonic()
        with pool.lock(timeout=10):
            assert hl.holder() & hostlock.HOLDER == hl.mine
        assert time.monotonic() - t0 < LEASE_MS / 1000      # at once, not after a lease


def test_a_live_holder_is_never_taken_over(cas_pool):
    holder = NodeProc()
    try:
        holder.attach(cas_pool)
        assert holder.call(op="lock") == {"locked": True}
        with cxlkv.open_pool(cas_pool) as pool:
            with pytest.raises(locks.LockTimeout, match="this host's lock"):
                with pool.lock(timeout=3 * LEASE_MS / 1000):
                    pass
            assert host_word(cas_pool) & hostlock.HOLDER == hostlock.word_of(holder.slot,
                                                                             holder.epoch)
            assert holder.call(op="unlock") == {"unlocked": True}
    finally:
        holder.close()


def test_paused_holder_is_fenced_taken_over_and_told_when_it_resumes(rack, remote_env):
    """Holder and waiter share a (simulated) host and its host lock; this
    process is another host, whose reaper (cas) or the lock manager fences
    the paused holder after its lease.  The waiter then takes the host lock
    over; the holder, resumed, must not free it and learns it lost the lock."""
    env = remote_env()
    holder, waiter, third = NodeProc(env=env), NodeProc(env=env), NodeProc(env=env)
    try:
        for p in (holder, waiter, third):
            p.attach(rack)
        with cxlkv.open_pool(rack) as pool:         # the reaper, on another host
            pool.node.interval = 0.02
            assert holder.call(op="lock") == {"locked": True}
            os.kill(holder.p.pid, signal.SIGSTOP)
            try:
                waiter.send(op="lock", timeout=30)
                assert waiter.reply() == {"locked": True}
                assert nodes.read_slot(pool, holder.slot).state in ("fenced", "free")
            finally:
                os.kill(holder.p.pid, signal.SIGCONT)
            r = holder.call(op="unlock")
            assert r.get("error") in ("LockLost", "NodeFenced"), r
            # the late release left the new holder's host lock alone
            r = third.call(op="lock", timeout=0.2)
            assert r.get("error") == "LockTimeout", r
            assert f"held by node {waiter.slot} " in r["message"], r
            assert waiter.call(op="unlock") == {"unlocked": True}
            assert third.call(op="lock", timeout=10) == {"locked": True}
            assert third.call(op="unlock") == {"unlocked": True}
            with pool.lock(timeout=10):
                pass
    finally:
        for p in (holder, waiter, third):
            p.close()


def test_release_after_a_takeover_writes_nothing(cas_pool):
    with cxlkv.open_pool(cas_pool, heartbeat=False) as pool:
        hl = pool.lock()._host
        assert hl.acquire(None)
        other = hostlock.word_of(5, 9) | hostlock.WAITERS
        assert hl.m.cas64(hostlock.WORD, hl.holder(), other) != 0      # taken over
        assert hl.release() is False
        assert hl.holder() == other
        hl.m.store64(hostlock.WORD, 0)


def test_timeouts_are_honoured_across_both_tiers(rack):
    holder = NodeProc()
    try:
        holder.attach(rack)
        assert holder.call(op="lock") == {"locked": True}
        with cxlkv.open_pool(rack) as pool:
            for timeout in (0.0, 0.05, 0.3):
                t0 = time.monotonic()
                with pytest.raises(locks.LockTimeout, match=f"node {holder.slot} "):
                    with pool.lock(timeout=timeout):
                        pass
                assert timeout <= time.monotonic() - t0 < timeout + 1.0
            assert holder.call(op="unlock") == {"unlocked": True}
            with pool.lock(timeout=5):
                pass
    finally:
        holder.close()


def test_waiters_sleep_rather_than_spin(cas_pool):
    """A waiter on a held host lock sleeps in the kernel: it burns little CPU."""
    import psutil

    holder, waiter = NodeProc(), NodeProc()
    try:
        holder.attach(cas_pool)
        waiter.attach(cas_pool)
        assert holder.call(op="lock") == {"locked": True}
        waiter.send(op="lock", timeout=1.0)
        proc = psutil.Process(waiter.p.pid)
        c0 = sum(proc.cpu_times()[:2])
        r = waiter.reply()
        used = sum(proc.cpu_times()[:2]) - c0
        assert r.get("error") == "LockTimeout", r
        assert used < 0.5, f"the waiter used {used:.2f} s of CPU in 1 s"
        assert holder.call(op="unlock") == {"unlocked": True}
    finally:
        holder.close()
        waiter.close()


def test_fenced_waiter_stops_waiting(cas_pool):
    holder = NodeProc()
    try:
        holder.attach(cas_pool)
        assert holder.call(op="lock") == {"locked": True}
        with cxlkv.open_pool(cas_pool, heartbeat=False) as pool:
            errors = []

            def take():
                try:
                    with pool.lock(timeout=20):
                        pass
                except Exception as e:      # noqa: BLE001 - the test looks at it
                    errors.append(e)

            t = threading.Thread(target=take)
            t.start()
            wait_for(lambda: pool.lock()._host.holder() & hostlock.WAITERS, what="a waiter")
            with Pool.open(cas_pool) as other:      # another party fences us
                nodes.fence(other, pool.node.slot, pool.node.control)
            t.join(10)
            assert not t.is_alive() and isinstance(errors[0], nodes.NodeFenced), errors
        assert holder.call(op="unlock") == {"unlocked": True}
    finally:
        holder.close()
