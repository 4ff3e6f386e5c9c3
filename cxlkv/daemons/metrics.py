"""The agent's Prometheus metrics (prometheus-client) and its HTTP endpoint.

GET /metrics   the text exposition format
GET /healthz   200 when the pool and the agent are healthy (OK or WARNING),
               503 when not (CRITICAL or UNKNOWN); the body is the status line

Every series carries a `pool` label: the pool's UUID (once the agent has
opened it), so that several pools scraped by one Prometheus stay apart and
the series of one pool can be grouped whatever the scrape's own labels are.

Two kinds of series, told apart by POOL_WIDE:

* pool-wide figures (bytes by state, KV counters per namespace, nodes by
  state, the quarantine, the lock manager's heartbeat, the hash table's
  limits) are read from the pool by the agent's snapshot, taken every tick.
  Every agent of the pool exports the same figures, so aggregate them with
  `max by (pool)` (never `sum`: that would multiply them by the number of
  agents); the recording rules in cxlkv/data/prometheus do it.  Every agent
  exports them rather than one elected agent: the pool has no leader role
  outside sync mode manager (and there the lock manager may run outside an
  agent), a handover would move the series between targets, and any one
  agent down or unscraped would take the pool's figures with it.
* figures of the agent itself (its reaps, evictions, lock waits, ticks, its
  health verdict, the lock manager it hosts; with --spill-dir the host's
  spill store, cxlkv_spill_*; with --remote-push its remote client and
  write-behind, cxlkv_remote_*): `sum by (pool)` adds them up.

No `_created` series are exported (they only double the series count), and
the write-behind's cxlkv_remote_push_* series exist only with --remote-push.
"""
from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cxlkv import __version__
from cxlkv.errors import RefusedError, UsageError
from cxlkv.kv.tiers.spill import Collector
from cxlkv.remote.metrics import Collector as RemoteCollector

#: lock waits: 1 us (uncontended cas) .. 10 s (a lock manager failing over)
LOCK_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)

#: the label every series carries: the pool's UUID
POOL_LABEL = "pool"

#: the pool-wide families (the same in every agent of the pool: aggregate them with
#: `max by (pool)`); every other family is the agent's own (`sum by (pool)`)
POOL_WIDE = frozenset({
    "cxlkv_pool_bytes", "cxlkv_pool_data_bytes", "cxlkv_pool_unevictable_ratio",
    "cxlkv_pool_lease_seconds", "cxlkv_pool_quarantine_grace_seconds",
    "cxlkv_kv_hits", "cxlkv_kv_misses", "cxlkv_kv_stores", "cxlkv_kv_evictions",
    "cxlkv_kv_stored_bytes", "cxlkv_kv_loaded_bytes",
    "cxlkv_kv_blocks", "cxlkv_kv_entries", "cxlkv_kv_max_entries", "cxlkv_kv_hash_slots",
    "cxlkv_kv_tombstones", "cxlkv_nodes", "cxlkv_nodes_by_version",
    "cxlkv_dead_nodes_unreaped", "cxlkv_dead_nodes_unreaped_seconds",
    "cxlkv_quarantined_nodes", "cxlkv_quarantined_bytes", "cxlkv_quarantine_oldest_seconds",
    "cxlkv_lock_manager_up", "cxlkv_node_pinned_blocks", "cxlkv_node_pinned_bytes",
})


def version_label(sw_version: str) -> str:
    """A node's software version as a label value without spaces:
    'cxlkv 0.9.0' -> '0.9.0' (any other blank run becomes '_')."""
    v = sw_version.strip()
    if v.startswith("cxlkv "):
        v = v[len("cxlkv "):].strip()
    return re.sub(r"\s+", "_", v) or "unknown"


