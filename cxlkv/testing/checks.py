"""Assertions the tests share: a pool passes fsck, a condition holds within
a deadline, fsck's JSON report through the CLI."""
from __future__ import annotations

import hashlib
import os
import time

from cxlkv.api import Pool
from cxlkv.ops.fsck import check


def fsck_clean(path: str):
    """Assert that fsck (read-only) finds no error in the pool at path; returns its report."""
    with Pool.open(path, writable=False) as p:
        rep = check(p)
    assert rep.clean, [f.to_json() for f in rep.errors]
    return rep


def foreign_env(**extra: str) -> dict[str, str]:
    """The environment for running a program that is not ours (man, an
    engine's own venv): this one without the sanitizer runtimes that
    scripts/test-asan preloads, which report the other program's own bugs
    (troff frees with the wrong operator) or break its libraries (torch)."""
    env = dict(os.environ, **extra)
    env.pop("LD_PRELOAD", None)
    return env


def wait_for(cond, timeout: float = 30.0, what: str = "condition", step: float = 0.01):
    """Poll `cond()` every `step` seconds until it is true and return its value;
    raise AssertionError after `timeout` (a deadline, never a sleep used as
    synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def fsck(cli, path: str, *extra: str) -> tuple[int, dict]:
    """`cxlkv fsck --pool PATH --json [extra]` through the `cli` fixture: (exit code, report)."""
    r = cli("fsck", "--pool", path, "--json", *extra)
    return r.code, r.json()


def codes(doc: dict) -> set[str]:
    """The codes of the error findings in an fsck JSON report."""
    return {f["code"] for f in doc["findings"] if f["severity"] == "error"}


def digest(path: str) -> str:
    """SHA-256 of a file's bytes (to show a check left a pool untouched)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def mapped_bytes(path: str) -> int:
    """Bytes of the file at `path` mapped into this process's page tables
    now (the Rss of its mappings in /proc/self/smaps)."""
    real, total, cur = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            w = line.split()
            if w and "-" in w[0] and len(w) >= 5:
                cur = line.rstrip().endswith(real)
            elif cur and line.startswith("Rss:"):
                total += int(w[1]) * 1024
    return total
