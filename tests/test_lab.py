"""Lab tier: cxlkv on a real kernel CXL stack, in QEMU guests (scripts/cxl-lab).

Debian's 6.1 kernel with its CXL modules and the real cxl/ndctl/daxctl, under
QEMU 7.2's emulated CXL Type-3 device (TCG: no KVM needed); cxlkv itself is
this repository's .venv, run from the host's root shared read-only over 9p
(`hostrun` in the guest).  Each test boots its own guests.

Runs when asked: `./scripts/test -m lab` or CXLKV_LAB=1 (tests/conftest.py).
`scripts/cxl-lab setup` is run first (idempotent: 0.2 s when done; the first
time it installs Debian packages - needs root - and downloads the kernel);
if the lab cannot be set up the tests fail, saying why - they do not skip.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAB_SCRIPT = REPO / "scripts" / "cxl-lab"
FIXTURES = REPO / "tests" / "fixtures" / "lab"
pytestmark = [pytest.mark.lab, pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def lab():
    """The lab set up (scripts/cxl-lab setup), and the .venv the guests run."""
    if not (REPO / ".venv" / "bin" / "cxlkv").exists():
        pytest.fail("no .venv in the repository: run scripts/setup")
    r = subprocess.run([sys.executable, str(LAB_SCRIPT), "setup"], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"scripts/cxl-lab setup failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return True


def boot(out: Path, script: str, *, guests: int = 1, timeout: int = 420) -> list[Path]:
    """Run `script` in the guest(s) with the host root shared; the guests' /out dirs."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "guest.sh"
    path.write_text(f'REPO="{REPO}"\n' + script)
    r = subprocess.run([sys.executable, str(LAB_SCRIPT), "run", "--share", "--guests",
                        str(guests), "--script", str(path), "--out", str(out / "run"),
                        "--timeout", str(timeout)],
                       capture_output=True, text=True, timeout=timeout + 120)
    logs = "\n".join((out / "run" / f"guest{g}.log").read_text(errors="replace")[-4000:]
                     for g in range(guests) if (out / "run" / f"guest{g}.log").exists())
    assert r.returncode == 0, f"cxl-lab run: exit {r.returncode}\n{r.stderr[-2000:]}\n{logs}"
    return [out / "run" / f"guest{g}" for g in range(guests)]


# a guest-side helper: run cxlkv, keep stdout (.json), stderr (.err) and the exit status (.rc)
RUN = r"""
run() { name=$1; shift
    hostrun -C "$REPO" "$REPO/.venv/bin/cxlkv" "$@" > $LAB_OUT/$name.json 2> $LAB_OUT/$name.err
    echo $? > $LAB_OUT/$name.rc; echo "cxlkv $* -> $(cat $LAB_OUT/$name.rc)"; }
"""


class Out:
    def __init__(self, d: Path):
        self.d = d

    def rc(self, name: str) -> int:
        return int((self.d / f"{name}.rc").read_text())

    def json(self, name: str):
        text = (self.d / f"{name}.json").read_text()
        assert text.strip(), (self.d / f"{name}.err").read_text()
        return json.loads(text)

    def err(self, name: str) -> str:
        return (self.d / f"{name}.err").read_text()


# -- the first lab test: init / inspect / attach / fsck on /dev/dax0.0 ------------------

GUEST_INIT = r"""
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


def test_devdax_pool_on_a_real_kernel_cxl_stack(lab, tmp_path):
    (g,) = boot(tmp_path, GUEST_INIT, timeout=300)
    init = json.loads((g / "init.json").read_text())
    assert init["action"] == "formatted"           # a new namespace reads as zeros: blank
    assert init["target"]["kind"] == "devdax" and init["target"]["align"] == 2 << 20
    assert json.loads((g / "init2.json").read_text())["action"] == "unchanged"
    pool = json.loads((g / "inspect.json").read_text())["pool"]
    assert pool["superblock"]["pool_size"] == init["target"]["size"]
    assert int((g / "attach.out").read_text()) == pool["superblock"]["regions"]["data"]["offset"]
    fsck = json.loads((g / "fsck.json").read_text())
    assert fsck["clean"] and fsck["stats"]["allocator"]["slots_published"] == 1


# -- inspect, provision (plan, apply, apply again, teardown) and doctor in one guest ------

GUEST_PROVISION = RUN + r"""
run inspect-raw inspect --json
run plan provision plan --group disk --json
run apply provision apply --yes --group disk --json
run apply2 provision apply --yes --group disk --json
run plan2 provision plan --group disk --json
run inspect-devdax inspect --json
run doctor-nomgr doctor --json
# the pool is in sync mode manager: start its lock manager, wait until it says "active"
hostrun -C "$REPO" "$REPO/.venv/bin/cxlkv" lock-manager --pool /dev/dax0.0 \
    2> $LAB_OUT/lock-manager.log &
