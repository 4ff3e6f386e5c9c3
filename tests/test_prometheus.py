"""The Prometheus rules and the Grafana dashboard shipped in cxlkv/data.

Offline: `promtool check rules` passes, `promtool test rules` passes and has a
case for every rule, a rule changed under the tests makes them fail, and every
dashboard query parses (as a recording rule, for promtool).

Live: Debian's Prometheus on 127.0.0.1 scrapes two `cxlkv serve` agents of one
emulated pool (sync mode manager, each hosting a lock manager, one with a spill
store, both with a remote tier that cannot be reached); a workload runs; then
every metric the rules and the dashboard use exists with the labels they use,
alerts fire when their condition is produced (the pool pinned full, the remote
tier failing, an agent killed -9 and with it the standby lock manager), a node
killed -9 is reaped without the dead-node alert, and every dashboard query
returns data.  The live copy of the rules has its `for:` durations set to 0 s
(the unit tests cover them) so that the test takes seconds, not minutes.
"""
from __future__ import annotations

import json
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from importlib import resources
from pathlib import Path

import pytest

from cxlkv.api import Pool
from cxlkv.ops.init import init_pool
from cxlkv.testing.checks import wait_for
from cxlkv.testing.nodes import NodeProc

MiB = 1 << 20
BLOCK = 64 * 1024
DATA = resources.files("cxlkv.data")
RULES = Path(str(DATA.joinpath("prometheus", "cxlkv-rules.yml")))
RULE_TESTS = Path(str(DATA.joinpath("prometheus", "cxlkv-rules.test.yml")))
DASHBOARD = Path(str(DATA.joinpath("grafana", "cxlkv.json")))

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package: "
                             "scripts/setup --test installs it where apt-get and root exist)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus is not installed (Debian's prometheus package: scripts/setup --test "
           "installs it where apt-get and root exist)")

#: used by the rules or the dashboard, and impossible on an emulated pool / this branch
NOT_LIVE = {
    "cxlkv_device_temperature_celsius": "needs a CXL device (an emulated pool has none)",
    "cxlkv_device_alarms": "needs a CXL device (an emulated pool has none)",
}
#: (the rules also read kube-state-metrics' kube_deployment_status_replicas_available and
#: node_exporter's node_systemd_unit_state: not cxlkv's, covered by the unit tests only)


def rules_doc() -> dict:
    import yaml
    return yaml.safe_load(RULES.read_text())


