"""Creating and formatting pools: the logic behind `cxlkv init` and `cxlkv format`.

`init` is the idempotent, friendly path: it creates an emulated pool file
when the path is missing, leaves a valid pool with matching parameters alone,
and refuses anything it would destroy unless forced.  `format` is the
lower-level verb: it formats what it is pointed at, but refuses anything that
already carries a cxlkv superblock unless forced.  Both refuse to reformat a
pool while live nodes are attached, even when forced.
"""
from __future__ import annotations

import errno
import grp
import os
from dataclasses import dataclass, field, fields

from cxlkv.errors import (CxlkvError, DeviceError, LiveNodesError, NotFormatted,
                          ParameterMismatch, PoolExistsError, PoolIncompatible, PoolInvalid,
                          PoolNotFound, PoolTruncated, RefusedError, UsageError, WrongMagic)
from cxlkv.pool import device, layout as L
from cxlkv.pool.format import (DEFAULT_SIZE, FormatParams, compute_layout, format_mapping,
                               human_size)
from cxlkv.pool.pool import Pool, read_superblocks
from cxlkv.pool.superblock import Superblock, select

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

    @property
    def has_cxlkv_magic(self) -> bool:
        return self.state in ("pool", "corrupt", "incompatible", "truncated")


def examine(path: str) -> Examination:
    """Look at a path without changing it (maps it read-only)."""
    try:
        t = device.probe(path)
    except PoolNotFound as e:
        if not os.path.lexists(path):
            return Examination(path, "missing", error=e)
        raise
    if t.size < L.SB_COPIES * L.SB_SIZE:
        return Examination(path, "blank" if t.size == 0 else "foreign", t)
    m = device.map_target(t, writable=False, length=_map_len(t, L.SB_COPIES * L.SB_SIZE))
    try:
        raw_a, raw_b = read_superblocks(m)
    finally:
        m.close()
    try:
        sel = select(raw_a, raw_b)
    except NotFormatted as e:
        return Examination(path, "blank", t, error=e)
    except WrongMagic as e:
        return Examination(path, "foreign", t, error=e)
    except PoolIncompatible as e:
        return Examination(path, "incompatible", t, error=e)
    except PoolInvalid as e:
        return Examination(path, "corrupt", t, error=e)
    if sel.sb.pool_size > t.size:
        return Examination(path, "truncated", t, sel.sb,
                           PoolTruncated(f"{path} is {t.size} bytes but its superblock says "
                                         f"{sel.sb.pool_size}"))
    return Examination(path, "pool", t, sel.sb)


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
            "max_nodes": sb.max_nodes, "lease_ms": sb.lease_ms, "hash_slots": sb.hash_slots,
            "hash_max_load_pct": sb.hash_max_load_pct, "label": sb.label}


def _check_given(given: dict) -> None:
    unknown = set(given) - set(PARAM_NAMES)
    if unknown:
        raise TypeError(f"unknown format parameters: {sorted(unknown)}")


def _resolve_params(given: dict, default_size: int | None) -> FormatParams:
    kw = dict(given)
    if "size" not in kw:
        if default_size is None:
            raise UsageError("--size is required to create a new pool file")
        kw["size"] = default_size
    p = FormatParams(**kw)
    compute_layout(p)      # validates, including "too small", before anything is touched
    return p


def _refuse_live(path: str, observe: bool = True) -> None:
    from cxlkv.state.nodes import live_nodes

    try:
        pool = Pool.open(path, writable=False, force=True)
    except CxlkvError:
        return  # not readable as a pool: no node table to consult
    with pool:
        alive = live_nodes(pool, observe=observe)
    if alive:
        names = ", ".join(n.describe() for n in alive)
        raise LiveNodesError(
            f"refusing to reformat {path}: {len(alive)} live node(s) attached: {names}",
            [n.to_json() for n in alive], path=path,
            hint="stop the serving processes (or let their lease lapse), then retry")


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise UsageError(f"no such group: {group}") from None


def create_pool_file(path: str, size: int, group: str | None = None) -> device.Target:
    """Create a pool file of `size` bytes, mode 0660, space reserved (no SIGBUS later)."""
    gid = _group_id(group)
    parent = os.path.dirname(os.path.abspath(path))
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
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, POOL_MODE)
    except FileExistsError:
        raise RefusedError(f"{path} appeared while creating it", path=path) from None
    except PermissionError:
        raise PoolNotFound(f"{path}: permission denied creating the pool file",
                           path=path) from None
    try:
        os.fchmod(fd, POOL_MODE)
        if gid is not None:
            os.fchown(fd, -1, gid)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(fd, size)     # filesystem without fallocate
            else:
                raise DeviceError(f"{path}: cannot reserve {human_size(size)}: {e.strerror}",
                                  path=path) from None
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return device.probe(path)


