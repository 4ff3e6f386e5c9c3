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
* every tick (--interval): keeps free space in the data area above the
  KV low watermark (5 %): below 7.5 % it evicts unpinned KV blocks, least
  recently used and leaf first, until 10 % is free, 256 blocks per
  pool-lock hold - so stores rarely have to evict inline, and allocations
  outside the KV cache do not fail;
  times one pool-lock acquisition (the lock wait histogram); takes a
  snapshot of the pool for the metrics and /healthz (cxlkv.ops.health),
  reading the usage figures once; the tick's lock waits give up as soon as
  the agent is asked to stop;
* with --spill-dir, owns the host's spill store (cxlkv.kv.tiers.spill): the
  blocks its watermark evictions take out of the pool are written there by
  the store's background writers instead of being dropped, and serving
  processes of the host that enable the same directory attach to it as
  readers (they find, promote and add blocks; the agent keeps the size
  limit and the LRU); the store's drops are logged through the agent's
  logger and its counters are in the metrics;
* with --remote-push (and a cluster: the [remote] table of --config, or
  --remote-nodes), pushes published blocks of those namespaces to the
  remote tier (cxlkv.kv.tiers.remote.Pusher, in a thread of its own, every
  --remote-push-interval): version-checked copies, queued on the client's
  bounded queue, sent by its writer; a full queue or a down cluster drops
  them, counted in the metrics and logged once, and /healthz says WARNING
  while the cluster is unreachable;
* every minute reads the CXL device's health, in a thread of its own (a
  slow `cxl list` never delays a tick);
* serves Prometheus metrics and /healthz on --metrics-addr (loopback
  unless told otherwise);
* with --kv-events (or a [kv_events] table), is a candidate publisher of
  the pool's block events for routers (cxlkv.daemons.kv_events): its
  sockets are bound before it attaches, and the one leader of the pool's
  candidates publishes.

SIGTERM or SIGINT: stop ticking, detach (its own recovery runs: nothing of
it outlives the slot), stop the lock manager and the HTTP server, exit 0 -
all within --stop-timeout (5 s).  When the detach cannot finish in time
(another node holds the pool lock its recovery needs) the agent stops
heartbeating, logs a warning and exits 0 all the same: its slot is reaped by
the other nodes (at once on this host, after a lease elsewhere) and its
recovery runs then.  A second signal kills the process at once (the node is
then reaped by the others after its lease).  SIGUSR1 writes the stack of
every thread to stderr (faulthandler: it works while a thread is stuck in a
C call) and the agent runs on.

/healthz answers 503 when the last snapshot is older than max(3 x
--interval, lease) (the tick is stuck), and the `agent` check is CRITICAL
when the node is fenced or one of its threads (heartbeat, reaper, the hosted
lock manager) has died.  Logs go to stderr; log_json gives one JSON object
a line.  Under systemd (Type=notify) it reports READY=1 and STOPPING=1.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from cxlkv.api import Pool
from cxlkv.daemons.config import AgentConfig, kv_events_args, remote_args, spill_args
from cxlkv.daemons.kv_events import KVEventsPublisher
from cxlkv.daemons.lockmgr import LockManager
from cxlkv.daemons.metrics import AgentMetrics, MetricsServer, parse_addr
from cxlkv.daemons.service import make_logger, sd_notify
from cxlkv.errors import CxlkvError, LockTimeout, ManagerExists, RefusedError, UsageError
from cxlkv.host import numa
from cxlkv.host import poison
from cxlkv.kv.area import AGENT_BATCH, AGENT_WATERMARK, HIGH_WATERMARK, Area, pins_by_node
from cxlkv.kv.cache import kv_report, quarantine
from cxlkv.kv.tiers import spill
from cxlkv.kv.tiers.remote import Pusher
from cxlkv.ops import health
from cxlkv.ops.health import ManagerWatch, Thresholds
from cxlkv.pool import layout
from cxlkv.remote import RemoteClient
from cxlkv.state import locks, protocol
from cxlkv.state import nodes as node_table
from cxlkv.state.locks import describe_owner

DEVICE_REFRESH_S = 60.0
#: how often the poison follower reads the cxl_poison trace events
POISON_POLL_S = 2.0
#: the device tools (cxl, ndctl, daxctl) together, per refresh
DEVICE_TIMEOUT_S = 5.0
#: a tick's pool-lock wait is cut in slices this long, to notice a stop request
LOCK_SLICE_S = 0.5


class _Stopping(Exception):
    """A tick's wait given up because the agent is stopping."""


# -- reaps are counted by a recovery hook ----------------------------------------------

