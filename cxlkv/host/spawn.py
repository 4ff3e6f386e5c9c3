"""The one seam for starting processes of our own (stress workers, a lock
manager for a run): every library use of subprocess goes through here (the
external tools cxl/ndctl/daxctl/numactl through cxlkv.host.tools), so tests
and embedders see one place that forks."""
from __future__ import annotations

import subprocess
import sys

#: what Popen.wait raises when its timeout passes
TimeoutExpired = subprocess.TimeoutExpired
PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL


def python_module(module: str, *args: str, **popen) -> subprocess.Popen:
    """`python -m module args...` with this interpreter; Popen keywords as given."""
    return subprocess.Popen([sys.executable, "-m", module, *args], **popen)