class AgentMetrics:
    """The registry of one agent: its own counters plus a collector over its snapshot."""

    def __init__(self, agent):
        self.agent = agent
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reaps = Counter("cxlkv_reaps", "Dead nodes this agent (or its lock manager) "
                                            "reaped and recovered.", registry=r)
        self.evicted_blocks = Counter("cxlkv_agent_evicted_blocks",
                                      "KV blocks this agent evicted to restore the free-space "
                                      "watermark.", registry=r)
        self.evicted_bytes = Counter("cxlkv_agent_evicted_bytes",
                                     "Slot bytes this agent evicted to restore the watermark.",
                                     registry=r)
        self.lock_wait = Histogram("cxlkv_lock_wait_seconds",
                                   "Time this agent waited for the pool lock (each tick's probe "
                                   "and its evictions).", buckets=LOCK_BUCKETS, registry=r)
        self.ticks = Counter("cxlkv_agent_ticks", "Maintenance rounds run.", registry=r)
        self.poison_records = Counter("cxlkv_poison_records", "Poison records this agent "
                                      "handled, by outcome (quarantined, critical: in "
                                      "metadata, outside-pool, cleared).", ["outcome"],
                                      registry=r)
        r.register(SnapshotCollector(agent))
        r.register(_AgentInfo(agent))
        r.register(PinsCollector(lambda: agent.snapshot))

        r.register(Collector(lambda: agent.spill))
        r.register(RemoteCollector(lambda: agent.remote))
        if agent.cfg.remote_push:                   # the write-behind's, only when on
            self.push_scans = Counter("cxlkv_remote_push_scans", "Write-behind passes "
                                      "(--remote-push).", registry=r)
            self.push_journal_records = Counter(
                "cxlkv_remote_push_journal_records", "Change-journal records the write-behind "
                "read.", registry=r)
            self.push_journal_resyncs = Counter(
                "cxlkv_remote_push_journal_resyncs", "Full passes over the hash table the "
                "write-behind made instead of reading the change journal (its first pass, a "
                "ring overrun, a torn record, a node slot used again).", registry=r)
            self.push_blocks = Counter("cxlkv_remote_push_selected_blocks",
                                       "Blocks the write-behind selected, by outcome: queued, "
                                       "present (the cluster had them), changed (evicted or "
                                       "replaced while copied: skipped).", ["outcome"], registry=r)
            self.push_errors = Counter("cxlkv_remote_push_errors", "Write-behind passes that "
                                       "failed (logged).", registry=r)

        self._exported = _Exported(self.registry, agent)

    def exposition(self) -> bytes:
        return generate_latest(self._exported)


class _Exported:
    """What /metrics serves: the registry's families without their `_created`
    samples, each sample labelled with the pool's UUID (once known)."""

    def __init__(self, registry, agent):
        self.registry, self.agent = registry, agent
        self.pool_uuid = ""

    def _uuid(self) -> str:
        if not self.pool_uuid:
            pool = self.agent.pool
            sb = getattr(pool, "sb", None) if pool is not None else None
            if sb is not None:
                self.pool_uuid = str(sb.uuid)
        return self.pool_uuid

    def collect(self):
        uuid = self._uuid()
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                if s.name.endswith("_created") and fam.type in ("counter", "histogram",
                                                                 "summary", "gaugehistogram"):
                    continue
                labels = {**s.labels, POOL_LABEL: uuid} if uuid else s.labels
                out.samples.append(s._replace(labels=labels))
            yield out


class _AgentInfo:
    """Collector: cxlkv_agent_info, 1 while attached, labelled with the
    agent's node slot, host, pid and version (for joins and the dashboard)."""

    def __init__(self, agent):
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        pool = self.agent.pool
        node = getattr(pool, "node", None) if pool is not None else None
        if node is None or node.slot < 0:
            return
        g = GaugeMetricFamily("cxlkv_agent_info", "1 while this agent is attached: its node "
                                                  "slot, host, pid and cxlkv version.",
                              labels=["node", "host", "pid", "sw_version"])
        g.add_metric([str(node.slot), socket.gethostname(), str(os.getpid()),
                      version_label(f"cxlkv {__version__}")], 1)
        yield g


