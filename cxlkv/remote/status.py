"""What `cxlkv remote status` reports: the cluster's state as its nodes see
it and as this host reaches them, memory against the budget, and the
blocks per namespace (from key names and STRLEN: values are not read).

Read-only: CLUSTER NODES / CLUSTER INFO from the first startup node that
answers, then PING, INFO memory and (unless scan=False) SCAN MATCH
`<prefix>*` + pipelined STRLEN on every node it lists, and HGETALL
`<prefix>ns` for the namespace names.
"""
from __future__ import annotations

import re
import time

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from cxlkv.remote.config import RemoteConfig, parse_node
from cxlkv.remote.redis_cluster import client_kwargs

SLOTS = 16384
#: keys per SCAN step (and per STRLEN pipeline)
SCAN_COUNT = 1000
OK, DEGRADED, UNREACHABLE = 0, 1, 2


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


def _parse_nodes(raw) -> list[dict]:
    raw = raw.decode() if isinstance(raw, bytes) else raw
    if isinstance(raw, dict):                 # pragma: no cover - a parsed reply
        raise TypeError("unexpected CLUSTER NODES reply")
    out = []
    for line in raw.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        addr = f[1].split("@")[0]
        flags = f[2].split(",")
        slots = 0
        for r in f[8:]:
            if r.startswith("["):              # a slot being migrated
                continue
            lo, _, hi = r.partition("-")
            try:
                slots += int(hi or lo) - int(lo) + 1
            except ValueError:
                pass
        out.append({"id": f[0], "addr": addr, "flags": flags,
                    "role": "master" if "master" in flags else "replica",
                    "master_id": None if f[3] == "-" else f[3], "link": f[7], "slots": slots,
                    "ranges": [r for r in f[8:] if not r.startswith("[")]})
    return out


def _parse_info(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    raw = raw.decode() if isinstance(raw, bytes) else raw
    out = {}
    for line in raw.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


class _Conns:
    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self.kw = client_kwargs(cfg)
        self.open: dict[str, object] = {}

    def get(self, addr: str):
        c = self.open.get(addr)
        if c is None:
            host, port = parse_node(addr)
            # one try: a node that does not answer is down, now
            c = redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0), **self.kw)
            self.open[addr] = c
        return c

    def close(self) -> None:
        for c in self.open.values():
            try:
                c.close()
            except Exception:                               # noqa: BLE001
                pass


def _err(cfg: RemoteConfig, e: BaseException) -> str:
    return cfg.scrub(f"{type(e).__name__}: {e}")


def cluster_status(cfg: RemoteConfig, *, scan: bool = True) -> dict:
    """The report (see the module doc); `exit_code` 0 ok, 1 degraded (slots
    not all covered, a node down or failing, cluster_state not ok), 2
    unreachable (no startup node answers, or authentication refused)."""
    cfg.require_nodes()
    cfg.secret()
    conns = _Conns(cfg)
    started = time.monotonic()
    rep: dict = {"nodes_given": list(cfg.nodes), "prefix": cfg.prefix, "reachable": False,
                 "error": None, "cluster_state": None,
                 "slots": {"total": SLOTS, "assigned": 0, "covered": 0},
                 "masters": {"total": 0, "up": 0, "down": 0},
                 "replicas": {"total": 0, "up": 0, "down": 0},
                 "nodes": [], "memory": {"used_memory": None, "max_bytes": cfg.max_bytes,
                                         "used_pct": None},
                 "scanned": False, "namespaces": [], "keys": None, "bytes": None,
                 "problems": [], "status": "unreachable", "exit_code": UNREACHABLE}
    try:
        seed = view = info = None
        errors = []
        for addr in cfg.nodes:
            try:
                c = conns.get(addr)
                view = _parse_nodes(c.execute_command("CLUSTER", "NODES"))
                info = _parse_info(c.execute_command("CLUSTER", "INFO"))
                seed = addr
                break
            except Exception as e:                          # noqa: BLE001 - next one
                errors.append(f"{addr}: {_err(cfg, e)}")
        if seed is None:
            rep["error"] = "no startup node answered: " + "; ".join(errors)
            rep["problems"].append(rep["error"])
            return rep
        rep["reachable"] = True
        rep["seed"] = seed
        rep["cluster_state"] = info.get("cluster_state")
        rep["slots"].update(assigned=int(info.get("cluster_slots_assigned", 0)),
                            ok=int(info.get("cluster_slots_ok", 0)),
                            pfail=int(info.get("cluster_slots_pfail", 0)),
                            fail=int(info.get("cluster_slots_fail", 0)))
        rep["known_nodes"] = int(info.get("cluster_known_nodes", len(view)))
        _probe(cfg, conns, rep, view, scan)
    finally:
        conns.close()
        rep["elapsed_s"] = round(time.monotonic() - started, 3)
    _judge(rep)
    return rep


