"""cxlkv.host.procs says what psutil says about local processes, without psutil."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

from cxlkv.host import procs
from cxlkv.state import nodes


def psutil_start_ns(pid: int) -> int:
    return int(psutil.Process(pid).create_time() * 1e9)


def test_start_time_is_psutils_for_this_process_and_a_child():
    assert procs.boot_time() == psutil.boot_time()
    assert procs.start_time_ns(os.getpid()) == psutil_start_ns(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        start = procs.start_time_ns(child.pid)
        assert start == psutil_start_ns(child.pid)
        assert nodes.local_process_alive(child.pid, start)
        assert not nodes.local_process_alive(child.pid, start + 5_000_000)   # pid reused
    finally:
        child.stdin.close()
        child.wait(30)
    assert procs.start_time_ns(child.pid) is None           # gone (waited for)
    assert not nodes.local_process_alive(child.pid, start)


def test_zombie_and_missing_processes_are_not_running():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # not waited for: a zombie once it exits
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            os.sched_yield()
        assert procs.start_time_ns(child.pid) is None
    finally:
        child.wait(30)
    assert procs.start_time_ns(max(psutil.pids()) + 100_000) is None
    assert procs.start_time_ns(0) is None and procs.start_time_ns(-5) is None


def test_procfs_path_is_the_seam(tmp_path, monkeypatch):
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n")
    (tmp_path / "42").mkdir()
    rest = " ".join(["0"] * 18) + " 250 " + " ".join(["0"] * 20)     # starttime: 250 ticks
    (tmp_path / "42" / "stat").write_text(f"42 (a (b) c) S {rest}\n")
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text(f"43 (z) Z {rest}\n")
    monkeypatch.setattr(procs, "PROCFS_PATH", str(tmp_path))
    assert procs.boot_time() == 1_700_000_000.0
    assert procs.start_time_ns(42) == int((250 / procs.CLOCK_TICKS + 1_700_000_000.0) * 1e9)
    assert procs.start_time_ns(43) is None
    assert procs.start_time_ns(44) is None