def _prepare_existing(ex: Examination, p: FormatParams, group: str | None,
                      warnings: list[str]) -> device.Target:
    """Resize a file to the requested size, fix mode and group; check a device's limits."""
    t = ex.target
    gid = _group_id(group)
    if t.kind == "file":
        if p.size != t.size:
            fd = os.open(t.path, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, p.size)
                if p.size > t.size:
                    try:
                        os.posix_fallocate(fd, 0, p.size)
                    except OSError as e:
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise DeviceError(f"{t.path}: cannot reserve "
                                              f"{human_size(p.size)}: {e.strerror}") from None
            finally:
                os.close(fd)
            warnings.append(f"resized {t.path} from {t.size} to {p.size} bytes")
        if t.mode & 0o777 != POOL_MODE:
            os.chmod(t.path, POOL_MODE)
            if t.mode & 0o006:
                warnings.append(f"changed mode of {t.path} from {t.mode:04o} to 0660")
    else:
        if p.size > t.size:
            raise UsageError(f"--size {p.size} is larger than {t.path} ({t.size} bytes)")
        if p.size % t.align:
            raise UsageError(f"--size {p.size} is not a multiple of the device "
                             f"alignment {t.align}")
        if gid is not None:
            os.chmod(t.path, POOL_MODE)
    if gid is not None:
        os.chown(t.path, -1, gid)
    return device.probe(t.path)


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
    default_size = ex.target.size if ex.target.kind == "file" else \
        ex.target.size // ex.target.align * ex.target.align
    if ex.target.kind == "file" and ex.target.size == 0:
        default_size = DEFAULT_SIZE
    return _resolve_params(given, default_size)


def init_pool(path: str, given: dict | None = None, *, force: bool = False,
              group: str | None = None, progress=None, inject: dict | None = None,
              observe_remote: bool = True, create: bool = True) -> FormatResult:
    """`cxlkv init`: make `path` a formatted pool with the given parameters.

    given: the parameters the user gave explicitly (FormatParams field names);
    those left out take defaults for a new pool, or the existing pool's values.
    create=False (a device was named) refuses to create a file at a missing path.
    """
    given = dict(given or {})
    _check_given(given)
    inject = inject or {}
    warnings: list[str] = []
    ex = examine(path)
    if ex.state == "missing" and not create:
        raise ex.error
    if ex.state == "missing":
        p = _resolve_params(given, DEFAULT_SIZE)
        t = create_pool_file(path, p.size, group)
        sb = _write_format(t, p, False, progress, inject)
        return FormatResult("created", path, sb, t, warnings)

    w = device.check_permissions(ex.target, force)
    if w:
        warnings.append(w)
    if ex.state == "pool":
        current = sb_params(ex.sb)
        diffs = {k: (current[k], v) for k, v in given.items()
                 if k in current and current[k] != v}
        if not diffs:
            return FormatResult("unchanged", path, ex.sb, ex.target, warnings)
        if not force:
            desc = ", ".join(f"{k}: pool has {a!r}, asked {b!r}" for k, (a, b) in diffs.items())
            raise ParameterMismatch(
                f"{path} is already a cxlkv pool with different parameters ({desc})", path=path,
                hint="repeat the command with the pool's parameters, or add --force to "
                     "reformat it (its contents are lost)")
    elif ex.state != "blank" and not force:
        what = {"foreign": "does not hold a cxlkv pool and is not empty",
                "corrupt": f"holds a damaged cxlkv pool ({ex.error})",
                "incompatible": f"holds a pool this cxlkv cannot use ({ex.error})",
                "truncated": f"holds a truncated cxlkv pool ({ex.error})"}[ex.state]
        raise RefusedError(f"{path} {what}; refusing to overwrite it", path=path,
                           hint="check the path; add --force to format over it")
    if ex.has_cxlkv_magic:
        _refuse_live(path, observe_remote)
    # existing valid pool: keep its parameters for what was not given
    base = sb_params(ex.sb) if ex.state == "pool" else {}
    if "size" in given:
        base.pop("hash_slots")      # derived from the size unless given
    merged = {**base, **given}
    p = _params_for_existing(ex, merged)
    t = _prepare_existing(ex, p, group, warnings)
    sb = _write_format(t, p, True, progress, inject)
    action = "reformatted" if ex.has_cxlkv_magic else "formatted"
    return FormatResult(action, path, sb, t, warnings)


def format_pool(path: str, given: dict | None = None, *, force: bool = False,
                group: str | None = None, progress=None, inject: dict | None = None,
                observe_remote: bool = True) -> FormatResult:
    """`cxlkv format`: format a file or device; refuses an existing pool unless forced."""
    given = dict(given or {})
    _check_given(given)
    inject = inject or {}
    warnings: list[str] = []
    ex = examine(path)
    if ex.state == "missing":
        p = _resolve_params(given, None)
        t = create_pool_file(path, p.size, group)
        sb = _write_format(t, p, False, progress, inject)
        return FormatResult("created", path, sb, t, warnings)
    w = device.check_permissions(ex.target, force)
    if w:
        warnings.append(w)
    if ex.has_cxlkv_magic:
        if not force:
            what = "a cxlkv pool" if ex.state == "pool" else f"a cxlkv pool ({ex.error})"
            raise PoolExistsError(f"{path} already holds {what}; refusing to format over it",
                                  path=path, hint="add --force to reformat (its contents "
                                                  "are lost)")
        _refuse_live(path, observe_remote)
    p = _params_for_existing(ex, given)
    t = _prepare_existing(ex, p, group, warnings)
    sb = _write_format(t, p, True, progress, inject)
    return FormatResult("reformatted" if ex.has_cxlkv_magic else "formatted", path, sb, t,
                        warnings)
