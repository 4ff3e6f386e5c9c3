"""The cxlkv exception tree and the exit codes the CLI maps them to.

Only the CLI turns these into a message and an exit status; library callers
catch them by class.  Every class carries the exit code of the commands that
share the general table below (commands with a conventional code table of
their own - health, fsck, doctor - document theirs).

General exit codes:

  0   success
  1   refused: the operation would destroy or conflict with something
      (an existing pool, different parameters, live nodes)
  2   usage error: bad option or argument
  3   not found or not accessible: missing path, a directory, no permission
  4   not a usable pool: not formatted, wrong magic, corrupt, truncated
  5   incompatible pool: newer format version or unknown incompat features
  6   unsafe permissions: a world-readable or world-writable pool
  7   device or mapping error: wrong size or alignment, mmap failed, no space
  70  internal error (a bug: please report it with CXLKV_DEBUG=1 output)
  130 interrupted (Ctrl-C)
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INVALID = 4
EXIT_INCOMPATIBLE = 5
EXIT_UNSAFE = 6
EXIT_DEVICE = 7
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

#: (code, meaning) rows shown in --help epilogs and man pages.
EXIT_CODES = (
    (EXIT_OK, "success"),
    (EXIT_REFUSED, "refused (existing pool, different parameters, live nodes)"),
    (EXIT_USAGE, "usage error"),
    (EXIT_NOT_FOUND, "pool path missing, a directory, or not accessible"),
    (EXIT_INVALID, "not a usable pool (unformatted, wrong magic, corrupt, truncated)"),
    (EXIT_INCOMPATIBLE, "pool needs a newer cxlkv (format version or features)"),
    (EXIT_UNSAFE, "unsafe permissions (world-readable or world-writable)"),
    (EXIT_DEVICE, "device or mapping error (size, alignment, mmap, no space)"),
    (EXIT_INTERNAL, "internal error (a bug)"),
    (EXIT_INTERRUPTED, "interrupted"),
)


class CxlkvError(Exception):
    """Base of every error cxlkv raises on purpose."""

    exit_code = EXIT_INTERNAL
    kind = "error"

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = path
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict:
        d = {"kind": self.kind, "message": self.message, "exit_code": self.exit_code}
        if self.path is not None:
            d["path"] = self.path
        if self.hint:
            d["hint"] = self.hint
        return d


class UsageError(CxlkvError):
    exit_code = EXIT_USAGE
    kind = "usage"


class RefusedError(CxlkvError):
    """The operation would destroy or conflict with existing state."""

    exit_code = EXIT_REFUSED
    kind = "refused"


class PoolExistsError(RefusedError):
    kind = "pool-exists"


class ParameterMismatch(RefusedError):
    kind = "parameter-mismatch"


class LiveNodesError(RefusedError):
    kind = "live-nodes"

    def __init__(self, message: str, nodes: list, **kw):
        super().__init__(message, **kw)
        self.nodes = nodes

    def to_json(self) -> dict:
        d = super().to_json()
        d["nodes"] = self.nodes
        return d


class PoolReadOnly(RefusedError, PermissionError):
    """A write to a pool that is open read-only (also a PermissionError)."""

    kind = "read-only"


class PoolNotFound(CxlkvError):
    exit_code = EXIT_NOT_FOUND
    kind = "not-found"


class PoolInvalid(CxlkvError):
    """Not a usable pool: unformatted, wrong magic, corrupt or truncated."""

    exit_code = EXIT_INVALID
    kind = "invalid"


class NotFormatted(PoolInvalid):
    kind = "not-formatted"


class WrongMagic(PoolInvalid):
    kind = "wrong-magic"


class PoolCorrupt(PoolInvalid):
    kind = "corrupt"


class MetadataCorrupt(PoolCorrupt, ValueError):
    """Shared state in the pool that cannot be right (a chunk descriptor of
    unknown kind, a slab of impossible geometry, ...), met by an operation
    before it wrote anything.  The message names the way out:
    `cxlkv fsck --repair`.  A ValueError too, for callers that treat a bad
    slot and a bad descriptor alike."""

    kind = "metadata-corrupt"
    REPAIR = "cxlkv fsck --repair"

    def __init__(self, message: str, **kw):
        kw.setdefault("hint", f"stop the nodes using the pool and run `{self.REPAIR}`")
        if self.REPAIR not in message:
            message = f"{message} (pool metadata is corrupt: run `{self.REPAIR}`)"
        super().__init__(message, **kw)


class PoolTruncated(PoolInvalid):
    kind = "truncated"


class PoolIncompatible(CxlkvError):
    exit_code = EXIT_INCOMPATIBLE
    kind = "incompatible"


class UnsafePermissions(CxlkvError):
    exit_code = EXIT_UNSAFE
    kind = "unsafe-permissions"


class DeviceError(CxlkvError):
    exit_code = EXIT_DEVICE
    kind = "device"


class PoolRangeError(CxlkvError, IndexError):
    """An offset or length outside the pool mapping (raised by the C core)."""

    exit_code = EXIT_INVALID
    kind = "out-of-range"

    def __init__(self, message: str, **kw):
        super().__init__(message, **kw)


class SpillDirBusy(RefusedError):
    """mode="owner" on a spill directory another live process owns
    (cxlkv.kv.tiers.spill)."""

    kind = "spill-busy"
