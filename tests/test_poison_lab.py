"""Lab tier: poison on a live kernel CXL stack (QEMU >= 8 and Linux >= 6.5).

A guest formats a pool on /dev/dax0.0, stores KV blocks, injects poison
(debugfs inject_poison) at the DPA under one block's payload, lists it
(trigger_poison_list -> cxl_poison trace event), and `cxlkv kv quarantine
--trace` takes it out: that block is no longer served, its chunk is retired,
fsck is clean.  Needs the 6.12 / QEMU 10 lab (Debian bookworm's defaults,
6.1 and QEMU 7.2, cannot inject: tests/fixtures/lab/poison/README):

    export CXLKV_LAB_DIR=~/.cache/cxlkv-lab-q10
    export CXLKV_LAB_KERNEL=linux-image-6.12.117+deb12-amd64
    export CXLKV_LAB_QEMU=<unpacked QEMU 10>/usr/bin/qemu-system-x86_64
    .venv/bin/python -m pytest -m lab tests/test_poison_lab.py

Skips, saying so, when the configured lab cannot inject.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from test_lab import REPO, RUN, Out, boot

LAB_SCRIPT = REPO / "scripts" / "cxl-lab"
pytestmark = [pytest.mark.lab, pytest.mark.timeout(1800)]


def _version(text: str) -> tuple[int, ...]:
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@pytest.fixture(scope="module")
def poison_lab():
    if not (REPO / ".venv" / "bin" / "cxlkv").exists():
        pytest.fail("no .venv in the repository: run scripts/setup")
    if not os.environ.get("CXLKV_LAB_KERNEL", "").startswith("linux-image-6.1") or \
            _version(os.environ["CXLKV_LAB_KERNEL"][len("linux-image-"):]) < (6, 5):
        pytest.skip("poison injection needs kernel >= 6.5 and QEMU >= 8: set CXLKV_LAB_DIR, "
                    "CXLKV_LAB_KERNEL (linux-image-6.12.*) and CXLKV_LAB_QEMU (10.0), see "
                    "this module's docstring")
    q = subprocess.run([os.environ.get("CXLKV_LAB_QEMU", "qemu-system-x86_64"), "--version"],
                       capture_output=True, text=True)
    if _version(q.stdout) < (8, 0):
        pytest.skip(f"CXLKV_LAB_QEMU is {q.stdout.splitlines()[:1]}: QEMU >= 8 injects poison")
    r = subprocess.run([sys.executable, str(LAB_SCRIPT), "setup"], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"scripts/cxl-lab setup failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return True


STORE = r"""
import json, sys
import numpy as np
import cxlkv
from cxlkv.host import poison
from cxlkv.kv.area import Area
from cxlkv.pool import layout
with cxlkv.open_pool("/dev/dax0.0") as p:
    kv = p.kv(model="m", block_tokens=4, block_bytes=4096)
    toks = list(range(32))
    kv.store(toks, [np.full(4096, i, np.uint8) for i in range(8)])
    t = Area(p).entries()
    live = t[(t["ctl"] & 0xFF) == layout.KV_PUBLISHED]
    leaf = live[live["children"] == 0][0]
    off = int(leaf["payload"]) + 128                # a cache line inside the leaf's payload
    rm = poison.region_map("region0")
    (dx,) = [d for d in poison.dax_ranges() if d.dax == "dax0.0"]
    pos, dpa_off = poison.hpa_offset_to_dpa_offset(dx.resource + off - rm.resource, rm.ways,
                                                   rm.granularity)
    dpa = rm.targets[pos].dpa_resource + dpa_off
    print(json.dumps({"offset": off, "dpa": dpa, "match": kv.match(toks)}))
"""

AFTER = r"""
import json
import cxlkv
with cxlkv.open_pool("/dev/dax0.0") as p:
    kv = p.kv(model="m", block_tokens=4, block_bytes=4096)
    print(json.dumps({"match": kv.match(list(range(32)))}))
"""

GUEST = RUN + r"""
set -e
mount -t debugfs none /sys/kernel/debug
mount -t tracefs none /sys/kernel/tracing
cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0 >/dev/null
ndctl create-namespace -r region0 -m devdax -a 2M >/dev/null
run init init --device /dev/dax0.0 --json
cat > /out/store.py <<'EOF'
""" + STORE + r"""EOF
cat > /out/after.py <<'EOF'
""" + AFTER + r"""EOF
py() { hostrun -C "$REPO" "$REPO/.venv/bin/python" "$@"; }
py /run/cxl-lab/out/store.py > $LAB_OUT/store.json
dpa=$(sed -n 's/.*"dpa": \([0-9]*\).*/\1/p' $LAB_OUT/store.json)
echo 1 > /sys/kernel/tracing/events/cxl/cxl_poison/enable
printf '0x%x\n' $dpa > /sys/kernel/debug/cxl/mem0/inject_poison
echo 1 > /sys/bus/cxl/devices/mem0/trigger_poison_list
cat /sys/kernel/tracing/trace > $LAB_OUT/trace.txt
set +e
run quarantine kv quarantine --pool /dev/dax0.0 --trace /run/cxl-lab/out/trace.txt --json
run again kv quarantine --pool /dev/dax0.0 --trace /run/cxl-lab/out/trace.txt --json
run stats kv stats --pool /dev/dax0.0 --json
run fsck fsck --pool /dev/dax0.0 --json
py /run/cxl-lab/out/after.py > $LAB_OUT/after.json
exit 0
"""


def test_live_poison_is_translated_and_quarantined(poison_lab, tmp_path):
    (g,) = boot(tmp_path, GUEST, timeout=1500)
    out = Out(g)
    before = json.loads((g / "store.json").read_text())
    assert before["match"] == 32
    trace = (g / "trace.txt").read_text()
    assert f"dpa={before['dpa']:#x}" in trace, trace[-2000:]
    assert out.rc("quarantine") == 0, out.err("quarantine")
    q = out.json("quarantine")
    assert [r["offset"] for r in q["ranges"]] == [before["offset"]]
    (res,) = q["results"]
    assert res["region"] == "data" and len(res["retired_chunks"]) == 1
    assert res["evicted_blocks"] == 1                  # the leaf, nothing else
    assert out.json("again")["results"][0]["already_retired"] == res["retired_chunks"]
    assert out.json("stats")["kv"]["retired"]["chunks"] == 1
    assert out.json("fsck")["clean"]
    assert json.loads((g / "after.json").read_text())["match"] == 28
