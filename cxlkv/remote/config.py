"""Settings of the remote tier: `RemoteConfig`, from a TOML `[remote]` table,
a dict or command-line options.

    [remote]
    nodes = ["10.0.1.5:6379", "10.0.1.6:6379"]   # startup nodes ("host:port", "[v6]:port")
    username = "cxlkv"                           # ACL user (optional)
    password_file = "/etc/cxlkv/redis.pass"      # or password = "..." (never logged)
    tls = true                                   # tls_ca, tls_cert, tls_key, tls_verify
    ttl_s = 86400                                # SET ... EX; 0: no expiry
    max_bytes = "200G"                           # budget of the cluster's used_memory; 0: none
    prefix = "cxlkv:"                            # key prefix (no {hash tags})
    wait_replicas = 1                            # WAIT for n replicas after each batch
    queue_bytes = "64M"                          # write-behind queue bound
    timeout_s = 2.0                              # connect / socket timeout

The password is kept out of repr(), str(), to_json() and every message:
`secret()` is the one way to read it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from cxlkv.errors import UsageError
from cxlkv.util.sizes import parse_size
from cxlkv.util.toml import read_toml

MiB = 1 << 20

#: defaults of the settings that have one
DEFAULT_PREFIX = "cxlkv:"
DEFAULT_TTL_S = 86400
DEFAULT_QUEUE_BYTES = 64 * MiB
DEFAULT_TIMEOUT_S = 2.0


def parse_node(text, where: str = "nodes") -> tuple[str, int]:
    """'host:port' or '[v6addr]:port' -> (host, port)."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{where}: a node must be a 'host:port' string, not {text!r}")
    s = text.strip()
    if s.startswith("["):
        host, sep, port = s[1:].partition("]:")
    else:
        host, sep, port = s.rpartition(":")
        if ":" in host:
            sep = ""                       # an IPv6 address without brackets
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{where}: {text!r} is not 'host:port' (IPv6: '[addr]:port')")
    return host, int(port)


def _size(value, what: str) -> int:
    if isinstance(value, bool):
        raise UsageError(f"{what} must be a byte count, not {value!r}")
    n = parse_size(value, what) if isinstance(value, (str, int)) else None
    if n is None or n < 0:
        raise UsageError(f"{what} must be a byte count >= 0 (e.g. 64M, 200G), not {value!r}")
    return n