mgr=$!
n=0
until grep -q active $LAB_OUT/lock-manager.log 2>/dev/null; do
    n=$((n + 1)); [ $n -gt 600 ] && { echo "lock manager never became active"; exit 3; }
    usleep 100000
done
run doctor doctor --json
run teardown-busy provision teardown --yes --json
kill $mgr; wait $mgr
run plan-teardown provision plan --teardown --json
run teardown provision teardown --yes --json
run teardown2 provision teardown --yes --json
run inspect-after inspect --json
"""


@pytest.fixture(scope="module")
def provisioned(lab, tmp_path_factory):
    (g,) = boot(tmp_path_factory.mktemp("provision"), GUEST_PROVISION)
    return Out(g)


def test_inspect_json_in_a_guest(provisioned):
    o = provisioned
    assert o.rc("inspect-raw") == 0
    h = o.json("inspect-raw")["host"]
    assert h["kernel"]["release"].startswith("6.1.")
    c = h["cxl"]
    assert c["present"] and not c["errors"] and c["tools"] == {"cxl": True, "ndctl": True,
                                                               "daxctl": True}
    (m,) = c["memdevs"]
    assert m["memdev"] == "mem0" and m["pmem_size"] == 256 << 20 and m["enabled"]
    assert m["health"]["reported"] is False                 # QEMU: no health, "unknown"
    assert {d["kind"] for d in c["decoders"]} == {"root", "switch", "endpoint"}
    assert c["regions"] == [] and c["dax_devices"] == []
    assert h["numa"]["nodes"][0]["cpus"] and h["memory"]["auto_online_blocks"] == "offline"
    # after provisioning: the region and dax0.0, as the guest's tools and sysfs see them
    c = o.json("inspect-devdax")["host"]["cxl"]
    (r,) = c["regions"]
    assert (r["region"], r["type"], r["decode_state"], r["dax_devices"]) == \
        ("region0", "pmem", "commit", ["dax0.0"])
    (d,) = c["dax_devices"]
    assert d["mode"] == "devdax" and d["align"] == 2 << 20 and d["cxl_region"] == "region0"
    assert d["device"]["mode"] == "0660" and d["device"]["group"] == "disk"
    assert d["device"]["char_device"] and d["target_node"] == 1 and d["numa_node"] == 0
    after = o.json("inspect-after")["host"]["cxl"]
    assert after["regions"] == [] and after["dax_devices"] == []


def test_provision_plan_apply_apply_teardown_in_a_guest(provisioned):
    o = provisioned
    plan = o.json("plan")
    assert [(s["id"], s["status"]) for s in plan["steps"]] == [
        ("region", "todo"), ("namespace", "todo"), ("permissions", "todo"), ("format", "todo")]
    assert plan["steps"][0]["command"] == "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0"
    assert o.rc("apply") == 0, o.err("apply")
    apply = o.json("apply")
    assert apply["changed"] and [s["id"] for s in apply["ran"]] == [
        "region", "namespace", "permissions", "format"]
    assert apply["ran"][1]["command"] == "ndctl create-namespace -r region0 -m devdax -a 2M"
    assert apply["plan"]["device"] == "/dev/dax0.0"
    # the second apply finds everything in place and changes nothing
    assert o.rc("apply2") == 0 and o.json("apply2")["changed"] is False
    assert o.json("apply2")["ran"] == []
    assert o.json("plan2")["changes"] == 0
    # teardown refuses while the lock manager maps the device
    assert o.rc("teardown-busy") == 1
    assert "in use by pid" in o.json("teardown-busy")["error"]["message"]
    # then tears down, and a second teardown has nothing to do
    assert [s["command"] for s in o.json("plan-teardown")["steps"]] == [
        "ndctl destroy-namespace -f namespace0.0", "cxl destroy-region -f region0"]
    assert o.rc("teardown") == 0, o.err("teardown")
    assert [s["id"] for s in o.json("teardown")["ran"]] == ["namespace", "region"]
    assert o.rc("teardown2") == 0 and o.json("teardown2")["changed"] is False


def test_doctor_in_a_guest(provisioned):
    o = provisioned
    # without the lock manager of a manager-mode pool: a failure
    assert o.rc("doctor-nomgr") == 2
    fails = [c["id"] for c in o.json("doctor-nomgr")["checks"] if c["status"] == "fail"]
    assert fails == ["lock-manager"]
    # with it: only the 6.1 kernel warning; QEMU's missing health is "unknown"
    doc = o.json("doctor")
    assert o.rc("doctor") == 1
    by = {(c["id"], c["subject"]): c["status"] for c in doc["checks"]}
    assert [k for k, s in by.items() if s == "warn"] == [("kernel", None)]
    assert by[("lock-manager", "/dev/dax0.0")] == "pass"
    assert by[("devdax", "dax0.0")] == by[("permissions", "dax0.0")] == "pass"
    assert by[("temperature", "mem0")] == "unknown"


# -- two guests, one CXL memory: two nodes of one pool share KV blocks --------------------

KV = r"""
import hashlib, json, sys, time
import numpy as np
import cxlkv
from cxlkv import errors

