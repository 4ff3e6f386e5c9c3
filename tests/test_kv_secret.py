"""`cxlkv kv secret`: racks that share blocks through the remote tier share
the tenant secret, so salted tenants' keys agree across pools."""
from __future__ import annotations

import json
import os
import stat

import cxlkv
from cxlkv.ops.init import init_pool

MiB = 1 << 20


def mk(path):
    init_pool(path, {"size": 16 * MiB, "chunk_size": 256 * 1024, "max_nodes": 8,
                     "lease_ms": 300})


def keys(path, salt):
    with cxlkv.open_pool(path) as p:
        return p.kv(model="m", block_bytes=4096, salt=salt)._keys(list(range(32))).tobytes()


def test_export_then_import_makes_salted_keys_agree(tmp_path, cli):
    a, b = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    mk(a)
    mk(b)
    assert keys(a, None) == keys(b, None)              # unsalted keys never depend on it
    assert keys(a, "tenant-1") != keys(b, "tenant-1")
    f = str(tmp_path / "secret")
    r = cli("kv", "secret", "--pool", a, "--export", f, "--json")
    assert r.code == 0, r.err
    fp_a = json.loads(r.out)["fingerprint"]
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert cli("kv", "secret", "--pool", a, "--export", f).code == 1   # never overwritten
    r = cli("kv", "secret", "--pool", b, "--import", f, "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["changed"] is True and doc["fingerprint"] == fp_a
    assert keys(a, "tenant-1") == keys(b, "tenant-1")
    assert json.loads(cli("kv", "secret", "--pool", b, "--import", f, "--json").out)["changed"] \
        is False
    # the secret itself is never printed
    out = cli("kv", "secret", "--pool", a).out
    assert fp_a in out and open(f).read().strip() not in out


def test_import_is_refused_with_salted_tenants_or_other_nodes(tmp_path, cli):
    a, b = str(tmp_path / "a.pool"), str(tmp_path / "b.pool")
    mk(a)
    mk(b)
    f = str(tmp_path / "secret")
    assert cli("kv", "secret", "--pool", a, "--export", f).code == 0
    with cxlkv.open_pool(b) as p:                        # another node attached
        r = cli("kv", "secret", "--pool", b, "--import", f)
        assert r.code == 1 and "other nodes are attached" in r.err
        kv = p.kv(model="m", block_bytes=4096, salt="t")   # a salted tenant...
    r = cli("kv", "secret", "--pool", b, "--import", f, "--json")
    assert r.code == 0, r.err                          # ... without blocks does not matter
    assert cli("kv", "secret", "--pool", b, "--export", str(tmp_path / "s2")).code == 0
    with cxlkv.open_pool(b) as p:
        kv = p.kv(model="m", block_bytes=4096, salt="t")
        kv.store(list(range(16)), bytes(4096))          # one that holds blocks does
    c, g = str(tmp_path / "c.pool"), str(tmp_path / "other")
    mk(c)                                              # another secret
    assert cli("kv", "secret", "--pool", c, "--export", g).code == 0
    r = cli("kv", "secret", "--pool", b, "--import", g)
    assert r.code == 1 and "salted tenants hold blocks" in r.err
    bad = tmp_path / "bad"
    bad.write_text("zz\n")
    r = cli("kv", "secret", "--pool", a, "--import", str(bad))
    assert r.code == 2 and "not a tenant secret file" in r.err
    bad.write_text("00" * 16 + "\n")
    assert cli("kv", "secret", "--pool", a, "--import", str(bad)).code == 2
    assert cli("kv", "secret", "--pool", a, "--import", f, "--export", str(bad)).code == 2