@dataclass(frozen=True)
class RemoteConfig:
    nodes: tuple[str, ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False, compare=False)
    password_file: str | None = None
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_verify: bool = True
    fast: bool = True           # puts and lookups through cxlkv.remote.fastpath (plain TCP)
    ttl_s: int = DEFAULT_TTL_S
    max_bytes: int = 0
    prefix: str = DEFAULT_PREFIX
    wait_replicas: int = 0
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        self._validate()

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, where: str = "[remote]") -> "RemoteConfig":
        """From a mapping (a TOML table: keys with _ or -).  UsageError naming
        `where` on unknown keys, wrong types or bad values."""
        if not isinstance(d, dict):
            raise UsageError(f"{where} must be a table of settings")
        names = {f.name for f in fields(cls)}
        kw = {}
        for key, value in d.items():
            name = str(key).replace("-", "_")
            if name not in names:
                raise UsageError(f"{where}: unknown setting {key!r} "
                                 f"(known: {', '.join(sorted(names))})")
            kw[name] = value
        try:
            return cls(**_coerce(kw, where))
        except UsageError as e:
            if e.message.startswith(where):
                raise
            raise UsageError(f"{where}: {e.message}", hint=e.hint) from None

    @classmethod
    def from_toml(cls, path, table: str = "remote") -> "RemoteConfig":
        """The `[remote]` table of a TOML file."""
        doc = read_toml(path)
        if table not in doc:
            raise UsageError(f"--config {path}: no [{table}] table")
        return cls.from_dict(doc[table], where=f"{path}: [{table}]")

    def with_overrides(self, **kw) -> "RemoteConfig":
        """A copy with the settings in `kw` that are not None replaced (the
        command line over a config file).  A password given here replaces a
        password_file of the file and the other way round."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if "password" in kw:
            kw.setdefault("password_file", None)
        if "password_file" in kw:
            kw.setdefault("password", None)
        return replace(self, **_coerce(kw, "option"))

    # -- checks -----------------------------------------------------------------------
    def _validate(self) -> None:
        for n in self.nodes:
            parse_node(n)
        for name in ("username", "password", "password_file", "tls_ca", "tls_cert", "tls_key"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise UsageError(f"{name} must be a non-empty string")
        if self.password is not None and self.password_file is not None:
            raise UsageError("give password or password_file, not both")
        for name in ("tls", "tls_verify", "fast"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be true or false")
        if not self.tls:
            given = [n for n in ("tls_ca", "tls_cert", "tls_key") if getattr(self, n)]
            if given:
                raise UsageError(f"{', '.join(given)} given without tls = true")
        if self.tls_key and not self.tls_cert:
            raise UsageError("tls_key needs tls_cert (the client certificate)")
        for name in ("ttl_s", "max_bytes", "wait_replicas", "queue_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{name} must be an integer >= 0, not {v!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or not 0 < self.timeout_s <= 3600:
            raise UsageError(f"timeout_s must be seconds in (0, 3600], not {self.timeout_s!r}")
        p = self.prefix
        if not isinstance(p, str) or not p or any(c.isspace() for c in p) or "{" in p or "}" in p:
            raise UsageError(f"prefix must be a non-empty string without spaces or braces "
                             f"(a {{hash tag}} would put every block in one slot), not {p!r}")

    def require_nodes(self) -> "RemoteConfig":
        if not self.nodes:
            raise UsageError("no remote nodes given",
                             hint="set nodes = [\"host:port\", ...] in the [remote] table "
                                  "or pass --nodes host:port,...")
        return self

    # -- use ----------------------------------------------------------------------------
    def endpoints(self) -> list[tuple[str, int]]:
        return [parse_node(n) for n in self.nodes]

    def secret(self) -> str | None:
        """The password (read from password_file when that is set)."""
        if self.password is not None:
            return self.password
        if self.password_file is None:
            return None
        try:
            with open(self.password_file, encoding="utf-8") as f:
                pw = f.read().rstrip("\r\n")
        except OSError as e:
            raise UsageError(f"password_file {self.password_file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UsageError(f"password_file {self.password_file}: not UTF-8 text") from None
        if not pw:
            raise UsageError(f"password_file {self.password_file} is empty")
        return pw

    def scrub(self, text: str) -> str:
        """`text` with the password (if any, and known) replaced by ***."""
        for pw in (self.password, _peek(self.password_file)):
            if pw and len(pw) >= 3:
                text = text.replace(pw, "***")
        return text

    def to_json(self) -> dict:
        """Every setting, with raw values; the password only as whether one is set."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "password"}
        d["nodes"] = list(self.nodes)
        d["password_set"] = self.password is not None or self.password_file is not None
        return d


def _peek(path) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n") or None
    except (OSError, UnicodeDecodeError):
        return None


def _coerce(kw: dict, where: str) -> dict:
    """TOML / CLI values into the dataclass's types (sizes with suffixes, a
    comma-separated node list); type errors as UsageError."""
    out = dict(kw)
    if "nodes" in out:
        v = out["nodes"]
        if isinstance(v, str):
            v = [x for x in (s.strip() for s in v.split(",")) if x]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise UsageError("nodes must be a list of 'host:port' strings")
        out["nodes"] = tuple(x.strip() for x in v)
    for name in ("max_bytes", "queue_bytes"):
        if name in out:
            out[name] = _size(out[name], name)
    if "password_file" in out and out["password_file"] is not None:
        out["password_file"] = os.fspath(out["password_file"])
    if "timeout_s" in out and isinstance(out["timeout_s"], int) \
            and not isinstance(out["timeout_s"], bool):
        out["timeout_s"] = float(out["timeout_s"])
    return out