role = sys.argv[1]
tokens = np.arange(7000, 7000 + 16 * 8, dtype=np.uint32)            # 8 blocks of 16
blocks = np.random.default_rng(20261129).integers(0, 256, (8, 4096), dtype=np.uint8)
want = hashlib.sha256(blocks.tobytes()).hexdigest()
deadline = time.monotonic() + 240
from cxlkv.state.nodes import local_boot_id
out = {"role": role, "boot_id": local_boot_id(), "expected_sha256": want}
if role == "writer":
    with cxlkv.open_pool("/dev/dax0.0", numa_node="auto") as pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=4096)
        out["stored"] = kv.store(tokens, blocks)
        out["match"] = kv.match(tokens)
        out["numa"] = pool.numa.to_json()
        out["slot"] = pool.node.slot
else:
    while True:                    # the other host formats the pool: wait for it
        try:
            pool = cxlkv.open_pool("/dev/dax0.0", numa_node="auto")
            break
        except (errors.PoolInvalid, errors.PoolNotFound):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with pool:
        kv = pool.kv(model="m", block_tokens=16, block_bytes=4096)
        while kv.match(tokens) < len(tokens):      # ... and to store the blocks
            if time.monotonic() > deadline:
                raise SystemExit("the blocks never appeared")
            time.sleep(0.2)
        got = np.zeros_like(blocks)
        out["match"] = kv.match(tokens)
        out["loaded"] = kv.load_into(tokens, got)
        out["sha256"] = hashlib.sha256(got.tobytes()).hexdigest()
        out["bit_exact"] = bool(np.array_equal(got, blocks))
        out["numa"] = pool.numa.to_json()
        out["slot"] = pool.node.slot
print(json.dumps(out, default=str))
"""

GUEST_TWO = RUN + r"""
cat > /tmp/kv.py <<'PYEOF'
""" + KV + r"""
PYEOF
mkdir -p /host/run/cxl-lab/tmp && cp /tmp/kv.py /host/run/cxl-lab/tmp/kv.py
if [ "$LAB_GUEST" = 0 ]; then
    run apply provision apply --yes --sync cas --group disk --json
    hostrun -C "$REPO" "$REPO/.venv/bin/python" /run/cxl-lab/tmp/kv.py writer \
        > $LAB_OUT/kv.json 2> $LAB_OUT/kv.err
