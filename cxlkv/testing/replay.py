"""A tool runner that replays output captured from a real guest.

`scripts/cxl-lab capture` records every cxl/ndctl/daxctl/numactl call it
makes in a real QEMU guest as commands/STATE/NAME.json (argv, rc, stdout,
stderr), and a sysfs/procfs snapshot per state.  `ReplayRunner` answers a
call with the record of the same argv in the current state, and moves to the
next state when the call is one that changes the machine (create a region,
a namespace, ...), so code that provisions can be run, unit-tested, against
what the kernel and tools really did - never against invented output.

Used by the tests; also handy to try `cxlkv inspect` / `doctor` / `provision`
on a machine without CXL (see tests/test_host_discovery.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from cxlkv.host.tools import Runner, ToolResult, failed, not_found

#: captured commands that change the machine: argv -> (state they were recorded
#: in, name, state the machine is in afterwards)
MUTATIONS = {
    ("cxl", "create-region", "-m", "-d", "decoder0.0", "-w", "1", "-t", "pmem", "mem0"):
        ("region", "create-region", "region"),
    ("ndctl", "create-namespace", "-r", "region0", "-m", "devdax", "-a", "2M"):
        ("devdax", "create-namespace", "devdax"),
    ("daxctl", "reconfigure-device", "-m", "system-ram", "dax0.0"):
        ("system-ram", "reconfigure-system-ram", "system-ram"),
    ("daxctl", "reconfigure-device", "-m", "devdax", "-f", "dax0.0"):
        ("system-ram", "reconfigure-devdax", "devdax"),
    ("ndctl", "destroy-namespace", "-f", "namespace0.0"):
        ("teardown-namespace", "destroy-namespace", "teardown-namespace"),
    ("cxl", "destroy-region", "-f", "region0"):
        ("teardown", "destroy-region", "teardown"),
}
#: the states captured (each has commands/STATE and sysfs/STATE)
STATES = ("raw", "region", "devdax", "system-ram", "teardown-namespace", "teardown")


class ReplayRunner(Runner):
    """Replays tests/fixtures/lab/commands; `state` moves on with each mutation.

    missing: tools to report as not installed.  inject: argv tuple ->
    (state, name) of a captured record to answer with instead (a real error
    the tool printed, e.g. in another state), and the state does not move.
    sysfs_dest: when given, the state's sysfs snapshot is copied there (and
    $CXLKV_SYSFS_ROOT / $CXLKV_PROCFS_ROOT pointed at it with `setenv`, default
    os.environ; tests pass monkeypatch.setenv) on every state change.
    dev_dest: when given, the device nodes the state had (/dev/daxX.Y, from the
    snapshot's manifest) come and go there as regular files with the captured
    mode, `dev_size` bytes long (sparse; a stand-in, smaller than the device),
    as devtmpfs makes and removes them; a file already there is left alone.
    """

    def __init__(self, fixtures: str | os.PathLike, state: str, *, missing=(),
                 inject: dict | None = None, sysfs_dest: str | os.PathLike | None = None,
                 setenv=None, dev_dest: str | os.PathLike | None = None,
                 dev_size: int = 32 << 20):
        super().__init__()
        self.fixtures = Path(fixtures)
        self.missing = set(missing)
        self.inject = {tuple(k): v for k, v in (inject or {}).items()}
        self.sysfs_dest = Path(sysfs_dest) if sysfs_dest is not None else None
        self.setenv = setenv
        self.dev_dest = Path(dev_dest) if dev_dest is not None else None
        self.dev_size = dev_size
        self.calls: list[list[str]] = []
        self.states: list[str] = []
        self.state = ""
        self.enter(state)

    def record(self, state: str, name: str) -> dict:
        with open(self.fixtures / "commands" / state / f"{name}.json") as f:
            return json.load(f)

    def find(self, state: str, argv: list[str]) -> dict | None:
        """The first record (in capture order) of argv in state, errors left out."""
        found = []
        for p in (self.fixtures / "commands" / state).glob("*.json"):
            with open(p) as f:
                rec = json.load(f)
            if rec.get("argv") == argv and not rec["name"].startswith("err-"):
                found.append(rec)
        return min(found, key=lambda r: r["seq"]) if found else None

    def enter(self, state: str) -> None:
        self.state = state
        self.states.append(state)
        if self.sysfs_dest is not None:
            install_sysfs(self.fixtures, state, self.sysfs_dest, self.setenv)
        if self.dev_dest is not None:
            self.sync_dev(state)

    def sync_dev(self, state: str) -> None:
        with open(self.fixtures / "sysfs" / state / "snapshot.json") as f:
            devs = {os.path.basename(p): d for p, d in json.load(f)["dev"].items()
                    if os.path.basename(p).startswith("dax")}
        self.dev_dest.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(self.dev_dest):
            if name.startswith("dax") and name not in devs:
                os.unlink(self.dev_dest / name)
        for name, d in devs.items():
            p = self.dev_dest / name
            if not p.exists():
                with open(p, "wb") as f:
                    f.truncate(self.dev_size)
                os.chmod(p, int(d["mode"], 8))

    def which(self, tool: str) -> str | None:
        return None if tool in self.missing else f"/replay/{tool}"

    def run(self, argv, *, check: bool = True, timeout: float | None = None) -> ToolResult:
        argv = [str(a) for a in argv]
        if self.which(argv[0]) is None:
            raise not_found(argv[0])
        self.calls.append(argv)
        key = tuple(argv)
        if key in self.inject:
            rec = self.record(*self.inject[key])
            nxt = None
        elif key in MUTATIONS:
            st, name, nxt = MUTATIONS[key]
            rec = self.record(st, name)
        else:
            rec, nxt = self.find(self.state, argv), None
            if rec is None:
                raise LookupError(f"no captured output of {' '.join(argv)!r} in state "
                                  f"{self.state!r} (tests/fixtures/lab/commands/{self.state})")
        res = ToolResult(argv, rec["rc"], rec["stdout"], rec["stderr"])
        self.log.append(res)
        if nxt is not None:
            self.enter(nxt)
        if check and res.rc != 0:
            raise failed(res)
        return res


def install_sysfs(fixtures: str | os.PathLike, state: str, dest: str | os.PathLike,
                  setenv=None) -> Path:
    """Copy the sysfs/procfs snapshot of `state` to dest (replacing it), recreate the
    empty directories git cannot keep, and point the sysfs/procfs roots at it."""
    src = Path(fixtures) / "sysfs" / state
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, symlinks=True)
    for line in (src / "empty-dirs.txt").read_text().splitlines():
        if line.strip():
            (dest / line.strip()).mkdir(parents=True, exist_ok=True)
    setenv = setenv or os.environ.__setitem__
    setenv("CXLKV_SYSFS_ROOT", str(dest / "sys"))
    setenv("CXLKV_PROCFS_ROOT", str(dest / "proc"))
    return dest
