"""The spill store's choice of read path (cxlkv/kv/tiers/spill/readpath.py):
learnt from its own timings, fixed by argument or environment, both paths
bit-exact through fetch."""
from __future__ import annotations

import pytest

from cxlkv.errors import UsageError
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.spill import files, readpath

NSD = b"n" * 16
BB = 64 << 10


def feed(rp: readpath.ReadPaths, rates: dict, runs: int) -> list:
    """`runs` picks, each timed at rates[path] bytes/s; the paths picked."""
    out = []
    for _ in range(runs):
        p = rp.pick()
        out.append(p)
        rp.record(p, 1 << 20, (1 << 20) / rates[p])
    return out


def test_auto_tries_both_then_keeps_the_faster_and_rechecks_the_other():
    rp = readpath.ReadPaths("auto")
    picks = feed(rp, {"mapped": 4e9, "pread": 8e9}, 2 * readpath.TRIAL)
    assert picks.count("mapped") == picks.count("pread") == readpath.TRIAL
    after = feed(rp, {"mapped": 4e9, "pread": 8e9}, 4 * readpath.RECHECK)
    assert rp.stats()["read_path"] == "pread"
    # the slower path still gets one run in every RECHECK, no more
    assert 3 <= after.count("mapped") <= 5
    st = rp.stats()
    assert st["read_pread_Bps"] == pytest.approx(8e9) and st["read_mapped_Bps"] == pytest.approx(4e9)


def test_auto_follows_a_change_of_conditions():
    rp = readpath.ReadPaths("auto")
    feed(rp, {"mapped": 9e9, "pread": 5e9}, 4 * readpath.RECHECK)
    assert rp.stats()["read_path"] == "mapped"
    # mapped turns slow (say the page tables got expensive): its own runs and
    # the rechecks of pread move the medians over
    feed(rp, {"mapped": 2e9, "pread": 5e9}, 2 * readpath.WINDOW * readpath.RECHECK)
    assert rp.stats()["read_path"] == "pread"


def test_a_fixed_path_is_always_taken_and_learns_nothing():
    for p in readpath.PATHS:
        rp = readpath.ReadPaths(p)
        assert set(feed(rp, {"mapped": 1e9, "pread": 9e9}, 100)) == {p}
        assert rp.stats() == {"read_path": p, "read_mapped_Bps": 0.0, "read_pread_Bps": 0.0}


def test_bad_choices_are_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="read_path must be one of auto, mapped, pread"):
        spill.SpillStore(tmp_path / "s", 1 << 20, read_path="fast")
    monkeypatch.setenv(readpath.ENV, "mmap")
    with pytest.raises(UsageError, match="CXLKV_SPILL_READ must be one of"):
        spill.SpillStore(tmp_path / "s", 1 << 20)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


@pytest.mark.parametrize("choice", ["auto", "mapped", "pread", "env-pread"])
def test_fetch_is_bit_exact_on_the_path_it_takes(tmp_path, monkeypatch, choice):
    taken = []
    real = files.SlotFile.read_run

    def spy(self, *a, mapped=None, **k):
        taken.append(mapped)
        return real(self, *a, mapped=mapped, **k)
    monkeypatch.setattr(files.SlotFile, "read_run", spy)
    if choice == "env-pread":
        monkeypatch.setenv(readpath.ENV, "pread")
        st = spill.SpillStore(tmp_path / "s", 64 * spill.footprint(BB), writers=1)
    else:
        st = spill.SpillStore(tmp_path / "s", 64 * spill.footprint(BB), writers=1,
                              read_path=choice)
    try:
        keys = [bytes([i]) * 16 for i in range(8)]
        data = {k: bytes([k[0] ^ 0x5A]) * BB for k in keys}
        for k in keys:
            assert st.offer(k, NSD, data[k])
        st.flush()
        for _ in range(3 * readpath.TRIAL):
            got = st.fetch(keys, NSD, BB)
            assert [bytes(b) for b in got] == [data[k] for k in keys]
        want = {"auto": {True, False}, "mapped": {True}, "pread": {False},
                "env-pread": {False}}[choice]
        assert set(taken) == want
        s = st.stats()
        assert s["hits"] == 3 * readpath.TRIAL * len(keys)
        if choice == "auto":
            assert s["read_mapped_Bps"] > 0 and s["read_pread_Bps"] > 0
            assert s["read_path"] in readpath.PATHS
        else:
            assert s["read_path"] == choice.removeprefix("env-")
    finally:
        st.close()