def all_rules() -> list[dict]:
    return [r for g in rules_doc()["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard."""
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def concrete(expr: str, pool: str = ".+", rate: str = "10s") -> str:
    """A dashboard query with Grafana's variables filled in."""
    return expr.replace("$__rate_interval", rate).replace("$pool", pool)


_ALT = re.compile(r"(cxlkv_[a-z_]*)\(([a-z_|]+)\)([a-z_]*)")


def metric_names(expr: str) -> set[str]:
    """The raw series an expression reads (recorded cxlkv:... names excluded)."""
    names = set()
    for m in _ALT.finditer(expr):                  # {__name__=~"cxlkv_(a|b)_c"}
        names |= {m.group(1) + alt + m.group(3) for alt in m.group(2).split("|")}
    expr = _ALT.sub("", expr)
    names |= set(re.findall(r"(?<![:\w])(cxlkv_[a-z_]+)(?![:\w(])", expr))
    if re.search(r"(?<![:\w])up\{", expr):
        names.add("up")
    return names


def labels_used(expr: str) -> set[str]:
    """Labels an expression groups by or selects on (not Prometheus's own)."""
    used = set()
    for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
        used |= {x.strip() for x in group.split(",") if x.strip()}
    for sel in re.findall(r"\{([^}]*)\}", expr):
        used |= {m for m in re.findall(r"(\w+)\s*[=!]~?", sel) if m != "__name__"}
    return used - {"le", "instance", "job"}


# -- offline ---------------------------------------------------------------------------

@needs_promtool
def test_promtool_check_rules():
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in r.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    r = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True,
                       text=True, timeout=60, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_rule_has_a_unit_test():
    import yaml
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", ())
             if a.get("exp_alerts")}
    quiet = {a["alertname"] for t in tests for a in t.get("alert_rule_test", ())
             if not a.get("exp_alerts")}
    recorded = {e["expr"] for t in tests for e in t.get("promql_expr_test", ())}
    for r in all_rules():
        if "alert" in r:
            assert r["alert"] in fired, f"{r['alert']}: no test that it fires"
            assert r["alert"] in quiet, f"{r['alert']}: no test that it stays quiet"
            assert r["labels"]["severity"] in ("warning", "critical")
            assert {"summary", "description"} <= set(r["annotations"])
        else:
            assert r["record"] in recorded, f"{r['record']}: no test"


@needs_promtool
def test_a_changed_threshold_fails_the_unit_tests(tmp_path):
    """The unit tests judge the rules: move one threshold and they fail."""
    text = RULES.read_text()
    assert text.count("cxlkv:kv_table_load:ratio > 0.90") == 1
    (tmp_path / RULES.name).write_text(text.replace("cxlkv:kv_table_load:ratio > 0.90",
                                                    "cxlkv:kv_table_load:ratio > 0.96"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0
    assert "CxlkvHashTableNearFull" in r.stdout + r.stderr


def test_pool_wide_series_are_never_summed():
    """Every agent of a pool exports the pool-wide series: the rules and the
    dashboard take their max by pool, never their sum."""
    from cxlkv.daemons.metrics import POOL_WIDE

    exprs = [r["expr"] for r in all_rules()] + [e for _, e in dashboard_exprs()]
    for expr in exprs:
        for agg in re.finditer(r"\b(sum|count|avg)\b\s*(?:by\s*\([^)]*\))?\s*\(", expr):
            depth, i = 1, agg.end()
            while depth and i < len(expr):
                depth += {"(": 1, ")": -1}.get(expr[i], 0)
                i += 1
            inner = expr[agg.end():i]
            summed = {n.removesuffix("_total") for n in metric_names(inner)} & POOL_WIDE
            # count of the lock managers: a per-agent series; max by inside: fine
            assert not summed or "max by" in inner, f"{agg.group(1)} over {summed}: {expr}"


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    """Each query, its variables filled in, as a recording rule for promtool."""
    import yaml
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"]
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "pool"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            for t in p["targets"]:                      # every query follows the pool picked
                assert 'pool=~"$pool"' in t["expr"], (p["title"], t["expr"])
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": concrete(e)} for i, (_, e) in enumerate(exprs)]}]}
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump(rules))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # and a broken one does not
    f.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "max by (pool (cxlkv_pool_bytes)"}]}]}))
    assert subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True,
                          timeout=60).returncode != 0


# -- live ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """`cxlkv serve` in a child process; its JSON log lines read as they come."""

    def __init__(self, path, *args):
        argv = [sys.executable, "-m", "cxlkv", "serve", "--pool", path, "--interval", "0.1",
                "--metrics-addr", "127.0.0.1:0", "--log-json", *args]
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.log: list = []
        self.addr = None

    def _read(self):
        for line in self.p.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def ready(self, timeout=60.0) -> str:
        deadline = time.monotonic() + timeout
        while self.addr is None:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"serve never got ready: rc={self.p.poll()} {self.log}")
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                d = line
            self.log.append(d)
            if isinstance(d, dict) and "metrics_url" in d:
                self.addr = d["metrics_url"].removeprefix("http://")
        return self.addr

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