else
    # the same region and namespace, but the pool is the other host's to format
    run apply provision apply --yes --no-format --group disk --json
    hostrun -C "$REPO" "$REPO/.venv/bin/python" /run/cxl-lab/tmp/kv.py reader \
        > $LAB_OUT/kv.json 2> $LAB_OUT/kv.err
fi
echo $? > $LAB_OUT/kv.rc
"""


def test_two_guests_share_kv_blocks_through_one_cxl_memory(lab, tmp_path):
    g0, g1 = (Out(d) for d in boot(tmp_path, GUEST_TWO, guests=2, timeout=480))
    for o in (g0, g1):
        assert o.rc("apply") == 0, o.err("apply")
        assert o.rc("kv") == 0, o.err("kv")
    assert [s["id"] for s in g1.json("apply")["ran"]] == ["region", "namespace", "permissions"]
    w, r = g0.json("kv"), g1.json("kv")
    assert w["stored"] == 8 and w["match"] == 128
    assert r["match"] == 128 and r["loaded"] == 8          # tokens matched, blocks loaded
    assert r["bit_exact"] and r["sha256"] == w["expected_sha256"] == r["expected_sha256"]
    # two hosts (boots) attached to one pool
    assert w["boot_id"] != r["boot_id"] and isinstance(w["slot"], int)
    # --numa-node auto in a real guest: dax0.0's memory node (1) is offline in devdax
    # mode, so CPUs and memory go to the node it is attached to (0); verified by read-back
    for n in (w["numa"], r["numa"]):
        assert (n["target_node"], n["cpu_node"], n["mem_node"], n["membind"]) == (1, 0, 0, [0])
        assert n["device"] == "dax0.0" and n["cpus"]


# -- same pool on every host: visibility proven both ways; another memory refused by its pin ---

SEE = r"""
import json, sys, time
import cxlkv
from cxlkv import errors
from cxlkv.api import Pool
from cxlkv.ops import doctor
from cxlkv.state import visibility

role, dev = sys.argv[1], "/dev/dax0.0"
deadline = time.monotonic() + 240
out = {"role": role}
done = [4242, 4243]                       # the prover's "done" mark, as a KV block of 2 tokens
if role == "stayer":
    with cxlkv.open_pool(dev) as pool:
        out["uuid"], out["slot"] = str(pool.sb.uuid), pool.node.slot
        kv = pool.kv(model="mark", block_tokens=2, block_bytes=64)
        while kv.match(done) < 2:         # attached, heartbeating, answering, until proven
            if time.monotonic() > deadline:
                raise SystemExit("the prover never finished")
            time.sleep(0.2)
else:
    while True:                           # the other host formats the pool and attaches
        try:
            with Pool.open(dev) as p:
                if visibility.probe(p, timeout=0.5).sights:
                    break
        except (errors.PoolInvalid, errors.PoolNotFound):
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the other host never attached")
        time.sleep(0.2)
    checks = {c.id: c for c in doctor.check_pool(dev)}
    out["visibility"] = checks["visibility"].to_json()
    with cxlkv.open_pool(dev, expect_uuid=sys.argv[2] if len(sys.argv) > 2 else None) as pool:
        out["uuid"] = str(pool.sb.uuid)
        pool.kv(model="mark", block_tokens=2, block_bytes=64).store(done, bytes(64))
print(json.dumps(out, default=str))
"""

GUEST_SEE = RUN + r"""
cat > /tmp/see.py <<'PYEOF'
""" + SEE + r"""
PYEOF
mkdir -p /host/run/cxl-lab/tmp && cp /tmp/see.py /host/run/cxl-lab/tmp/see.py
if [ "$LAB_GUEST" = 0 ]; then
    run apply provision apply --yes --sync manager --group disk --json
    hostrun -C "$REPO" "$REPO/.venv/bin/cxlkv" lock-manager --pool /dev/dax0.0 \
        2> $LAB_OUT/mgr.err &
    hostrun -C "$REPO" "$REPO/.venv/bin/python" /run/cxl-lab/tmp/see.py stayer \
        > $LAB_OUT/see.json 2> $LAB_OUT/see.err
