"""Lab tier: poison on a live kernel CXL stack (QEMU >= 8 and Linux >= 6.5).

A guest formats a pool on /dev/dax0.0, stores KV blocks, injects poison
(debugfs inject_poison) at the DPA under one block's payload, lists it
(trigger_poison_list -> cxl_poison trace event), and `cxlkv kv quarantine
--trace` takes it out: that block is no longer served, its chunk is retired,
fsck is clean.  Live: `cxlkv serve` runs in a guest on the pool while poison
arrives (QMP before boot, debugfs before and while it runs); its start-up
scan and its tracefs follower quarantine the records (blocks evicted, chunks
retired, log lines, metrics), fsck is clean.  Needs the 6.12 / QEMU 10 lab
(Debian bookworm's defaults, 6.1 and QEMU 7.2, cannot inject:
tests/fixtures/lab/poison/README):

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


# -- the live path: `cxlkv serve` in the guest follows poison while it runs ---------------
#
# Three poison records, three ways in:
#   * QMP cxl-inject-poison before the guest kernel runs, at DPA 0x1000 (in region0, in
#     front of dax0.0: namespace metadata, not the pool) - only the device's list knows it;
#   * debugfs inject_poison under chain A's leaf before serve starts, with the cxl_poison
#     event off - again only the device's list knows it;
#   * debugfs inject_poison under chain B's leaf while serve runs (event on: Inject).
# serve's start-up scan (trigger_poison_list) must report the first as outside the pool and
# quarantine A; its follower must quarantine B within a poll.

LIVE_QMP = [{"execute": "cxl-inject-poison",
             "arguments": {"path": "/machine/peripheral/cxl-pmem0", "start": 0x1000,
                           "length": 64}}]

LIVE_STORE = r"""
import json
import numpy as np
import cxlkv
from cxlkv.host import poison
from cxlkv.kv.area import Area
from cxlkv.pool import layout
from cxlkv.state import alloc
out = {}
with cxlkv.open_pool("/dev/dax0.0") as p:
    base, chunk = alloc.geometry(p)[:2]
    rm = poison.region_map("region0")
    (dx,) = [d for d in poison.dax_ranges() if d.dax == "dax0.0"]
    for name, bb, t0 in (("a", 4096, 0), ("b", 8192, 1000)):
        kv = p.kv(model=name, block_tokens=4, block_bytes=bb)
        toks = list(range(t0, t0 + 32))
        kv.store(toks, [np.full(bb, i, np.uint8) for i in range(8)])
        t = Area(p).entries()
        live = t[((t["ctl"] & 0xFF) == layout.KV_PUBLISHED) & (t["children"] == 0)
                 & (t["length"] == bb)]
        (leaf,) = live
        off = int(leaf["payload"]) + 128            # a cache line inside the leaf's payload
        pos, dpa_off = poison.hpa_offset_to_dpa_offset(dx.resource + off - rm.resource,
                                                       rm.ways, rm.granularity)
        out[name] = {"offset": off, "hex": hex(off), "chunk": (off - base) // chunk,
                     "dpa": rm.targets[pos].dpa_resource + dpa_off, "match": kv.match(toks)}
print(json.dumps(out))
with open("/run/cxl-lab/out/store.sh", "w") as f:       # for the guest's shell
    for name, x in out.items():
        f.write(f"dpa_{name}={x['dpa']}\nhex_{name}={x['hex']}\n")
"""

LIVE_AFTER = r"""
import json
import cxlkv
from cxlkv.state import alloc
with cxlkv.open_pool("/dev/dax0.0") as p:
    out = {n: p.kv(model=n, block_tokens=4, block_bytes=bb).match(list(range(t0, t0 + 32)))
           for n, bb, t0 in (("a", 4096, 0), ("b", 8192, 1000))}
    out["retired"] = alloc.retired(p)