_AGENTS: dict[int, "Agent"] = {}      # id(pool object) -> the agent it belongs to


@node_table.register_recovery(order=99)
def _count_reap(pool, slot: int, epoch: int) -> None:
    agent = _AGENTS.get(id(pool))
    if agent is None:
        return
    if (slot, epoch) in agent.own:
        return                                   # our own detach, not a reap
    agent.metrics.reaps.inc()
    try:
        n = node_table.read_slot(pool, slot)
        who = {"pid": n.pid, "host": n.hostname} if n.ident_epoch == epoch and n.pid else {}
    except Exception:                            # noqa: BLE001 - only for the log line
        who = {}
    # a fixed message (log queries match it); who it was is in the fields
    agent.event(logging.INFO, "reaped a dead node", node=slot, epoch=epoch,
                **(who or {"abandoned_attach": True}))


# -- the hosted lock manager --------------------------------------------------------

class ManagerThread:
    """A lock manager run by the agent: standby, taking over whenever no
    other is active, until stopped.  `dead` says why the thread ended when
    it ended without being asked to (the agent reports it CRITICAL)."""

    def __init__(self, agent, path: str):
        self.agent, self.path = agent, path
        self.mgr = None
        self.stopping = False
        self.active = False
        self.error: CxlkvError | None = None
        self.dead = ""
        self.thread = threading.Thread(target=self._run, name="cxlkv-lock-manager", daemon=True)

    def _log(self, msg: str) -> None:
        if msg.startswith("active"):
            self.active = True
        elif "stepping down" in msg or msg == "stopped":
            self.active = False
        self.agent.event(logging.INFO, f"lock manager: {msg}")

    def start(self) -> None:
        self.mgr = LockManager(self.path, standby=True, log=self._log)   # refuses cas pools
        _AGENTS[id(self.mgr.pool)] = self.agent
        self.thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:      # noqa: BLE001 - reported by the agent's health
            self.dead = f"{type(e).__name__}: {e}"
            self.agent.event(logging.ERROR, f"lock manager thread died: {self.dead}")
        else:
            if not self.stopping:
                self.dead = str(self.error or "stopped")
        finally:
            self.active = False

    def alive(self) -> bool:
        return self.thread.is_alive()

    def _loop(self) -> None:
        while not self.stopping:
            try:
                self.mgr.run()
            except ManagerExists:
                self.active = False
            except CxlkvError as e:
                if not self.stopping:
                    self.error = e
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
                self.error = e
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
        if not cfg.pool:
            raise UsageError("no pool given (--pool PATH, CXLKV_POOL or `pool` in --config)")
        if cfg.interval <= 0:
            raise UsageError("--interval must be positive")
        if cfg.warn_used > cfg.crit_used or cfg.warn_temp > cfg.crit_temp:
            raise UsageError("a warning threshold is above its critical one")
        if cfg.stop_timeout <= 0:
            raise UsageError("--stop-timeout must be positive")
        if cfg.metrics_addr:
            parse_addr(cfg.metrics_addr)                # a usage error before attaching
        self.spill_args = spill_args(cfg)
        self.kv_events_args = kv_events_args(cfg.kv_events, cfg.kv_events_table)
        self.kv_events: KVEventsPublisher | None = None
        self.spill = None                           # the spill store this agent owns
        self.remote_args = remote_args(cfg)
        self.remote = None                          # the RemoteClient of the write-behind
        self.pusher = None
        self._push_thread: threading.Thread | None = None
        self._push_error = ""
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
        self._last_error = ""
        self._last_status = None
        self._usage_status = health.OK         # the usage verdict of the last tick
        self.stop_event = threading.Event()
        self.stop_deadline: float | None = None
        self.own: set[tuple[int, int]] = set()     # (slot, epoch) this agent attached as
        self._device_thread: threading.Thread | None = None
        # poison ranges whose blocks readers still pinned: quarantined again each poll
        self._poison_pending: set[tuple[int, int]] = set()
        self.detach_abandoned = False
        self._dax = None                            # the pool's DAX device, None: a file

    def request_stop(self) -> None:
        """Stop ticking; the shutdown that follows has --stop-timeout from now."""
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.cfg.stop_timeout
        self.stop_event.set()

    def event(self, level: int, msg: str, **fields) -> None:
        self.log.log(level, msg, extra={"fields": fields})

    # -- start / stop ----------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        with Pool.open(cfg.pool, writable=False, force=cfg.force) as p:
            sync, lease_ms = p.sb.sync, p.sb.lease_ms
        if cfg.metrics_addr:
            # bound before anything attaches: a port in use fails here, touching nothing
            self.server = MetricsServer(cfg.metrics_addr, self.metrics, self.healthz)
        if cfg.with_lock_manager:
            if sync != "manager":
                raise RefusedError(f"{cfg.pool} is in sync mode {sync}: it has no lock manager "
                                   "(--with-lock-manager is for pools formatted with --sync "
                                   "manager)", path=cfg.pool)
            self.manager = ManagerThread(self, cfg.pool)
            self.manager.start()
        try:
            self._open_spill()
            self._open_remote()
            self._bind_kv_events()
            self._attach()
            self._start_pusher()
            if self.kv_events is not None:
                self.kv_events.start(lambda: self.pool, self._pool_lock)
            if self.server is not None:
                self.server.start()
                self.event(logging.INFO, f"metrics on {self.server.url}/metrics",
                           metrics_url=self.server.url)
            self._start_device_watch()
            self.tick()
        except BaseException:
            self.shutdown()
            raise
        self.event(logging.INFO, "ready", pool=cfg.pool, sync=sync, lease_ms=lease_ms,
                   interval=cfg.interval)
        sd_notify("READY=1\nSTATUS=attached")

    def _attach(self) -> None:
        cfg = self.cfg
        pool = Pool.open(cfg.pool, writable=True, force=cfg.force)
        _AGENTS[id(pool)] = self
        self.pool = pool
        try:
            numa = None
            if cfg.numa_node is not None:
                numa = int(cfg.numa_node) if str(cfg.numa_node).isdigit() else cfg.numa_node
            pool.attach(numa_node=numa, expect_uuid=cfg.pool_uuid)
        except BaseException:
            _AGENTS.pop(id(pool), None)
            self.pool = None
            pool.close()
            raise
        self.own.add((pool.node.slot, pool.node.epoch))
        self.observer = node_table.Observer(pool)
        self.mgr_watch = ManagerWatch(pool) if pool.sb.sync == "manager" else None
        self.area = None

        if pool.sb.compat & layout.COMPAT_KV:
            self.area = Area(pool)
        if self.spill is not None:
            spill.use(pool, self.spill)                # the watermark's evictions spill
        if self.remote is not None and self.area is not None:
            self.pusher = Pusher(pool, self.remote, self.cfg.remote_push,
                                 self.cfg.remote_push_policy,
                                 lock_timeout=max(1.0, 2 * pool.sb.lease_ms / 1000.0),
                                 stop=self.stop_event)
        fields_ = {"node": pool.node.slot, "epoch": pool.node.epoch, "pid": os.getpid()}
        b = getattr(pool, "numa", None)
        if b is not None:
            fields_["numa_cpu_node"] = getattr(b, "cpu_node", None)
            fields_["numa_mem_node"] = getattr(b, "mem_node", None)
        self.event(logging.INFO, "attached", **fields_)

    def _bind_kv_events(self) -> None:
        """--kv-events: bind the PUB and replay sockets (refused, exit 1, when
        an address is taken) before attaching."""
        if self.kv_events_args is None:
            return
        self.kv_events = KVEventsPublisher(self.kv_events_args, self.log)
        self.kv_events.bind()
        self.event(logging.INFO, f"kv events on {self.kv_events.endpoint}",
                   kv_events=self.kv_events.endpoint,
                   kv_events_replay=self.kv_events.replay_endpoint or "none")

    def _open_spill(self) -> None:
        """--spill-dir: open the host's spill store as its owner (refused,
        exit 1, while another process owns the directory)."""
        if self.spill_args is None:
            return

        path, size, qbytes = self.spill_args
        self.spill = spill.SpillStore(path, size, queue_bytes=qbytes, mode="owner", logger=self.log)
        st = self.spill.stats()
        self.event(logging.INFO, "spill store open", spill_dir=path, mode=st["mode"],
                   blocks=st["blocks"], used_bytes=st["used_bytes"], max_bytes=st["max_bytes"])

    def _open_remote(self) -> None:
        """--remote-push: the client of the write-behind (it never fails on a
        cluster that is down: pushes are then dropped, counted)."""
        if self.remote_args is None:
            if self.cfg.remote or self.cfg.remote_nodes:
                self.event(logging.INFO, "remote tier configured without --remote-push: "
                                         "this agent pushes nothing")
            return

        self.remote = RemoteClient(self.remote_args, logger=self.log)
        self.event(logging.INFO, "remote tier", nodes=",".join(self.remote_args.nodes),
                   push=",".join(self.cfg.remote_push), policy=self.cfg.remote_push_policy,
                   wait_replicas=self.remote_args.wait_replicas)

    def _start_pusher(self) -> None:
        if self.remote is None:
            return
        if self.area is None:
            self.event(logging.WARNING, "the pool has no KV region: --remote-push has nothing "
                                        "to push")
            return
        self._push_thread = threading.Thread(target=self._push_loop, daemon=True,
                                             name="cxlkv-remote-push")
        self._push_thread.start()

    def _push_loop(self) -> None:
        while not self.stop_event.wait(self.cfg.remote_push_interval):
            pusher = self.pusher
            if pusher is None or self.pool is None:
                continue
            try:
                got = pusher.scan()
            except Exception as e:                 # noqa: BLE001 - a daemon keeps going
                msg = str(e) if isinstance(e, CxlkvError) else f"{type(e).__name__}: {e}"
                self.metrics.push_errors.inc()
                if msg != self._push_error:
                    self._push_error = msg
                    self.event(logging.WARNING, f"remote push scan failed: {msg}")
                continue
            self._push_error = ""
            for k in ("queued", "present", "changed"):
                self.metrics.push_blocks.labels(k).inc(got[k])
            self.metrics.push_scans.inc()
            self.metrics.push_journal_records.inc(got.get("records", 0))
            self.metrics.push_journal_resyncs.inc(got.get("resyncs", 0))

    def _close_remote(self, deadline: float) -> None:
        """Send what the push queue holds, until the stop deadline."""
        rc = self.remote
        self.remote = self.pusher = None
        if rc is None:
            return
        if not rc.flush(max(0.0, deadline - time.monotonic())):
            self.event(logging.WARNING, "remote push queue not sent within --stop-timeout "
                                        "(those blocks are not pushed)",
                       queued_bytes=rc.stats()["queued_bytes"])
        rc.close(timeout=max(0.1, deadline - time.monotonic()))

    def _close_spill(self, deadline: float) -> None:
        """Write what the spill queue holds, until the stop deadline."""
        sp, self.spill = self.spill, None
        if sp is None:
            return
        if not sp.close(timeout=max(0.0, deadline - time.monotonic())):
            left = sp.stats()["queued_bytes"]
            if left:
                self.event(logging.WARNING, "spill queue not written within --stop-timeout "
                                            "(those blocks are lost)", queued_bytes=left)

    def _detach(self, deadline: float | None = None) -> bool:
        """Detach (its own recovery runs, under the pool lock).  With a
        deadline the detach runs in a thread and is given up when it has not
        finished by then: the node stops heartbeating and stays in the table,
        for the other nodes to reap (at once on this host, after a lease
        elsewhere).  Returns True when the node detached."""
        pool, self.pool = self.pool, None
        if pool is None:
            return True
        node = pool.node
        slot = node.slot if node is not None else -1
        # let the queue pass a ticket a tick gave up before the detach's
        # recovery takes a new one (see _pool_lock), until the stop deadline
        if deadline is not None and not self._ticket_passed(deadline, pool):
            if node is not None:
                node.stop_heartbeats()
            self._abandoned_detach(pool, slot)
            return False
        if deadline is None:
            try:
                pool.close()
                self._wait_slot_freed(slot, None)
                self.event(logging.INFO, "detached", node=slot)
            finally:
                _AGENTS.pop(id(pool), None)
            return True
        box: dict = {}

        def work():
            try:
                pool.close()
            except BaseException as e:          # noqa: BLE001 - re-raised below
                box["e"] = e

        t = threading.Thread(target=work, name="cxlkv-detach", daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            if node is not None:
                node.stop_heartbeats()          # whatever detach waits on
            self._abandoned_detach(pool, slot)
            return False
        _AGENTS.pop(id(pool), None)
        if "e" in box:
            raise box["e"]
        self._wait_slot_freed(slot, deadline)
        self.event(logging.INFO, "detached", node=slot)
        return True

    def _abandoned_detach(self, pool, slot: int) -> None:
        self.detach_abandoned = True
        why = "its recovery needs the pool lock, held by another node"
        try:
            if pool.sb.sync == "cas":
                why = f"its recovery needs the pool lock, held by {describe_owner(pool)}"
            elif not self._manager_running(pool):
                why = ("no lock manager is running to grant the pool lock its recovery needs "
                       "(sync mode manager: were the lock managers stopped first? stop "
                       "cxlkv-serve@ before cxlkv-lock-manager@)")
        except Exception:                       # noqa: BLE001 - only for the message
            pass
        self.event(logging.WARNING,
                   f"could not detach within --stop-timeout {self.cfg.stop_timeout:g} s "
                   f"({why}); exiting without "
                   f"detaching: node {slot} stopped heartbeating and is reaped by the other "
                   "nodes (at once on this host, after a lease elsewhere)", node=slot)

    @staticmethod
    def _manager_running(pool) -> bool:
        """Is a lock manager heartbeating (a short look: the agent is stopping)?"""
        m, h = pool.mapping, protocol.lock_header(pool)
        m.invalidate(h + protocol.MGR_TOKEN, 8)
        token = m.load64(h + protocol.MGR_TOKEN)
        return bool(token) and protocol.heartbeating(pool, token, lease=0.3)

    def _wait_slot_freed(self, slot: int, deadline: float | None) -> None:
        """Sync mode manager: a detach is a request the lock manager answers;
        when it is ours, let it answer before it stops."""
        mt = self.manager
        if slot < 0 or mt is None or not mt.active or mt.mgr is None:
            return
        end = time.monotonic() + mt.mgr.lease + 1.0
        if deadline is not None:
            end = min(end, deadline)
        while time.monotonic() < end and mt.active:
            if node_table.read_slot(mt.mgr.pool, slot).state == "free":
                return
            time.sleep(0.005)

    def shutdown(self) -> None:
        """Detach, stop the lock manager and the HTTP server (in that order:
        detaching in manager mode needs a lock manager), all by the stop
        deadline (--stop-timeout after the stop request)."""
        sd_notify("STOPPING=1")
        deadline = self.stop_deadline
        if deadline is None:
            deadline = time.monotonic() + self.cfg.stop_timeout
        self.stop_event.set()                    # the device watch, too
        t = self._push_thread
        if t is not None:
            # the push thread reads blocks out of the pool: it ends (its pass
            # stops at the next block) before the pool is closed
            t.join(max(0.0, deadline - time.monotonic()))
        if self.kv_events is not None:           # gives the leader flag up before detaching
            self.kv_events.stop(max(0.1, min(2.0, deadline - time.monotonic())))
        try:
            self._detach(deadline)
        finally:
            if self.manager is not None:
                lease = 1.0
                if self.manager.mgr is not None:
                    lease = self.manager.mgr.lease
                self.manager.stop(timeout=max(0.2, min(lease + 2.0,
                                                       deadline - time.monotonic())))
            if self.server is not None:
                self.server.stop()
                self.server = None
            self._close_spill(deadline)
            self._close_remote(deadline)
            t = self._device_thread
            if t is not None:
                t.join(max(0.0, min(0.5, deadline - time.monotonic())))

    def run(self) -> None:
        """Tick until stop_event is set."""
        while not self.stop_event.wait(self.cfg.interval):
            self.tick()

    # -- the device, in a thread of its own ---------------------------------------------
    def _start_device_watch(self) -> None:
        try:
            self._dax = numa.dax_of(self.cfg.pool)
        except Exception:                          # noqa: BLE001 - then: no device figures
            self._dax = None
        if self._dax is None:
            return                                 # a file-backed pool: nothing to read
        self._device_thread = threading.Thread(target=self._device_loop, daemon=True,
                                               name="cxlkv-device")
        self._device_thread.start()
        if poison.supported()["trace_event"]:
            threading.Thread(target=self._poison_loop, daemon=True, name="cxlkv-poison").start()
        else:
            # a DAX pool whose poison nobody follows: said once, not silently skipped
            self.event(logging.WARNING, f"poison: not following poison on {self._dax}: no "
                                        f"cxl_poison trace event at {poison.poison_event_dir()} "
                                        "(tracefs not mounted, or a kernel older than 6.5)")

    def _poison_loop(self) -> None:
        """Poison on the pool's device: the memdevs' poison lists at start,
        then every cxl_poison event, each translated to a pool offset and
        quarantined (its KV blocks evicted, its chunks retired)."""
        try:
            tr = poison.Translator(pool_dax=self._dax, pool_size=self.pool.sb.pool_size)
            mems = sorted({t.memdev for rm in tr.maps.values() for t in rm.targets if t.memdev})
            follower = poison.Follower(mems)
            for why in follower.start():
                self.event(logging.WARNING, f"poison: {why}")
        except Exception as e:                     # noqa: BLE001 - the rest of serve goes on
            self.event(logging.WARNING, f"poison: cannot follow poison events: {e}")
            return
        while not self.stop_event.is_set():
            try:
                for rec in follower.poll():
                    self._on_poison(tr, rec)
                self._poison_retry()
            except Exception as e:                 # noqa: BLE001 - logged, next poll retries
                self.event(logging.ERROR, f"poison: {e}")
            if self.stop_event.wait(POISON_POLL_S):
                return

    def _on_poison(self, tr, rec) -> None:
        if rec.trace_type == "Clear":
            self.metrics.poison_records.labels("cleared").inc()
            return                                 # retirement is for good
        for t in tr.ranges([rec]):
            if t.pool_offset is None or self.pool is None:
                self.metrics.poison_records.labels("outside-pool").inc()
                self.event(logging.WARNING, f"poison {rec.memdev} dpa {rec.dpa:#x} not in "
                                            f"the pool: {t.note or t.dax}")
                continue
            r = quarantine(self.pool, t.pool_offset, t.length, "poison")
            if r["pinned"]:
                self._poison_pending.add((t.pool_offset, t.length))
            self.metrics.poison_records.labels("critical" if r["critical"]
                                               else "quarantined").inc()
            self.event(logging.CRITICAL if r["critical"] else logging.WARNING,
                       f"poison {rec.memdev} dpa {rec.dpa:#x} -> pool offset "
                       f"{t.pool_offset:#x}: {r['evicted_blocks']} block(s) evicted, chunks "
                       f"{r['retired_chunks']} retired, region {r['region']}")

    def _poison_retry(self) -> None:
        """Quarantine again the ranges whose blocks readers still pinned
        (each poll, until every block on them is evicted)."""
        for off, length in sorted(self._poison_pending):
            r = quarantine(self.pool, off, length, "poison")
            if not r["pinned"]:
                self._poison_pending.discard((off, length))
                self.event(logging.WARNING, f"poison at pool offset {off:#x}: the last "
                                            f"{r['evicted_blocks']} pinned block(s) evicted")

    def _device_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.device = health.device_health(self.cfg.pool, timeout=DEVICE_TIMEOUT_S)
            except Exception as e:                 # noqa: BLE001 - figures unknown
                self.device = {"device": self._dax, "memdevs": [], "temperature_c": None,
                               "alarms": [], "error": f"{type(e).__name__}: {e}"}
            if self.stop_event.wait(DEVICE_REFRESH_S):
                return

    # -- one round ------------------------------------------------------------------
    def tick(self) -> None:
        self.metrics.ticks.inc()
        try:
            self._check_fenced()
            u = health.usage(self.pool)                  # once per tick: the watermark and health
            if self._keep_watermark(u):
                u = health.usage(self.pool)              # evicted: the figures changed
            self._probe_lock()
            snap = self._snapshot(u)
        except _Stopping:
            return
        except Exception as e:        # noqa: BLE001 - a daemon keeps going; /healthz says 503
            msg = str(e) if isinstance(e, CxlkvError) else f"{type(e).__name__}: {e}"
            if msg != self._last_error:
                self._last_error = msg
                self.event(logging.ERROR, f"tick failed: {msg}")
            h = health.Health(self.cfg.pool)
            h.add("agent", health.UNKNOWN, f"agent tick failed: {msg}")
            self._agent_checks(h, ok=False)
            self.snapshot = {**self.snapshot, "health": h, "at": time.monotonic()}
            return
        self._last_error = ""
        self.snapshot = snap
        st = snap["health"].status
        if st != self._last_status:
            self.event(logging.INFO if st == health.OK else logging.WARNING,
                       f"health {health.STATUS_NAMES[st]}", summary=snap["health"].line())
            self._last_status = st

    def _check_fenced(self) -> None:
        if self.pool is None:                   # a re-attach failed: try again
            self._attach()
            return
        node = self.pool.node
        try:
            node.check()
            return
        except node_table.NodeFenced:
            pass
        self.event(logging.ERROR, "this node was fenced (its heartbeat stopped for a lease); "
                                  "attaching again", node=node.slot)
        with self._kv_events_out():
            self._detach()
            self._attach()

    def _kv_events_out(self):
        """The KV-events thread stays out of the pool meanwhile."""
        if self.kv_events is None:
            return contextlib.nullcontext()
        return self.kv_events.suspended()

    def _keep_watermark(self, u: dict) -> bool:
        """Evict when free space is below the agent's watermark, up to the
        high one, AGENT_BATCH blocks per pool-lock hold (other nodes wait at
        most one batch); True if it did."""

        size = u["data_bytes"]
        free = u["bytes"]["free"]
        if self.area is None or free >= AGENT_WATERMARK * size or not u["kv_evictable_bytes"]:
            return False
        need = int(HIGH_WATERMARK * size) - free
        blocks = nbytes = 0
        while nbytes < need and not self.stop_event.is_set():
            with self._pool_lock():
                b, n = self.area.evict(need_bytes=need - nbytes, limit=AGENT_BATCH)
            blocks += b
            nbytes += n
            if not b:
                break
        self.metrics.evicted_blocks.inc(blocks)
        self.metrics.evicted_bytes.inc(nbytes)
        self.event(logging.INFO, "evicted KV blocks to restore the free-space watermark",
                   blocks=blocks, bytes=nbytes, free_before=free, data_bytes=size)
        return bool(blocks)

    def _lock_timeout(self) -> float:
        return max(1.0, 2 * self.pool.sb.lease_ms / 1000.0)

    @contextlib.contextmanager
    def _pool_lock(self):
        """The pool lock for a tick: waited for up to two leases, in slices of
        LOCK_SLICE_S, given up (_Stopping) as soon as the agent is asked to
        stop; the wait goes into the lock wait histogram.

        Sync mode cas: a slice that times out gives its ticket up (its lock
        entry says ABANDONED, so the queue skips it at once).  A new ticket
        is taken only once the queue has passed that one: taking it earlier
        would overwrite the entry and leave a ticket nobody claims, which
        costs every waiter a lease."""

        lock = self.pool.lock()
        t0 = time.monotonic()
        deadline = t0 + self._lock_timeout()
        while True:
            if not self._ticket_passed(deadline, stop=self.stop_event):
                if self.stop_event.is_set():
                    raise _Stopping()
                raise LockTimeout(f"{self.pool.path}: timed out waiting for the pool lock "
                                  "(the queue has not reached this agent's last ticket)")
            left = deadline - time.monotonic()
            try:
                lock.acquire(max(0.001, min(LOCK_SLICE_S, left)))
            except LockTimeout:
                if self.stop_event.is_set():
                    raise _Stopping() from None
                if time.monotonic() >= deadline:
                    raise
                continue
            if self.stop_event.is_set():
                lock.release()
                raise _Stopping()
            break
        self.metrics.lock_wait.observe(time.monotonic() - t0)
        try:
            yield lock
        finally:
            lock.release()

    def _ticket_passed(self, deadline: float, pool=None, stop=None) -> bool:
        """Sync mode cas: wait (until `deadline`, or `stop` is set) for the
        ticket queue to pass the ticket this node last gave up.  True when
        there is none, or it has passed; always True in sync mode manager
        (a withdrawn request leaves nothing behind)."""

        pool = pool or self.pool
        if pool.sb.sync != "cas" or pool.node is None or pool.node.slot < 0:
            return True
        m = pool.mapping
        hdr, _ = locks.lock_offsets(pool)
        serving = hdr + layout.field_offset(layout.LockHdrStruct, "now_serving")
        entry = locks.entry_offset(pool, pool.node.slot)
        m.invalidate(entry, 16)
        if m.load64(entry) != layout.LOCK_ABANDONED:
            return True
        ticket = m.load64(entry + 8)
        while True:
            m.invalidate(serving, 8)
            if m.load64(serving) > ticket:
                return True
            if time.monotonic() >= deadline:
                return False
            if stop is not None and stop.wait(0.005):
                return False
            if stop is None:
                time.sleep(0.005)

    def _probe_lock(self) -> None:
        with self._pool_lock():
            pass

    def _snapshot(self, u: dict | None = None) -> dict:
        pool = self.pool
        h = health.evaluate(pool, self.th, observer=self.observer, manager=self.mgr_watch,
                       deadline=None, device=self.device, figures=u)
        self._settle_usage(h)
        self._agent_checks(h)
        nodes = dict(h.data["nodes"])
        nodes["free"] = pool.sb.max_nodes - sum(nodes[k] for k in ("alive", "dead", "unknown"))
        vers: dict = {}
        for n in node_table.read_nodes(pool):
            if n.state == "attached":
                key = (n.sw_version, n.format_version)
                vers[key] = vers.get(key, 0) + 1
        nodes["versions"] = vers
        kv = None
        if pool.sb.compat & layout.COMPAT_KV and not h.data["usage"].get("kv_error"):
            kv = kv_report(pool)
        pins = h.data["pins"] if "pins" in h.data else pins_by_node(pool)
        return {"usage": h.data["usage"], "kv": kv, "nodes": nodes, "health": h,
                "quarantine": h.data["quarantine"], "pins": pins,
                "device": self.device, "at": time.monotonic(),
                "manager": None if self.manager is None else self.manager.active}

    def _settle_usage(self, h) -> None:
        """The usage verdict (unevictable share) counts against the thresholds
        only on the second tick in a row above them: a store in flight holds
        its blocks unevictable (reserved slots, pending entries) for a moment,
        and one tick's peak while another process stores is not a pool pinned
        full (the agent's health flapped to WARNING).  `cxlkv health`, one
        shot, judges at once."""
        for i, c in enumerate(h.checks):
            if c.id != "usage":
                continue
            prev, self._usage_status = self._usage_status, c.status
            if c.status in (health.WARNING, health.CRITICAL) and prev == health.OK:
                h.checks[i] = health.Check(
                    c.id, health.OK, f"{c.text} (above the threshold this tick only: judged "
                    "again at the next; stores in flight count as unevictable)")

    def _agent_checks(self, h, ok: bool = True) -> None:
        """The agent's own state: its node fenced, or one of its threads
        (heartbeat, reaper, the hosted lock manager) dead -> CRITICAL."""

        pool = self.pool
        node = pool.node if pool is not None else None
        mt = self.manager
        bad = []
        if pool is not None and (node is None or node.fenced):
            bad.append("this agent's node is fenced")
        stopped = node.stopped_threads() if node is not None and not node.fenced else []
        if "heartbeat" in stopped:
            bad.append("this agent's heartbeat thread stopped")
        if "reaper" in stopped:
            bad.append("this agent's reaper thread stopped: dead nodes are not reaped"
                       + (f" ({node.reap_error})" if node.reap_error else ""))
        ev = self.kv_events
        if ev is not None and ev.error:
            bad.append(f"this agent's KV-events publisher stopped: {ev.error}")
        if mt is not None and not mt.stopping and not mt.alive():
            bad.append("the lock manager this agent hosts stopped"
                       + (f": {mt.dead}" if mt.dead else ""))
        for text in bad:
            h.add("agent", health.CRITICAL, text)
        rc = self.remote
        st = rc.stats() if rc is not None else None
        if st is not None and (st["unavailable"] or st["failing"]):
            h.add("remote", health.WARNING, "the remote tier's cluster is unreachable or failing "
                                       f"({st['last_error'] or 'backing off'}): pushes are "
                                       "dropped (cxlkv_remote_dropped_blocks_total)")
        if ok and not bad and node is not None:
            h.add("agent", health.OK, f"attached as node {node.slot}")

    def max_snapshot_age(self) -> float:
        """How old the snapshot may get before /healthz stops believing it."""
        lease = 0.0
        pool = self.pool
        if pool is not None:
            lease = pool.sb.lease_ms / 1000.0
        return max(3 * self.cfg.interval, lease)

    def healthz(self) -> tuple[bool, str]:
        snap = self.snapshot
        h = snap.get("health")
        if h is None:
            return False, "CXLKV UNKNOWN - the agent has not checked the pool yet"
        age = time.monotonic() - snap.get("at", 0.0)
        if age > self.max_snapshot_age():
            return False, (f"CXLKV UNKNOWN - {self.cfg.pool}: the agent's last check is "
                           f"{age:.1f} s old (its maintenance tick is stuck); last: "
                           f"{h.line()}")
        return h.status in (health.OK, health.WARNING), h.line()


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):   # io.UnsupportedOperation is an OSError
        return None