class Prom:
    """Debian's prometheus on 127.0.0.1 with its HTTP API."""

    def __init__(self, tmp: Path, targets: list[str], rules: Path):
        port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms",
                       "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "cxlkv", "static_configs": [{"targets": targets}]}],
        }))
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "prometheus.log"
        self._logf = open(self.log, "w")                    # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}",
                                   f"--storage.tsdb.path={tmp / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}",
                                   "--log.level=warn"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=self._logf)
        wait_for(lambda: self._ready(), timeout=60, step=0.1, what="prometheus ready")

    def _ready(self) -> bool:
        if self.p.poll() is not None:
            raise AssertionError(f"prometheus exited {self.p.returncode}: "
                                 f"{self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params):
        q = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=10) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as e:
            doc = json.load(e)
        assert doc["status"] == "success", (path, params, doc)
        return doc["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def firing(self) -> dict:
        """{alertname: [labels]} of the alerts firing now."""
        out: dict = {}
        for a in self.api("alerts")["alerts"]:
            if a["state"] == "firing":
                out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
        return out

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._logf.close()


def live_rules(tmp: Path) -> Path:
    """The rules with every `for:` set to 0s (the unit tests cover the durations)."""
    text = re.sub(r"(?m)^(\s+for:) \S+$", r"\1 0s", RULES.read_text())
    assert " for: 0s" in text
    out = tmp / "cxlkv-rules.yml"
    out.write_text(text)
    return out


@pytest.fixture
def rack(tmp_path, pool_path):
    """Two agents of one pool (sync mode manager, a lock manager hosted by each)
    scraped by a Prometheus on loopback."""
    init_pool(pool_path, {"size": 16 * MiB, "chunk_size": BLOCK, "max_nodes": 8,
                          "lease_ms": 1000, "hash_slots": 512, "sync": "manager"})
    dead_port = free_port()                # the remote tier's cluster: nobody listens
    common = ["--with-lock-manager", "--remote-nodes", f"127.0.0.1:{dead_port}",
              "--remote-push", "llama", "--remote-push-policy", "all",
              "--remote-push-interval", "0.2"]
    agents = [Agent(pool_path, *common, "--spill-dir", str(tmp_path / "spill-a"),
                    "--spill-bytes", "64M"),
              Agent(pool_path, *common)]
    procs: list = []
    prom = None
    try:
        targets = [a.ready() for a in agents]
        prom = Prom(tmp_path, targets, live_rules(tmp_path))
        yield {"pool": pool_path, "agents": agents, "prom": prom, "targets": targets,
               "procs": procs}
    finally:
        for q in procs:
            q.close()
        for a in agents:
            a.kill()
        if prom is not None:
            prom.stop()


def _pin_pool_full(q: NodeProc, data_bytes: int) -> int:
    """Store and pin blocks a few at a time until 96 % of the data area is pinned
    (a few at a time: the agents evict unpinned blocks to keep free space)."""
    pinned, seq, empty = 0, 0, 0
    while pinned * BLOCK < 0.96 * data_bytes and empty < 20:
        toks = [1_000_000 + seq * 1000 + i for i in range(16)]           # 4 blocks
        seq += 1
        q.call(op="kv_store", tokens=toks)
        got = q.call(op="kv_hold", tokens=toks)
        n = got.get("blocks", 0)
        pinned += n
        empty = 0 if n else empty + 1
    return pinned


@needs_prometheus
@pytest.mark.slow
def test_live_prometheus_rules_and_dashboard(rack):
    prom, pool_path = rack["prom"], rack["pool"]
    t0 = time.time()
    with Pool.open(pool_path, writable=False) as p:
        uuid, data_bytes = str(p.sb.uuid), p.sb.regions["data"][1]
    wait_for(lambda: len(prom.query('up{job="cxlkv"} == 1')) == 2, timeout=30,
             what="both agents scraped")

    # -- a workload: stores, lookups, loads in namespace llama ---------------------------
    q = NodeProc()
    rack["procs"].append(q)
    q.attach(pool_path)
    q.call(op="kv_open", args=dict(model="llama", block_tokens=4, block_bytes=BLOCK))
    assert q.call(op="kv_store", tokens=list(range(40)))["stored"] == 10
    assert q.call(op="kv_match", tokens=list(range(48)))["matched"] == 40
    assert q.call(op="kv_hold", tokens=list(range(8))) == {"blocks": 2}
    q.call(op="kv_release")
    wait_for(lambda: prom.query(f'cxlkv_kv_stores_total{{namespace="llama",pool="{uuid}"}} '
                                '>= 10'), timeout=30, what="the stores scraped")

    # -- the remote tier cannot be reached: the write-behind fails ---------------------
    wait_for(lambda: "CxlkvRemoteTierFailing" in prom.firing(), timeout=30,
             what="CxlkvRemoteTierFailing")

    # -- a node killed -9 is reaped (within a lease): no dead-node alert ------------------
    victim = NodeProc()
    rack["procs"].append(victim)
    victim.attach(pool_path)
    wait_for(lambda: prom.query(f'max(cxlkv_nodes{{state="alive",pool="{uuid}"}}) >= 4'),
             timeout=30, what="the victim alive in the metrics")
    victim.kill()
    wait_for(lambda: prom.query(f'max(cxlkv_nodes{{state="alive",pool="{uuid}"}}) == 3'),
             timeout=30, what="the victim gone from the metrics")
    assert "CxlkvDeadNodeNotReaped" not in prom.firing()
    assert prom.query("max_over_time(cxlkv_dead_nodes_unreaped_seconds[1m]) > 1") == []

    # -- pin the pool full --------------------------------------------------------------
    pinned = _pin_pool_full(q, data_bytes)
    assert pinned * BLOCK >= 0.95 * data_bytes, pinned
    firing = wait_for(lambda: (lambda f: f if "CxlkvPoolUnevictableCritical" in f else None)(
        prom.firing()), timeout=30, what="CxlkvPoolUnevictableCritical")
    assert firing["CxlkvPoolUnevictableCritical"] == [
        {"alertname": "CxlkvPoolUnevictableCritical", "pool": uuid, "severity": "critical"}]
    assert "CxlkvPoolUnevictableHigh" in firing
    # the per-agent verdict follows: health CRITICAL in both agents
    wait_for(lambda: len(prom.query("cxlkv_health_status >= 2")) == 2, timeout=30,
             what="both agents CRITICAL")

    # -- every metric of the rules and the dashboard, with the labels they use ---------
    exprs = [r["expr"] for r in all_rules()] + [concrete(e) for _, e in dashboard_exprs()]
    wanted: dict[str, set] = {}
    for e in exprs:
        names = metric_names(e)
        for n in names:
            wanted.setdefault(n, set())
            if len(names) == 1:
                wanted[n] |= labels_used(e)
    exported = set()
    for a in rack["targets"]:
        with urllib.request.urlopen(f"http://{a}/metrics", timeout=10) as r:
            exported |= set(re.findall(r"(?m)^# TYPE (\w+) ", r.read().decode()))
    for name, labels in sorted(wanted.items()):
        if name in NOT_LIVE:
            assert name not in exported, f"{name} is exported: drop it from NOT_LIVE"
            continue
        series = prom.api("series", **{"match[]": name, "start": t0})
        assert series, f"no series {name}"
        for s in series:
            need = labels | ({"pool"} if name != "up" else set())
            assert need <= set(s), f"{name} lacks {need - set(s)}: {s}"
            if name != "up":
                assert s["pool"] == uuid and s["job"] == "cxlkv"

    # -- kill -9 an agent: it is down, and the standby lock manager with it -------------
    a, b = rack["agents"]
    b.kill()
    firing = wait_for(lambda: (lambda f: f if {"CxlkvAgentDown",
                                               "CxlkvLockManagerStandbyMissing"} <= set(f)
                               else None)(prom.firing()),
                      timeout=30, what="CxlkvAgentDown and CxlkvLockManagerStandbyMissing")
    assert [x["instance"] for x in firing["CxlkvAgentDown"]] == [rack["targets"][1]]
    assert [x["pool"] for x in firing["CxlkvLockManagerStandbyMissing"]] == [uuid]
    # the surviving agent's lock manager is (or becomes) the active one
    wait_for(lambda: prom.query(f'cxlkv_lock_manager_active{{instance="{rack["targets"][0]}"}}'
                                ' == 1'), timeout=30, what="agent a's lock manager active")

    # -- every dashboard query returns data over the run ---------------------------------
    end = time.time()
    for title, e in dashboard_exprs():
        got = prom.api("query_range", query=concrete(e, pool=uuid), start=t0, end=end,
                       step="1s")["result"]
        assert got, f"panel {title!r}: no data for {e}"
