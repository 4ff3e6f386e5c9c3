"""The runbook as a test: every man page rendered with `man`, every TOML and
shell line in bold on it must still parse after rendering, and the
procedures of cxlkv-runbook(7) run in order on emulated pools - the commands
taken from the rendered page, not copied here.

What an emulated pool cannot stand for is translated, openly (RACK.translate):
/dev/dax0.0 is a pool file; `systemctl ... cxlkv-lock-manager@kv0` starts or
stops `cxlkv lock-manager --standby` processes and `cxlkv-serve@kv0` agents
(the units' ExecStart); `cxlkv init --device` becomes `--pool`; the
acceptance stress test runs for seconds, not a minute.  Steps that need root
or CXL hardware (udev, groupadd, provision, cxl list) are only checked to
parse, and the test lists them.  A step fails the test when its command
fails.
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
                             'stop-timeout = 5\n')
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CXLKV_N")}
        self.env["CXLKV_POOL"] = self.pool
        self.managers: list[subprocess.Popen] = []
        self.agents: list[subprocess.Popen] = []
        self.ran: list[tuple[str, int]] = []
        self.parsed_only: list[str] = []
        self.mentions: list[str] = []
        self.group = grp.getgrgid(os.getgid()).gr_name
        self.nlogs = 0
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
        if len(argv) == 2 and argv[1] in ("init", "format") or argv[1] not in COMMANDS:
            # "never cxlkv init or format on a pool in use", "cxlkv 0.2.0": named, not steps
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
        return p

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


@pytest.mark.long
def test_runbook_procedures_in_order(tmp_path):
    """Every procedure, in order, on an emulated two-host rack (about two
    to four minutes on a shared 2-core machine: pytest -m long, or CXLKV_LONG=1)."""
    rack = Rack(tmp_path)
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

        # REMOVE A HOST: its units stop cleanly (exit 0, checked in stop_unit), the
        # active lock manager included; health on the other host: one node fewer
        for cmd in steps_of("REMOVE A HOST"):
            r = rack.run(cmd, hosts=1)
            if cmd.startswith("cxlkv health"):
                assert r.returncode == 0 and "1 node(s) alive" in r.stdout, r.stdout
        assert len(rack.agents) == len(rack.managers) == 1
        for cmd in units:                      # the host comes back (ADD A HOST: step 5)
            rack.run(cmd, hosts=1)

        # POOL FULL: a reader pins blocks; stats names it; drop says who pins
        from cxlkv.testing.nodes import NodeProc

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
        secs = sections(render(RUNBOOK))
        spill = [s for line in secs["A CACHE BIGGER THAN THE POOL: THE SPILL TIER"]
                 for s in bold_spans(line) if TOML_LINE.match(s)]
        assert any(s.startswith("spill-dir") for s in spill), spill
        conf = rack.toml.read_text() + "".join(
            s.replace("/var/lib/cxlkv/spill", str(tmp_path / "spill-{HOST}"))
            .replace('"64G"', '"64M"') + "\n" for s in spill)
        tomllib.loads(conf)
        rack.toml.write_text(conf)
        for i in range(rack.hosts + 1):                  # "install -d" on every host
            (tmp_path / f"spill-{i}").mkdir(mode=0o2770)
        for cmd in steps_of("A CACHE BIGGER THAN THE POOL: THE SPILL TIER"):
            rack.run(cmd)
        rack.systemctl(["restart", "cxlkv-serve@kv0"])
        assert rack.agents[0].poll() is None

        # REPLACE A HOST / RECOVER AFTER A CRASH: kill -9 the agent, then the steps
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
        rolling, fmt = subsections(sections(render(RUNBOOK))["UPGRADE"])
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
        rack.systemctl(["stop", "cxlkv-serve@kv0", "cxlkv-lock-manager@kv0"])
    finally:
        rack.close()
    assert rack.parsed_only, "nothing needed hardware? the translation table is stale"
    for cmd in rack.parsed_only:                      # still valid shell
        assert subprocess.run(["bash", "-n", "-c", cmd]).returncode == 0, cmd
