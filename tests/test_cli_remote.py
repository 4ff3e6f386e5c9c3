"""`cxlkv remote status`: usage errors, and a real cluster on loopback seen
healthy (exit 0), with a master killed and no replica (degraded, exit 1)
and stopped (unreachable, exit 2)."""
from __future__ import annotations

import os
import time

import pytest
import xxhash

from cxlkv.remote import RemoteClient, RemoteConfig
from cxlkv.testing.redis import TestCluster, skip_reason

SKIP = skip_reason()


def test_help(cli):
    r = cli("remote", "--help")
    assert r.code == 0 and "status" in r.out
    r = cli("remote", "status", "--help")
    assert r.code == 0
    for opt in ("--config", "--nodes", "--password-file", "--tls", "--no-scan", "--json"):
        assert opt in r.out
    assert "2   unreachable" in cli("remote", "--help").out


def test_usage_errors(cli, tmp_path):
    r = cli("remote", "status")
    assert r.code == 2 and "no remote nodes given" in r.err
    r = cli("remote", "status", "--nodes", "nohost", "--json")
    assert r.code == 2 and r.json()["error"]["kind"] == "usage"
    assert "host:port" in r.json()["error"]["message"]
    r = cli("remote", "status", "--config", tmp_path / "none.toml")
    assert r.code == 2 and "none.toml" in r.err
    (tmp_path / "c.toml").write_text('[remote]\nnodes = ["127.0.0.1:1"]\nbogus = 1\n')
    r = cli("remote", "status", "--config", tmp_path / "c.toml")
    assert r.code == 2 and "unknown setting 'bogus'" in r.err
    r = cli("remote", "status", "--nodes", "127.0.0.1:1", "--tls-ca", "/x.pem")
    assert r.code == 2 and "without tls" in r.err
    r = cli("remote", "status", "--nodes", "127.0.0.1:1", "--password-file",
            tmp_path / "missing")
    assert r.code == 2 and "password_file" in r.err


def test_unreachable_nodes(cli):
    t0 = time.monotonic()
    r = cli("remote", "status", "--nodes", "127.0.0.1:1,127.0.0.1:2", "--json")
    assert r.code == 2, r.err
    doc = r.json()
    assert doc["reachable"] is False and doc["status"] == "unreachable"
    assert doc["exit_code"] == 2 and "127.0.0.1:2" in doc["error"]
    assert time.monotonic() - t0 < 5
    r = cli("remote", "status", "--nodes", "127.0.0.1:1")
    assert r.code == 2 and "UNREACHABLE" in r.out


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_status_healthy_degraded_unreachable(cli, tmp_path):
    ns = xxhash.xxh3_128_digest(b"cxlkv-namespace\0llama/bf16")
    with TestCluster(masters=3) as c:
        nodes = ",".join(c.addrs[:1])
        with RemoteClient(RemoteConfig(nodes=tuple(c.addrs))) as rc:
            rc.register_namespace(ns, "llama/bf16")
            for _ in range(30):
                rc.push(os.urandom(16), ns, os.urandom(1000))
            rc.push(os.urandom(16), b"\x01" * 16, os.urandom(500))
            assert rc.flush(10)
        (tmp_path / "c.toml").write_text(f'[remote]\nnodes = ["{c.addrs[1]}"]\n'
                                         'max_bytes = "1G"\n')
        # healthy: from a config file, one startup node is enough
        r = cli("remote", "status", "--config", tmp_path / "c.toml", "--json")
        assert r.code == 0, r.out + r.err
        doc = r.json()
        assert doc["status"] == "ok" and doc["cluster_state"] == "ok" and doc["problems"] == []
        assert doc["slots"]["covered"] == 16384 and doc["slots"]["assigned"] == 16384
        assert doc["masters"] == {"total": 3, "up": 3, "down": 0}
        assert doc["replicas"] == {"total": 0, "up": 0, "down": 0}
        assert doc["memory"]["max_bytes"] == 1 << 30
        assert 0 < doc["memory"]["used_memory"] < 1 << 30 and doc["memory"]["used_pct"] > 0
        assert doc["scanned"] and doc["keys"] == 31
        by = {s["digest8"]: s for s in doc["namespaces"]}
        assert by[ns.hex()[:8]] == {"digest8": ns.hex()[:8], "namespace": "llama/bf16",
                                    "keys": 30, "bytes": 30 * (72 + 1000)}
        assert by["01010101"]["namespace"] is None and by["01010101"]["keys"] == 1
        assert sum(n["keys"] for n in doc["nodes"]) == 31
        assert "password" not in r.out
        r = cli("remote", "status", "--nodes", nodes)
        assert r.code == 0 and "status: OK" in r.out and "llama/bf16" in r.out
        r = cli("remote", "status", "--nodes", nodes, "--no-scan", "--json")
        assert r.code == 0 and r.json()["keys"] is None and not r.json()["scanned"]
        # a master killed, no replica: degraded
        victim = c.masters()[0]
        c.kill(victim)
        r = cli("remote", "status", "--nodes", ",".join(c.addrs), "--json")
        assert r.code == 1, r.out
        doc = r.json()
        assert doc["status"] == "degraded" and doc["masters"]["down"] == 1
        assert doc["slots"]["covered"] < 16384
        assert any(f"127.0.0.1:{victim} is down" in p for p in doc["problems"])
        r = cli("remote", "status", "--nodes", ",".join(c.addrs))
        assert r.code == 1 and "status: DEGRADED" in r.out and "DOWN" in r.out
        # every node stopped: unreachable
        c.kill_all()
        t0 = time.monotonic()
        r = cli("remote", "status", "--nodes", ",".join(c.addrs), "--json")
        assert r.code == 2 and r.json()["status"] == "unreachable"
        assert time.monotonic() - t0 < 5