def serve(cfg: AgentConfig, log: logging.Logger | None = None) -> int:
    """Run an agent in the foreground until SIGTERM/SIGINT; returns 0 after a
    clean detach.  A second signal ends the process at once."""
    agent = Agent(cfg, log)
    stopping = []
    # The handler runs on the main thread between two bytecodes, perhaps while
    # that thread holds stop_event's own lock (every Event.wait() does for a
    # moment): setting the event there would wait for itself forever.  The
    # handler only writes to a pipe; a thread of its own asks the agent to stop.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(signum, frame):
        if stopping:
            signal.signal(signum, signal.SIG_DFL)          # second signal: now
            os.kill(os.getpid(), signum)
            return
        stopping.append(signum)
        try:
            os.write(wake_w, b"\0")
        except OSError:                                     # the pipe is full: one byte wakes it
            pass

    def relay():
        if os.read(wake_r, 1):                              # b"": serve() is done
            agent.request_stop()

    relay_thread = threading.Thread(target=relay, daemon=True, name="cxlkv-signal")
    relay_thread.start()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    # where is it stuck? kill -USR1 answers on stderr, from the C signal handler
    # (which needs a file descriptor: not under click's test runner)
    dump = _stderr_fd() is not None
    if dump:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
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
        os.close(wake_w)                                    # the relay reads EOF and ends
        relay_thread.join()
        os.close(wake_r)
        if dump:
            faulthandler.unregister(signal.SIGUSR1)
    if agent.detach_abandoned:
        # a thread may still wait for the pool lock inside the mapping: end the
        # process here, without the interpreter's teardown
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        for h in agent.log.handlers:
            h.flush()
        os._exit(0)
    return 0
