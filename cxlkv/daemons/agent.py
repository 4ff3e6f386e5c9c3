"""`cxlkv serve`: the node agent of one host.

It attaches to the pool as a node and then, until SIGTERM:

* heartbeats and reaps dead nodes - state.nodes' heartbeat and reaper
  threads, every lease/4: a node of this host whose process is gone is
  reaped at the next scan, any other node once its heartbeat has not moved
  for a lease on this agent's clock; reaping revokes its lock, drops its
  pins and reclaims its reservations (the recoveries state/ and kv/
  register).  In sync mode manager the lock manager reaps instead;
  --with-lock-manager hosts one (standby unless none is active), so every
  host can carry it;
* every tick (--interval): keeps free space in the data area at or above
  the KV low watermark (5 %): below it, evicts unpinned KV blocks, least
  recently used and leaf first, until 10 % is free - so stores do not
  have to evict inline, and allocations outside the KV cache do not fail;
  times one pool-lock acquisition (the lock wait histogram); takes a
  snapshot of the pool for the metrics and /healthz (cxlkv.daemons.health);
  every minute reads the CXL device's health;
* serves Prometheus metrics and /healthz on --metrics-addr (loopback
  unless told otherwise).

SIGTERM or SIGINT: stop ticking, detach (its own recovery runs: nothing of
it outlives the slot), stop the lock manager and the HTTP server, exit 0.
A second signal kills the process at once (the node is then reaped by the
others after its lease).  Logs go to stderr; log_json gives one JSON object
a line.  Under systemd (Type=notify) it reports READY=1 and STOPPING=1.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, fields

from cxlkv.errors import CxlkvError, RefusedError, UsageError
from cxlkv.state import nodes as N

DEVICE_REFRESH_S = 60.0


# -- configuration ------------------------------------------------------------------

@dataclass
class AgentConfig:
    pool: str | None = None
    metrics_addr: str | None = None
    with_lock_manager: bool = False
    numa_node: str | None = None
    interval: float = 1.0
    log_json: bool = False
    warn_used: float = 80.0
    crit_used: float = 95.0
    warn_temp: float = 70.0
    crit_temp: float = 85.0
    force: bool = False


_TYPES = {f.name: f.type for f in fields(AgentConfig)}


def load_config(path: str) -> dict:
    """A TOML file's settings as {option_name: value} (keys as the long flags,
    with - or _; a [serve] table or top-level keys).  UsageError on unknown
    keys or wrong types."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from None
    if isinstance(doc.get("serve"), dict):
        doc = {**{k: v for k, v in doc.items() if k != "serve"}, **doc["serve"]}
    out = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name not in _TYPES:
            known = ", ".join(sorted(k.replace("_", "-") for k in _TYPES))
            raise UsageError(f"--config {path}: unknown setting {key!r} (known: {known})")
        want = _TYPES[name]
        ok = (isinstance(value, bool) if "bool" in want else
              isinstance(value, (int, float)) and not isinstance(value, bool) if "float" in want
              else isinstance(value, (str, int)) and not isinstance(value, bool))
        if not ok:
            raise UsageError(f"--config {path}: {key} = {value!r} has the wrong type "
                             f"(expected {want.split(' |')[0]})")
        out[name] = str(value) if name in ("numa_node", "pool", "metrics_addr") else value
    return out


# -- logging ------------------------------------------------------------------------

class _JsonFormatter(logging.Formatter):
    def format(self, record):
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
               "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record):
        f = getattr(record, "fields", {})
        extra = "".join(f" {k}={v}" for k, v in f.items())
        lvl = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"cxlkv serve: {lvl}{record.getMessage()}{extra}"


def make_logger(log_json: bool, stream=None) -> logging.Logger:
    log = logging.getLogger(f"cxlkv.serve.{id(stream)}")
    log.handlers.clear()
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(_JsonFormatter() if log_json else _TextFormatter())
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError:
        pass


# -- reaps are counted by a recovery hook ----------------------------------------------

_AGENTS: dict[int, "Agent"] = {}      # id(pool object) -> the agent it belongs to


@N.register_recovery(order=99)
def _count_reap(pool, slot: int, epoch: int) -> None:
    agent = _AGENTS.get(id(pool))
    if agent is None:
        return
    if (slot, epoch) in agent.own:
        return                                   # our own detach, not a reap
    agent.metrics.reaps.inc()
    agent.event(logging.INFO, "reaped a dead node", node=slot, epoch=epoch)


