"""The runbook as a test: every man page rendered with `man`, every TOML and
shell line in bold or in an example block on it must still parse after
rendering, and the procedures of cxlkv-runbook(7) run in order on emulated
pools - the commands taken from the rendered page, not copied here.

What an emulated pool cannot stand for is translated, openly (RACK.translate
and the long test): /dev/dax0.0 is a pool file, /dev/daxX.Y (POISON) a second
one; `systemctl ... cxlkv-lock-manager@kv0` starts or stops `cxlkv
lock-manager --standby` processes and `cxlkv-serve@kv0` agents (the units'
ExecStart); `cxlkv init --device` becomes `--pool`; the acceptance stress test
runs for seconds, not a minute; poison is quarantined by --offset, not from
trace records; `kubectl apply -k` is `kubectl kustomize` plus the Kubernetes
schemas.  Steps that need root, CXL hardware or a cluster (udev, groupadd,
provision, cxl list, kubectl label/get/logs) are only checked to parse, and
the test lists them.  A step fails the test when its command fails.
"""
from __future__ import annotations

import grp
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from cxlkv.cli import COMMANDS
from cxlkv.testing.checks import foreign_env

MAN = Path(__file__).resolve().parent.parent / "man"
RUNBOOK = MAN / "cxlkv-runbook.7"
pytestmark = pytest.mark.skipif(shutil.which("man") is None,
                                reason="man is not installed (scripts/setup --test installs man-db)")

#: words a shell command in the pages starts with
SHELL_WORDS = ("cxlkv ", "systemctl ", "udevadm ", "groupadd ", "install ", "ls ", "cxl ",
               "ndctl ", "daxctl ", "chmod ", "chgrp ", "kill ", "journalctl ", "man ",
               "promtool ", "kubectl ", "curl ", "cp ")
TOML_LINE = re.compile(r"^[a-z][a-z0-9_-]* = \S")   # TOML as the pages write it (key = value)
#: in an example block, where Python's `x = f(...)` looks the same: a TOML value
TOML_EXAMPLE = re.compile(r"""^[a-z][a-z0-9_-]* = (["'[{\d]|true\b|false\b)""")
BOLD = re.compile(r"(.)\x08\1")


#: marks the example blocks (.nf/.EX ... .fi/.EE) in a copy of a page, so their
#: rendered lines can be told from the prose around them
EX_BEGIN, EX_END = "CXLKVEXAMPLEBEGIN", "CXLKVEXAMPLEEND"


def render(page: Path, mark_examples: bool = False) -> list[str]:
    """The page as `man` renders it for a terminal: no wrapping (one line per
    paragraph), bold kept as overstrike (X backspace X); with mark_examples,
    each example block between a line EX_BEGIN and a line EX_END."""
    src = page.read_text()
    if mark_examples:
        src = re.sub(r"^\.(nf|EX)\b.*$", lambda m: f"{m.group(0)}\n{EX_BEGIN}", src, flags=re.M)
        src = re.sub(r"^\.(fi|EE)\b.*$", lambda m: f"{EX_END}\n{m.group(0)}", src, flags=re.M)
    r = subprocess.run(["man", "-E", "ascii", "-l", "-"], input=src, capture_output=True,
                       text=True, timeout=60,
                       env=foreign_env(MANWIDTH="4000", MAN_KEEP_FORMATTING="1"))
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def example_lines(lines: list[str]) -> list[str]:
    """The lines of the example blocks of a page rendered with mark_examples,
    plain, a shell line continued with a backslash joined to the next."""
    out, inside, cont = [], False, False
    for line in lines:
        text = plain(line).strip()
        if text == EX_BEGIN:
            inside, cont = True, False
        elif text == EX_END:
            inside = False
        elif inside and text:
            if cont:
                out[-1] = out[-1][:-1].rstrip() + " " + text
            else:
                out.append(text)
            cont = text.endswith("\\")
    return out


def bold_spans(line: str) -> list[str]:
    """Runs of bold text in a rendered line (bold words separated by single
    spaces join into one run), overstrike removed; underline is not bold."""
    spans, cur, i = [], "", 0
    while i < len(line):
        m = BOLD.match(line, i)
        if m:
            cur += m.group(1)
            i = m.end()
            continue
        if line[i] == " " and cur and BOLD.match(line, i + 1):
            cur += " "
            i += 1
            continue
        if cur:
            spans.append(cur)
            cur = ""
        i += 1
    if cur:
        spans.append(cur)
    return [s.strip() for s in spans if s.strip()]


