"""What a pool path is, whether it is safe to use, and mapping it.

A pool lives in a regular file (emulated: /dev/shm, hugetlbfs, an fsdax
mount) or on a device-dax character device (/dev/daxX.Y), whose size and
alignment come from sysfs (/sys/dev/char/MAJ:MIN/{size,align}).  Device-dax
allows only mmap, MAP_SHARED, with offset and length multiples of the
alignment (2 MiB by default).
"""
from __future__ import annotations

import errno
import grp
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cxlkv._core import Mapping
from cxlkv.errors import DeviceError, PoolNotFound, UnsafePermissions
from cxlkv.host import sysfs

DEFAULT_DAX_ALIGN = 2 << 20


@dataclass(frozen=True)
class Target:
    path: str
    kind: str            # "file" | "devdax"
    size: int            # bytes available to map
    align: int           # mapping granularity
    mode: int            # st_mode permission bits
    uid: int
    gid: int
    device: str | None = None   # "dax0.0" for device-dax

    @property
    def world_readable(self) -> bool:
        return bool(self.mode & stat.S_IROTH)

    @property
    def world_writable(self) -> bool:
        return bool(self.mode & stat.S_IWOTH)

    def to_json(self) -> dict:
        try:
            group = grp.getgrgid(self.gid).gr_name
        except KeyError:
            group = str(self.gid)
        return {"path": self.path, "kind": self.kind, "size": self.size, "align": self.align,
                "mode": f"{self.mode & 0o7777:04o}", "uid": self.uid, "group": group,
                "device": self.device}


def probe(path: str | os.PathLike) -> Target:
    """Stat a pool path and work out what it is; raises PoolNotFound or DeviceError."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.basename(path).startswith("dax") and path.startswith("/dev/"):
            # a device path: a regular file there would be no device at all
            raise PoolNotFound(f"{path}: no such DAX device", path=path,
                               hint="cxlkv provision plan shows how to create it (a CXL "
                                    "region and a devdax namespace); cxlkv inspect lists the "
                                    "DAX devices this host has") from None
        raise PoolNotFound(f"{path}: no such file or device", path=path,
                           hint=f"create an emulated pool with: cxlkv init --pool {path}") from None
    except PermissionError:
        raise PoolNotFound(f"{path}: permission denied", path=path) from None
    except OSError as e:
        raise PoolNotFound(f"{path}: {e.strerror}", path=path) from None
    perm = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        raise PoolNotFound(f"{path} is a directory, not a pool file or device", path=path,
                           hint=f"name a file inside it, e.g. {os.path.join(path, 'cxlkv.pool')}")
    if stat.S_ISREG(st.st_mode):
        return Target(path, "file", st.st_size, 4096, perm, st.st_uid, st.st_gid)
    if stat.S_ISCHR(st.st_mode):
        return _probe_dax(path, st, perm)
    raise DeviceError(f"{path} is neither a regular file nor a device-dax character device",
                      path=path)


def _probe_dax(path: str, st: os.stat_result, perm: int) -> Target:
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    d = sysfs.char_device_dir(major, minor)
    subsystem = os.path.basename(os.readlink(d / "subsystem")) if (d / "subsystem").is_symlink() else None
    name = Path(os.path.realpath(d)).name if d.exists() else None
    if subsystem != "dax" and not (name or "").startswith("dax"):
        raise DeviceError(
            f"{path} (char {major}:{minor}) is not a device-dax device "
            f"(sysfs {d} {'has subsystem ' + subsystem if subsystem else 'not found'})",
            path=path, hint="a CXL pool is a /dev/daxX.Y device in devdax mode (daxctl list)")
    size = sysfs.read_int(d / "size")
    if not size:
        raise DeviceError(f"{path}: cannot read the device size from {d / 'size'}", path=path)
    align = sysfs.read_int(d / "align", DEFAULT_DAX_ALIGN) or DEFAULT_DAX_ALIGN
    if size % align:
        raise DeviceError(
            f"{path}: device size {size} is not a multiple of its alignment {align}; "
            "device-dax maps only whole alignment units", path=path,
            hint="recreate the namespace with a size that is a multiple of the alignment")
    return Target(path, "devdax", size, align, perm, st.st_uid, st.st_gid, device=name)


def check_permissions(t: Target, force: bool = False) -> str | None:
    """Refuse a world-readable or world-writable pool (KV data is tenant data).

    Returns a warning line when `force` overrides the refusal.
    """
    if not (t.world_readable or t.world_writable):
        return None
    what = " and ".join(w for w, on in (("world-readable", t.world_readable),
                                        ("world-writable", t.world_writable)) if on)
    msg = f"{t.path} is {what} (mode {t.mode:04o}); a pool holds tenant data"
    if force:
        return msg + "; continuing because of --force"
    raise UnsafePermissions(msg, path=t.path,
                            hint=f"chmod 0660 {t.path} (and chgrp to the serving group), "
                                 "or pass --force")


def check_mapping_size(t: Target, length: int) -> None:
    if length <= 0 or length > t.size:
        raise DeviceError(f"{t.path}: cannot map {length} bytes of {t.size}", path=t.path)
    if length % t.align:
        raise DeviceError(
            f"{t.path}: mapping length {length} is not a multiple of the device "
            f"alignment {t.align}", path=t.path)


def map_target(t: Target, *, writable: bool = True, length: int | None = None,
               populate: bool = False):
    """mmap the target MAP_SHARED; returns a cxlkv._core.Mapping."""

    length = t.size if length is None else length
    check_mapping_size(t, length)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
    try:
        fd = os.open(t.path, flags)
    except PermissionError:
        raise PoolNotFound(f"{t.path}: permission denied (opening "
                           f"{'read-write' if writable else 'read-only'})", path=t.path,
                           hint="run as a member of the pool's group") from None
    except OSError as e:
        raise DeviceError(f"{t.path}: open failed: {e.strerror}", path=t.path) from None
    try:
        return Mapping(fd, length, writable, populate, align=t.align)
    except OSError as e:
        hint = None
        if e.errno == errno.EINVAL and t.kind == "devdax":
            hint = f"device-dax needs lengths that are multiples of {t.align}"
        raise DeviceError(f"{t.path}: mmap of {length} bytes failed: {e.strerror}",
                          path=t.path, hint=hint) from None
    finally:
        os.close(fd)
