"""Reading a TOML settings file (`--config`) with usage errors that name it."""
from __future__ import annotations

import tomllib

from cxlkv.errors import UsageError


def read_toml(path) -> dict:
    """The parsed file; UsageError for a missing, unreadable or invalid one."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from None