def plain(line: str) -> str:
    return re.sub(r".\x08", "", line)


def sections(lines: list[str]) -> dict[str, list[str]]:
    """Section name -> its lines (headings are the unindented lines)."""
    out: dict[str, list[str]] = {}
    name = None
    for line in lines:
        text = plain(line)
        if text and not text[0].isspace():
            name = text.strip()
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def subsections(lines: list[str]) -> list[list[str]]:
    """A section's lines split at its subheadings (indented by exactly 3)."""
    out: list[list[str]] = [[]]
    for line in lines:
        text = plain(line)
        if text.startswith("   ") and not text.startswith("    ") and text.strip():
            out.append([])
        out[-1].append(line)
    return [x for x in out[1:]] if len(out) > 1 else out


def commands(lines: list[str]) -> list[str]:
    """The bold shell commands of some lines and the shell lines of their
    example blocks (when rendered with mark_examples), in order."""
    out: list[str] = []
    block: list[str] | None = None
    for line in lines:
        text = plain(line).strip()
        if text == EX_BEGIN:
            block = [line]
        elif text == EX_END and block is not None:
            out += [c for c in example_lines(block + [line]) if c.startswith(SHELL_WORDS)]
            block = None
        elif block is not None:
            block.append(line)
        else:
            for span in bold_spans(line):
                for part in re.split(r"\s*&&\s*", span):
                    if part.startswith(SHELL_WORDS):
                        out.append(part)
    return out


# -- every page: what is rendered in bold still parses ----------------------------------