print(json.dumps(out, default=str))
"""

GUEST_LIVE = r"""
REPO_PY() { hostrun -C "$REPO" /usr/bin/env PYTHONPATH="$REPO" "$@"; }
run() { name=$1; shift
    REPO_PY "$REPO/.venv/bin/cxlkv" "$@" > $LAB_OUT/$name.json 2> $LAB_OUT/$name.err
    echo $? > $LAB_OUT/$name.rc; echo "cxlkv $* -> $(cat $LAB_OUT/$name.rc)"; }
# until_seen FILE PATTERN SECONDS [PID]: wait for PATTERN in FILE (1: time out, 2: PID died)
until_seen() {
    n=0
    until grep -q -- "$2" "$1" 2>/dev/null; do
        n=$((n + 1)); [ $n -gt $(($3 * 10)) ] && return 1
        [ -n "$4" ] && ! kill -0 $4 2>/dev/null && return 2
        usleep 100000
    done
}
TR=/sys/kernel/tracing
set -e
mount -t debugfs none /sys/kernel/debug
mount -t tracefs none $TR
mount -t tracefs none /host$TR           # the chroot's /sys is a bind of the guest's
ifconfig lo 127.0.0.1 up
mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm   # cxlkv's host-local lock tier
cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0 >/dev/null
ndctl create-namespace -r region0 -m devdax -a 2M >/dev/null
run init init --device /dev/dax0.0 --json
cat > /out/store.py <<'EOF'
""" + LIVE_STORE + r"""EOF
cat > /out/after.py <<'EOF'
""" + LIVE_AFTER + r"""EOF
REPO_PY "$REPO/.venv/bin/python" /run/cxl-lab/out/store.py > $LAB_OUT/store.json
. /out/store.sh
# A: poisoned before serve starts, the cxl_poison event off: only the device's list has it
cat $TR/events/cxl/cxl_poison/enable > $LAB_OUT/event-enabled-before.txt
printf '0x%x\n' $dpa_a > /sys/kernel/debug/cxl/mem0/inject_poison
set +e
# hostrun execs down to the agent: $! is its pid, SIGTERM reaches it
hostrun -C "$REPO" /usr/bin/env PYTHONPATH="$REPO" "$REPO/.venv/bin/cxlkv" serve --pool /dev/dax0.0 --metrics-addr 127.0.0.1:9464 \
    --log-json --interval 0.5 2> $LAB_OUT/serve.log &
SERVE=$!
until_seen $LAB_OUT/serve.log "pool offset $hex_a:" 400 $SERVE
echo $? > $LAB_OUT/wait-a.rc
# B: poisoned while serve runs (serve enabled the event: an Inject record)
printf '0x%x\n' $dpa_b > /sys/kernel/debug/cxl/mem0/inject_poison
until_seen $LAB_OUT/serve.log "pool offset $hex_b:" 120 $SERVE
echo $? > $LAB_OUT/wait-b.rc
# the retired-chunk gauge follows at the agent's next tick
n=0
while [ $n -lt 600 ]; do
    wget -q -O $LAB_OUT/metrics.txt http://127.0.0.1:9464/metrics
    grep -q -E '^cxlkv_poison_retired_chunks(\{[^}]*\})? 2(\.0)?$' $LAB_OUT/metrics.txt && break
    n=$((n + 1)); usleep 100000
done
kill -TERM $SERVE; wait $SERVE; echo $? > $LAB_OUT/serve.rc
cat $TR/trace > $LAB_OUT/trace.txt
run stats kv stats --pool /dev/dax0.0 --json
run fsck fsck --pool /dev/dax0.0 --json
REPO_PY "$REPO/.venv/bin/python" /run/cxl-lab/out/after.py > $LAB_OUT/after.json
exit 0
"""


def _boot_qmp(out, script: str, qmp: list, timeout: int):
    """test_lab.boot, with QMP commands sent to the guest's QEMU before its kernel runs."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "guest.sh").write_text(f'REPO="{REPO}"\n' + script)
    (out / "qmp.json").write_text(json.dumps(qmp))
    r = subprocess.run([sys.executable, str(LAB_SCRIPT), "run", "--share", "--script",
                        str(out / "guest.sh"), "--qmp", str(out / "qmp.json"), "--out",
                        str(out / "run"), "--timeout", str(timeout)],
                       capture_output=True, text=True, timeout=timeout + 120)
    log = out / "run" / "guest0.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    assert r.returncode == 0, f"cxl-lab run: exit {r.returncode}\n{r.stderr[-2000:]}\n{tail}"
    return out / "run" / "guest0", json.loads((out / "run" / "guest0.qmp.json").read_text())