else
    run apply provision apply --yes --no-format --group disk --json
    hostrun -C "$REPO" "$REPO/.venv/bin/python" /run/cxl-lab/tmp/see.py prover \
        > $LAB_OUT/see.json 2> $LAB_OUT/see.err
fi
echo $? > $LAB_OUT/see.rc
"""

GUEST_PINNED = RUN + r"""
run apply provision apply --yes --sync cas --group disk --json
pinned() { name=$1; shift        # run() with the pin (hostrun resets the environment)
    hostrun -C "$REPO" /usr/bin/env CXLKV_POOL_UUID=$PIN "$REPO/.venv/bin/cxlkv" "$@" \
        > $LAB_OUT/$name.json 2> $LAB_OUT/$name.err
    echo $? > $LAB_OUT/$name.rc; }
pinned pinned stress --pool /dev/dax0.0 --seconds 1 --json
pinned doctor doctor --pool /dev/dax0.0 --json
"""


def test_two_hosts_prove_they_see_one_pool_and_a_pin_refuses_another(lab, tmp_path):
    """Two guests on one CXL memory, a manager-mode pool (flushes and
    invalidates on the way): the prover sees the other host's node both ways
    and the pin of that pool admits it.  Then a guest on another memory file
    with the same pin: its pool is refused, naming both uuids."""
    g0, g1 = (Out(d) for d in boot(tmp_path / "two", GUEST_SEE, guests=2, timeout=480))
    for o in (g0, g1):
        assert o.rc("apply") == 0, o.err("apply")
        assert o.rc("see") == 0, o.err("see")
    stay, prove = g0.json("see"), g1.json("see")
    assert stay["uuid"] == prove["uuid"]
    v = prove["visibility"]
    assert v["status"] == "pass", v
    (n,) = v["data"]["nodes"]
    assert n["slot"] == stay["slot"] and not n["same_host"]
    assert n["heartbeat_advanced"] and n["challenge"] == "answered" and n["proven"]
    assert v["data"]["lock_manager_heartbeat"] == "advancing"
    # another guest, another CXL memory file, the first pool's uuid pinned
    (d,) = boot(tmp_path / "other", f'PIN="{stay["uuid"]}"\n' + GUEST_PINNED)
    o = Out(d)
    assert o.rc("apply") == 0, o.err("apply")
    assert o.rc("pinned") == 4, o.err("pinned")
    assert stay["uuid"] in o.err("pinned") and "pins" in o.err("pinned")
    by = {c["id"]: c for c in o.json("doctor")["checks"]}
    assert by["pool-uuid"]["status"] == "fail" and stay["uuid"] in by["pool-uuid"]["detail"]


# -- the fixtures regenerate from a guest, and still match --------------------------------

def _strip(doc):
    """JSON without the values that differ from capture to capture (UUIDs)."""
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in ("uuid", "raw_uuid")}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def test_fixtures_regenerate_and_match(lab, tmp_path):
    out = tmp_path / "fixtures"
    r = subprocess.run([sys.executable, str(LAB_SCRIPT), "capture", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    new = json.loads((out / "commands" / "index.json").read_text())
    old = json.loads((FIXTURES / "commands" / "index.json").read_text())
    assert new == old, "the capture script and the committed fixtures differ: regenerate them"
    for rec in new:
        a = json.loads((out / "commands" / rec["state"] / f"{rec['name']}.json").read_text())
        b = json.loads((FIXTURES / "commands" / rec["state"] / f"{rec['name']}.json").read_text())
        if rec["argv"][0] not in ("cxl", "ndctl", "daxctl"):
            continue                       # uname, numactl, ls: times and free memory vary
        if a["stdout"].strip().startswith(("[", "{")):
            assert _strip(json.loads(a["stdout"])) == _strip(json.loads(b["stdout"])), rec
        assert a["stderr"] == b["stderr"], rec
    for st in ("raw", "region", "devdax", "system-ram", "teardown-namespace", "teardown"):
        assert (out / "sysfs" / st / "sys" / "bus" / "cxl" / "devices" / "mem0").is_symlink()