def _probe(cfg: RemoteConfig, conns: _Conns, rep: dict, view: list[dict], scan: bool) -> None:
    used_total = 0
    pattern = _glob_escape(cfg.prefix) + "*"
    block = re.compile(re.escape(cfg.prefix.encode()) + rb"([0-9a-f]{8}):[0-9a-f]{32}\Z")
    per_ns: dict[str, list[int]] = {}
    covered = 0
    scanned_all = scan
    for n in sorted(view, key=lambda n: (n["role"] != "master", n["addr"])):
        node = {"id": n["id"], "addr": n["addr"], "role": n["role"],
                "master_id": n["master_id"], "flags": [f for f in n["flags"] if f != "myself"],
                "slots": n["slots"], "up": False, "used_memory": None, "maxmemory": None,
                "keys": None, "error": None}
        rep["nodes"].append(node)
        failing = "fail" in n["flags"] or "fail?" in n["flags"]
        if "noaddr" in n["flags"] or n["addr"].startswith(":"):
            node["error"] = "no address known"
        else:
            try:
                c = conns.get(n["addr"])
                c.ping()
                node["up"] = True
                mem = _parse_info(c.info("memory"))
                node["used_memory"] = int(mem.get("used_memory", 0))
                node["maxmemory"] = int(mem.get("maxmemory", 0))
            except Exception as e:                          # noqa: BLE001 - a node down
                node["error"] = _err(cfg, e)
        up = node["up"] and not failing
        group = rep["masters" if n["role"] == "master" else "replicas"]
        group["total"] += 1
        group["up" if up else "down"] += 1
        if n["role"] == "master" and up:
            covered += n["slots"]
            used_total += node["used_memory"] or 0
            if scan:
                try:
                    node["keys"] = _scan(conns.get(n["addr"]), pattern, block, per_ns)
                except Exception as e:                      # noqa: BLE001
                    node["error"] = f"scan: {_err(cfg, e)}"
                    rep.setdefault("scan_error", f"{n['addr']}: {node['error']}")
                    scanned_all = False
    rep["slots"]["covered"] = covered
    rep["memory"]["used_memory"] = used_total
    if cfg.max_bytes:
        rep["memory"]["used_pct"] = round(100.0 * used_total / cfg.max_bytes, 2)
    if scan:
        names = _names(cfg, conns, view)
        rep["scanned"] = scanned_all
        rep["namespaces"] = [{"digest8": d, "namespace": names.get(d), "keys": v[0],
                              "bytes": v[1]} for d, v in sorted(per_ns.items())]
        rep["keys"] = sum(v[0] for v in per_ns.values())
        rep["bytes"] = sum(v[1] for v in per_ns.values())


def _scan(c, pattern: str, block, per_ns: dict) -> int:
    """SCAN one master for block keys; STRLEN them pipelined; add to per_ns."""
    n = 0
    cursor = 0
    while True:
        cursor, keys = c.scan(cursor=cursor, match=pattern, count=SCAN_COUNT)
        keys = [k for k in keys if block.match(k)]
        if keys:
            p = c.pipeline(transaction=False)
            for k in keys:
                p.strlen(k)
            for k, ln in zip(keys, p.execute()):
                d = block.match(k).group(1).decode()
                acc = per_ns.setdefault(d, [0, 0])
                acc[0] += 1
                acc[1] += int(ln)
            n += len(keys)
        if int(cursor) == 0:
            return n


def _names(cfg: RemoteConfig, conns: _Conns, view: list[dict]) -> dict[str, str]:
    """digest8 -> namespace name, from the `<prefix>ns` hash (on the master
    serving its slot); {} when it cannot be read."""

    hk = f"{cfg.prefix}ns".encode()
    slot = key_slot(hk)
    for n in view:
        if n["role"] != "master" or "fail" in n["flags"]:
            continue
        for r in n["ranges"]:
            lo, _, hi = r.partition("-")
            try:
                inside = int(lo) <= slot <= int(hi or lo)
            except ValueError:
                continue
            if inside:
                try:
                    raw = conns.get(n["addr"]).hgetall(hk)
                except Exception:                           # noqa: BLE001
                    return {}
                out = {}
                for f, v in raw.items():
                    f = f.decode(errors="replace") if isinstance(f, bytes) else str(f)
                    out.setdefault(f[:8], v.decode(errors="replace")
                                   if isinstance(v, bytes) else str(v))
                return out
    return {}


def _judge(rep: dict) -> None:
    if not rep["reachable"]:
        return
    p = rep["problems"]
    if rep["cluster_state"] != "ok":
        p.append(f"cluster_state is {rep['cluster_state']}")
    if rep["slots"]["covered"] < SLOTS:
        p.append(f"{SLOTS - rep['slots']['covered']} of {SLOTS} slots not served by a master "
                 "that is up")
    for n in rep["nodes"]:
        if not n["up"]:
            p.append(f"{n['role']} {n['addr']} is down ({n['error'] or 'no answer'})")
        elif "fail" in n["flags"] or "fail?" in n["flags"]:
            p.append(f"{n['role']} {n['addr']} is flagged failing by the cluster")
    m = rep["memory"]
    if m["max_bytes"] and m["used_memory"] is not None and m["used_memory"] >= m["max_bytes"]:
        p.append("used_memory is at or over max_bytes: pushes are dropped")
    rep["status"] = "degraded" if p else "ok"
    rep["exit_code"] = DEGRADED if p else OK
