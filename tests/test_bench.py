"""cxlkv bench: every figure is reported with its baseline, in one JSON document."""
from __future__ import annotations

import math

from cxlkv import benchmarks


def test_quick_bench_reports_every_figure(monkeypatch, tmp_path):
    monkeypatch.setattr(benchmarks, "_scratch_dir", lambda: str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    steps = []
    res = benchmarks.run(steps.append, quick=True)
    for key in ("memcpy_gbps", "pool_write_gbps", "pool_read_gbps", "lock_cas_us",
                "alloc_ops_per_s", "alloc_utilisation", "buddy_utilisation"):
        assert isinstance(res[key], float) and res[key] > 0 and math.isfinite(res[key]), key
    assert res["pool_write_vs_memcpy"] == res["pool_write_gbps"] / res["memcpy_gbps"]
    assert res["lock_manager_us"] > 0
    assert set(res["targets"]) == set(benchmarks.TARGETS)
    assert steps and not (tmp_path / "scratch").exists()       # scratch pools removed


def test_bench_json_is_one_document(cli, monkeypatch):
    monkeypatch.setattr(benchmarks, "run", lambda progress, quick=False: {
        "memcpy_gbps": 1.0, "notes": {}, "targets": {}})
    r = cli("bench", "--json")
    assert r.code == 0 and r.json()["memcpy_gbps"] == 1.0 and r.err == ""
