"""Poison records -> pool offsets (cxlkv.host.poison): the interleave
arithmetic (the kernel's cxl_dpa_to_hpa / cxl_is_hpa_in_range facts), and
the translation of the records a real guest printed
(tests/fixtures/lab/poison/, `scripts/cxl-lab capture --scenario poison`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cxlkv.errors import UsageError
from cxlkv.host import poison

FIX = Path(__file__).parent / "fixtures" / "lab" / "poison"
LIVE = FIX / "kernel6.12-qemu10.0"          # the pair that can inject (README.txt)
OLD = FIX / "kernel6.1-qemu7.2"             # the pair that cannot


def cmd(base: Path, name: str) -> dict:
    return json.loads((base / "commands" / "poison" / f"{name}.json").read_text())


def sysroot(monkeypatch, base: Path) -> None:
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(base / "sysfs" / "poison" / "sys"))


# -- interleave arithmetic ---------------------------------------------------------------

def test_one_way_region_maps_dpa_offsets_straight():
    assert poison.dpa_offset_to_hpa_offset(0x801000, 1, 256, 0) == 0x801000


def test_two_and_three_way_examples_worked_by_hand():
    # 2 ways x 256: DPA granule 1 of position 1 is HPA granule 1*2+1 = 3
    assert poison.dpa_offset_to_hpa_offset(300, 2, 256, 1) == 3 * 256 + 44
    assert poison.dpa_offset_to_hpa_offset(0, 2, 256, 1) == 256
    # 3 ways x 512, position 2: DPA granule 1 -> HPA granule 1*3+2 = 5
    assert poison.dpa_offset_to_hpa_offset(1000, 3, 512, 2) == 5 * 512 + 488
    # 12 ways x 4096, position 11, DPA granule 2 -> HPA granule 35
    assert poison.dpa_offset_to_hpa_offset(2 * 4096 + 7, 12, 4096, 11) == 35 * 4096 + 7


@settings(max_examples=300, deadline=None)
@given(ways=st.sampled_from(poison.VALID_WAYS), eig=st.integers(0, 6),
       data=st.data())
def test_translation_is_the_kernels_and_inverts(ways, eig, data):
    gran = 256 << eig
    pos = data.draw(st.integers(0, ways - 1))
    dpa_off = data.draw(st.integers(0, 1 << 40))
    hpa_off = poison.dpa_offset_to_hpa_offset(dpa_off, ways, gran, pos)
    # the kernel's cxl_is_hpa_in_range: the HPA granule belongs to `pos`
    assert (hpa_off // gran) % ways == pos
    assert hpa_off % gran == dpa_off % gran
    assert poison.hpa_offset_to_dpa_offset(hpa_off, ways, gran) == (pos, dpa_off)


@pytest.mark.parametrize("ways", poison.VALID_WAYS)
def test_every_hpa_granule_is_some_position_once(ways):
    gran, rows = 256, 5
    got = sorted(poison.dpa_offset_to_hpa_offset(r * gran, ways, gran, p)
                 for p in range(ways) for r in range(rows))
    assert got == [g * gran for g in range(ways * rows)]


@pytest.mark.parametrize("ways,gran,pos", [(5, 256, 0), (2, 128, 0), (2, 768, 0),
                                           (2, 32768, 0), (4, 256, 4)])
def test_impossible_geometry_is_refused(ways, gran, pos):
    with pytest.raises(UsageError):
        poison.dpa_offset_to_hpa_offset(0, ways, gran, pos)


def test_interleaved_record_is_split_per_granule(monkeypatch):
    tr = poison.Translator.__new__(poison.Translator)
    tr.pool_dax, tr.pool_base, tr.pool_size = "dax0.0", 0, None
    tr.maps = {"region0": poison.RegionMap("region0", 0x1000_0000, 0x4000_0000, 2, 256, [
        poison.Target(0, "decoder3.0", "mem0", 0, 0x2000_0000),
        poison.Target(1, "decoder4.0", "mem1", 0, 0x2000_0000)])}
    tr.dax = [poison.DaxRange("dax0.0", 0x1000_0000 + 0x20_0000, 0x3000_0000)]
    rec = poison.PoisonRecord(memdev="mem1", dpa=0x20_0080, length=0x200, region="region0")
    parts = tr.ranges([rec])
    # 0x180 bytes to the end of its granule, then 0x80 in the next granule of mem1
    assert [(p.record.dpa, p.length) for p in parts] == [(0x20_0080, 0x80), (0x20_0100, 0x100),
                                                         (0x20_0200, 0x80)]
    # HPA granules 2 * 0x2000 + 1, ... of region0; dax0.0 starts 0x200000 into it
    assert [p.dax_offset for p in parts] == [0x20_0180, 0x20_0300, 0x20_0500]


# -- parsing -----------------------------------------------------------------------------

def test_trace_lines_parse_and_bad_ones_are_named():
    line = ("  sh-175 [000] .....  38.5: cxl_poison: memdev=mem0 host=0000:0d:00.0 serial=0 "
            "trace_type=List region=region0 region_uuid=1cc6fa84-e0b0-46ba-a3a0-fa37f0cfc04d "
            "hpa=0x390801000 dpa=0x801000 dpa_length=0x40 source=Injected flags= "
            "overflow_time=0")
    (r,) = poison.parse_trace("# tracer: nop\n" + line + "\n  sh-1 [000] ..... 1.0: other: x=1\n")
    assert (r.memdev, r.dpa, r.length, r.hpa, r.source, r.trace_type, r.timestamp) == (
        "mem0", 0x801000, 0x40, 0x390801000, "Injected", "List", 38.5)
    with pytest.raises(UsageError, match="dpa"):
        poison.parse_trace("x-1 [000] ..... 1.0: cxl_poison: memdev=mem0 hpa=0x1\n")
    with pytest.raises(UsageError, match="line 2"):
        poison.parse_monitor('{"event": "cxl_dram"}\nnot json\n')


def test_clear_removes_and_a_later_list_brings_back():
    mk = (lambda t, d: poison.PoisonRecord("mem0", d, 64, trace_type=t))
    recs = [mk("List", 1 << 12), mk("Inject", 2 << 12), mk("Clear", 1 << 12),
            mk("Clear", 2 << 12), mk("List", 2 << 12)]
    assert [r.dpa for r in poison.current_poison(recs)] == [2 << 12]


# -- the captured guest (kernel 6.12 + QEMU 10.0) -------------------------------------

needs_live = pytest.mark.skipif(not LIVE.exists(), reason=f"no capture in {LIVE}")


@needs_live
def test_captured_list_records_map_to_the_kernels_hpa(monkeypatch):
    sysroot(monkeypatch, LIVE)
    recs = poison.parse_trace(cmd(LIVE, "trace-after-list")["stdout"])
    listed = [r for r in recs if r.trace_type == "List"]
    assert len(listed) >= 3 and all(r.hpa is not None for r in listed if r.region)
    rm = poison.region_map("region0")
    assert rm.ways == 1 and rm.targets[0].memdev == "mem0"
    for r in recs:
        if r.hpa is not None:
            assert rm.dpa_to_hpa(r.memdev, r.dpa) == r.hpa, r


@needs_live
def test_injected_dpas_map_back_to_the_offsets_the_scenario_wrote(monkeypatch):
    sysroot(monkeypatch, LIVE)
    markers = [json.loads(x) for x in (LIVE / "markers.json").read_text().splitlines()]
    recs = {r.dpa: r for r in poison.parse_trace(cmd(LIVE, "trace-after-list")["stdout"])
            if r.trace_type == "List"}
    tr = poison.Translator(pool_dax="dax0.0")
    assert markers
    for m in markers:
        t = tr.translate(recs[m["dpa"]])          # the device listed the DPA we injected
        assert (t.dax, t.dax_offset, t.pool_offset) == ("dax0.0", m["dax_offset"],
                                                        m["dax_offset"]), t
        assert not t.note


@needs_live
def test_qmp_poison_before_the_namespace_lands_outside_the_pool(monkeypatch):
    sysroot(monkeypatch, LIVE)
    qmp = json.loads((LIVE / "qmp.json").read_text())
    assert [x["response"] for x in qmp[2:]] == [{"return": {}}, {"return": {}}]
    recs = poison.current_poison(poison.parse_trace(cmd(LIVE, "trace-after-clear")["stdout"]))
    tr = poison.Translator(pool_dax="dax0.0")
    by = {r.dpa: tr.translate(r) for r in recs}
    # DPA 0x1000: in region0 but in front of dax0.0 (the namespace's info block)
    assert by[0x1000].hpa is not None and by[0x1000].pool_offset is None
    assert "no DAX device" in by[0x1000].note
    # 0x700000 was cleared (clear_poison) before the second list
    assert 0x700000 not in by


@needs_live
def test_captured_failures_are_what_the_tools_printed():
    assert cmd(LIVE, "err-cxl-list-L")["stderr"].strip().startswith("Error: unknown switch")
    assert "unknown option" in cmd(LIVE, "err-cxl-list-media-errors")["stderr"]
    assert cmd(LIVE, "err-inject-unaligned")["rc"] != 0


OLD_NEEDED = pytest.mark.skipif(not OLD.exists(), reason=f"no capture in {OLD}")


@OLD_NEEDED
def test_kernel_61_and_qemu_72_cannot_inject_and_say_so():
    """What the bookworm defaults printed (recorded, not assumed)."""
    qmp = json.loads((OLD / "qmp.json").read_text())
    assert all(x["response"]["error"]["class"] == "CommandNotFound" for x in qmp[2:])
    assert "inject_poison" not in cmd(OLD, "ls-debugfs-cxl")["stdout"]
    assert cmd(OLD, "ls-events-cxl")["rc"] != 0           # no cxl trace events at all
    assert "Permission denied" in cmd(OLD, "trigger-poison-list")["stderr"]
    assert poison.parse_trace(cmd(OLD, "trace-after-list")["stdout"]) == []
    assert "cxl_trace_event_enable() failed" in (OLD / "cxl-monitor.stderr").read_text()


@needs_live
def test_cxl_monitor_saw_the_same_records_as_tracefs():
    # 76.1 writes the events to stderr (its log), one JSON object a line
    mon = "".join(x for f in ("cxl-monitor.stdout", "cxl-monitor.stderr")
                  for x in (LIVE / f).read_text(errors="replace").splitlines(keepends=True)
                  if x.startswith("{"))
    if not mon.strip():
        pytest.skip("this capture's cxl monitor printed nothing (see its README.txt)")
    recs = poison.parse_monitor(mon)
    trace = poison.parse_trace(cmd(LIVE, "trace-after-clear")["stdout"])
    key = (lambda r: (r.memdev, r.dpa, r.length, r.trace_type, r.hpa, r.source))
    assert [key(r) for r in recs] == [key(r) for r in trace]
