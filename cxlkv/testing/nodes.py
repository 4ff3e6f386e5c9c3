"""A separate process attached to a pool as its own node, driven over a pipe.

Tests stand several of these in for several hosts.  `NodeProc` starts one
(`python -m cxlkv.testing.nodes`); each command is one JSON line on its
stdin, each reply one JSON line on its stdout.  Tests signal these
processes (SIGSTOP / SIGCONT / SIGKILL through `NodeProc.p`) to stand in
for stalled and dead hosts.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

import cxlkv
from cxlkv.api import Pool
from cxlkv.testing.data import pattern, verify


def main() -> None:
    """The node process: attach, lock, allocate, store and load as told, one
    JSON line per command on stdin, one JSON reply per line on stdout (a
    failed command answers {"error": class name, "message": ...}); "exit"
    closes the pool and ends it."""
    pool = None
    lock = None
    kv = None
    held = []
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "attach":
                pool = cxlkv.open_pool(cmd["path"])
                if cmd.get("interval"):
                    pool.node.interval = cmd["interval"]
                r = {"slot": pool.node.slot, "epoch": pool.node.epoch, "pid": os.getpid()}
            elif op == "lock":
                lock = pool.lock(timeout=cmd.get("timeout"))
                lock.__enter__()
                r = {"locked": True}
            elif op == "unlock":
                lk, lock = lock, None
                lk.__exit__(None, None, None)
                r = {"unlocked": True}
            elif op == "guard":
                lock.guard()
                r = {"guarded": True}
            elif op == "state":
                n = pool.node
                r = {"fenced": n.fenced, "acknowledged": n.acknowledged, "slot": n.slot}
            elif op == "incr":
                off, n = cmd["offset"], cmd["n"]
                m = pool.mapping
                for _ in range(n):
                    with pool.lock():
                        v = m.load64(off)          # a plain read-modify-write, guarded by the lock
                        m.store64(off, v + 1)
                r = {"done": n}
            elif op == "incr_nc":
                # the non-coherent discipline: invalidate before reading what others
                # wrote, flush what we wrote before releasing the lock
                off, n = cmd["offset"], cmd["n"]
                m = pool.mapping
                for _ in range(n):
                    with pool.lock():
                        m.invalidate(off, 8)
                        v = m.load64(off)
                        m.store64(off, v + 1)
                        m.flush(off, 8)
                r = {"done": n}
            elif op == "fair":
                ctr, log, n = cmd["counter"], cmd["log"], cmd["n"]
                m = pool.mapping
                me = pool.node.slot + 1
                print(json.dumps({"ready": True}), flush=True)
                while m.load64(cmd["go"]) == 0:        # start together
                    time.sleep(0.0005)
                for _ in range(n):
                    asked = m.load64(ctr)              # turns begun before this request
                    with pool.lock():
                        i = m.load64(ctr)
                        m.store64(log + 8 * i, me)     # who got the lock, in order
                        m.store64(cmd["waits"] + 8 * i, i - asked)  # turns others had meanwhile
                        m.store64(ctr, i + 1)
                        t = time.perf_counter() + cmd.get("hold", 0)
                        while time.perf_counter() < t:  # a critical section of some length
                            pass
                r = {"done": n}
            elif op == "free_all":
                pool.free_batch(cmd["offsets"], cmd.get("zero", True))
                r = {"freed": len(cmd["offsets"])}
            elif op == "churn":
                rng = random.Random(cmd["seed"])
                nb, kept, bad = cmd["nbytes"], [], 0
                tag = bytes([pool.node.slot + 1]) * nb
                for _ in range(cmd["rounds"]):
                    offs = pool.alloc_batch(nb, rng.randint(1, 40))
                    for o in offs.tolist():
                        pool.mapping.write(o, tag)
                    kept += offs.tolist()
                    rng.shuffle(kept)
                    for o in kept[cmd["keep"]:]:
                        bad += pool.mapping.read(o, nb) != tag
                    pool.free_batch(kept[cmd["keep"]:])
                    kept = kept[:cmd["keep"]]
                bad += sum(pool.mapping.read(o, nb) != tag for o in kept)
                r = {"kept": kept, "bad": bad}
            elif op == "alloc_publish":
                nb = cmd["nbytes"]
                res = [pool.alloc(nb) for _ in range(cmd["reserved"])]
                pub = [pool.alloc(nb) for _ in range(cmd["published"])]
                for o in res:
                    pool.mapping.write(o, b"RESV" * (nb // 4))
                for o in pub:
                    pool.mapping.write(o, b"PUBL" * (nb // 4))
                pool.publish(pub)
                r = {"reserved": res, "published": pub}
            elif op == "kv_open":
                kv = pool.kv(**cmd["args"])
                r = {"ns": kv.ns, "tenant": kv.tenant}
            elif op == "kv_store":
                toks = np.array(cmd["tokens"], dtype=np.int64)
                r = {"stored": kv.store(toks, b"".join(pattern(kv, toks)))}
            elif op == "kv_match":
                r = {"matched": kv.match(cmd["tokens"])}
            elif op == "kv_verify":
                n, bad = verify(kv, cmd["tokens"])
                r = {"blocks": n, "bad": bad}
            elif op == "kv_purge":
                with pool.lock():
                    r = {"freed": kv.area.purge_tombstones(force=True, budget=kv.area.nslots)}
            elif op == "kv_recount":
                with pool.lock():
                    kv.area.recount()
                r = {"recounted": True}
            elif op == "kv_drop":
                r = {"dropped": kv.drop()}
            elif op == "kv_hold":
                h = kv.load(cmd["tokens"])
                h.views()
                held.append(h)
                r = {"blocks": h.blocks}
            elif op == "kv_release":
                for h in held:
                    h.release()
                held.clear()
                r = {"released": True}
            elif op == "kv_churn":
                # store, match and read back random prefixes that share a stem;
                # with `until` (a path), stop before the first round after it
                # exists (`rounds` is then at most)
                rng = random.Random(cmd["seed"])
                stem = list(range(cmd["stem"]))
                stored = bad = loaded = 0
                until = cmd.get("until")
                for _ in range(cmd["rounds"]):
                    if until and os.path.exists(until):
                        break
                    k = rng.randrange(cmd["variants"])
                    toks = stem + [100000 + k * 1000 + j for j in range(rng.randrange(1, 6) * 16)]
                    if rng.random() < 0.5:
                        stored += kv.store(np.array(toks), b"".join(pattern(kv, toks)))
                    n, b = verify(kv, toks)
                    loaded += n
                    bad += b
                r = {"stored": stored, "loaded": loaded, "bad": bad}
            elif op == "exit":
                if pool is not None:
                    pool.close()
                print(json.dumps({"bye": True}), flush=True)
                break
            else:
                r = {"error": "unknown op " + op}
        except Exception as e:
            r = {"error": type(e).__name__, "message": str(e)}
        print(json.dumps(r), flush=True)


class NodeProc:
    """One node process (main() above) in a child of this process; `p` is its
    Popen.  env: variables added to this process's environment for it (e.g. a
    remote_env, so it judges and is judged as another host)."""

    def __init__(self, env: dict | None = None):
        self.p = subprocess.Popen([sys.executable, "-m", "cxlkv.testing.nodes"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})})

    def send(self, **cmd) -> None:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def reply(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"node process died: {self.p.stderr.read()}")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self.reply()

    def attach(self, path, **kw) -> dict:
        r = self.call(op="attach", path=path, **kw)
        assert "slot" in r, r
        self.slot, self.epoch = r["slot"], r["epoch"]
        return r

    def close(self) -> None:
        if self.p.poll() is None:
            self.send(op="exit")
            self.p.stdin.close()
            self.p.wait(30)

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(30)


class Turns(NamedTuple):
    """What `lock_turn_gaps` saw.  gaps: for the stretch where all nodes
    contend, how many turns passed between two turns of the same node (the
    time a node spent off the CPU between its turns counts too).  waits: for
    every turn, how many turns other nodes had between its request and its
    grant (a node off the CPU before asking does not count: only order)."""
    gaps: list[int]
    waits: list[int]

    @property
    def mean_gap(self) -> float:
        return sum(self.gaps) / len(self.gaps)

    def wait(self, q: float) -> float:
        """The q-th percentile of `waits`."""
        return float(np.percentile(self.waits, q))


def lock_turn_gaps(path: str, nodes: int = 4, n: int = 150, hold: float = 0.001,
                   hosts=None) -> Turns:
    """Run `nodes` processes that keep taking the pool lock (each holding it
    `hold` seconds) and return the `Turns` they saw.  hosts: a remote_env, to
    make each process a host of its own (the pool lock's order then); without
    it they share this host's host-local lock."""
    procs = [NodeProc(hosts() if hosts else None) for _ in range(nodes)]
    with Pool.open(path) as p:
        go = p.region("data")[0]
        ctr, log = go + 64, go + 128
        waits = log + 8 * nodes * n
    try:
        for q in procs:
            q.attach(path)
        for q in procs:
            q.send(op="fair", counter=ctr, log=log, waits=waits, n=n, go=go, hold=hold)
        assert [q.reply() for q in procs] == [{"ready": True}] * nodes
        with Pool.open(path) as p:
            p.mapping.store64(go, 1)
        replies = [q.reply() for q in procs]
        assert replies == [{"done": n}] * nodes, replies
    finally:
        for q in procs:
            q.close()
    with Pool.open(path) as p:
        order = [p.mapping.load64(log + 8 * i) for i in range(nodes * n)]
        waited = [p.mapping.load64(waits + 8 * i) for i in range(nodes * n)]
    assert sorted(set(order)) == sorted(q.slot + 1 for q in procs)
    # between the last first turn and the first last turn, all of them contend
    start = max(order.index(s) for s in set(order))
    end = min(len(order) - 1 - order[::-1].index(s) for s in set(order))
    assert end - start > n // 2, "the nodes hardly overlapped"
    gaps, last = [], {}
    for i in range(start, end + 1):
        if order[i] in last:
            gaps.append(i - last[order[i]])
        last[order[i]] = i
    return Turns(gaps, waited[start:end + 1])


def lock_manager(path: str) -> subprocess.Popen:
    """`cxlkv lock-manager` for a pool, in a child process of its own, outside
    the non-coherence emulation (it stands in for a host's manager)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
    return subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", path],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Manager:
    """`cxlkv lock-manager` in a child process, its log lines read from stderr."""

    def __init__(self, path, *args, env=None):
        self.p = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool",
                                   path, *args], stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})})

    def line(self) -> str:
        return self.p.stderr.readline()

    def wait_for(self, text: str) -> str:
        """The first log line containing `text` (a standby logs that it stands
        by before it becomes active); AssertionError when the process ends first."""
        while True:
            line = self.line()
            if not line:
                raise AssertionError(f"lock manager ended before logging {text!r}")
            if text in line:
                return line

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            self.p.wait(10)


def incr_together(path: str, offset: int, n: int, procs: int = 4, op: str = "incr",
                  env=None) -> list[dict]:
    """`procs` node processes each add 1 to the pool word at `offset` `n`
    times under the pool lock (op "incr", or "incr_nc" with the non-coherent
    discipline), all at once; returns their replies.  env: a dict, or a
    callable giving each process its own (e.g. a remote_env: hosts apart)."""
    nodes = [NodeProc(env() if callable(env) else env) for _ in range(procs)]
    try:
        for q in nodes:
            q.attach(path)
        for q in nodes:
            q.send(op=op, offset=offset, n=n)
        return [q.reply() for q in nodes]
    finally:
        for q in nodes:
            q.close()


if __name__ == "__main__":
    main()
