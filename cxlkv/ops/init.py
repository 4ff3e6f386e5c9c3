"""Creating and formatting pools: the logic behind `cxlkv init` and `cxlkv format`.

`init` is the idempotent, friendly path: it creates an emulated pool file
when the path is missing, leaves a valid pool with matching parameters alone,
and refuses anything it would destroy unless forced.  `format` is the
lower-level verb: it always formats, but like init it formats without
--force only a missing path (given --size) or a blank (all-zero) target.
Both refuse to reformat a pool while live nodes are attached, even when
forced, and refuse targets another user owns unless forced.

New files are made beside the path and linked into place once formatted,
and work on an existing path holds an flock on it, so concurrent runs on one
host never see or make a half-formatted pool.
"""
from __future__ import annotations

import errno
import fcntl
import grp
import os
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import numpy as np

from cxlkv.api import Pool
from cxlkv.errors import (
    CxlkvError,
    DeviceError,
    LiveNodesError,
    NotFormatted,
    ParameterMismatch,
    PoolExistsError,
    PoolIncompatible,
    PoolInvalid,
    PoolNotFound,
    PoolTruncated,
    RefusedError,
    UnsafePermissions,
    UsageError,
    WrongMagic,
)
from cxlkv.host import sysfs
from cxlkv.pool import device, layout
from cxlkv.pool.format import DEFAULT_SIZE, FormatParams, compute_layout, format_mapping
from cxlkv.pool.image import read_superblocks
from cxlkv.pool.superblock import Superblock, select
from cxlkv.state import protocol
from cxlkv.state.nodes import live_nodes
from cxlkv.util.sizes import human_size

DEFAULT_POOL_PATH = "/dev/shm/cxlkv-default.pool"
POOL_MODE = 0o660

PARAM_NAMES = tuple(f.name for f in fields(FormatParams))


@dataclass
class Examination:
    """What is at a pool path before formatting."""

    path: str
    state: str                  # missing | blank | pool | foreign | corrupt | incompatible | truncated
    target: device.Target | None = None
    sb: Superblock | None = None
    error: CxlkvError | None = None
    problems: dict = field(default_factory=dict)   # bad superblock copy of a valid pool

    @property
    def has_cxlkv_magic(self) -> bool:
        return self.state in ("pool", "corrupt", "incompatible", "truncated")


ZERO_SCAN_STEP = 64 << 20