def _metric(text: str, name: str, **labels) -> float | None:
    """A sample's value in Prometheus text: `name{labels...} value`, the labels given
    among the sample's (the agent adds pool="<uuid>")."""
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name and \
                set(f'{k}="{v}"' for k, v in labels.items()) <= set(
                    re.findall(r'\w+="[^"]*"', m.group(2) or "")):
            return float(m.group(3))
    return None


def test_serve_quarantines_poison_live(poison_lab, tmp_path):
    from cxlkv.host import poison

    g, qmp = _boot_qmp(tmp_path, GUEST_LIVE, LIVE_QMP, timeout=1500)
    assert qmp[-1]["response"] == {"return": {}}, qmp
    out = Out(g)
    st = json.loads((g / "store.json").read_text())
    a, b = st["a"], st["b"]
    assert a["match"] == b["match"] == 32 and a["chunk"] != b["chunk"]
    serve_log = (g / "serve.log").read_text()
    assert (g / "wait-a.rc").read_text().strip() == "0", serve_log[-3000:]
    assert (g / "wait-b.rc").read_text().strip() == "0", serve_log[-3000:]
    assert (g / "serve.rc").read_text().strip() == "0", serve_log[-3000:]
    lines = [json.loads(x) for x in serve_log.splitlines() if x.startswith("{")]
    hits = {x["msg"] for x in lines if x["msg"].startswith("poison ")}
    # the records, as the kernel emitted them: A and 0x1000 only from the start-up scan of
    # the device's list, B only as the live Inject
    assert (g / "event-enabled-before.txt").read_text().strip() == "0"
    recs = poison.parse_trace((g / "trace.txt").read_text())
    got = sorted((r.trace_type, r.dpa) for r in recs)
    assert got == sorted([("List", 0x1000), ("List", a["dpa"]), ("Inject", b["dpa"])]), got
    # the agent's lines: outside the pool, then A and B each quarantined, one leaf each
    assert any(m.startswith("poison mem0 dpa 0x1000 not in the pool") for m in hits), hits
    for x, name in ((a, "a"), (b, "b")):
        want = (f"poison mem0 dpa {x['dpa']:#x} -> pool offset {x['hex']}: 1 block(s) evicted, "
                f"chunks [{x['chunk']}] retired, region data")
        assert want in hits, (name, hits)
    assert not [x for x in lines if x["level"] in ("error", "critical")], serve_log[-3000:]
    # its metrics
    m = (g / "metrics.txt").read_text()
    assert _metric(m, "cxlkv_poison_records_total", outcome="quarantined") == 2, m
    assert _metric(m, "cxlkv_poison_records_total", outcome="outside-pool") == 1, m
    assert _metric(m, "cxlkv_poison_records_total", outcome="critical") is None, m
    assert _metric(m, "cxlkv_poison_retired_chunks") == 2, m
    assert _metric(m, "cxlkv_poison_metadata_hits") == 0, m
    # the pool afterwards: the two leaves gone (28 of 32 tokens), their chunks retired
    after = json.loads((g / "after.json").read_text())
    assert after["a"] == after["b"] == 28
    assert sorted(e["chunk"] for e in after["retired"]) == sorted([a["chunk"], b["chunk"]])
    assert out.json("stats")["kv"]["retired"]["chunks"] == 2
    assert out.rc("fsck") == 0 and out.json("fsck")["clean"], out.err("fsck")