class SnapshotCollector:
    """Collector: the agent's latest view of the pool (pool-wide, POOL_WIDE;
    the health verdict and the hosted lock manager's role are the agent's).

    It also keeps, across scrapes, when it first saw each dead node still
    unreaped (so the age it exports has the scrape interval's resolution)."""

    def __init__(self, agent):
        self.agent = agent
        self._dead_since: dict[tuple[int, int], float] = {}   # (slot, epoch) -> monotonic

    def describe(self):
        return []

    def collect(self):
        s = self.agent.snapshot
        if not s:
            return
        pool = self.agent.pool
        sb = getattr(pool, "sb", None) if pool is not None else None
        if sb is not None:
            yield GaugeMetricFamily("cxlkv_pool_lease_seconds", "The pool's lease: a node "
                                    "whose heartbeat stops for this long is dead.",
                                    value=sb.lease_ms / 1000.0)
            yield GaugeMetricFamily("cxlkv_pool_quarantine_grace_seconds",
                                    "How long a fenced node's memory stays quarantined at "
                                    "most, unless it acknowledges or is proven gone.",
                                    value=sb.quarantine_grace_ms / 1000.0)
        u = s.get("usage")
        if u:
            g = GaugeMetricFamily("cxlkv_pool_bytes", "Data-area bytes by state (slot bytes).",
                                  labels=["state"])
            for state, v in u["bytes"].items():
                g.add_metric([state], v)
            yield g
            yield GaugeMetricFamily("cxlkv_pool_data_bytes", "Size of the data area.",
                                    value=u["data_bytes"])
            yield GaugeMetricFamily("cxlkv_pool_unevictable_ratio",
                                    "Unevictable bytes over the data area (what health judges).",
                                    value=u["unevictable_pct"] / 100.0)
        kv = s.get("kv")
        if kv is not None:
            yield from self._kv(kv)
        nodes = s.get("nodes")
        if nodes:
            yield from self._nodes(nodes, s.get("health"), s.get("at", time.monotonic()))
        q = s.get("quarantine")
        if q is not None:
            yield GaugeMetricFamily("cxlkv_quarantined_nodes",
                                    "Fenced nodes whose quarantine has not ended (stalled past "
                                    "their lease, or dead on another host).",
                                    value=len(q["nodes"]))
            yield GaugeMetricFamily("cxlkv_quarantined_bytes",
                                    "Bytes fenced nodes still hold: reserved payload slots and "
                                    "pinned blocks, not reused until the quarantine ends.",
                                    value=q["bytes"])
            seen = [x["seen_fenced_s"] for x in q["nodes"] if x.get("seen_fenced_s") is not None]
            yield GaugeMetricFamily("cxlkv_quarantine_oldest_seconds",
                                    "How long the oldest quarantined node has been seen fenced "
                                    "(0: none).", value=max(seen, default=0.0))
        dev = s.get("device")
        if dev and dev.get("memdevs"):
            g = GaugeMetricFamily("cxlkv_device_temperature_celsius",
                                  "CXL memdev temperature (only devices that report one).",
                                  labels=["device", "memdev"])
            for m in dev["memdevs"]:
                if isinstance(m.get("temperature_c"), (int, float)):
                    g.add_metric([dev["device"], m["memdev"]], m["temperature_c"])
            yield g
        if dev and dev.get("memdevs"):
            for key, name, help_ in (
                    ("life_used_percent", "cxlkv_device_life_used_percent",
                     "CXL memdev life used, % (cxl list -H; devices that report it)."),
                    ("dirty_shutdowns", "cxlkv_device_dirty_shutdowns",
                     "CXL memdev dirty shutdown count (cxl list -H)."),
                    ("volatile_errors", "cxlkv_device_volatile_errors",
                     "CXL memdev volatile error count (cxl list -H).")):
                g = GaugeMetricFamily(name, help_, labels=["device", "memdev"])
                for m in dev["memdevs"]:
                    v = m.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        g.add_metric([dev["device"], m["memdev"]], v)
                yield g
        if dev:
            yield GaugeMetricFamily("cxlkv_device_alarms", "Health alarms the pool's CXL "
                                    "memdevs raise (cxl list -H), as this agent last read them.",
                                    value=len(dev.get("alarms") or ()))
        h = s.get("health")
        pz = h.data.get("poison") if h is not None else None
        if pz is not None:
            yield GaugeMetricFamily("cxlkv_poison_retired_chunks",
                                    "Chunks retired for poison / media errors (on media).",
                                    value=pz["chunks"])
            yield GaugeMetricFamily("cxlkv_poison_retired_bytes",
                                    "Bytes of the retired chunks.", value=pz["bytes"])
            yield GaugeMetricFamily("cxlkv_poison_metadata_hits",
                                    "Poisoned ranges in pool metadata (re-format).",
                                    value=pz["metadata_hits"])
        if h is not None:
            yield GaugeMetricFamily("cxlkv_health_status", "0 OK, 1 WARNING, 2 CRITICAL, "
                                                           "3 UNKNOWN (as cxlkv health).",
                                    value=h.status)
            verdict = h.data.get("lock_manager")
            if verdict is not None:
                yield GaugeMetricFamily("cxlkv_lock_manager_up",
                                        "Sync mode manager: 0 when no lock manager has "
                                        "heartbeated for a lease, else 1.",
                                        value=0 if verdict == "dead" else 1)
        if s.get("manager") is not None:
            yield GaugeMetricFamily("cxlkv_lock_manager_active",
                                    "1 while the lock manager hosted by this agent is the "
                                    "active one, 0 while it stands by.",
                                    value=1 if s["manager"] else 0)

    @staticmethod
    def _kv(kv):
        fams = {k: CounterMetricFamily(f"cxlkv_kv_{k}", help_, labels=["namespace"])
                for k, help_ in (("hits", "KV blocks found by lookups."),
                                 ("misses", "KV blocks looked up and not found."),
                                 ("stores", "KV blocks stored."),
                                 ("evictions", "KV blocks evicted."),
                                 ("stored_bytes", "Payload bytes stored."),
                                 ("loaded_bytes", "Payload bytes loaded (copied out of the "
                                                  "pool by lookups)."))}
        blocks = GaugeMetricFamily("cxlkv_kv_blocks", "KV blocks held.", labels=["namespace"])
        for ns in kv["namespaces"]:
            for k, fam in fams.items():
                fam.add_metric([ns["namespace"]], ns[k])
            blocks.add_metric([ns["namespace"]], ns["blocks"])
        yield from fams.values()
        yield blocks
        yield GaugeMetricFamily("cxlkv_kv_entries", "Live hash-table entries.",
                                value=kv["entries"])
        yield GaugeMetricFamily("cxlkv_kv_max_entries", "Live entries the hash table takes "
                                "at most (its slots times the pool's max load).",
                                value=kv["max_entries"])
        yield GaugeMetricFamily("cxlkv_kv_hash_slots", "Slots of the hash table.",
                                value=kv["hash_slots"])
        yield GaugeMetricFamily("cxlkv_kv_tombstones", "Hash-table slots holding tombstones.",
                                value=kv["tombstones"])

    def _nodes(self, nodes, h, at):
        g = GaugeMetricFamily("cxlkv_nodes", "Node slots by state, as this agent judges "
                                             "them.", labels=["state"])
        for state in ("alive", "dead", "unknown", "free"):
            g.add_metric([state], nodes.get(state, 0))
        yield g
        v = GaugeMetricFamily("cxlkv_nodes_by_version", "Attached nodes by software and "
                                                        "format version.",
                              labels=["sw_version", "format_version"])
        for (sw, fmt), n in sorted(nodes.get("versions", {}).items()):
            v.add_metric([version_label(sw), str(fmt)], n)
        yield v
        # dead and still attached: not fenced, nothing of theirs recovered yet
        dead = [] if h is None else [d for d in h.data.get("nodes", {}).get("dead_nodes", ())
                                     if d.get("state") == "attached"]
        keys = {(d["slot"], d["epoch"]) for d in dead}
        for k in list(self._dead_since):
            if k not in keys:
                del self._dead_since[k]
        for k in keys:
            self._dead_since.setdefault(k, at)
        yield GaugeMetricFamily("cxlkv_dead_nodes_unreaped", "Nodes judged dead and not "
                                "reaped yet (still attached: locks, pins and reservations "
                                "not recovered).", value=len(keys))
        yield GaugeMetricFamily("cxlkv_dead_nodes_unreaped_seconds",
                                "How long the oldest of them has been seen dead by this "
                                "agent (resolution: the scrape interval; 0: none).",
                                value=max((at - t for t in self._dead_since.values()),
                                          default=0.0))


