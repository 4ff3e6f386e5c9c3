"""Sizes as operators write them ('2M', '1G', '512MiB') and as we print them."""
from __future__ import annotations

from cxlkv.errors import UsageError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_SUFFIX = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
           "g": GiB, "gb": GiB, "gib": GiB, "t": TiB, "tb": TiB, "tib": TiB}


def parse_size(text: str | int, what: str = "size") -> int:
    """'1G', '512MiB', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace("_", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    if not num.isdigit() or unit not in _SUFFIX:
        raise UsageError(f"invalid {what} {text!r}: use bytes or a K/M/G/T suffix (e.g. 2M, 1G)")
    return int(num) * _SUFFIX[unit]


def human_size(n: int) -> str:
    for unit, div in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % (div // 1024 or 1) == 0:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"
