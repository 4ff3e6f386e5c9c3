"""The C core: the only code that touches pool memory.

`Mapping` maps a pool (file or device-dax) or wraps a buffer; every access
takes a byte offset from the pool base and is bounds-checked in C.
"""
import logging
import os

from cxlkv.errors import (InternalError, LockLost, MetadataCorrupt, PoolRangeError,
                          PoolReadOnly, UsageError)

try:
    from cxlkv._core import _native
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "cxlkv's C core is not built (cxlkv._core._native): "
        "run `pip install -e .` (or ./scripts/setup) in the source tree"
    ) from e

#: The interface version this Python code was written against; a stale or
#: foreign build of the extension is refused at import.
EXPECTED_ABI = 24
if _native.ABI_VERSION != EXPECTED_ABI:  # pragma: no cover - depends on the build
    raise ImportError(
        f"cxlkv C core ABI {_native.ABI_VERSION} does not match the Python code "
        f"(expects {EXPECTED_ABI}): rebuild with `pip install -e .`"
    )

_native.set_error_types(PoolRangeError, MetadataCorrupt, PoolReadOnly, InternalError, LockLost)

#: crash points are live only when CXLKV_CRASH_AT or CXLKV_PAUSE_AT is set
#: (tests); hot paths test this flag before calling crashpoint().
CRASH_ENABLED = bool(os.environ.get("CXLKV_CRASH_AT") or os.environ.get("CXLKV_PAUSE_AT"))


def crashpoint(site: str) -> None:
    """SIGKILL this process the Nth time it passes `site` (CXLKV_CRASH_AT=site:N),
    or SIGSTOP it there (CXLKV_PAUSE_AT=site:N: a stall, for tests)."""
    if CRASH_ENABLED:
        _native.crashpoint(site)


Mapping = _native.Mapping
fence = _native.fence
sfence = _native.sfence
cpu_info = _native.cpu_info
layout = _native.layout
constants = _native.constants
kv_chain = _native.kv_chain
kv_keys = _native.kv_keys
gather = _native.gather
kv_copy = _native.kv_copy
spill_read = _native.spill_read
spill_layout = _native.spill_layout
spill_helpers = _native.spill_helpers
spill_helper_stats = _native.spill_helper_stats

from cxlkv._core import copymode  # noqa: E402  (needs _native; sets the copy modes)
from cxlkv._core import deadline_clock  # noqa: E402  (needs _native; picks the deadline clock)

try:
    copymode.apply()                 # CXLKV_COPY, else this host's cached calibration
except UsageError as e:              # a bad CXLKV_COPY: the defaults, and say so
    logging.getLogger(__name__).warning("%s; using the default copy modes", e)

__all__ = ["Mapping", "fence", "sfence", "cpu_info", "layout", "constants", "kv_chain", "kv_keys", "gather", "kv_copy",
           "spill_read", "spill_layout", "spill_helpers", "spill_helper_stats",
           "copymode", "deadline_clock", "crashpoint",
           "CRASH_ENABLED"]