# -- the hosted lock manager --------------------------------------------------------

class ManagerThread:
    """A lock manager run by the agent: standby, taking over whenever no
    other is active, until stopped."""

    def __init__(self, agent, path: str):
        self.agent, self.path = agent, path
        self.mgr = None
        self.stopping = False
        self.active = False
        self.error: CxlkvError | None = None
        self.thread = threading.Thread(target=self._run, name="cxlkv-lock-manager", daemon=True)

    def _log(self, msg: str) -> None:
        if msg.startswith("active"):
            self.active = True
        elif "stepping down" in msg or msg == "stopped":
            self.active = False
        self.agent.event(logging.INFO, f"lock manager: {msg}")

    def start(self) -> None:
        from cxlkv.daemons.lockmgr import LockManager

        self.mgr = LockManager(self.path, standby=True, log=self._log)   # refuses cas pools
        _AGENTS[id(self.mgr.pool)] = self.agent
        self.thread.start()

    def _run(self) -> None:
        from cxlkv.daemons.lockmgr import LockManager, ManagerExists

        while not self.stopping:
            try:
                self.mgr.run()
            except ManagerExists:
                self.active = False
            except CxlkvError as e:
                if not self.stopping:
                    self.agent.event(logging.ERROR, f"lock manager: {e}")
            finally:
                _AGENTS.pop(id(self.mgr.pool), None)
                try:
                    self.mgr.close()
                except Exception:  # noqa: BLE001 - closing a half-broken manager
                    pass
                self.active = False
            if self.stopping:
                return
            try:
                self.mgr = LockManager(self.path, standby=True, log=self._log)
                _AGENTS[id(self.mgr.pool)] = self.agent
            except CxlkvError as e:
                self.agent.event(logging.ERROR, f"lock manager: cannot restart: {e}")
                return

    def stop(self, timeout: float) -> None:
        self.stopping = True
        if self.mgr is not None:
            self.mgr.stop = True
        self.thread.join(timeout)


# -- the agent --------------------------------------------------------------------