def _data_ranges(t: device.Target) -> list[tuple[int, int]]:
    """Byte ranges that may hold data: a file's data extents (holes skipped)."""
    if t.kind != "file":
        return [(0, t.size)]
    ranges, pos = [], 0
    fd = os.open(t.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while pos < t.size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:     # no data after pos
                    break
                return [(0, t.size)]           # no SEEK_DATA here: scan it all
            end = min(os.lseek(fd, start, os.SEEK_HOLE), t.size)
            ranges.append((start, end))
            pos = end
    finally:
        os.close(fd)
    return ranges


def _all_zero(t: device.Target, m, progress=None) -> bool:
    """True when every byte of the target reads as zero (stops at the first that does not)."""

    total = sum(e - s for s, e in _data_ranges(t))
    done = 0
    for start, end in _data_ranges(t):
        for off in range(start, end, ZERO_SCAN_STEP):
            n = min(ZERO_SCAN_STEP, end - off)
            v = m.view(off, n)
            try:
                nonzero = np.frombuffer(v, dtype=np.uint8).any()
            finally:
                v.release()
            if nonzero:
                return False
            done += n
            if progress:
                progress(done, total)
    return True


def examine(path: str, progress=None) -> Examination:
    """Look at a path without changing it (maps it read-only).

    "blank" means every byte reads as zero (holes of a sparse file count as
    zero); anything else that is not a cxlkv pool is "foreign".
    """
    if path == "":
        raise UsageError("empty pool path")
    try:
        os.stat(path)
    except FileNotFoundError:
        try:
            os.lstat(path)            # a dangling symlink is not a missing path
        except FileNotFoundError:
            try:
                device.probe(path)
            except PoolNotFound as e:
                return Examination(path, "missing", error=e)
    except OSError as e:
        raise PoolNotFound(f"{path}: {e.strerror}", path=path) from None
    t = device.probe(path)
    if t.size == 0:
        return Examination(path, "blank", t)
    if t.size < layout.SB_COPIES * layout.SB_SIZE:
        m = device.map_target(t, writable=False, length=t.size)
        try:
            return Examination(path, "blank" if _all_zero(t, m) else "foreign", t)
        finally:
            m.close()
    m = device.map_target(t, writable=False, length=t.size // t.align * t.align)
    try:
        raw_a, raw_b = read_superblocks(m)
        try:
            sel = select(raw_a, raw_b)
        except NotFormatted as e:
            blank = _all_zero(t, m, progress)
            return Examination(path, "blank" if blank else "foreign", t,
                               error=None if blank else e)
        except WrongMagic as e:
            return Examination(path, "foreign", t, error=e)
        except PoolIncompatible as e:
            return Examination(path, "incompatible", t, error=e)
        except PoolInvalid as e:
            return Examination(path, "corrupt", t, error=e)
    finally:
        m.close()
    if sel.sb.pool_size > t.size:
        return Examination(path, "truncated", t, sel.sb,
                           PoolTruncated(f"{path} is {t.size} bytes but its superblock says "
                                         f"{sel.sb.pool_size}"))
    return Examination(path, "pool", t, sel.sb, problems=sel.problems)


def _map_len(t: device.Target, want: int) -> int:
    return min(t.size, max(want, t.align) // t.align * t.align)


@dataclass
class FormatResult:
    action: str                      # created | formatted | reformatted | unchanged
    path: str
    sb: Superblock
    target: device.Target
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"action": self.action, "path": self.path, "target": self.target.to_json(),
                "superblock": self.sb.to_json(), "warnings": self.warnings}


def sb_params(sb: Superblock) -> dict:
    """The FormatParams a superblock was formatted with."""
    return {"size": sb.pool_size, "sync": sb.sync, "chunk_size": sb.chunk_size,
            "max_nodes": sb.max_nodes, "lease_ms": sb.lease_ms, "grace_ms": sb.grace_ms,
            "hash_slots": sb.hash_slots,
            "hash_max_load_pct": sb.hash_max_load_pct, "label": sb.label,
            "name_tokens": sb.name_tokens}


def _check_given(given: dict) -> None:
    unknown = set(given) - set(PARAM_NAMES)
    if unknown:
        raise UsageError(f"unknown format parameters: {sorted(unknown)}")


def _resolve_params(given: dict, default_size: int | None, size_source: str = "") -> FormatParams:
    kw = dict(given)
    if "size" not in kw:
        if default_size is None:
            raise UsageError("--size is required to create a new pool file")
        if default_size % layout.PAGE:
            raise UsageError(f"{size_source or 'the target'} is {default_size} bytes, not a "
                             "multiple of 4 KiB: give --size (the file is resized to it)")
        kw["size"] = default_size
    p = FormatParams(**kw)
    compute_layout(p)      # validates, including "too small", before anything is touched
    return p


def _refuse_live(path: str, warnings: list[str], observe: bool = True, notice=None) -> None:
    try:
        pool = Pool.open(path, writable=False, force=True)
    except CxlkvError as e:
        warnings.append(f"could not check {path} for live nodes ({e}); formatting because "
                        "of --force")
        return
    with pool:
        if pool.sb.sync == "manager":
            _refuse_manager(pool, path)
        alive = live_nodes(pool, observe=observe, notice=notice)
    if alive:
        names = ", ".join(n.describe() for n in alive)
        raise LiveNodesError(
            f"refusing to reformat {path}: {len(alive)} live node(s) attached: {names}",
            [n.to_json() for n in alive], path=path,
            hint="stop the serving processes (or let their lease lapse), then retry")


def _refuse_manager(pool, path: str) -> None:
    """Sync mode manager: a lock manager heartbeating (watched for up to a
    lease) would carry on with the old geometry - writing its words into
    what the new format puts there.  Refused, even with --force."""

    if protocol.manager_alive(pool):
        raise RefusedError(
            f"refusing to reformat {path}: a lock manager is active for it "
            f"({protocol.describe_manager(pool)})", path=path,
            hint="stop the lock managers on every host first (systemctl stop "
                 "cxlkv-lock-manager@POOL and cxlkv-serve@POOL when it runs one with "
                 "--with-lock-manager), then retry")


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise UsageError(f"no such group: {group}") from None


def _check_owner(path: str, t: device.Target, force: bool, warnings: list[str]) -> None:
    """Refuse to format what another (non-root) user owns or planted a link to."""
    me = os.geteuid()
    st = os.lstat(path)
    problems = []
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
        problems.append(f"{path} is a symbolic link owned by uid {st.st_uid}")
    if t.uid not in (me, 0):
        problems.append(f"{t.path} is owned by uid {t.uid}, not by you or root")
    if not problems:
        return
    msg = "; ".join(problems)
    if force:
        warnings.append(msg + "; continuing because of --force")
        return
    raise UnsafePermissions(msg + "; another user could read or swap the pool", path=path,
                            hint="use a path you own, or pass --force")


def _reserve(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, size)     # filesystem without fallocate
        else:
            raise DeviceError(f"{path}: cannot reserve {human_size(size)}: {e.strerror}",
                              path=path) from None


def create_pool_file(path: str, size: int, group: str | None = None) -> device.Target:
    """Create a pool file of `size` bytes, mode 0660, space reserved (no SIGBUS later).

    Returns the target of a temporary file beside `path`; _publish_new links
    it into place atomically once formatted, so no other process ever sees a
    half-made pool at `path`.
    """
    gid = _group_id(group)
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(parent):
        raise PoolNotFound(f"{parent}: no such directory (for pool file {path})", path=path)
    try:
        vfs = os.statvfs(parent)
        avail = vfs.f_bavail * vfs.f_frsize
    except OSError:
        avail = None
    if avail is not None and size > avail:
        raise DeviceError(
            f"not enough space for a {human_size(size)} pool in {parent}: "
            f"{human_size(avail)} available", path=path, hint="choose a smaller --size")
    tmp = os.path.join(parent,
                       f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, POOL_MODE)
    except PermissionError:
        raise PoolNotFound(f"{parent}: permission denied creating the pool file",
                           path=path) from None
    try:
        os.fchmod(fd, POOL_MODE)
        if gid is not None:
            os.fchown(fd, -1, gid)
        _reserve(fd, size, path)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    return device.probe(tmp)


def _publish_new(tmp: device.Target, path: str) -> bool:
    """Link a formatted temporary pool file into place; False if `path` appeared."""
    try:
        os.link(tmp.path, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp.path)
    return True


@contextmanager
def _exclusive(path: str):
    """Serialise init/format of one path between processes of this host (flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


#: file systems whose files live in memory: a pool file there is memory, not disk
MEMORY_FS = {"tmpfs", "hugetlbfs", "ramfs", "devtmpfs"}


def backing_fs(path: str) -> tuple[str, str] | None:
    """(file system type, mount options) of the mount holding `path`, from
    the procfs seam's self/mountinfo; None when it cannot be told."""
    try:
        lines = sysfs.proc_path("self", "mountinfo").read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts, rest = left.split(), right.split()
        if not sep or len(parts) < 6 or len(rest) < 3:
            continue
        mnt = parts[4].replace("\\040", " ")
        if real == mnt or real.startswith(mnt.rstrip("/") + "/"):
            if best is None or len(mnt) >= len(best[0]):
                best = (mnt, rest[0], f"{parts[5]},{rest[2]}")
    return None if best is None else (best[1], best[2])


def disk_backing_warning(path: str) -> str | None:
    """A warning when a pool file sits on a disk-backed file system (not
    tmpfs or hugetlbfs, not mounted -o dax): it is then page cache written
    back to a disk, not memory."""
    fs = backing_fs(path)
    if fs is None:
        return None
    kind, opts = fs
    if kind in MEMORY_FS or "dax" in opts.split(","):
        return None
    return (f"{path} is on a {kind} file system backed by a disk: the pool is page cache "
            "written back to that disk (slower, and it wears the disk), not memory; use "
            "/dev/shm, a hugetlbfs mount or a DAX device (cxlkv init --device /dev/daxX.Y)")


def format_running(path: str) -> bool:
    """Is an init or format of `path` running on this host right now (it
    holds the flock _exclusive takes)?  False when it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _prepare_existing(ex: Examination, p: FormatParams, group: str | None,
                      warnings: list[str]) -> device.Target:
    """Resize a file to the requested size, tighten its mode, set its group."""
    t = ex.target
    if t.kind == "file":
        if p.size != t.size:
            fd = os.open(t.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, p.size)
                if p.size > t.size:
                    _reserve(fd, p.size, t.path)
            finally:
                os.close(fd)
            warnings.append(f"resized {t.path} from {t.size} to {p.size} bytes")
        _set_pool_mode(t, warnings)
    return _apply_group(device.probe(t.path), group, warnings)


def _set_pool_mode(t: device.Target, warnings: list[str]) -> None:
    """One rule for init --force and format: a pool file is 0660 - the owner
    and the serving group read and write it, nobody else touches it (0666,
    0664 and 0440 alike become 0660) - or 0600 when its group had no access
    at all (kept private on purpose)."""
    if t.kind != "file":
        return
    want = POOL_MODE if t.mode & 0o070 else 0o600
    if t.mode & 0o7777 != want:
        os.chmod(t.path, want)
        warnings.append(f"changed mode of {t.path} from {t.mode & 0o7777:04o} to {want:04o}")


def _apply_group(t: device.Target, group: str | None, warnings: list[str]) -> device.Target:
    gid = _group_id(group)
    if gid is None or gid == t.gid:
        return t
    os.chown(t.path, -1, gid)
    warnings.append(f"set the group of {t.path} to {group}")
    return device.probe(t.path)


def _check_device_size(t: device.Target, given: dict) -> None:
    if t.kind != "devdax" or "size" not in given:
        return
    size = given["size"]
    if size > t.size:
        raise UsageError(f"--size {size} is larger than {t.path} ({t.size} bytes)")
    if size % t.align:
        raise UsageError(f"--size {size} is not a multiple of the device alignment {t.align}")


def _write_format(t: device.Target, p: FormatParams, zero_data: bool, progress,
                  inject: dict) -> Superblock:
    m = device.map_target(t, writable=True, length=_map_len(t, p.size) if t.kind == "devdax"
                          else t.size)
    try:
        format_mapping(m, p, zero_data=zero_data, progress=progress, **inject)
    finally:
        m.close()
    # read back through the normal open path: what we wrote must open
    with Pool.open(t.path, writable=False, force=True) as pool:
        return pool.sb


def _params_for_existing(ex: Examination, given: dict) -> FormatParams:
    t = ex.target
    if t.kind == "file":
        default = t.size or DEFAULT_SIZE
    else:
        default = t.size // t.align * t.align
    return _resolve_params(given, default, f"{t.path}")


_REFUSAL = {"foreign": "holds data that is not a cxlkv pool",
            "corrupt": "holds a damaged cxlkv pool",
            "incompatible": "holds a pool this cxlkv cannot use",
            "truncated": "holds a truncated cxlkv pool",
            "pool": "already holds a cxlkv pool"}


def _make(path: str, given: dict, *, verb: str, force: bool, group: str | None, progress,
          inject: dict | None, observe_remote: bool, create: bool, notice) -> FormatResult:
    given = dict(given or {})
    _check_given(given)
    inject = inject or {}
    warnings: list[str] = []
    if path == "":
        raise UsageError("empty pool path")
    _group_id(group)                               # an unknown group fails before anything
    for attempt in range(3):
        ex = examine(path)
        if ex.state == "missing":
            if not create:
                raise ex.error
            p = _resolve_params(given, DEFAULT_SIZE if verb == "init" else None)
            tmp = create_pool_file(path, p.size, group)
            try:
                _write_format(tmp, p, False, progress, inject)
            except BaseException:
                os.unlink(tmp.path)
                raise
            if _publish_new(tmp, path):
                w = disk_backing_warning(path)
                if w:
                    warnings.append(w)
                with Pool.open(path, writable=False) as pool:
                    return FormatResult("created", path, pool.sb, pool.target, warnings)
            continue        # another process created it meanwhile: look again
        with _exclusive(ex.target.path):
            ex = examine(path, progress=lambda d, t: None)
            if ex.state == "missing":
                continue
            return _make_existing(ex, given, verb=verb, force=force, group=group,
                                  progress=progress, inject=inject, warnings=warnings,
                                  observe_remote=observe_remote, notice=notice)
    raise RefusedError(f"{path} keeps appearing and disappearing; retry", path=path)


def _make_existing(ex: Examination, given: dict, *, verb, force, group, progress, inject,
                   warnings, observe_remote, notice) -> FormatResult:
    path, t = ex.path, ex.target
    w = device.check_permissions(t, force)
    if w:
        warnings.append(w)
    _check_device_size(t, given)
    for copy, problem in ex.problems.items():
        warnings.append(f"superblock copy {copy} is bad ({problem})")
    if ex.state == "pool" and verb == "init":
        current = sb_params(ex.sb)
        diffs = {k: (current[k], v) for k, v in given.items()
                 if k in current and current[k] != v}
        if not diffs:
            if group is not None:
                _check_owner(path, t, force, warnings)
                t = _apply_group(t, group, warnings)
            if force:
                _set_pool_mode(t, warnings)     # --force: put the mode right, as format does
                t = device.probe(path)
            if not ex.sb.compat & layout.COMPAT_KV:
                warnings.append("this pool was made by a cxlkv from before the KV cache (no KV "
                                "region): the KV cache refuses it; back up what it holds and "
                                "re-create it with `cxlkv format --force`")
            return FormatResult("unchanged", path, ex.sb, t, warnings)
        if not force:
            desc = ", ".join(f"{k}: pool has {a!r}, asked {b!r}" for k, (a, b) in diffs.items())
            raise ParameterMismatch(
                f"{path} is already a cxlkv pool with different parameters ({desc})", path=path,
                hint="repeat the command with the pool's parameters, or add --force to "
                     "reformat it (its contents are lost)")
    elif ex.state != "blank" and not force:
        detail = f" ({ex.error})" if ex.error and ex.state != "pool" else ""
        raise (PoolExistsError if ex.state == "pool" else RefusedError)(
            f"{path} {_REFUSAL[ex.state]}{detail}; refusing to format over it", path=path,
            hint="check the path; add --force to format over it (its contents are lost)")
    _check_owner(path, t, force, warnings)
    if ex.has_cxlkv_magic:
        _refuse_live(path, warnings, observe_remote, notice)
    base = sb_params(ex.sb) if (ex.state == "pool" and verb == "init") else {}
    if "size" in given:
        base.pop("hash_slots", None)      # derived from the size unless given
    if t.kind == "file":
        base.pop("size", None)            # the file as it is, unless --size says otherwise
    p = _params_for_existing(ex, {**base, **given})
    t = _prepare_existing(ex, p, group, warnings)
    sb = _write_format(t, p, True, progress, inject)
    return FormatResult("reformatted" if ex.has_cxlkv_magic else "formatted", path, sb, t,
                        warnings)


def init_pool(path: str, given: dict | None = None, *, force: bool = False,
              group: str | None = None, progress=None, inject: dict | None = None,
              observe_remote: bool = True, create: bool = True, notice=None) -> FormatResult:
    """`cxlkv init`: make `path` a formatted pool with the given parameters.

    given: the parameters the user gave explicitly (FormatParams field names);
    those left out take defaults for a new pool, or the existing pool's values.
    Idempotent on a matching pool.  Formats a missing path (creating a file
    unless create=False) or a blank (all-zero) target; anything else only
    with force.  create=False (a device was named) refuses a missing path.
    """
    return _make(path, given or {}, verb="init", force=force, group=group, progress=progress,
                 inject=inject, observe_remote=observe_remote, create=create, notice=notice)


def format_pool(path: str, given: dict | None = None, *, force: bool = False,
                group: str | None = None, progress=None, inject: dict | None = None,
                observe_remote: bool = True, notice=None) -> FormatResult:
    """`cxlkv format`: format a file or device.

    Creates a missing file when given a size; formats a blank target; refuses
    anything else (a pool, foreign data) unless force.
    """
    return _make(path, given or {}, verb="format", force=force, group=group,
                 progress=progress, inject=inject, observe_remote=observe_remote, create=True,
                 notice=notice)