# -- who pins what (per node; ops helper "ops" owns this part) ----------------------

class PinsCollector:
    """cxlkv_node_pinned_blocks / _bytes{node, pid, host}: the KV blocks each
    node (attached, or fenced and quarantined; host "unknown" while a slot is
    being claimed, before its identity is written) pins, from the agent's last
    snapshot - the engine to restart when health says unevictable.  A pool-wide
    view: every agent exports the same series, so aggregate with max, not sum."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        pins = (self.snapshot() or {}).get("pins")
        if pins is None:
            return
        labels = ["node", "pid", "host"]
        blocks = GaugeMetricFamily("cxlkv_node_pinned_blocks", "KV blocks a node pins (readers "
                                   "holding them: not evictable).", labels=labels)
        nbytes = GaugeMetricFamily("cxlkv_node_pinned_bytes", "Slot bytes of the KV blocks a "
                                   "node pins.", labels=labels)
        for x in pins:
            # a slot being claimed has no identity yet: Prometheus drops an
            # empty label, so the series would lack `host`
            key = [str(x["slot"]), str(x["pid"]), x["hostname"] or "unknown"]
            blocks.add_metric(key, x["pinned_blocks"])
            nbytes.add_metric(key, x["pinned_bytes"])
        yield blocks
        yield nbytes


def parse_addr(text: str) -> tuple[str, int]:
    """HOST:PORT ([IPv6]:PORT); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--metrics-addr {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9464")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "127.0.0.1", int(port)


class MetricsServer:
    """A small threaded HTTP server for /metrics and /healthz."""

    def __init__(self, addr: str, metrics: AgentMetrics, healthz, log=None):
        host, port = parse_addr(addr)
        self.metrics, self.healthz, self.log = metrics, healthz, log

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):                                  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = outer.metrics.exposition(), CONTENT_TYPE_LATEST, 200
                elif path == "/healthz":
                    ok, line = outer.healthz()
                    body, ctype, code = (line + "\n").encode(), "text/plain; charset=utf-8", \
                        200 if ok else 503
                else:
                    body, ctype, code = b"not found: try /metrics or /healthz\n", \
                        "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):                 # quiet: scrapes are not news
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self.httpd = Server((host, port), Handler)
        except OSError as e:
            hint = ("choose another --metrics-addr port" if e.errno == errno.EADDRINUSE else
                    "choose an address of this host for --metrics-addr (127.0.0.1, or one "
                    "`ip addr` lists)" if e.errno == errno.EADDRNOTAVAIL else
                    "check --metrics-addr")
            raise RefusedError(f"cannot listen on {addr} for metrics: {e.strerror or e}",
                               hint=hint) from None
        self.address = self.httpd.server_address[:2]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="cxlkv-metrics",
                                       kwargs={"poll_interval": 0.2}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.thread.ident is not None:       # shutdown() waits for a loop that started
            self.httpd.shutdown()
        self.httpd.server_close()
