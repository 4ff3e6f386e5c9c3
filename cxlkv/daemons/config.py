"""`cxlkv serve`'s settings: the flags, a TOML file (--config), and the
checks of what must fit together (the spill store's, the remote tier's)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from cxlkv.daemons.kv_events import KVEventsSettings, settings
from cxlkv.errors import UsageError
from cxlkv.kv.tiers.remote import POLICIES
from cxlkv.kv.tiers.spill import QUEUE_BYTES
from cxlkv.remote import RemoteConfig
from cxlkv.util.sizes import parse_size
from cxlkv.util.toml import read_toml


@dataclass
class AgentConfig:
    pool: str | None = None
    pool_uuid: str | None = None            # the pool this host pins (cxlkv.api.check_uuid)
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
    stop_timeout: float = 5.0
    spill_dir: str | None = None
    spill_bytes: str | None = None          # a size: bytes or K/M/G/T suffixes
    spill_queue_bytes: str | None = None
    remote: dict | None = None              # the [remote] table (cxlkv.remote.RemoteConfig)
    remote_nodes: str | None = None         # host:port,... (over the table's nodes)
    remote_push: tuple = ()                 # namespace names or patterns to push
    remote_push_policy: str = "reused"
    remote_push_interval: float = 5.0
    kv_events: str | None = None            # tcp://HOST:PORT: publish KV events (kv_events.py)
    kv_events_table: dict | None = None     # the [kv_events] table


_TYPES = {f.name: f.type for f in fields(AgentConfig)}


def load_config(path: str) -> dict:
    """A TOML file's settings as {option_name: value} (keys as the long flags,
    with - or _; a [serve] table or top-level keys).  UsageError on unknown
    keys or wrong types."""
    doc = read_toml(path)
    if isinstance(doc.get("serve"), dict):
        doc = {**{k: v for k, v in doc.items() if k != "serve"}, **doc["serve"]}
    out = {}
    for key, value in doc.items():
        name = key.replace("-", "_")
        if name == "remote":
            if not isinstance(value, dict):
                raise UsageError(f"--config {path}: remote must be a [remote] table")
            RemoteConfig.from_dict(value, where=f"--config {path}: [remote]")   # checked now
            out["remote"] = value
            continue
        if name == "kv_events" and isinstance(value, dict):
            kv_events_args(None, value, where=f"--config {path}: [kv_events]")  # checked now
            out["kv_events_table"] = value
            continue
        if name == "remote_push":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise UsageError(f"--config {path}: remote-push must be a list of namespace "
                                 "names or patterns")
            out["remote_push"] = tuple(value)
            continue
        if name not in _TYPES or name == "kv_events_table":
            known = ", ".join(sorted(k.replace("_", "-") for k in _TYPES
                                     if k != "kv_events_table"))
            raise UsageError(f"--config {path}: unknown setting {key!r} (known: {known})")
        want = _TYPES[name]
        ok = (isinstance(value, bool) if "bool" in want else
              isinstance(value, (int, float)) and not isinstance(value, bool) if "float" in want
              else isinstance(value, (str, int)) and not isinstance(value, bool))
        if not ok:
            raise UsageError(f"--config {path}: {key} = {value!r} has the wrong type "
                             f"(expected {want.split(' |')[0]})")
        out[name] = str(value) if name in ("numa_node", "pool", "pool_uuid", "metrics_addr",
                                           "spill_dir", "remote_nodes", "kv_events",
                                           "remote_push_policy") else value
    return out


def remote_args(cfg: AgentConfig):
    """The RemoteConfig of --remote-push, or None; UsageErrors for what does
    not fit together."""

    if cfg.remote_push_policy not in POLICIES:
        raise UsageError(f"--remote-push-policy must be one of {', '.join(POLICIES)}")
    if cfg.remote_push_interval <= 0:
        raise UsageError("--remote-push-interval must be positive")
    rc = RemoteConfig.from_dict(cfg.remote, where="[remote]") if cfg.remote else RemoteConfig()
    if cfg.remote_nodes:
        rc = rc.with_overrides(nodes=tuple(n.strip() for n in cfg.remote_nodes.split(",")
                                           if n.strip()))
    if not cfg.remote_push:
        return None
    if not rc.nodes:
        raise UsageError("--remote-push needs the cluster: a [remote] table with nodes in "
                         "--config, or --remote-nodes HOST:PORT,...")
    return rc


def spill_args(cfg: AgentConfig) -> tuple[str, int, int] | None:
    """(directory, size limit, queue bound) from --spill-*, or None; a
    UsageError for a size that does not parse or an incomplete set."""

    if not cfg.spill_dir:
        if cfg.spill_bytes is not None or cfg.spill_queue_bytes is not None:
            raise UsageError("--spill-bytes and --spill-queue-bytes need --spill-dir")
        return None
    if cfg.spill_bytes is None:
        raise UsageError("--spill-dir needs --spill-bytes, the spill store's size limit "
                         "(e.g. 64G)")
    size = parse_size(cfg.spill_bytes, "--spill-bytes")
    qbytes = QUEUE_BYTES if cfg.spill_queue_bytes is None else \
        parse_size(cfg.spill_queue_bytes, "--spill-queue-bytes")
    return str(cfg.spill_dir), size, qbytes


def kv_events_args(endpoint: str | None, table: dict | None,
                   where: str = "[kv_events]") -> KVEventsSettings | None:
    """The KV-events publisher's settings (--kv-events over the [kv_events]
    table's endpoint), or None; UsageError for a bad address or setting."""
    return settings(endpoint, table, where)
