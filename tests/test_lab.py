"""Lab tier: cxlkv on a real kernel CXL stack, in a QEMU guest (scripts/cxl-lab).

Runs only when asked (`./scripts/test -m lab`, or CXLKV_LAB=1) on a machine
where `scripts/cxl-lab setup` has been run; otherwise skipped with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.lab

GUEST = r"""
set -e
cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0 >/dev/null
ndctl create-namespace -m devdax >/dev/null
run() { hostrun -C "$REPO" "$REPO/.venv/bin/cxlkv" "$@"; }
run init --device /dev/dax0.0 --json > $LAB_OUT/init.json
run init --device /dev/dax0.0 --json > $LAB_OUT/init2.json
run inspect --pool /dev/dax0.0 --json > $LAB_OUT/inspect.json
hostrun -C "$REPO" "$REPO/.venv/bin/python" -c '
import cxlkv
with cxlkv.open_pool("/dev/dax0.0") as p:
    o = p.alloc(1 << 20)
    p.mapping.write(o, b"lab!" * (1 << 18))
    p.publish(o)
    print(o)
' > $LAB_OUT/attach.out
run fsck --pool /dev/dax0.0 --json > $LAB_OUT/fsck.json
"""


def lab_ready() -> str | None:
    lab = Path(os.environ.get("CXLKV_LAB_DIR") or Path.home() / ".cache" / "cxlkv-lab")
    if not (lab / "initramfs-base.cpio.gz").exists():
        return f"the QEMU lab is not set up ({lab}): run scripts/cxl-lab setup"
    if not (REPO / ".venv" / "bin" / "cxlkv").exists():
        return "no .venv in the repository (run scripts/setup)"
    return None


def test_devdax_pool_on_a_real_kernel_cxl_stack(tmp_path):
    why = lab_ready()
    if why:
        pytest.skip(why)
    script = tmp_path / "guest.sh"
    script.write_text(f'REPO="{REPO}"\n' + GUEST)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "cxl-lab"), "run", "--share",
                        "--script", str(script), "--out", str(out), "--timeout", "300"],
                       capture_output=True, text=True, timeout=400)
    g = out / "guest0"
    assert r.returncode == 0, (r.stderr, (out / "guest0.log").read_text()[-3000:])
    init = json.loads((g / "init.json").read_text())
    assert init["action"] == "formatted"           # a new namespace reads as zeros: blank
    assert init["target"]["kind"] == "devdax" and init["target"]["align"] == 2 << 20
    assert json.loads((g / "init2.json").read_text())["action"] == "unchanged"
    pool = json.loads((g / "inspect.json").read_text())["pool"]
    assert pool["superblock"]["pool_size"] == init["target"]["size"]
    assert int((g / "attach.out").read_text()) == pool["superblock"]["regions"]["data"]["offset"]
    fsck = json.loads((g / "fsck.json").read_text())
    assert fsck["clean"] and fsck["stats"]["allocator"]["slots_published"] == 1