class Agent:
    def __init__(self, cfg: AgentConfig, log: logging.Logger | None = None):
        from cxlkv.daemons.health import Thresholds
        from cxlkv.daemons.metrics import AgentMetrics

        if not cfg.pool:
            raise UsageError("no pool given (--pool PATH, CXLKV_POOL or `pool` in --config)")
        if cfg.interval <= 0:
            raise UsageError("--interval must be positive")
        if cfg.warn_used > cfg.crit_used or cfg.warn_temp > cfg.crit_temp:
            raise UsageError("a warning threshold is above its critical one")
        if cfg.metrics_addr:
            from cxlkv.daemons.metrics import parse_addr

            parse_addr(cfg.metrics_addr)                # a usage error before attaching
        self.cfg = cfg
        self.log = log or make_logger(cfg.log_json)
        self.th = Thresholds(cfg.warn_used, cfg.crit_used, cfg.warn_temp, cfg.crit_temp)
        self.metrics = AgentMetrics(self)
        self.pool = None
        self.area = None
        self.manager: ManagerThread | None = None
        self.server = None
        self.snapshot: dict = {}
        self.observer = None
        self.mgr_watch = None
        self.device = None
        self._device_at = -1e9
        self._last_error = ""
        self._last_status = None
        self.stop_event = threading.Event()
        self.own: set[tuple[int, int]] = set()     # (slot, epoch) this agent attached as

    def event(self, level: int, msg: str, **fields) -> None:
        self.log.log(level, msg, extra={"fields": fields})

    # -- start / stop ----------------------------------------------------------------
    def start(self) -> None:
        from cxlkv.pool.pool import Pool

        cfg = self.cfg
        with Pool.open(cfg.pool, writable=False, force=cfg.force) as p:
            sync, lease_ms = p.sb.sync, p.sb.lease_ms
        if cfg.with_lock_manager:
            if sync != "manager":
                raise RefusedError(f"{cfg.pool} is in sync mode {sync}: it has no lock manager "
                                   "(--with-lock-manager is for pools formatted with --sync "
                                   "manager)", path=cfg.pool)
            self.manager = ManagerThread(self, cfg.pool)
            self.manager.start()
        try:
            self._attach()
            if cfg.metrics_addr:
                from cxlkv.daemons.metrics import MetricsServer

                self.server = MetricsServer(cfg.metrics_addr, self.metrics, self.healthz)
                self.server.start()
                self.event(logging.INFO, f"metrics on {self.server.url}/metrics",
                           metrics_url=self.server.url)
            self.tick()
        except BaseException:
            self.shutdown()
            raise
        self.event(logging.INFO, "ready", pool=cfg.pool, sync=sync, lease_ms=lease_ms,
                   interval=cfg.interval)
        sd_notify("READY=1\nSTATUS=attached")

    def _attach(self) -> None:
        from cxlkv.daemons.health import ManagerWatch
        from cxlkv.pool.pool import Pool

        cfg = self.cfg
        pool = Pool.open(cfg.pool, writable=True, force=cfg.force)
        _AGENTS[id(pool)] = self
        self.pool = pool
        try:
            numa = None
            if cfg.numa_node is not None:
                numa = int(cfg.numa_node) if str(cfg.numa_node).isdigit() else cfg.numa_node
            pool.attach(numa_node=numa)
        except BaseException:
            _AGENTS.pop(id(pool), None)
            self.pool = None
            pool.close()
            raise
        self.own.add((pool.node.slot, pool.node.epoch))
        self.observer = N.Observer(pool)
        self.mgr_watch = ManagerWatch(pool) if pool.sb.sync == "manager" else None
        self.area = None
        from cxlkv.pool import layout as L

        if pool.sb.compat & L.COMPAT_KV:
            from cxlkv.kv.area import Area

            self.area = Area(pool)
        fields_ = {"node": pool.node.slot, "epoch": pool.node.epoch, "pid": os.getpid()}
        b = getattr(pool, "numa", None)
        if b is not None:
            fields_["numa_cpu_node"] = getattr(b, "cpu_node", None)
            fields_["numa_mem_node"] = getattr(b, "mem_node", None)
        self.event(logging.INFO, "attached", **fields_)

    def _detach(self) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        slot = pool.node.slot if pool.node is not None else -1
        try:
            pool.close()
            self._wait_slot_freed(slot)
            self.event(logging.INFO, "detached", node=slot)
        finally:
            _AGENTS.pop(id(pool), None)

    def _wait_slot_freed(self, slot: int) -> None:
        """Sync mode manager: a detach is a request the lock manager answers;
        when it is ours, let it answer before it stops."""
        mt = self.manager
        if slot < 0 or mt is None or not mt.active or mt.mgr is None:
            return
        deadline = time.monotonic() + mt.mgr.lease + 1.0
        while time.monotonic() < deadline and mt.active:
            if N.read_slot(mt.mgr.pool, slot).state == "free":
                return
            time.sleep(0.005)

    def shutdown(self) -> None:
        """Detach, stop the lock manager and the HTTP server (in that order:
        detaching in manager mode needs a lock manager)."""
        sd_notify("STOPPING=1")
        try:
            self._detach()
        finally:
            if self.manager is not None:
                lease = 1.0
                if self.manager.mgr is not None:
                    lease = self.manager.mgr.lease
                self.manager.stop(timeout=lease + 2.0)
            if self.server is not None:
                self.server.stop()
                self.server = None

    def run(self) -> None:
        """Tick until stop_event is set."""
        while not self.stop_event.wait(self.cfg.interval):
            self.tick()

    # -- one round ------------------------------------------------------------------
    def tick(self) -> None:
        from cxlkv.daemons import health as H

        self.metrics.ticks.inc()
        try:
            self._check_fenced()
            u = H.usage(self.pool)
            self._keep_watermark(u)
            self._probe_lock()
            snap = self._snapshot()
        except Exception as e:        # noqa: BLE001 - a daemon keeps going; /healthz says 503
            msg = str(e) if isinstance(e, CxlkvError) else f"{type(e).__name__}: {e}"
            if msg != self._last_error:
                self._last_error = msg
                self.event(logging.ERROR, f"tick failed: {msg}")
            h = H.Health(self.cfg.pool)
            h.add("agent", H.UNKNOWN, f"agent tick failed: {msg}")
            self.snapshot = {**self.snapshot, "health": h}
            return
        self._last_error = ""
        self.snapshot = snap
        st = snap["health"].status
        if st != self._last_status:
            self.event(logging.INFO if st == H.OK else logging.WARNING,
                       f"health {H.STATUS_NAMES[st]}", summary=snap["health"].line())
            self._last_status = st

    def _check_fenced(self) -> None:
        if self.pool is None:                   # a re-attach failed: try again
            self._attach()
            return
        node = self.pool.node
        try:
            node.check()
            return
        except N.NodeFenced:
            pass
        self.event(logging.ERROR, "this node was fenced (its heartbeat stopped for a lease); "
                                  "attaching again", node=node.slot)
        self._detach()
        self._attach()

    def _keep_watermark(self, u: dict) -> None:
        from cxlkv.kv.area import HIGH_WATERMARK, LOW_WATERMARK

        size = u["data_bytes"]
        free = u["bytes"]["free"]
        if self.area is None or free >= LOW_WATERMARK * size or not u["kv_evictable_bytes"]:
            return
        need = int(HIGH_WATERMARK * size) - free
        t0 = time.monotonic()
        with self.pool.lock(timeout=self._lock_timeout()):
            self.metrics.lock_wait.observe(time.monotonic() - t0)
            blocks, nbytes = self.area.evict(need_bytes=need)
        self.metrics.evicted_blocks.inc(blocks)
        self.metrics.evicted_bytes.inc(nbytes)
        self.event(logging.INFO, "evicted KV blocks to restore the free-space watermark",
                   blocks=blocks, bytes=nbytes, free_before=free, data_bytes=size)

    def _lock_timeout(self) -> float:
        return max(1.0, 2 * self.pool.sb.lease_ms / 1000.0)

    def _probe_lock(self) -> None:
        t0 = time.monotonic()
        with self.pool.lock(timeout=self._lock_timeout()):
            self.metrics.lock_wait.observe(time.monotonic() - t0)

    def _snapshot(self) -> dict:
        from cxlkv.daemons import health as H
        from cxlkv.pool import layout as L

        pool = self.pool
        now = time.monotonic()
        if now - self._device_at >= DEVICE_REFRESH_S:
            self._device_at = now
            self.device = H.device_health(pool.path, timeout=5.0)
        h = H.evaluate(pool, self.th, observer=self.observer, manager=self.mgr_watch,
                       deadline=None, device=self.device)
        node = pool.node
        if node is None or node.fenced:
            h.add("agent", H.CRITICAL, "this agent's node is fenced")
        elif node._thread is not None and not node._thread.is_alive():
            h.add("agent", H.CRITICAL, "this agent's heartbeat thread stopped")
        else:
            h.add("agent", H.OK, f"attached as node {node.slot}")
        nodes = dict(h.data["nodes"])
        nodes["free"] = pool.sb.max_nodes - sum(nodes[k] for k in ("alive", "dead", "unknown"))
        vers: dict = {}
        for n in N.read_nodes(pool):
            if n.state == "attached":
                key = (n.sw_version, n.format_version)
                vers[key] = vers.get(key, 0) + 1
        nodes["versions"] = vers
        kv = None
        if pool.sb.compat & L.COMPAT_KV:
            from cxlkv.kv.cache import kv_report

            kv = kv_report(pool)
        return {"usage": h.data["usage"], "kv": kv, "nodes": nodes, "health": h,
                "device": self.device,
                "manager": None if self.manager is None else self.manager.active}

    def healthz(self) -> tuple[bool, str]:
        from cxlkv.daemons import health as H

        h = self.snapshot.get("health")
        if h is None:
            return False, "CXLKV UNKNOWN - the agent has not checked the pool yet"
        return h.status in (H.OK, H.WARNING), h.line()


def serve(cfg: AgentConfig, log: logging.Logger | None = None) -> int:
    """Run an agent in the foreground until SIGTERM/SIGINT; returns 0 after a
    clean detach.  A second signal ends the process at once."""
    agent = Agent(cfg, log)
    stopping = []

    def on_signal(signum, frame):
        if stopping:
            signal.signal(signum, signal.SIG_DFL)          # second signal: now
            os.kill(os.getpid(), signum)
            return
        stopping.append(signum)
        agent.stop_event.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        agent.start()
        try:
            agent.run()
            agent.event(logging.INFO, f"stopping ({signal.Signals(stopping[0]).name})"
                        if stopping else "stopping")
        finally:
            agent.shutdown()
        agent.event(logging.INFO, "stopped")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0
