"""`cxlkv kv stats|ls|drop`, KV usage in `cxlkv inspect`, pre-KV pools."""
from __future__ import annotations


import pytest

import cxlkv
from cxlkv.api import Pool
from cxlkv.ops.init import init_pool
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BB = 4096


@pytest.fixture
def stocked_pool(pool_path):
    """A 16 MiB pool with two namespaces stored (llama/bf16 matched twice,
    qwen/fp8); returns its path."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8})
    with cxlkv.open_pool(pool_path) as pool:
        a = pool.kv(model="llama/bf16", block_tokens=4, block_bytes=BB)
        a.store(list(range(16)), bytes(4 * BB))
        a.match(list(range(16)))
        a.match(list(range(100, 116)))
        b = pool.kv(model="qwen/fp8", block_tokens=4, block_bytes=2 * BB)
        b.store(list(range(8)), bytes(4 * BB))
    return pool_path


def test_stats_json(cli, stocked_pool):
    r = cli("kv", "stats", "--pool", stocked_pool, "--json")
    assert r.code == 0, r.err
    kv = r.json()["kv"]
    assert kv["entries"] == 6 and kv["used_bytes"] == 4 * BB + 2 * 2 * BB
    a = {s["namespace"]: s for s in kv["namespaces"]}["llama/bf16"]
    assert (a["blocks"], a["hits"], a["misses"], a["stores"]) == (4, 4, 4, 4)
    one = cli("kv", "stats", "--pool", stocked_pool, "--namespace", "qwen/fp8", "--json").json()
    assert [s["namespace"] for s in one["kv"]["namespaces"]] == ["qwen/fp8"]
    human = cli("kv", "stats", "--pool", stocked_pool)
    assert human.code == 0 and "llama/bf16" in human.out and "6 of" in human.out


def test_ls_lists_namespaces_and_blocks(cli, stocked_pool):
    doc = cli("kv", "ls", "--pool", stocked_pool, "--json").json()
    assert sorted(s["namespace"] for s in doc["namespaces"]) == ["llama/bf16", "qwen/fp8"]
    assert "blocks" not in doc
    doc = cli("kv", "ls", "--pool", stocked_pool, "-n", "llama/bf16", "--json").json()
    blocks = doc["blocks"]
    assert len(blocks) == 4 and {b["state"] for b in blocks} == {"published"}
    roots = [b for b in blocks if b["parent"] is None]
    assert len(roots) == 1 and sum(b["children"] for b in blocks) == 3
    assert len(cli("kv", "ls", "--pool", stocked_pool, "-n", "llama/bf16", "--limit", "2",
                   "--json").json()["blocks"]) == 2


def test_unknown_namespace_is_a_usage_error(cli, stocked_pool):
    r = cli("kv", "stats", "--pool", stocked_pool, "--namespace", "nope", "--json")
    assert r.code == 2
    assert "no KV namespace 'nope'" in r.json()["error"]["message"]
    assert cli("kv", "drop", "--pool", stocked_pool, "--namespace", "nope").code == 2
    assert cli("kv", "drop", "--pool", stocked_pool).code == 2          # --namespace required


def test_drop_keeps_pinned_blocks_and_exits_1(cli, stocked_pool):
    reader = NodeProc()
    try:
        reader.attach(stocked_pool)
        reader.call(op="kv_open", args={"model": "llama/bf16", "block_tokens": 4,
                                        "block_bytes": BB})
        assert reader.call(op="kv_hold", tokens=list(range(8))) == {"blocks": 2}
        r = cli("kv", "drop", "--pool", stocked_pool, "--namespace", "llama/bf16", "--json")
        assert r.code == 1
        doc = r.json()
        # the two unpinned leaves go; the pinned two (and so their chain) stay
        assert (doc["evicted"], doc["pinned_left"], doc["dropped"]) == (2, 2, False)
        assert [x["slot"] for x in doc["pinned_by"]] == [reader.slot]
        assert "not dropped: 2 blocks pinned by node" in r.err
        assert f"pid {reader.p.pid}" in r.err
        r = cli("kv", "drop", "--pool", stocked_pool, "--namespace", "llama/bf16")
        assert r.code == 1 and "dropped namespace" not in r.out
        assert f"not dropped: 2 blocks pinned by node {reader.slot} (" in r.out
        reader.call(op="kv_release")
        r = cli("kv", "drop", "--pool", stocked_pool, "--namespace", "llama/bf16", "--json")
        assert r.code == 0 and r.json()["dropped"]
    finally:
        reader.close()
    names = [s["namespace"] for s in cli("kv", "ls", "--pool", stocked_pool, "--json").json()
             ["namespaces"]]
    assert names == ["qwen/fp8"]
    assert cli("fsck", "--pool", stocked_pool).code == 0


def test_inspect_shows_kv_usage(cli, stocked_pool):
    doc = cli("inspect", "--pool", stocked_pool, "--json").json()["pool"]
    assert doc["kv"]["entries"] == 6 and len(doc["kv"]["namespaces"]) == 2
    human = cli("inspect", "--pool", stocked_pool)
    assert "6 of" in human.out and "2 namespace(s)" in human.out


def test_pool_formatted_before_the_kv_region(cli, golden_pool):
    """The pre-KV golden image still opens; its KV use is refused clearly."""
    path = golden_pool("pool-v1-4m-prekv")
    doc = cli("inspect", "--pool", str(path), "--json").json()["pool"]
    assert doc["kv"] is None and doc["superblock"]["features"]["compat"] == 0
    assert cli("fsck", "--pool", str(path)).code == 0
    r = cli("kv", "stats", "--pool", str(path))
    assert r.code == 5 and "without a KV region" in r.err
    r = cli("init", "--pool", str(path))           # kept as it is, with the way out named
    assert r.code == 0 and "before the KV cache" in r.err and "format --force" in r.err


def test_who_pins_what_in_stats_inspect_and_metrics(cli, stocked_pool):
    """A reader holding blocks is named (node, pid, host) wherever pins show."""
    from prometheus_client import CollectorRegistry, generate_latest

    from cxlkv.daemons.metrics import PinsCollector
    from cxlkv.kv.area import pins_by_node

    reader = NodeProc()
    try:
        reader.attach(stocked_pool)
        reader.call(op="kv_open", args={"model": "llama/bf16", "block_tokens": 4,
                                        "block_bytes": BB})
        assert reader.call(op="kv_hold", tokens=list(range(12))) == {"blocks": 3}
        pid = reader.p.pid
        doc = cli("kv", "stats", "--pool", stocked_pool, "--json").json()["kv"]
        mine = [x for x in doc["pins"] if x["slot"] == reader.slot]
        assert mine and (mine[0]["pid"], mine[0]["pinned_blocks"]) == (pid, 3)
        assert mine[0]["pinned_bytes"] >= 3 * BB
        other = cli("kv", "stats", "--pool", stocked_pool, "-n", "qwen/fp8", "--json").json()
        assert all(x["pinned_blocks"] == 0 for x in other["kv"]["pins"])
        text = cli("kv", "stats", "--pool", stocked_pool)
        assert "pinned by node" in text.out and str(pid) in text.out

        pool = cli("inspect", "--pool", stocked_pool, "--json").json()["pool"]
        node = {n["slot"]: n for n in pool["nodes"]}[reader.slot]
        assert (node["pinned_blocks"], node["liveness"], node["judged_by"]) == \
            (3, "alive", "process")
        text = cli("inspect", "--pool", stocked_pool).out
        assert "3 blocks" in text and "alive (its process runs" in text

        with Pool.open(stocked_pool, writable=False) as p:
            pins = pins_by_node(p)
        reg = CollectorRegistry()
        reg.register(PinsCollector(lambda: {"pins": pins}))
        body = generate_latest(reg).decode()
        want = f'node="{reader.slot}",pid="{pid}"'
        line = [x for x in body.splitlines()
                if x.startswith("cxlkv_node_pinned_blocks{") and want in x]
        assert line and line[0].endswith(" 3.0"), body
        assert "cxlkv_node_pinned_bytes{" in body
        reader.call(op="kv_release")
        doc = cli("kv", "stats", "--pool", stocked_pool, "--json").json()["kv"]
        assert all(x["pinned_blocks"] == 0 for x in doc["pins"])
        assert "no node pins a block" in cli("kv", "stats", "--pool", stocked_pool).out
    finally:
        reader.close()


def test_inspect_judges_a_killed_node_dead(cli, stocked_pool):
    """kill -9: inspect shows the node as dead (its process is gone), not attached-and-fine."""
    victim = NodeProc()
    victim.attach(stocked_pool)
    victim.kill()
    pool = cli("inspect", "--pool", stocked_pool, "--json").json()["pool"]
    node = {n["slot"]: n for n in pool["nodes"]}[victim.slot]
    assert (node["liveness"], node["judged_by"]) == ("dead", "process")
    assert "dead (its process is gone" in cli("inspect", "--pool", stocked_pool).out
