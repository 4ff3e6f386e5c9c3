"""The one seam through which cxlkv runs external tools: cxl, ndctl, daxctl, numactl.

Every call goes through a `Runner`: the tool is found on PATH, run with a
timeout and no stdin, its exit status and stderr are carried into a typed
error, and JSON output is parsed whatever shape the tool printed (a bare
object, an array, an array of arrays - `cxl list` prints all three).
`--human` / `-u` is never passed: it turns sizes into strings.

Tests replace the process-wide runner with `use_runner()` (a runner that
replays output captured in a real guest, tests/fixtures/lab/commands).

ndctl 76.1 exit codes lie (LAB.md): `cxl create-region` that created
nothing, `cxl destroy-region` of a missing region and a failed
`enable-region` all exit 0 with the reason on stderr, so callers verify by
listing, never by exit status alone.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from cxlkv.errors import ToolFailed, ToolNotFound, ToolOutputError, ToolTimeout

#: the tools the seam knows, and the Debian package that ships each
TOOLS = {"cxl": "ndctl", "ndctl": "ndctl", "daxctl": "daxctl", "numactl": "numactl"}
DEFAULT_TIMEOUT_S = 30.0
#: options that change number formatting; never passed (see module docstring)
HUMAN = ("--human", "-u")


@dataclass
class ToolResult:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float = 0.0

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    def stderr_gist(self, lines: int = 3) -> str:
        """The lines of stderr that say what went wrong (a usage error prints the
        error first and pages of usage after it), at most `lines` of them."""
        text = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        key = re.compile(r"error|fail|could not|cannot|can't|not supported|no such|"
                         r"unknown|invalid|denied|busy|destroyed 0", re.I)
        hits = [ln for ln in text if key.search(ln)]
        return "; ".join((hits or text)[:lines])

    def to_json(self) -> dict:
        return {"argv": self.argv, "rc": self.rc, "stdout": self.stdout, "stderr": self.stderr}


def parse_json(text: str):
    """A tool's JSON output as Python objects; an empty output is an empty list.

    ndctl/daxctl print nothing when there is nothing to list, `cxl list`
    prints `[\\n]`; with one result `cxl list -u` prints a bare object.
    Raises ValueError for anything that is not JSON.
    """
    text = text.strip()
    if not text:
        return []
    return json.loads(text)


def as_list(doc) -> list:
    """Object -> [object], array -> array, nothing -> []."""
    if doc is None:
        return []
    if isinstance(doc, dict):
        return [doc]
    return list(doc)


@dataclass
class Runner:
    """Runs tools found on PATH.  `path` overrides $PATH (None: the environment's)."""

    timeout: float = DEFAULT_TIMEOUT_S
    path: str | None = None
    log: list[ToolResult] = field(default_factory=list)

    def which(self, tool: str) -> str | None:
        return shutil.which(tool, path=self.path)

    def available(self, tool: str) -> bool:
        return self.which(tool) is not None

    def run(self, argv: list[str], *, check: bool = True,
            timeout: float | None = None) -> ToolResult:
        """Run argv[0] (a bare tool name, found on PATH) with the rest as arguments.

        check=True raises ToolFailed on a non-zero exit status.
        """
        argv = [str(a) for a in argv]
        if any(a in HUMAN for a in argv[1:]):
            raise ValueError(f"{argv}: --human output is never parsed (raw integers only)")
        exe = self.which(argv[0])
        if exe is None:
            raise not_found(argv[0])
        limit = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            p = subprocess.run([exe] + argv[1:], stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, errors="replace", timeout=limit,
                               env={**os.environ, "LC_ALL": "C"})
        except subprocess.TimeoutExpired as e:
            res = ToolResult(argv, -1, _text(e.stdout), _text(e.stderr), time.monotonic() - t0)
            self.log.append(res)
            raise ToolTimeout(f"{res.command}: no answer after {limit:g} s (killed)", res) from None
        except OSError as e:
            res = ToolResult(argv, -1, "", str(e), time.monotonic() - t0)
            self.log.append(res)
            raise ToolFailed(f"{res.command}: cannot run: {e.strerror or e}", res) from None
        res = ToolResult(argv, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)
        self.log.append(res)
        if check and res.rc != 0:
            raise failed(res)
        return res

    def json(self, argv: list[str], *, timeout: float | None = None):
        """Run and parse JSON output (whatever its shape; see parse_json)."""
        res = self.run(argv, timeout=timeout)
        try:
            return parse_json(res.stdout)
        except ValueError as e:
            raise ToolOutputError(f"{res.command}: output is not JSON ({e})", res) from None


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def not_found(tool: str) -> ToolNotFound:
    """ToolNotFound for `tool`, its hint naming the package that ships it."""
    return ToolNotFound(tool, TOOLS.get(tool, tool))


def failed(res: ToolResult, what: str | None = None) -> ToolFailed:
    why = res.stderr_gist() or "no message on stderr"
    return ToolFailed(f"{what or res.command} failed (exit status {res.rc}): {why}", res)


_runner: Runner | None = None


def runner() -> Runner:
    """The process-wide runner (the seam tests replace)."""
    global _runner
    if _runner is None:
        _runner = Runner()
    return _runner


@contextmanager
def use_runner(r: Runner):
    """Route every tool call through `r` inside the block."""
    global _runner
    old, _runner = _runner, r
    try:
        yield r
    finally:
        _runner = old


# --------------------------------------------------------------------------
# cxl list: every shape flattened into typed object lists

#: container key (before any ":parent" suffix) -> object kind
_CONTAINERS = {
    "buses": "bus", "ports": "port", "endpoints": "endpoint", "memdevs": "memdev",
    "anon memdevs": "memdev", "decoders": "decoder", "root decoders": "decoder",
    "port decoders": "decoder", "endpoint decoders": "decoder", "regions": "region",
}
#: identity key of each kind, for top-level lists of one kind
_IDENT = ("region", "decoder", "endpoint", "port", "bus", "memdev")


def _kind_of(obj: dict) -> str | None:
    for k in _IDENT:
        if isinstance(obj.get(k), str):
            return k
    return None


def flatten_cxl(doc) -> dict[str, list[dict]]:
    """`cxl list` output of any shape -> {"memdev": [...], "region": [...], ...}.

    Nested children are removed from their parents and gain "parent" (the
    name of the object they were listed under), so every object appears
    once, with only its own attributes.
    """
    out: dict[str, list[dict]] = {k: [] for k in _IDENT}
    seen: dict[tuple[str, str], dict] = {}

    def add(kind: str, obj: dict, parent: str | None):
        own = {}
        for key, val in obj.items():
            base = key.split(":", 1)[0]
            if base in _CONTAINERS and isinstance(val, list):
                for child in val:
                    if isinstance(child, dict):
                        add(_CONTAINERS[base], child, obj.get(kind))
            elif key == "memdev" and isinstance(val, dict):
                add("memdev", val, obj.get(kind))
            else:
                own[key] = val
        if parent is not None:
            own.setdefault("parent", parent)
        ident = (kind, str(own.get(kind)))
        if ident in seen:            # listed twice (e.g. -M with -E): merge
            seen[ident].update({k: v for k, v in own.items() if k not in seen[ident]})
            return
        seen[ident] = own
        out[kind].append(own)

    def walk(node):
        for item in as_list(node):
            if isinstance(item, list):           # array of arrays
                walk(item)
                continue
            if not isinstance(item, dict):
                continue
            kind = _kind_of(item)
            if kind is not None:
                add(kind, item, None)
                continue
            # {"buses": [...]} / {"anon memdevs": [...]}: a named top-level array
            for key, val in item.items():
                base = key.split(":", 1)[0]
                if base in _CONTAINERS:
                    for child in as_list(val):
                        if isinstance(child, dict):
                            add(_CONTAINERS[base], child, None)

    walk(doc)
    return out


def flatten_dax(doc) -> tuple[list[dict], list[dict]]:
    """`daxctl list -D -R -M -i` (or `-D`, `-R`) -> (regions, devices).

    Regions carry their devices nested under "devices"; a device listed
    under a region gains "region_id".  A missing key means its default
    (daxctl omits target_node when it is < 0, mode when unknown).
    """
    regions, devices = [], []
    for item in as_list(doc):
        if isinstance(item, list):
            r, d = flatten_dax(item)
            regions += r
            devices += d
        elif isinstance(item, dict) and "chardev" in item:
            devices.append(dict(item))
        elif isinstance(item, dict):
            reg = {k: v for k, v in item.items() if k != "devices"}
            regions.append(reg)
            for dev in item.get("devices", []):
                devices.append({**dev, "region_id": item.get("id")})
    return regions, devices


def flatten_nd(doc) -> tuple[list[dict], list[dict], list[dict]]:
    """`ndctl list -vvv` (buses > regions > namespaces) -> (buses, regions, namespaces)."""
    buses, regions, namespaces = [], [], []

    def region(r: dict, bus: str | None):
        regions.append({**{k: v for k, v in r.items() if k != "namespaces"}, "bus": bus})
        for ns in r.get("namespaces", []):
            namespaces.append({**ns, "region": r.get("dev")})

    for item in as_list(doc):
        if isinstance(item, list):
            b, r, n = flatten_nd(item)
            buses += b
            regions += r
            namespaces += n
        elif not isinstance(item, dict):
            continue
        elif "regions" in item or "provider" in item:
            buses.append({k: v for k, v in item.items() if k not in ("regions", "dimms")})
            for r in item.get("regions", []):
                region(r, item.get("dev"))
        elif str(item.get("dev", "")).startswith("region"):
            region(item, None)
        elif str(item.get("dev", "")).startswith("namespace"):
            namespaces.append(dict(item))
    return buses, regions, namespaces
