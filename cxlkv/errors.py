"""The cxlkv exception tree and the exit codes the CLI maps them to.

Every exception cxlkv raises is defined here, below the general classes
grouped by the layer that raises it; the public ones stay importable where
they were first defined too (cxlkv.kv.area.KVPoolFull,
cxlkv.state.alloc.PoolFullError, cxlkv.state.nodes.NodeFenced,
cxlkv.state.locks.LockLost).
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
  9   a service the pool needs is not running: no lock manager answered (a pool
      in sync mode manager)
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
EXIT_NO_MANAGER = 9
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
    (EXIT_NO_MANAGER, "no lock manager is running (a pool in sync mode manager)"),
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


class WrongPool(PoolInvalid):
    """The pool at the path is not the one this host pins (CXLKV_POOL_UUID,
    the serve config's pool-uuid): another region, device or format."""

    kind = "wrong-pool"


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


class InternalError(CxlkvError, RuntimeError):
    """A broken invariant of cxlkv itself (a bug), e.g. the C allocator used
    before its geometry was set (raised by the C core; also a RuntimeError)."""

    exit_code = EXIT_INTERNAL
    kind = "internal"


class PoolRangeError(CxlkvError, IndexError):
    """An offset or length outside the pool mapping (raised by the C core)."""

    exit_code = EXIT_INVALID
    kind = "out-of-range"

    def __init__(self, message: str, **kw):
        super().__init__(message, **kw)


# -- state: nodes, locks, allocator -------------------------------------------------------

class NodeFenced(CxlkvError):
    """This process was reaped (its lease lapsed): it must not write live state."""

    exit_code = 1
    kind = "fenced"


class NodeTableFull(RefusedError):
    """No free slot in the pool's node table: max_nodes processes are attached."""

    kind = "no-free-slot"


class LockTimeout(CxlkvError):
    exit_code = 1
    kind = "lock-timeout"


class NoLockManager(LockTimeout):
    """Sync mode manager and no lock manager answered: an operational state
    (start one), not a bug - nodes cannot attach, lock or detach."""

    exit_code = EXIT_NO_MANAGER
    kind = "no-lock-manager"


class LockLost(CxlkvError):
    """The lock was taken from this node while it held it (it was judged dead)."""

    exit_code = 1
    kind = "lock-lost"


class HostLockError(CxlkvError):
    """The host lock file cannot be used (wrong header, too small)."""

    kind = "hostlock"


class PoolFullError(RefusedError):
    """No free space in the pool's data area for the request (after releasing
    empty slabs)."""

    kind = "pool-full"


class AllocError(CxlkvError, ValueError):
    """A bad free or publish: an offset that is not an allocated slot."""

    exit_code = 1
    kind = "bad-offset"


class RetiredSlots(AllocError):
    """Reserved slots that lie in chunks retired (poison) since they were
    handed out: they are never written or published.  `offsets` names them.
    A KV store abandons its reservation and stores again (other slabs)."""

    kind = "retired"

    def __init__(self, message: str, offsets, **kw):
        super().__init__(message, **kw)
        self.offsets = offsets


# -- kv: the KV area, its cache and snapshots ---------------------------------------------

class KVError(CxlkvError):
    exit_code = 1


class KVPoolFull(PoolFullError):
    """No room for the blocks even after evicting every unpinned block: the
    allocator's PoolFullError as the KV cache raises it."""

    kind = "pool-full"


class KVTableFull(RefusedError):
    """The hash table is at its maximum load and nothing can be evicted."""

    kind = "table-full"


class QuotaExceeded(RefusedError):
    kind = "quota"


class TooManyPins(RefusedError):
    kind = "pins"


class SnapshotError(CxlkvError):
    """The snapshot directory is missing, incomplete or corrupt."""

    exit_code = EXIT_INVALID
    kind = "snapshot-invalid"


class SnapshotIncompatible(CxlkvError):
    exit_code = EXIT_INCOMPATIBLE
    kind = "snapshot-incompatible"


# -- remote: the cross-rack tier ----------------------------------------------------------

class RemoteError(CxlkvError):
    """The remote cluster answered with an error."""

    exit_code = EXIT_DEVICE
    kind = "remote"


class RemoteUnavailable(RemoteError):
    """The remote cluster cannot be reached (no node answers, connection
    refused or timed out, authentication refused, slots not served)."""

    kind = "remote-unavailable"


class CorruptValue(CxlkvError, ValueError):
    """A remote value that is not the block the reader asked for; `reason` is
    one of REASONS, `damaged` whether to delete it (see cxlkv.remote.value).
    A ValueError too, as it always was."""

    kind = "remote-value"
    REASONS = ("truncated", "magic", "version", "flags", "header-checksum", "key",
               "namespace", "length", "payload-checksum")

    def __init__(self, reason: str, detail: str = "", *, damaged: bool = True):
        super().__init__(f"remote value: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.damaged = damaged


# -- host: tools and NUMA -----------------------------------------------------------------

class ToolNotFound(CxlkvError):
    """The tool is not installed (not on PATH); `package` ships it (see
    cxlkv.host.tools.not_found)."""

    exit_code = EXIT_NOT_FOUND
    kind = "tool-not-found"

    def __init__(self, tool: str, package: str | None = None):
        super().__init__(f"{tool}: not found on PATH", hint=f"apt-get install {package or tool}")
        self.tool = tool


class ToolFailed(CxlkvError):
    """The tool ran and failed: its exit status and stderr are kept (`result`,
    a cxlkv.host.tools.ToolResult)."""

    exit_code = EXIT_DEVICE
    kind = "tool-failed"

    def __init__(self, message: str, result, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.result = result

    def to_json(self) -> dict:
        d = super().to_json()
        d["tool"] = self.result.to_json()
        return d


class ToolTimeout(ToolFailed):
    kind = "tool-timeout"


class ToolOutputError(ToolFailed):
    """The tool exited 0 but printed something that is not the JSON it documents."""

    kind = "tool-output"


class NumaError(CxlkvError):
    """A NUMA binding that cannot be resolved, applied or verified."""

    exit_code = EXIT_DEVICE
    kind = "numa"


class NumaUsage(NumaError):
    exit_code = EXIT_USAGE
    kind = "usage"


# -- ops: provisioning and repair ---------------------------------------------------------

class PlanError(CxlkvError):
    """The host cannot be provisioned as asked (no memdev, no fitting decoder, ...)."""

    exit_code = EXIT_DEVICE
    kind = "plan"


class InUse(RefusedError):
    kind = "in-use"


class ProvisionFailed(CxlkvError):
    """A step failed: what ran, what the tool said (`result`, a ToolResult or
    None), the state left, how to undo."""

    exit_code = EXIT_DEVICE
    kind = "provision-failed"

    def __init__(self, message: str, *, step: dict, result, completed: list[dict],
                 state: dict, undo: list[str], hint: str | None = None):
        super().__init__(message, hint=hint)
        self.step, self.result, self.completed = step, result, completed
        self.state, self.undo = state, undo

    def to_json(self) -> dict:
        d = super().to_json()
        d.update(step=self.step, tool=self.result.to_json() if self.result else None,
                 completed=self.completed, state=self.state, undo=self.undo)
        return d


class PoolChanged(CxlkvError):
    """The node table changed while the repair ran (fsck: operational error)."""

    exit_code = 8
    kind = "changed"


# -- daemons: the lock manager ------------------------------------------------------------

class ManagerExists(RefusedError):
    kind = "manager-active"


class PoolReformatted(RefusedError):
    """The pool's superblock (uuid or geometry) is no longer the one this
    manager opened: it stepped down without writing anything more."""

    kind = "pool-reformatted"


# -- cli: usage errors of the commands with an exit-code table of their own ---------------

class FsckUsage(CxlkvError):
    """A usage error is 16 for fsck, as for e2fsck (2 would read "corrected")."""

    exit_code = 16                    # cxlkv.cli.fsck.EXIT_USAGE
    kind = "usage"


class HealthUsage(CxlkvError):
    """A usage error is UNKNOWN (3) for a monitoring plugin, not 2 (CRITICAL)."""

    exit_code = 3
    kind = "usage"


class SpillDirBusy(RefusedError):
    """mode="owner" on a spill directory another live process owns
    (cxlkv.kv.tiers.spill)."""

    kind = "spill-busy"


class SpillOldFormat(CxlkvError, OSError):
    """A spill slot file of the previous format version: the store's owner
    migrates it when it opens the directory (cxlkv.kv.tiers.spill.files)."""

    kind = "spill-old-format"


class StaleViews(NodeFenced):
    """This node was fenced while it held loaded views: what they showed is
    not vouched for.  `stale` lists the blocks (indexes into the load) whose
    entries changed meanwhile - evicted, dropped or re-stored - so their
    views may have shown another block's bytes."""

    kind = "stale-views"

    def __init__(self, message: str, *, stale: list[int], **kw):
        super().__init__(message, **kw)
        self.stale = stale


# -- tools beside the library: the benchmarks, the test helpers ---------------------------

class Unavailable(RefusedError):
    """Something a scenario or baseline needs is missing here (one line naming it)."""

    kind = "bench-unavailable"


class BenchRefused(RefusedError):
    """The pool given with --pool lacks room for the bench (it never evicts)."""

    kind = "bench-no-room"


class ClusterUnavailable(CxlkvError, RuntimeError):
    """redis-server / redis-cli missing, or the cluster did not come up
    (cxlkv.testing.redis)."""

    kind = "redis-unavailable"