PAGES = sorted(MAN.glob("*.[1-8]"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_toml_and_shell_lines_survive_rendering(page):
    """Bold TOML and shell lines, and the lines of the example blocks."""
    seen = 0
    lines = render(page, mark_examples=True)
    examples = example_lines(lines)
    tomls = [e for e in examples if TOML_EXAMPLE.match(e)]
    for span in [s for line in lines for s in bold_spans(line)] + examples:
        if (TOML_LINE.match(span) and span not in examples or span in tomls) \
                and not span.startswith(SHELL_WORDS):
            tomllib.loads(span)              # raises on a line groff mangled
            seen += 1
        elif span.startswith(SHELL_WORDS):
            argv = shlex.split(span, comments=True)
            assert argv, span
            r = subprocess.run(["bash", "-n", "-c", span], capture_output=True, text=True)
            assert r.returncode == 0, (span, r.stderr)
            seen += 1
    if page.name in ("cxlkv-runbook.7", "cxlkv.1"):
        assert seen > 5
    # every example block that shows commands: each command line is checked
    source_cmds = [ln for ln in re.findall(r"^\.(?:nf|EX)\b.*?\n(.*?)^\.(?:fi|EE)\b",
                                           page.read_text(), flags=re.M | re.S)
                   for ln in ln.splitlines()
                   if re.match(r"(cxlkv|systemctl|promtool|kubectl|curl|cp) ", ln)]
    assert len([e for e in examples if e.startswith(SHELL_WORDS)]) == len(source_cmds), \
        (examples, source_cmds)


def test_example_blocks_are_found_and_joined(tmp_path):
    """The example-block reader sees a block's lines, joins a continued
    command, and does not take the prose around it."""
    page = tmp_path / "t.1"
    page.write_text('.TH T 1\n.SH X\ncxlkv prose \\- not a block\n.PP\n.nf\n'
                    'cxlkv kv stats \\-\\-pool /dev/dax0.0 \\e\n    \\-\\-json\n'
                    'spill\\-dir = "/var/lib/cxlkv/spill"\n.fi\n')
    lines = render(page, mark_examples=True)
    assert example_lines(lines) == ["cxlkv kv stats --pool /dev/dax0.0 --json",
                                    'spill-dir = "/var/lib/cxlkv/spill"']
    assert commands(lines) == ["cxlkv kv stats --pool /dev/dax0.0 --json"]


def test_the_check_would_catch_groff_eating_quotes(tmp_path):
    """The spill-dir line as it once was: its quotes are eaten, and the TOML check says so."""
    page = tmp_path / "t.7"
    page.write_text('.TH T 7\n.SH X\n.B spill\\-dir = "/var/lib/cxlkv/spill"\n')
    spans = [s for line in render(page) for s in bold_spans(line)]
    assert spans[-1] == "spill-dir = /var/lib/cxlkv/spill"
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(spans[-1])


# -- the procedures, in order ---------------------------------------------------------------

class Rack:
    """A rack of one host on an emulated pool: the processes the units would run."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.pool = str(tmp / "kv0.pool")
        self.toml = tmp / "kv0.toml"
        self.toml.write_text('[serve]\nmetrics-addr = "127.0.0.1:0"\ninterval = 0.1\n'
                             'stop-timeout = 5\nlog-json = true\n')
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
        self.env["CXLKV_POOL"] = self.pool
        self.managers: list[subprocess.Popen] = []
        self.agents: list[subprocess.Popen] = []
        self.ran: list[tuple[str, int]] = []
        self.parsed_only: list[str] = []
        self.mentions: list[str] = []
        self.group = grp.getgrgid(os.getgid()).gr_name
        self.nlogs = 0
        self.logs: dict[int, Path] = {}          # pid -> its log (the journal)
        self.hosts = 2        # "every host": two of each unit (their processes stand in)

    # -- what stands for what --------------------------------------------------------
    def translate(self, cmd: str) -> str:
        cmd = cmd.replace("/dev/dax0.0", self.pool).replace("/etc/cxlkv/kv0.toml",
                                                            str(self.toml))
        cmd = cmd.replace("--pool P", f"--pool {self.pool}").replace("/root/", f"{self.tmp}/")
        if cmd.startswith("cxlkv init --device"):
            cmd = cmd.replace("--device", "--pool") + " --size 48M --lease 2s"
            cmd = cmd.replace("--group cxlkv", f"--group {self.group}")
        if cmd.startswith("cxlkv stress"):
            cmd = cmd.replace("--seconds 60", "--seconds 2")
        return cmd.replace("--namespace NAME", "--namespace m")

    def cxlkv(self, args: list[str], ok=(0,)) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "cxlkv", *args], capture_output=True,
                           text=True, timeout=120, env=self.env)
        self.ran.append((shlex.join(["cxlkv", *args]), r.returncode))
        assert r.returncode in ok, (args, r.returncode, r.stdout, r.stderr)
        return r

    def run(self, cmd: str, ok=(0,), hosts: int | None = None):
        """One step of the runbook, as rendered; `hosts`: how many hosts a
        systemctl step runs on (None: every host)."""
        cmd = self.translate(cmd)
        argv = shlex.split(cmd)
        if argv[0] == "systemctl":
            return self.systemctl(argv[1:], hosts)
        if argv[0] != "cxlkv" or argv[1] in ("doctor", "provision", "install-units"):
            self.parsed_only.append(cmd)           # root or CXL hardware: parsed, not run
            return None
        if (argv[1] in NAMED_ONLY and not {"--pool", "--config", "--nodes"} & set(argv)
                or argv[1] not in COMMANDS):
            # "never cxlkv init or format on a pool in use", "cxlkv 0.2.0", "cxlkv
            # format --grace", "cxlkv snapshot": named in the prose, not steps
            self.mentions.append(cmd)
            return None
        return self.cxlkv(argv[1:], ok)

    def systemctl(self, argv: list[str], hosts: int | None = None):
        verb, units = argv[0], [u for u in argv[1:] if not u.startswith("-")]
        n = self.hosts if hosts is None else hosts
        for unit in units:
            if verb in ("enable", "start", "restart"):
                if verb == "restart":
                    self.stop_unit(unit, n)
                for _ in range(n):
                    self.start_unit(unit)
            elif verb in ("stop", "disable"):
                self.stop_unit(unit, n)
            else:
                self.parsed_only.append(shlex.join(["systemctl", *argv]))

    def _spawn(self, argv: list[str], words: tuple[str, ...]) -> subprocess.Popen:
        """Start a unit's process (its log in a file, as the journal would
        keep it) and wait until it logs one of `words`."""
        self.nlogs += 1
        log = self.tmp / f"unit{self.nlogs}.log"
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "cxlkv", *argv], env=self.env,
                                 stdout=subprocess.DEVNULL, stderr=f)
        wait_until(lambda: any(w in log.read_text() for w in words) or p.poll() is not None,
                   timeout=60, what=f"{argv[0]} to log {words}")
        assert p.poll() is None, log.read_text()
        self.logs[p.pid] = log
        return p

    def events(self, p: subprocess.Popen) -> list[dict]:
        """The JSON log lines of a unit's process."""
        import json

        out = []
        for line in self.logs[p.pid].read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def start_unit(self, unit: str):
        if unit.startswith("cxlkv-lock-manager@"):
            self.managers.append(self._spawn(["lock-manager", "--pool", self.pool, "--standby"],
                                             ("active for", "standing by")))
        elif unit.startswith("cxlkv-serve@"):
            # each host's own copy of the settings ({HOST}: its local spill disk)
            own = self.tmp / f"kv0-host{len(self.agents)}.toml"
            own.write_text(self.toml.read_text().replace("{HOST}", str(len(self.agents))))
            self.agents.append(self._spawn(["serve", "--config", str(own)], ("ready",)))
        elif unit.startswith("cxlkv-health@"):
            self.cxlkv(["health", "--pool", self.pool, "--timeout", "5"], ok=(0, 1))
        else:
            raise AssertionError(f"the runbook names a unit cxlkv has not: {unit}")

    def stop_unit(self, unit: str, hosts: int):
        procs = (self.managers if unit.startswith("cxlkv-lock-manager@") else
                 self.agents if unit.startswith("cxlkv-serve@") else [])
        for _ in range(min(hosts, len(procs))):
            p = procs.pop()
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 0, f"{unit} did not stop cleanly (exit {p.returncode})"

    def kill9(self, procs):
        for p in procs:
            p.kill()
            p.wait(10)
        procs.clear()

    def close(self):
        for p in self.agents + self.managers:
            if p.poll() is None:
                p.kill()
                p.wait(10)


#: commands the prose names without the arguments a step would give them
NAMED_ONLY = ("init", "format", "serve", "snapshot", "restore", "remote")


def numbered(lines: list[str]) -> dict[int, list[str]]:
    """A section's numbered steps: number -> its lines."""
    out: dict[int, list[str]] = {}
    n = None
    for line in lines:
        m = re.match(r"^\s+(\d+)\. ", plain(line))
        if m:
            n = int(m.group(1))
            out[n] = []
        if n is not None:
            out[n].append(line)
    return out


def steps_of(name: str) -> list[str]:
    secs = sections(render(RUNBOOK, mark_examples=True))
    assert name in secs, f"no section {name!r} in the runbook: {list(secs)}"
    return commands(secs[name])


def wait_until(pred, timeout=20.0, what="the condition"):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def health_json(rack: Rack) -> dict:
    import json

    r = rack.cxlkv(["health", "--pool", rack.pool, "--timeout", "3", "--json"], ok=(0, 1, 2))
    return json.loads(r.stdout)


def test_start_a_rack_order_and_the_spill_settings():
    """What the long run below checks first, without running anything: the
    stress test comes before the units start, and the spill step's settings
    are TOML."""
    start = steps_of("START A RACK")
    first = {w: next(i for i, c in enumerate(start) if c.startswith(w))
             for w in ("cxlkv init", "cxlkv stress", "systemctl enable")}
    assert first["cxlkv init"] < first["cxlkv stress"] < first["systemctl enable"], start
    enable = start[first["systemctl enable"]].split()
    assert enable[3:] == ["cxlkv-lock-manager@kv0", "cxlkv-serve@kv0",
                          "cxlkv-health@kv0.timer"], enable
    secs = sections(render(RUNBOOK))
    spill = [s for line in secs["A CACHE BIGGER THAN THE POOL: THE SPILL TIER"]
             for s in bold_spans(line) if TOML_LINE.match(s)]
    assert tomllib.loads("\n".join(spill)) == {"spill-dir": "/var/lib/cxlkv/spill",
                                               "spill-bytes": "64G"}


def inspect_json(rack: Rack, pool: str | None = None) -> dict:
    import json

    r = rack.cxlkv(["inspect", "--pool", pool or rack.pool, "--json"])
    return json.loads(r.stdout)["pool"]


def active_manager(rack: Rack) -> int | None:
    lm = inspect_json(rack)["lock_manager"] or {}
    return lm.get("pid") if lm.get("state") == "active" else None


def check_health(doc: dict, status: str, text: str = "") -> bool:
    return doc["status"] == status and text in doc["summary"] + "".join(
        c.get("text", "") for c in doc.get("checks", []))


def stalled_node(rack: Rack, first: int, **env):
    """A serving process of 'another host' (its own boot id: judged by its
    heartbeat) that stops with 3 blocks reserved, as a GC pause or SIGSTOP
    would stop it."""
    from cxlkv.ops.stress import make_host_root
    from cxlkv.testing.nodes import NodeProc

    q = NodeProc(env={"CXLKV_POOL": rack.pool, "CXLKV_PAUSE_AT": "kv.reserved:1",
                      "CXLKV_PROCFS_ROOT": make_host_root(rack.tmp)[0], **env})
    q.attach(rack.pool)
    q.call(op="kv_open", args={"model": "m", "block_tokens": 4, "block_bytes": 4096})
    q.send(op="kv_store", tokens=list(range(first, first + 12)))  # stops, 3 reserved
    wait_until(lambda: check_health(health_json(rack), "WARNING",
                                    f"fenced node(s) quarantined: node {q.slot} "),
               timeout=30, what="the stalled node fenced and quarantined")
    return q


@pytest.mark.long
def test_runbook_procedures_in_order(tmp_path):
    """Every procedure that can run on emulated pools, in the page's order,
    on an emulated rack of two hosts (three while one is added): START A
    RACK, ADD / REMOVE / REPLACE A HOST, POOL FULL, the spill tier, SHARE
    BLOCKS ACROSS RACKS (a local Redis Cluster), POISON (by --offset), A NODE
    STALLED, RECOVER AFTER A CRASH, UPGRADE, MONITOR A RACK and DEPLOY ON
    KUBERNETES (offline: kubectl kustomize and the schemas).  TEMPERATURE
    ALARM's steps need a CXL device: parsed only.  About 70 s on a shared
    2-core machine (load 2-3): pytest -m long, or CXLKV_LONG=1."""
    import contextlib

    from cxlkv.testing.nodes import NodeProc

    rack = Rack(tmp_path)
    later = contextlib.ExitStack()
    page = sections(render(RUNBOOK, mark_examples=True))
    try:
        # START A RACK, steps in the order the page gives them
        start = steps_of("START A RACK")
        init = [c for c in start if c.startswith("cxlkv init")]
        stress = [c for c in start if c.startswith("cxlkv stress")]
        units = [c for c in start if c.startswith("systemctl enable")]
        assert init and stress and units, start
        assert start.index(init[0]) < start.index(stress[0]) < start.index(units[0]), \
            "the stress test must run on the new pool before the units start"
        for cmd in start:
            rack.run(cmd)
        assert rack.managers and rack.agents
        doc = health_json(rack)
        assert doc["status"] == "OK", doc["summary"]
        assert doc["nodes"]["alive"] == 2        # one agent per host

        # ADD A HOST: START A RACK's steps 1, 2 and 5 on the new host, then inspect
        steps = numbered(page["START A RACK"])
        for n in (1, 2, 5):
            for cmd in commands(steps[n]):
                rack.run(cmd, hosts=1)
        for cmd in steps_of("ADD A HOST"):
            r = rack.run(cmd)
            if cmd.startswith("cxlkv inspect"):
                # the pool's max_nodes slots, one more in use per agent
                assert re.search(r"nodes\s+3 of \d+ slots in use", r.stdout), r.stdout
        rack.hosts = 3
        assert len(rack.agents) == len(rack.managers) == 3
        assert health_json(rack)["nodes"]["alive"] == 3

        # REMOVE A HOST: its units stop cleanly (exit 0, checked in stop_unit), the
        # active lock manager included; health on the other host: one node fewer
        for cmd in steps_of("REMOVE A HOST"):
            r = rack.run(cmd, hosts=1)
            if cmd.startswith("cxlkv health"):
                assert r.returncode == 0 and "2 node(s) alive" in r.stdout, r.stdout
        rack.hosts = 2
        assert len(rack.agents) == len(rack.managers) == 2

        # REPLACE A HOST: a host dies without stopping (kill -9 its agent and the
        # active lock manager); a standby takes over and reaps the dead node (sync
        # mode manager; same machine here: proven dead at once, so no quarantine)
        lm = active_manager(rack)
        (dead_lm,) = [p for p in rack.managers if p.pid == lm]
        dead_agent = rack.agents[-1]
        rack.managers.remove(dead_lm)
        rack.agents.remove(dead_agent)
        rack.kill9([dead_lm, dead_agent])
        wait_until(lambda: active_manager(rack) not in (None, lm), timeout=30,
                   what="a standby lock manager to take over")
        wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                   what="the dead host's node reaped")
        for cmd in steps_of("REPLACE A HOST"):
            r = rack.run(cmd)
            if cmd.startswith("cxlkv health"):
                assert "1 node(s) alive" in r.stdout, r.stdout
        for cmd in commands(steps[5]):                 # "then add the new host"
            rack.run(cmd, hosts=1)
        assert len(rack.agents) == len(rack.managers) == 2

        # POOL FULL: a reader pins blocks; stats names it; drop says who pins
        reader = NodeProc(env={"CXLKV_POOL": rack.pool})
        try:
            reader.attach(rack.pool)
            reader.call(op="kv_open", args={"model": "m", "block_tokens": 4,
                                            "block_bytes": 4096})
            reader.call(op="kv_store", tokens=list(range(16)))
            reader.call(op="kv_hold", tokens=list(range(8)))
            for cmd in steps_of("POOL FULL"):
                r = rack.run(cmd, ok=(0, 1))
                if cmd.startswith("cxlkv kv stats"):
                    assert f"{reader.p.pid}" in r.stdout   # who pins what
                if cmd.startswith("cxlkv kv drop"):
                    assert r.returncode == 1 and "not dropped" in r.stdout
        finally:
            reader.close()

        # A CACHE BIGGER THAN THE POOL: the TOML lines of the page go into the config
        spill = [s for line in page["A CACHE BIGGER THAN THE POOL: THE SPILL TIER"]
                 for s in bold_spans(line) if TOML_LINE.match(s)]
        assert any(s.startswith("spill-dir") for s in spill), spill
        conf = rack.toml.read_text() + "".join(
            s.replace("/var/lib/cxlkv/spill", str(tmp_path / "spill-{HOST}"))
            .replace('"64G"', '"64M"') + "\n" for s in spill)
        tomllib.loads(conf)
        rack.toml.write_text(conf)
        for i in range(rack.hosts + 2):                  # "install -d" on every host
            (tmp_path / f"spill-{i}").mkdir(mode=0o2770)
        for cmd in steps_of("A CACHE BIGGER THAN THE POOL: THE SPILL TIER"):
            rack.run(cmd)
        rack.systemctl(["restart", "cxlkv-serve@kv0"])
        assert rack.agents[0].poll() is None

        # SHARE BLOCKS ACROSS RACKS: rack B's fresh pool gets rack A's secret, the
        # fingerprints agree; a [remote] table (a Redis Cluster on loopback) and
        # the page's remote-push; remote status exits 0
        from cxlkv.testing.redis import TestCluster, skip_reason

        pool_b = str(tmp_path / "rackb.pool")
        rack.cxlkv(["init", "--pool", pool_b, "--size", "16M"])
        share = steps_of("SHARE BLOCKS ACROSS RACKS")
        export = next(c for c in share if "--export" in c)
        rack.run(export)
        rack.run(export.replace("--export", "--import").replace("/dev/dax0.0", pool_b))
        fp = next(c for c in share if c.endswith("--pool P"))
        prints = [rack.run(fp).stdout, rack.run(fp.replace("--pool P", f"--pool {pool_b}")
                                                ).stdout]
        assert prints[0].replace(rack.pool, "") == prints[1].replace(pool_b, ""), prints
        reason = skip_reason()
        status = next(c for c in share if c.startswith("cxlkv remote status"))
        if reason is None:
            cluster = later.enter_context(TestCluster(masters=3))
            push = [s for line in page["SHARE BLOCKS ACROSS RACKS"] for s in bold_spans(line)
                    if s.startswith("remote-push")]
            assert push, "the page's remote-push line"
            conf = rack.toml.read_text().replace("[serve]\n", "[serve]\n" + push[0] + "\n")
            conf += (f"[remote]\nnodes = {list(cluster.addrs)!r}\n"
                     f"prefix = 'runbook-{os.getpid()}'\n")
            tomllib.loads(conf)
            rack.toml.write_text(conf)
            rack.systemctl(["restart", "cxlkv-serve@kv0"])
            rack.run(status)
        else:
            rack.parsed_only.append(f"{status}   # {reason}")

        # TEMPERATURE ALARM: its steps read a CXL device - health runs, the rest parses
        for cmd in steps_of("TEMPERATURE ALARM"):
            rack.run(cmd, ok=(0, 1, 2))

        # POISON AND MEDIA ERRORS, on rack B's pool (the page's /dev/daxX.Y: its
        # retired chunk warns for good, which rack A's later steps would see): the
        # trace records need a CXL device, a known range is quarantined by --offset
        from cxlkv.api import Pool

        with Pool.open(pool_b, writable=False) as p:
            data_off = p.sb.regions["data"][0]
        rack.env["CXLKV_POOL"] = pool_b
        try:
            for cmd in steps_of("POISON AND MEDIA ERRORS"):
                if "--trace" in cmd:
                    rack.parsed_only.append(cmd)
                    cmd = cmd.replace("--trace poison.txt",
                                      f"--offset {data_off + 8192} --length 64")
                    rack.run(cmd.replace("/dev/daxX.Y", pool_b))
                    continue
                r = rack.run(cmd, ok=(0, 1))
                if cmd.startswith(("cxlkv kv stats", "cxlkv inspect")):
                    assert "retired" in r.stdout, r.stdout
                if cmd == "cxlkv fsck":
                    assert r.returncode == 0, r.stdout
            # the introduction's health (before step 1 on the page): WARNING from 1 chunk
            r = rack.run("cxlkv health", ok=(1,))
            assert "retired" in r.stdout, r.stdout
        finally:
            rack.env["CXLKV_POOL"] = rack.pool

        # A NODE STALLED: a paused process of another host is fenced; health and
        # inspect name it; when it resumes it acknowledges and the quarantine ends
        stalled = stalled_node(rack, 1000)
        try:
            for cmd in commands(numbered(page["A NODE STALLED (QUARANTINE)"])[1]):
                r = rack.run(cmd, ok=(0, 1))
                if cmd.startswith(("cxlkv health", "cxlkv inspect --pool")):
                    assert f"{stalled.p.pid}" in r.stdout and "quarantin" in r.stdout, r.stdout
            stalled.p.send_signal(signal.SIGCONT)                 # step 2: it resumes
            assert stalled.reply().get("error") == "NodeFenced"
            wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                       what="the quarantine to end once the node acknowledged")
        finally:
            stalled.close()
        # step 3: a host frozen for good, then powered off (kill -9; its host lock in
        # a directory of its own, as on a host of its own, so nothing here proves
        # it gone); on a quiet pool fsck --repair ends its quarantine before the grace
        locks = tmp_path / "frozen-host-locks"
        locks.mkdir()
        frozen = stalled_node(rack, 2000, CXLKV_HOSTLOCK_DIR=str(locks))
        frozen.kill()
        stop = [c for c in commands(numbered(page["A NODE STALLED (QUARANTINE)"])[3])
                if c.startswith("systemctl stop")]
        assert stop, "step 3 stops the lock managers too"
        for cmd in commands(numbered(page["A NODE STALLED (QUARANTINE)"])[3]):
            r = rack.run(cmd, ok=(1,))                       # 1: repaired, clean now
            if cmd.startswith("systemctl stop"):
                doc = health_json(rack)
                assert check_health(doc, "CRITICAL", f"node {frozen.slot} "), doc
            if cmd.startswith("cxlkv fsck"):
                assert "repair(s) made" in r.stdout, r.stdout
        rack.systemctl(["start", "cxlkv-lock-manager@kv0", "cxlkv-serve@kv0"])
        wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                   what="health OK once the quarantine was repaired")

        # RECOVER AFTER A CRASH: the whole rack's agents kill -9, then the steps
        rack.kill9(rack.agents)
        wait_until(lambda: health_json(rack)["nodes"]["alive"] == 0, what="the kill seen")
        rack.systemctl(["start", "cxlkv-serve@kv0"])      # "start ... agents again"
        wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                   what="the dead node reaped")
        rack.systemctl(["stop", "cxlkv-serve@kv0"])       # "on a quiet pool"
        for cmd in steps_of("RECOVER AFTER A CRASH"):
            rack.run(cmd, ok=(0, 1) if "--repair" in cmd else (0,))

        rack.systemctl(["start", "cxlkv-serve@kv0"])      # the agents serve again

        # UPGRADE: the rolling upgrade one host at a time, then the format's
        rolling, fmt = subsections(page["UPGRADE"])
        stopped = []
        for cmd in commands(rolling):
            if cmd.startswith("systemctl stop"):
                rack.run(cmd, hosts=1)                  # one host at a time
                stopped = [u for u in cmd.split()[2:]]
            elif cmd.startswith("cxlkv health") and stopped:
                # "start them and the engines again", then wait for OK
                rack.systemctl(["start", *sorted(stopped, key=lambda u: "serve" in u)],
                               hosts=1)
                stopped = []
                wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                           what="health OK after the host came back")
                rack.run(cmd)
            else:
                rack.run(cmd)
        assert len(rack.agents) == len(rack.managers) == rack.hosts
        for cmd in commands(fmt):
            if cmd.startswith("cxlkv format"):
                assert not rack.agents and not rack.managers, "format on a live rack"
            if cmd.startswith("cxlkv health"):
                r = rack.run(cmd, ok=(0, 1, 2))        # drained: "shows 0 nodes"
                assert "nodes=0;" in r.stdout, r.stdout
                continue
            rack.run(cmd)
        # "start the lock managers, then the agents": the new pool serves
        rack.systemctl(["start", "cxlkv-lock-manager@kv0", "cxlkv-serve@kv0"])
        wait_until(lambda: health_json(rack)["status"] == "OK", timeout=30,
                   what="health OK on the new format")

        # MONITOR A RACK: the rules and dashboard written, the rules' unit tests
        # pass; every agent is a scrape target (its /metrics and /healthz answer)
        monitoring = tmp_path / "monitoring"
        for cmd in steps_of("MONITOR A RACK"):
            cmd = cmd.replace("/etc/cxlkv/monitoring", str(monitoring))
            if cmd.startswith("promtool") and shutil.which("promtool"):
                r = subprocess.run(shlex.split(cmd), capture_output=True, text=True,
                                   timeout=120)
                assert r.returncode == 0 and "SUCCESS" in r.stdout, (r.stdout, r.stderr)
                rack.ran.append((cmd, r.returncode))
            elif cmd.startswith("cxlkv "):
                rack.run(cmd, ok=(0, 1))
            else:
                rack.parsed_only.append(cmd)    # promtool missing; systemctl status
        assert (monitoring / "prometheus" / "cxlkv-rules.yml").is_file()
        assert (monitoring / "grafana" / "cxlkv.json").is_file()
        import urllib.request

        for a in rack.agents:
            (url,) = {e["metrics_url"] for e in rack.events(a) if "metrics_url" in e}
            with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
                assert b"cxlkv_pool_bytes{" in m.read()
            with urllib.request.urlopen(url + "/healthz", timeout=10) as h:
                assert h.status == 200
        rack.systemctl(["stop", "cxlkv-serve@kv0", "cxlkv-lock-manager@kv0"])

        # DEPLOY ON KUBERNETES, offline: the manifests written with the page's image,
        # pool and gid; `kubectl apply -k` stands as `kubectl kustomize` plus the
        # Kubernetes schemas (no cluster here); the cluster's own steps parse
        deploy = tmp_path / "deploy"
        kubectl = shutil.which("kubectl")
        try:
            import kubernetes_validate
        except ImportError:
            kubernetes_validate = None
        for cmd in steps_of("DEPLOY ON KUBERNETES"):
            cmd = cmd.replace("./cxlkv-deploy", str(deploy))
            if cmd.startswith("cxlkv install-manifests"):
                # written into the manifests, never opened here: the device stays
                rack.cxlkv(shlex.split(cmd)[1:])
            elif cmd.startswith("kubectl apply -k") and kubectl and kubernetes_validate:
                import yaml

                r = subprocess.run([kubectl, "kustomize", shlex.split(cmd)[-1]],
                                   capture_output=True, text=True, timeout=120)
                assert r.returncode == 0, r.stderr
                rack.ran.append((cmd, r.returncode))
                docs = [d for d in yaml.safe_load_all(r.stdout) if d]
                for d in docs:
                    if d["apiVersion"].startswith("monitoring.coreos.com"):
                        continue                  # the Prometheus Operator's: no schema
                    kubernetes_validate.validate(d, "1.30", strict=True)
                assert "registry.example/cxlkv:0.2" in r.stdout and "990" in r.stdout
                assert "/dev/dax0.0" in r.stdout
            else:
                rack.parsed_only.append(cmd)      # a cluster's: kubectl label/get/logs
        assert (deploy / "k8s" / "kustomization.yaml").is_file()
    finally:
        rack.close()
        later.close()
    assert rack.parsed_only, "nothing needed hardware? the translation table is stale"
    for cmd in rack.parsed_only:                      # still valid shell
        assert subprocess.run(["bash", "-n", "-c", cmd]).returncode == 0, cmd
