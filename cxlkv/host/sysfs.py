"""The one redirectable sysfs / procfs root.

Everything cxlkv reads from sysfs or procfs goes through `sys_path()` /
`proc_path()`, rooted at $CXLKV_SYSFS_ROOT (default /sys) and
$CXLKV_PROCFS_ROOT (default /proc), so tests point them at fixture trees
captured from a real kernel CXL stack.  Device nodes that host discovery and
`cxlkv doctor` look at (/dev/daxX.Y permissions) go through `dev_path()`,
rooted at $CXLKV_DEV_ROOT (default /dev).
"""
from __future__ import annotations

import os
from pathlib import Path


def sys_root() -> Path:
    return Path(os.environ.get("CXLKV_SYSFS_ROOT") or "/sys")


def proc_root() -> Path:
    return Path(os.environ.get("CXLKV_PROCFS_ROOT") or "/proc")


def dev_root() -> Path:
    return Path(os.environ.get("CXLKV_DEV_ROOT") or "/dev")


def dev_path(*parts: str) -> Path:
    return dev_root().joinpath(*parts)


def sys_path(*parts: str) -> Path:
    return sys_root().joinpath(*parts)


def proc_path(*parts: str) -> Path:
    return proc_root().joinpath(*parts)


def read_attr(path: Path, default: str | None = None) -> str | None:
    """Contents of a sysfs attribute, stripped; `default` when absent or unreadable."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return default


def read_int(path: Path, default: int | None = None) -> int | None:
    """An integer attribute (decimal or 0x-hex); `default` when absent or not a number."""
    text = read_attr(path)
    if text is None:
        return default
    try:
        return int(text, 0)
    except ValueError:
        return default


def char_device_dir(major: int, minor: int) -> Path:
    """sysfs directory of a character device, via /sys/dev/char/MAJ:MIN."""
    return sys_path("dev", "char", f"{major}:{minor}")
