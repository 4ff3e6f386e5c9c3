"""The agent's /metrics as Prometheus sees it: no `_created` series, every
series labelled with the pool's UUID, pool-wide series identical in every agent
of the pool (aggregated with max by (pool)), version labels without spaces,
the write-behind's series only with --remote-push, and the gauges the rules
need (dead nodes unreaped and for how long, the lock manager's heartbeat)."""
from __future__ import annotations

import re
import socket
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families
from test_serve import Serve

import cxlkv
from cxlkv.api import Pool
from cxlkv.daemons.metrics import POOL_WIDE, SnapshotCollector, version_label
from cxlkv.testing.checks import wait_for

#: pool-wide families that exist only in some setups
CONDITIONAL = {
    "cxlkv_lock_manager_up": "sync mode manager only",
    "cxlkv_node_pinned_blocks": "per-node pins: another branch",
    "cxlkv_node_pinned_bytes": "per-node pins: another branch",
}


def scrape(s: Serve) -> tuple[str, dict]:
    code, text = s.get("/metrics")
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return text, fams


def test_version_label():
    assert version_label(f"cxlkv {cxlkv.__version__}") == cxlkv.__version__
    assert version_label("cxlkv 1.0 rc1") == "1.0_rc1"
    assert version_label("other  2.0\t") == "other_2.0"
    assert version_label("") == "unknown"


def test_two_agents_of_one_pool(spool):
    """Agent b runs the write-behind (to a cluster nobody listens on), a does not."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    a = Serve(spool)
    b = Serve(spool, "--remote-nodes", f"127.0.0.1:{port}", "--remote-push", "m")
    try:
        with Pool.open(spool, writable=False) as p:
            uuid = str(p.sb.uuid)

        def settled():
            got = [scrape(s) for s in (a, b)]
            ok = all(f.get("cxlkv_nodes") and any(
                x.labels.get("state") == "alive" and x.value == 2 for x in f["cxlkv_nodes"].samples)
                for _, f in got)
            return got if ok else None

        (ta, fa), (tb, fb) = wait_for(settled, what="both agents seeing both nodes")
        for text, fams in ((ta, fa), (tb, fb)):
            assert "_created" not in text
            for f in fams.values():
                for s in f.samples:
                    assert s.labels.get("pool") == uuid, s
            info = fams["cxlkv_agent_info"].samples
            assert len(info) == 1 and info[0].labels["sw_version"] == cxlkv.__version__
            for s in fams["cxlkv_nodes_by_version"].samples:
                assert not re.search(r"\s", s.labels["sw_version"]), s
        # the node slots differ: a per-agent series
        assert fa["cxlkv_agent_info"].samples[0].labels["node"] != \
            fb["cxlkv_agent_info"].samples[0].labels["node"]
        # pool-wide families: the same series with the same values in both agents
        names = {n for n in fa if n in POOL_WIDE}
        assert names == {n for n in fb if n in POOL_WIDE}
        assert POOL_WIDE - names <= set(CONDITIONAL), POOL_WIDE - names - set(CONDITIONAL)
        for n in sorted(names):
            sa = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fa[n].samples}
            sb = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fb[n].samples}
            assert sa == sb, n
        # the write-behind's series only where it runs
        assert not [n for n in fa if n.startswith("cxlkv_remote")]
        assert "cxlkv_remote_push_scans" in fb and "cxlkv_remote_pushed_blocks" in fb
    finally:
        a.kill()
        b.kill()


class _Health:
    def __init__(self, dead, manager=None, status=1):
        self.status = status
        self.data = {"nodes": {"dead_nodes": dead}}
        if manager is not None:
            self.data["lock_manager"] = manager


def _collect(col) -> dict:
    return {s.name: s.value for f in col.collect() for s in f.samples}


def test_dead_nodes_unreaped_and_for_how_long():
    agent = SimpleNamespace(snapshot={}, pool=None)
    col = SnapshotCollector(agent)
    counts = {"alive": 2, "dead": 2, "unknown": 0, "free": 4, "versions": {}}
    dead = [{"slot": 3, "epoch": 2, "state": "attached"},
            {"slot": 4, "epoch": 1, "state": "fenced"}]          # fenced: reaped, quarantined

    def at(t, dead_nodes, manager=None):
        agent.snapshot = {"nodes": counts, "health": _Health(dead_nodes, manager), "at": t}
        return _collect(col)

    m = at(100.0, dead)
    assert m["cxlkv_dead_nodes_unreaped"] == 1 and m["cxlkv_dead_nodes_unreaped_seconds"] == 0
    m = at(112.5, dead)
    assert m["cxlkv_dead_nodes_unreaped_seconds"] == 12.5
    m = at(113.0, dead[1:])                                      # reaped
    assert m["cxlkv_dead_nodes_unreaped"] == 0 and m["cxlkv_dead_nodes_unreaped_seconds"] == 0
    m = at(114.0, [{"slot": 3, "epoch": 3, "state": "attached"}])   # a new death: from 0
    assert m["cxlkv_dead_nodes_unreaped_seconds"] == 0
    # the lock manager: dead -> 0; alive, or not judged yet within a lease -> 1; cas: none
    assert at(115.0, [], "dead")["cxlkv_lock_manager_up"] == 0
    assert at(115.0, [], "alive")["cxlkv_lock_manager_up"] == 1
    assert at(115.0, [], "unknown")["cxlkv_lock_manager_up"] == 1
    assert "cxlkv_lock_manager_up" not in at(115.0, [])


def test_a_slot_being_claimed_exports_host_unknown():
    """A claimed slot has no identity yet (pid 0, no host name): its pin
    series still carry every label (Prometheus drops an empty one)."""
    from cxlkv.daemons.metrics import PinsCollector
    snap = {"pins": [{"slot": 4, "pid": 0, "hostname": "", "pinned_blocks": 0,
                      "pinned_bytes": 0},
                     {"slot": 1, "pid": 812, "hostname": "host-a", "pinned_blocks": 3,
                      "pinned_bytes": 4096}]}
    fams = {f.name: f for f in PinsCollector(lambda: snap).collect()}
    hosts = {s.labels["node"]: s.labels["host"] for s in fams["cxlkv_node_pinned_blocks"].samples}
    assert hosts == {"4": "unknown", "1": "host-a"}
