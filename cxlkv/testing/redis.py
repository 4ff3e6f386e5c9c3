"""A real Redis Cluster on loopback, from the Debian `redis-server` package,
for the tests and the bench (never for production: it binds 127.0.0.1 only).

    with TestCluster(masters=3, replicas=1) as c:      # 3 masters, 3 replicas
        c.addrs                     # ["127.0.0.1:PORT", ...] every node
        port = c.master_of_key(b"cxlkv:...")
        c.kill(port)                # SIGKILL a node
        new = c.wait_failover(port) # a replica of it took over; cluster_state:ok again

Every node runs in its own temporary directory with no persistence
(`appendonly no`, `save ''`), a short `cluster-node-timeout` (2000 ms) and
its cluster bus port chosen explicitly (`cluster-port`), both ports taken
below the kernel's ephemeral range and checked free just before start (a
node that still loses the race is restarted on other ports).  The cluster is
made with `redis-cli --cluster create ... --cluster-yes`, then polled, with
deadlines, until every node says `cluster_state:ok`, knows every other node
and every replica's link is up.  `stop()` always kills every node and removes
the directories (also on errors during start: it is a context manager);
nodes also die with the thread that started them (PR_SET_PDEATHSIG), so a
run killed with -9 leaves no servers behind: start it from a thread that
outlives it (the main thread).
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from cxlkv.errors import ClusterUnavailable

SLOTS = 16384




def tools() -> tuple[str, str] | None:
    """(redis-server, redis-cli) paths, or None when either is not installed."""
    s, c = shutil.which("redis-server"), shutil.which("redis-cli")
    return (s, c) if s and c else None


def skip_reason() -> str | None:
    """Why a TestCluster cannot run here (None: it can)."""
    if tools() is None:
        return ("redis-server / redis-cli not installed (Debian package redis-server; "
                "scripts/setup installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:                                  # pragma: no cover
        return "the redis Python client is not installed"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int, taken: set[int]) -> list[int]:
    """n free ports under the ephemeral range (outgoing connections never take
    them meanwhile), not in `taken`."""
    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):            # pragma: no cover
        lo = 32768
    hi = max(12000, min(lo, 65536)) - 1
    out: list[int] = []
    for _ in range(2000):
        p = random.randint(11000, hi)
        if p not in taken and p not in out and _port_free(p):
            out.append(p)
            if len(out) == n:
                return out
    raise ClusterUnavailable("no free loopback ports found")


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):                                  # pragma: no cover
        return None


#: resolved here, not in the child (no dlopen between fork and exec)
_PRCTL = _prctl()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (the thread that
    started it) goes, so a killed test run leaves no servers behind."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGKILL))                                 # PR_SET_PDEATHSIG


@dataclass
class Node:
    port: int
    bus_port: int
    dir: str
    proc: subprocess.Popen | None = None
    node_id: str = ""
    alive: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


class TestCluster:
    """See the module doc.  `password` sets requirepass and masterauth on
    every node (written to each node's config file, never on a command line).
    `tls`: every node serves TLS only (cluster bus and replication too) with
    a certificate for 127.0.0.1 from a throwaway CA and requires client
    certificates; `tls_files` then holds the paths "ca", "cert", "key" of
    the CA and of a client certificate (needs the openssl command)."""

    __test__ = False                      # not a pytest test class

    #: cluster mode (RedisServer: one standalone server)
    cluster = True

    def __init__(self, masters: int = 3, replicas: int = 0, *, password: str | None = None,
                 node_timeout_ms: int = 2000, deadline_s: float = 90.0,
                 maxmemory: int | None = None, tls: bool = False):
        if self.cluster and masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        found = tools()
        if found is None:
            raise ClusterUnavailable(skip_reason())
        self.server, self.cli = found
        self.n_masters, self.n_replicas = masters, replicas
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.deadline_s = deadline_s
        self.maxmemory = maxmemory
        self.tls = tls
        self.tls_files: dict[str, str] = {}
        if tls and shutil.which("openssl") is None:
            raise ClusterUnavailable("TLS needs the openssl command (Debian package openssl)")
        self.nodes: list[Node] = []
        self.root: str | None = None
        self._conns: dict[int, object] = {}

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "TestCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "TestCluster":
        self.root = tempfile.mkdtemp(prefix="cxlkv-redis-cluster-")
        if self.tls:
            self._make_certs()
        total = self.n_masters * (1 + self.n_replicas)
        taken: set[int] = set()
        for i in range(total):
            ports = _ports(2, taken)
            taken.update(ports)
            d = os.path.join(self.root, f"node{i}")
            os.mkdir(d, 0o700)
            self.nodes.append(Node(ports[0], ports[1], d))
        deadline = time.monotonic() + self.deadline_s
        for node in self.nodes:
            self._launch(node, taken, deadline)
        if not self.cluster:
            return self
        self._create(deadline)
        self.wait_ok(deadline=deadline)
        for node in self.nodes:
            node.node_id = self._call(node.port, "CLUSTER", "MYID").decode()
        self._refresh_roles()
        return self

    def _refresh_roles(self) -> None:
        """Which master each replica follows now, each node asked about
        itself (its own line of CLUSTER NODES is never behind the gossip; a
        loaded machine can make the cluster fail over on its own)."""
        for n in self.live():
            try:
                me = next(x for x in self.cluster_nodes(n.port) if "myself" in x["flags"])
            except Exception:                              # noqa: BLE001
                self._drop(n.port)
                continue
            n.extra["master_id"] = None if me["master"] == "-" else me["master"]

    def stop(self) -> None:
        """Kill every node (SIGKILL: nothing to persist) and remove the directories."""
        for c in self._conns.values():
            try:
                c.close()
            except Exception:                             # noqa: BLE001
                pass
        self._conns.clear()
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                try:
                    node.proc.kill()
                except OSError:                           # pragma: no cover
                    pass
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(30)
                except subprocess.TimeoutExpired:         # pragma: no cover
                    pass
            node.alive = False
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    # -- nodes ---------------------------------------------------------------------------
    def _conf(self, node: Node) -> str:
        lines = [f"port {node.port}", "bind 127.0.0.1", "protected-mode yes",
                 "daemonize no", f"dir {node.dir}", "appendonly no", 'save ""',
                 "logfile node.log", "loglevel notice"]
        if self.cluster:
            lines += [f"cluster-port {node.bus_port}", "cluster-enabled yes",
                      "cluster-config-file nodes.conf",
                      f"cluster-node-timeout {self.node_timeout_ms}",
                      # a replica that lost its master a moment ago may still fail over
                      "cluster-replica-validity-factor 0",
                      # the tests write 256 KiB values in bursts
                      "client-output-buffer-limit replica 0 0 0",
                      # a replica's first sync starts at once (default: waits 5 s for others)
                      "repl-diskless-sync-delay 0"]
        if self.maxmemory is not None:
            lines.append(f"maxmemory {self.maxmemory}")
        if self.tls:
            t = self.tls_files
            lines[0] = "port 0"
            lines += [f"tls-port {node.port}", f"tls-cluster {'yes' if self.cluster else 'no'}",
                      "tls-replication yes",
                      f"tls-cert-file {t['server_cert']}", f"tls-key-file {t['server_key']}",
                      f"tls-ca-cert-file {t['ca']}", "tls-auth-clients yes"]
        if self.password is not None:
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        path = os.path.join(node.dir, "redis.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def _launch(self, node: Node, taken: set[int], deadline: float,
                attempts: int = 5) -> None:
        """Start the node and wait until it answers PING; a port lost to a
        race (the node exits with "Address already in use") is retried on
        other ports."""
        for _ in range(attempts):
            conf = self._conf(node)
            node.proc = subprocess.Popen([self.server, conf], cwd=node.dir,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            node.alive = True
            while node.proc.poll() is None and not self._ping(node):
                if time.monotonic() > deadline:
                    raise ClusterUnavailable(f"redis-server on port {node.port} did not "
                                             f"answer: {self.log_tail(node)}")
                time.sleep(0.01)
            if node.proc.poll() is None:
                return
            node.alive = False
            log = self.log_tail(node)
            if "in use" not in log and "Address already" not in log:
                raise ClusterUnavailable(f"redis-server on port {node.port} exited: {log}")
            node.port, node.bus_port = _ports(2, taken)
            taken.update((node.port, node.bus_port))
        raise ClusterUnavailable("redis-server could not get free ports")

    def log_tail(self, node: Node, lines: int = 6) -> str:
        try:
            with open(os.path.join(node.dir, "node.log"), errors="replace") as f:
                return " | ".join(f.read().splitlines()[-lines:])
        except OSError:
            return "no log"

    def _client(self, port: int):
        c = self._conns.get(port)
        if c is None:
            import redis

            tls = {}
            if self.tls:
                t = self.tls_files
                tls = dict(ssl=True, ssl_ca_certs=t["ca"], ssl_certfile=t["cert"],
                           ssl_keyfile=t["key"])
            c = redis.Redis(host="127.0.0.1", port=port, password=self.password,
                            socket_timeout=5.0, socket_connect_timeout=2.0, **tls)
            self._conns[port] = c
        return c

    def _call(self, port: int, *args):
        return self._client(port).execute_command(*args)

    def _ping(self, node: Node) -> bool:
        try:
            return bool(self._call(node.port, "PING"))
        except Exception:                                  # noqa: BLE001
            self._drop(node.port)
            return False

    def _drop(self, port: int) -> None:
        c = self._conns.pop(port, None)
        if c is not None:
            try:
                c.close()
            except Exception:                              # noqa: BLE001
                pass

    def _create(self, deadline: float) -> None:
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password
        args = [self.cli, "--cluster", "create", *(n.addr for n in self.nodes),
                "--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
        if self.tls:
            t = self.tls_files
            args[1:1] = ["--tls", "--cacert", t["ca"], "--cert", t["cert"], "--key", t["key"]]
        try:
            r = subprocess.run(args, env=env, capture_output=True, text=True,
                               timeout=max(5.0, deadline - time.monotonic()),
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ClusterUnavailable("redis-cli --cluster create did not finish") from None
        if r.returncode != 0:
            tail = " | ".join((r.stdout + r.stderr).splitlines()[-6:])
            raise ClusterUnavailable(f"redis-cli --cluster create failed: {tail}")

    def _make_certs(self) -> None:
        """A throwaway CA, a server certificate for 127.0.0.1 and a client one."""
        d = os.path.join(self.root, "tls")
        os.mkdir(d, 0o700)
        f = {k: os.path.join(d, v) for k, v in (
            ("ca", "ca.crt"), ("ca_key", "ca.key"), ("server_cert", "server.crt"),
            ("server_key", "server.key"), ("cert", "client.crt"), ("key", "client.key"))}
        ext = os.path.join(d, "san.ext")
        with open(ext, "w") as fh:
            fh.write("subjectAltName=IP:127.0.0.1\n")
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

        def run(*args):
            r = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
            if r.returncode != 0:
                raise ClusterUnavailable(f"openssl {args[0]} failed: {r.stderr.strip()[-300:]}")

        run("req", "-x509", *key, "-keyout", f["ca_key"], "-out", f["ca"], "-days", "2",
            "-subj", "/CN=cxlkv test CA")
        for crt, k, cn in (("server_cert", "server_key", "127.0.0.1"),
                           ("cert", "key", "cxlkv test client")):
            csr = f[crt] + ".csr"
            run("req", *key, "-keyout", f[k], "-out", csr, "-subj", f"/CN={cn}")
            run("x509", "-req", "-in", csr, "-CA", f["ca"], "-CAkey", f["ca_key"],
                "-CAcreateserial", "-out", f[crt], "-days", "2", "-extfile", ext)
        self.tls_files = f

    # -- state ---------------------------------------------------------------------------
    def info(self, port: int) -> dict:
        raw = self._call(port, "CLUSTER", "INFO")
        raw = raw.decode() if isinstance(raw, bytes) else raw
        out = {}
        for line in raw.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                out[k] = v.strip()
        return out

    def cluster_nodes(self, port: int) -> list[dict]:
        raw = self._call(port, "CLUSTER", "NODES")
        raw = raw.decode() if isinstance(raw, bytes) else raw
        out = []
        for line in raw.splitlines():
            f = line.split()
            if len(f) < 8:
                continue
            out.append({"id": f[0], "addr": f[1].split("@")[0], "flags": f[2].split(","),
                        "master": f[3], "link": f[7], "slots": f[8:]})
        return out

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def _healthy(self, node: Node, expect_known: int) -> bool:
        try:
            inf = self.info(node.port)
            if (inf.get("cluster_state") != "ok" or int(inf.get("cluster_slots_ok", 0)) != SLOTS
                    or int(inf.get("cluster_known_nodes", 0)) != expect_known):
                return False
            me = None
            for n in self.cluster_nodes(node.port):
                if "myself" in n["flags"]:
                    me = n
                if any(fl in n["flags"] for fl in ("handshake", "noaddr")):
                    return False
                alive = any(x.addr == n["addr"] and x.alive for x in self.nodes)
                if alive and (n["link"] != "connected" or "fail" in n["flags"]
                              or "fail?" in n["flags"]):
                    return False
            if me is not None and "slave" in me["flags"]:
                rep = self._call(node.port, "INFO", "replication")
                if isinstance(rep, bytes):
                    rep = dict(line.split(":", 1) for line in rep.decode().splitlines()
                               if ":" in line)
                if rep.get("master_link_status") != "up":
                    return False
            return True
        except Exception:                                  # noqa: BLE001
            self._drop(node.port)
            return False

    def wait_ok(self, timeout: float | None = None, *, deadline: float | None = None) -> None:
        """Wait until every live node says cluster_state:ok, covers every slot,
        sees every live node connected and (replicas) has its master link up."""
        if deadline is None:
            deadline = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        known = len(self.nodes)
        while True:
            bad = [n for n in self.live() if not self._healthy(n, known)]
            if not bad:
                return
            if time.monotonic() > deadline:
                raise ClusterUnavailable(
                    "cluster not ok on port(s) " + ", ".join(str(n.port) for n in bad)
                    + ": " + self.log_tail(bad[0]))
            time.sleep(0.05)

    def node(self, port: int) -> Node:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(port)

    def masters(self) -> list[int]:
        """Ports of the masters that serve slots, as a live node sees them."""
        for n in self.live():
            try:
                return sorted(int(x["addr"].rsplit(":", 1)[1]) for x in self.cluster_nodes(n.port)
                              if "master" in x["flags"] and x["slots"]
                              and "fail" not in x["flags"])
            except Exception:                              # noqa: BLE001
                self._drop(n.port)
        return []

    def master_of_key(self, key: bytes | str) -> int:
        """Port of the live master that owns `key`'s slot."""
        for n in self.live():
            try:
                slot = int(self._call(n.port, "CLUSTER", "KEYSLOT", key))
                for x in self.cluster_nodes(n.port):
                    if "master" not in x["flags"] or "fail" in x["flags"]:
                        continue
                    for r in x["slots"]:
                        if r.startswith("["):
                            continue
                        lo, _, hi = r.partition("-")
                        if int(lo) <= slot <= int(hi or lo):
                            return int(x["addr"].rsplit(":", 1)[1])
            except Exception:                              # noqa: BLE001
                self._drop(n.port)
        raise ClusterUnavailable("no live master owns that key")

    @property
    def addrs(self) -> list[str]:
        return [n.addr for n in self.nodes]

    def client(self, port: int):
        """A plain redis-py client of one node (tests poke values with it)."""
        return self._client(port)

    # -- faults ----------------------------------------------------------------------------
    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (a master, typically)."""
        node = self.node(port)
        self._refresh_roles()                 # wait_failover looks for its replicas
        self._drop(port)
        if node.proc is not None and node.proc.poll() is None:
            os.kill(node.proc.pid, signal.SIGKILL)
            node.proc.wait(30)
        node.alive = False

    def kill_all(self) -> None:
        for n in list(self.live()):
            self.kill(n.port)

    def wait_failover(self, port: int, timeout: float = 60.0) -> int:
        """After kill(port) of a master: wait until one of its replicas serves
        its slots and every live node says the cluster is ok again; returns
        the new master's port."""
        dead = self.node(port)
        mine = {n.node_id for n in self.nodes if n.extra.get("master_id") == dead.node_id}
        if not mine:
            raise ClusterUnavailable(f"the node on port {port} had no replica")
        deadline = time.monotonic() + timeout
        while True:
            new = None
            for n in self.live():
                try:
                    for x in self.cluster_nodes(n.port):
                        if (x["id"] in mine and "master" in x["flags"] and x["slots"]
                                and "fail" not in x["flags"]):
                            new = int(x["addr"].rsplit(":", 1)[1])
                    break
                except Exception:                          # noqa: BLE001
                    self._drop(n.port)
            if new is not None:
                try:
                    self.wait_ok(deadline=deadline)
                    return new
                except ClusterUnavailable:
                    pass
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"no failover of the master on port {port} within "
                                         f"{timeout:g} s")
            time.sleep(0.05)


class RedisServer(TestCluster):
    """One standalone redis-server on loopback (the same launcher as a
    cluster's nodes: a free port, no persistence, killed by stop() and with
    this process); `port` once started."""

    cluster = False

    def __init__(self, **kw):
        super().__init__(masters=1, **kw)

    @property
    def port(self) -> int:
        return self.nodes[0].port
