"""The agent's Prometheus metrics (prometheus-client) and its HTTP endpoint.

GET /metrics   the text exposition format
GET /healthz   200 when the pool and the agent are healthy (OK or WARNING),
               503 when not (CRITICAL or UNKNOWN); the body is the status line

Pool-wide figures (bytes by state, KV counters per namespace, nodes by
state) come from the agent's last snapshot, taken every tick; counters of
what this agent did (reaps, evictions, lock waits) are its own; with
--spill-dir, the spill store's (cxlkv_spill_*, cxlkv.kv.tiers.spill.Collector)
are read from the store at each scrape.
"""
from __future__ import annotations

import errno
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cxlkv.errors import RefusedError, UsageError
from cxlkv.kv.tiers.spill import Collector
from cxlkv.remote.metrics import Collector as RemoteCollector

#: lock waits: 1 us (uncontended cas) .. 10 s (a lock manager failing over)
LOCK_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)


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
        r.register(_Snapshot(agent))
        r.register(PinsCollector(lambda: agent.snapshot))

        r.register(Collector(lambda: agent.spill))
        r.register(RemoteCollector(lambda: agent.remote))
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshot:
    """Collector: the agent's latest view of the pool."""

    def __init__(self, agent):
        self.agent = agent

    def describe(self):
        return []

    def collect(self):
        s = self.agent.snapshot
        if not s:
            return
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
            fams = {k: CounterMetricFamily(f"cxlkv_kv_{k}", help_, labels=["namespace"])
                    for k, help_ in (("hits", "KV blocks found by lookups."),
                                     ("misses", "KV blocks looked up and not found."),
                                     ("stores", "KV blocks stored."),
                                     ("evictions", "KV blocks evicted."))}
            blocks = GaugeMetricFamily("cxlkv_kv_blocks", "KV blocks held.", labels=["namespace"])
            for ns in kv["namespaces"]:
                for k, fam in fams.items():
                    fam.add_metric([ns["namespace"]], ns[k])
                blocks.add_metric([ns["namespace"]], ns["blocks"])
            yield from fams.values()
            yield blocks
            yield GaugeMetricFamily("cxlkv_kv_entries", "Live hash-table entries.",
                                    value=kv["entries"])
        nodes = s.get("nodes")
        if nodes:
            g = GaugeMetricFamily("cxlkv_nodes", "Node slots by state, as this agent judges "
                                                 "them.", labels=["state"])
            for state in ("alive", "dead", "unknown", "free"):
                g.add_metric([state], nodes.get(state, 0))
            yield g
            v = GaugeMetricFamily("cxlkv_nodes_by_version", "Attached nodes by software and "
                                                            "format version.",
                                  labels=["sw_version", "format_version"])
            for (sw, fmt), n in sorted(nodes.get("versions", {}).items()):
                v.add_metric([sw, str(fmt)], n)
            yield v
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
        if s.get("manager") is not None:
            yield GaugeMetricFamily("cxlkv_lock_manager_active",
                                    "1 while the lock manager hosted by this agent is the "
                                    "active one.", value=1 if s["manager"] else 0)


# -- who pins what (per node; ops helper "ops" owns this part) ----------------------

class PinsCollector:
    """cxlkv_node_pinned_blocks / _bytes{node, pid, host}: the KV blocks each
    node (attached, or fenced and quarantined) pins, from the agent's last
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
            key = [str(x["slot"]), str(x["pid"]), x["hostname"]]
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
