"""`cxlkv init`, `format`, `inspect` end to end, and every bad input they must survive."""
from __future__ import annotations

import logging
import os
import stat

import psutil
import pytest

from cxlkv import errors
from cxlkv.api import Pool
from cxlkv.pool import layout
from cxlkv.state.nodes import local_boot_id
from cxlkv.testing.damage import fake_node, patch_bytes, rewrite_superblock
from cxlkv.testing.pools import SMALL, mode_of

SMALL_ARGS = ["--size", "8M", "--chunk-size", "64K", "--max-nodes", "8", "--hash-slots", "256"]


def assert_clean_error(r, code, *words):
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0], r.err      # one clear line
    for w in words:
        assert w in r.err, (w, r.err)


# -- init ---------------------------------------------------------------------

def test_library_warnings_show_on_stderr_as_cxlkv_lines(cli, capsys):
    """The library logs; the CLI shows its warnings as it printed them before."""
    assert cli("--version").code == 0 and cli("--version").code == 0   # one handler
    logging.getLogger("cxlkv.state.nodes").warning("reaping in %s failed: %s", "/p", "boom")
    logging.getLogger("cxlkv.state.hostlock").info("an info line is not shown")
    assert capsys.readouterr().err == "cxlkv: reaping in /p failed: boom\n"


def test_init_default_path_then_inspect(cli, tmp_path, monkeypatch):
    from cxlkv.ops import init as admin

    default = str(tmp_path / "shm" / "cxlkv-default.pool")
    os.mkdir(tmp_path / "shm")
    monkeypatch.setattr(admin, "DEFAULT_POOL_PATH", default)
    r = cli("init", "--size", "64M")
    assert r.code == 0, r.err
    assert f"created emulated pool file {default}" in r.out
    assert f"export CXLKV_POOL={default}" in r.out
    r = cli("inspect", "--json", env={"CXLKV_POOL": default})
    assert r.code == 0
    doc = r.json()
    assert doc["pool"]["superblock"]["pool_size"] == 64 << 20
    assert doc["pool"]["superblock"]["sync"] == "cas"
    assert doc["pool"]["usage"]["chunks_used"] == 0


def test_init_creates_0660_whatever_the_umask(cli, pool_path):
    old = os.umask(0)
    try:
        assert cli("init", "--pool", pool_path, *SMALL_ARGS).code == 0
    finally:
        os.umask(old)
    assert mode_of(pool_path) == 0o660


def test_init_group(cli, pool_path):
    import grp

    g = grp.getgrgid(os.getgid()).gr_name
    r = cli("init", "--pool", pool_path, *SMALL_ARGS, "--group", g)
    assert r.code == 0
    assert os.stat(pool_path).st_gid == os.getgid()
    r = cli("init", "--pool", pool_path + "2", *SMALL_ARGS, "--group", "no-such-group-xyz")
    assert_clean_error(r, errors.EXIT_USAGE, "no such group")
    assert not os.path.exists(pool_path + "2")


def test_init_is_idempotent(cli, pool_path):
    r = cli("init", "--pool", pool_path, *SMALL_ARGS, "--json")
    assert r.code == 0
    first = r.json()
    assert first["action"] == "created"
    with open(pool_path, "rb") as f:
        before = f.read()
    for args in (SMALL_ARGS, [], ["--sync", "cas"], ["--size", "8M"]):
        r = cli("init", "--pool", pool_path, *args, "--json")
        assert r.code == 0, r.err
        assert r.json()["action"] == "unchanged"
        assert r.json()["superblock"]["uuid"] == first["superblock"]["uuid"]
    r = cli("init", "--pool", pool_path)
    assert "nothing changed" in r.out
    with open(pool_path, "rb") as f:
        assert f.read() == before


def test_init_different_parameters_refused_then_forced(cli, pool_path):
    assert cli("init", "--pool", pool_path, *SMALL_ARGS).code == 0
    r = cli("init", "--pool", pool_path, "--sync", "manager", "--lease", "5s")
    assert_clean_error(r, errors.EXIT_REFUSED, "different parameters", "sync", "lease_ms",
                       "--force")
    r = cli("init", "--pool", pool_path, "--sync", "manager", "--force", "--json")
    assert r.code == 0
    doc = r.json()
    assert doc["action"] == "reformatted"
    assert doc["superblock"]["sync"] == "manager"
    assert doc["superblock"]["max_nodes"] == 8      # kept from the old pool


def test_init_force_refuses_live_node_and_names_it(cli, small_pool):
    me = psutil.Process()
    fake_node(small_pool, 3, pid=me.pid, start_time_ns=int(me.create_time() * 1e9),
              boot_id=local_boot_id(), hostname="rack1-host7")
    r = cli("init", "--pool", small_pool, "--sync", "manager", "--force")
    assert_clean_error(r, errors.EXIT_REFUSED, "live node", "node 3", "rack1-host7", str(me.pid))
    r = cli("format", "--pool", small_pool, "--force", "--json")
    assert r.code == errors.EXIT_REFUSED
    assert r.json()["error"]["nodes"][0]["slot"] == 3
    with Pool.open(small_pool) as p:
        assert p.sb.sync == "cas"                   # untouched


def test_init_force_proceeds_over_dead_nodes(cli, small_pool):
    # a local node whose pid is gone, and a remote node whose heartbeat never moves
    dead_pid = max(psutil.pids()) + 10_000
    fake_node(small_pool, 0, pid=dead_pid, start_time_ns=1, boot_id=local_boot_id())
    # pid reuse: our own pid but a different start time is not us
    fake_node(small_pool, 1, pid=os.getpid(), start_time_ns=12345, boot_id=local_boot_id())
    fake_node(small_pool, 2, pid=1, start_time_ns=1,
              boot_id="00000000-0000-0000-0000-000000000001", hostname="elsewhere")
    # the remote node is watched for one lease before it counts as dead
    rewrite_superblock(small_pool, "A", lease_ms=100)
    rewrite_superblock(small_pool, "B", lease_ms=100)
    r = cli("init", "--pool", small_pool, "--sync", "manager", "--force")
    assert r.code == 0, r.err
    with Pool.open(small_pool) as p:
        assert p.sb.sync == "manager"


def test_init_refuses_foreign_data(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.write(b"precious data " * 1000)
    os.chmod(pool_path, 0o660)
    r = cli("init", "--pool", pool_path)
    assert_clean_error(r, errors.EXIT_REFUSED, "not a cxlkv pool", "--force")
    r = cli("format", "--pool", pool_path, "--size", "8M", "--chunk-size", "64K")
    assert_clean_error(r, errors.EXIT_REFUSED, "not a cxlkv pool", "--force")
    with open(pool_path, "rb") as f:
        assert f.read(14) == b"precious data "


def test_init_formats_a_blank_file(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(8 << 20)
    os.chmod(pool_path, 0o660)
    r = cli("init", "--pool", pool_path, "--chunk-size", "64K", "--json")
    assert r.code == 0, r.err
    assert r.json()["action"] == "formatted"
    assert r.json()["superblock"]["pool_size"] == 8 << 20


def test_reformat_zeroes_old_data(cli, small_pool):
    with Pool.open(small_pool) as p:
        off, size = p.region("data")
    patch_bytes(small_pool, off + 12345, b"tenant secret bytes")
    r = cli("format", "--pool", small_pool, "--force", "--chunk-size", "64K")
    assert r.code == 0, r.err
    with open(small_pool, "rb") as f:
        assert b"tenant secret" not in f.read()


def test_device_and_pool_conflict(cli, pool_path):
    r = cli("init", "--pool", pool_path, "--device", "/dev/dax9.9")
    assert_clean_error(r, errors.EXIT_USAGE, "either --pool or --device")


def test_init_missing_device(cli):
    r = cli("init", "--device", "/dev/dax97.3")
    assert_clean_error(r, errors.EXIT_NOT_FOUND, "/dev/dax97.3")


# -- format -----------------------------------------------------------------

def test_format_refuses_existing_pool(cli, small_pool):
    r = cli("format", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_REFUSED, "already holds a cxlkv pool", "--force")


def test_format_requires_size_to_create(cli, pool_path):
    r = cli("format", "--pool", pool_path)
    assert_clean_error(r, errors.EXIT_USAGE, "--size is required")
    assert not os.path.exists(pool_path)
    r = cli("format", "--pool", pool_path, *SMALL_ARGS)
    assert r.code == 0, r.err
    assert mode_of(pool_path) == 0o660


@pytest.mark.parametrize("args,words", [
    (["--size", "12Q"], ["invalid size"]),
    (["--size", "5000"], ["not a multiple of 4 KiB"]),
    (["--size", "256K"], ["too small"]),
    (["--chunk-size", "3M"], ["power of two"]),
    (["--max-nodes", "0"], ["max nodes"]),
    (["--lease", "10 parsecs"], ["invalid duration"]),
    (["--lease", "1ms"], ["lease"]),
    (["--hash-slots", "1000"], ["power of two"]),
    (["--sync", "magic"], ["magic"]),
])
def test_format_bad_parameters(cli, pool_path, args, words):
    base = {"--size": "8M", "--chunk-size": "64K"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    r = cli("format", "--pool", pool_path, *flat)
    assert r.code == errors.EXIT_USAGE, (r.code, r.err)
    assert "Traceback" not in r.err
    for w in words:
        assert w in r.err
    assert not os.path.exists(pool_path)


def test_json_error_document(cli, tmp_path):
    r = cli("inspect", "--pool", str(tmp_path / "nope"), "--json")
    assert r.code == errors.EXIT_NOT_FOUND
    doc = r.json()
    assert doc["error"]["kind"] == "not-found"
    assert doc["error"]["exit_code"] == errors.EXIT_NOT_FOUND


# -- bad input: every case gets one clear line and a documented exit code ------

def test_inspect_missing_path(cli, tmp_path):
    r = cli("inspect", "--pool", str(tmp_path / "missing.pool"))
    assert_clean_error(r, errors.EXIT_NOT_FOUND, "no such file", "cxlkv init")


def test_inspect_directory(cli, tmp_path):
    r = cli("inspect", "--pool", str(tmp_path))
    assert_clean_error(r, errors.EXIT_NOT_FOUND, "is a directory")


def test_zero_filled_file(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(8 << 20)
    os.chmod(pool_path, 0o660)
    assert_clean_error(cli("inspect", "--pool", pool_path), errors.EXIT_INVALID, "not a formatted")


def test_file_smaller_than_superblocks(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.write(b"\0" * 3000)
    os.chmod(pool_path, 0o660)
    assert_clean_error(cli("inspect", "--pool", pool_path), errors.EXIT_INVALID, "too small")


def test_empty_file(cli, pool_path):
    open(pool_path, "wb").close()
    os.chmod(pool_path, 0o660)
    assert_clean_error(cli("inspect", "--pool", pool_path), errors.EXIT_INVALID, "too small")


def test_truncated_pool(cli, small_pool):
    os.truncate(small_pool, 4 << 20)
    r = cli("inspect", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_INVALID, "truncated", str(4 << 20), str(8 << 20))
    r = cli("init", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_REFUSED, "truncated")


def test_wrong_magic(cli, small_pool):
    patch_bytes(small_pool, 0, b"NOTAPOOL")
    patch_bytes(small_pool, 4096, b"NOTAPOOL")
    assert_clean_error(cli("inspect", "--pool", small_pool), errors.EXIT_INVALID, "wrong magic")


def test_both_checksums_bad(cli, small_pool):
    patch_bytes(small_pool, 300, b"\xff\xff")
    patch_bytes(small_pool, 4096 + 300, b"\xff\xff")
    assert_clean_error(cli("inspect", "--pool", small_pool), errors.EXIT_INVALID, "checksum")
    r = cli("format", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_REFUSED, "damaged")


def test_one_bad_copy_is_survivable(cli, small_pool):
    patch_bytes(small_pool, 300, b"\xff\xff")
    r = cli("inspect", "--pool", small_pool, "--json")
    assert r.code == 0
    doc = r.json()["pool"]
    assert doc["superblock_copy"] == "B"
    assert "checksum" in doc["superblock_problems"]["A"]
    assert "copy A is bad" in r.err


def test_unknown_incompat_feature(cli, small_pool):
    rewrite_superblock(small_pool, "A", incompat=1 << 40)
    rewrite_superblock(small_pool, "B", incompat=1 << 40)
    r = cli("inspect", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_INCOMPATIBLE, "unknown incompatible features")


def test_unknown_ro_compat_opens_read_only(cli, small_pool):
    rewrite_superblock(small_pool, "A", ro_compat=2)
    rewrite_superblock(small_pool, "B", ro_compat=2)
    with Pool.open(small_pool) as p:
        assert p.read_only and not p.mapping.writable
        assert any("read-only" in w for w in p.warnings)
    r = cli("inspect", "--pool", small_pool)
    assert r.code == 0 and "read-only" in r.out


def test_newer_format_version(cli, small_pool):
    rewrite_superblock(small_pool, "A", version=7)
    rewrite_superblock(small_pool, "B", version=7)
    r = cli("inspect", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_INCOMPATIBLE, "format version 7", "upgrade cxlkv")
    assert_clean_error(cli("init", "--pool", small_pool), errors.EXIT_REFUSED, "cannot use")


@pytest.mark.parametrize("mode,word", [(0o666, "world-writable"), (0o664, "world-readable"),
                                       (0o662, "world-writable")])
def test_world_accessible_pool_refused_unless_forced(cli, small_pool, mode, word):
    os.chmod(small_pool, mode)
    r = cli("inspect", "--pool", small_pool)
    assert_clean_error(r, errors.EXIT_UNSAFE, word, "chmod 0660")
    r = cli("inspect", "--pool", small_pool, "--force")
    assert r.code == 0 and word in r.err
    assert_clean_error(cli("init", "--pool", small_pool), errors.EXIT_UNSAFE, word)
    # init --force on a matching pool changes nothing but the mode, as format --force
    r = cli("init", "--pool", small_pool, "--force")
    assert r.code == 0 and "changed mode" in r.err
    assert mode_of(small_pool) == 0o660


def test_reformat_fixes_world_accessible_mode(cli, small_pool):
    os.chmod(small_pool, 0o666)
    r = cli("format", "--pool", small_pool, "--force", "--chunk-size", "64K")
    assert r.code == 0, r.err
    assert mode_of(small_pool) == 0o660
    assert "changed mode" in r.err
    os.chmod(small_pool, 0o600)                  # tighter than 0660 stays as it is
    assert cli("format", "--pool", small_pool, "--force", "--chunk-size", "64K").code == 0
    assert mode_of(small_pool) == 0o600


# -- device-dax paths, with a fake sysfs and a character device node ----------

@pytest.fixture
def fake_dax(tmp_path, monkeypatch):
    """A char device node (/dev/null's numbers) and a sysfs tree that calls it dax."""
    st = os.stat("/dev/null")
    dev = tmp_path / "dax0.0"
    try:
        os.mknod(dev, 0o660 | stat.S_IFCHR, st.st_rdev)
    except PermissionError:
        pytest.skip("mknod is not permitted here (needs root / CAP_MKNOD)")
    maj, mnr = os.major(st.st_rdev), os.minor(st.st_rdev)
    sysroot = tmp_path / "sys"
    devdir = sysroot / "devices" / "dax0.0"
    devdir.mkdir(parents=True)
    (sysroot / "bus" / "dax").mkdir(parents=True)
    (devdir / "subsystem").symlink_to(sysroot / "bus" / "dax")
    (sysroot / "dev" / "char").mkdir(parents=True)
    (sysroot / "dev" / "char" / f"{maj}:{mnr}").symlink_to(devdir)
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(sysroot))

    def set_geometry(size, align):
        (devdir / "size").write_text(f"{size}\n")
        (devdir / "align").write_text(f"{align}\n")

    return str(dev), set_geometry


def test_device_with_wrong_alignment(cli, fake_dax):
    dev, geometry = fake_dax
    geometry(3 << 20, 2 << 20)
    r = cli("inspect", "--pool", dev)
    assert_clean_error(r, errors.EXIT_DEVICE, "not a multiple of its alignment")
    r = cli("init", "--device", dev)
    assert_clean_error(r, errors.EXIT_DEVICE, "alignment")


@pytest.mark.parametrize("size,words", [("3M", "not a multiple of the device alignment"),
                                        ("128M", "larger than")])
def test_device_size_checked_before_mapping(cli, fake_dax, monkeypatch, size, words):
    from cxlkv.ops import init as admin

    dev, geometry = fake_dax
    geometry(64 << 20, 2 << 20)
    # what is on the device does not matter: the size is refused first
    monkeypatch.setattr(admin, "examine",
                        lambda path, progress=None: admin.Examination(
                            path, "blank", admin.device.probe(path)))
    r = cli("format", "--pool", dev, "--size", size, "--force")
    assert_clean_error(r, errors.EXIT_USAGE, words)


def test_device_mmap_failure_is_clean(cli, fake_dax):
    dev, geometry = fake_dax
    geometry(64 << 20, 2 << 20)
    r = cli("inspect", "--pool", dev)      # /dev/null cannot be mmapped
    assert_clean_error(r, errors.EXIT_DEVICE, "mmap")


def test_char_device_that_is_not_dax(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(tmp_path / "emptysys"))
    r = cli("inspect", "--pool", "/dev/null", "--force")
    assert_clean_error(r, errors.EXIT_DEVICE, "not a device-dax device")


def test_fifo_is_refused(cli, tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    assert_clean_error(cli("inspect", "--pool", str(p)), errors.EXIT_DEVICE, "neither")


def test_exit_codes_documented_in_help(cli):
    """Each command lists the codes it can return: these three open a pool
    without attaching, so never 9 (no lock manager)."""
    for cmd in ("init", "format", "inspect"):
        r = cli(cmd, "--help")
        assert r.code == 0
        for code, _ in errors.EXIT_CODES:
            assert (f"  {code} " in r.out) == (code != errors.EXIT_NO_MANAGER), (cmd, code)
    assert "  9 " in cli("serve", "--help").out


def test_region_layout_in_inspect(cli, small_pool):
    doc = cli("inspect", "--pool", small_pool, "--json").json()["pool"]
    regions = doc["superblock"]["regions"]
    assert list(regions) == list(layout.POOL_ORDER)
    assert regions["data"]["offset"] % SMALL["chunk_size"] == 0
    assert doc["usage"]["chunks_total"] == doc["superblock"]["nchunks"]


def test_probe_reads_captured_devdax_sysfs(cli, tmp_path, monkeypatch):
    """sysfs captured from a real guest (tests/fixtures/lab): dax0.0 is char 252:0."""
    from pathlib import Path

    from cxlkv.pool import device

    root = Path(__file__).parent / "fixtures" / "lab" / "sysfs" / "devdax" / "sys"
    node = tmp_path / "dax0.0"
    try:
        os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(252, 0))
    except PermissionError:
        pytest.skip("mknod is not permitted here (needs root / CAP_MKNOD)")
    monkeypatch.setenv("CXLKV_SYSFS_ROOT", str(root))
    t = device.probe(str(node))
    assert (t.kind, t.device) == ("devdax", "dax0.0")
    assert t.size == int((root / "bus/dax/devices/dax0.0/size").read_text())
    assert t.align == 2 << 20 and t.size % t.align == 0
    # this host has no such device behind 252:0: a clean device error, no traceback
    r = cli("inspect", "--pool", str(node))
    assert_clean_error(r, errors.EXIT_DEVICE, str(node))



# -- found in review ------------------------------------------------------------

def test_size_on_blank_and_foreign_targets(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(4 << 20)
    os.chmod(pool_path, 0o660)
    r = cli("init", "--pool", pool_path, "--size", "8M", "--chunk-size", "64K", "--json")
    assert r.code == 0, r.err
    assert r.json()["superblock"]["pool_size"] == 8 << 20
    patch_bytes(pool_path, 0, b"junk" * 100)
    r = cli("init", "--pool", pool_path, "--size", "8M", "--chunk-size", "64K", "--force")
    assert r.code == 0, r.err


def test_zero_superblocks_with_data_behind_them_is_not_blank(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(8 << 20)
    patch_bytes(pool_path, 5 << 20, b"PRECIOUS DATA")
    os.chmod(pool_path, 0o660)
    for verb in ("init", "format"):
        r = cli(verb, "--pool", pool_path, "--chunk-size", "64K")
        assert_clean_error(r, errors.EXIT_REFUSED, "not a cxlkv pool")
    with open(pool_path, "rb") as f:
        assert b"PRECIOUS DATA" in f.read()


def test_other_users_file_refused(cli, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(8 << 20)
    os.chmod(pool_path, 0o660)
    try:
        os.chown(pool_path, 65534, 65534)
    except PermissionError:
        pytest.skip("chown needs root")
    r = cli("init", "--pool", pool_path, "--chunk-size", "64K")
    assert_clean_error(r, errors.EXIT_UNSAFE, "owned by uid 65534")
    r = cli("init", "--pool", pool_path, "--chunk-size", "64K", "--force")
    assert r.code == 0 and "owned by uid 65534" in r.err


def test_symlink_planted_by_another_user(cli, tmp_path, pool_path):
    with open(pool_path, "wb") as f:
        f.truncate(8 << 20)
    os.chmod(pool_path, 0o660)
    link = tmp_path / "link.pool"
    link.symlink_to(pool_path)
    try:
        os.lchown(link, 65534, 65534)
    except PermissionError:
        pytest.skip("lchown needs root")
    r = cli("init", "--pool", str(link), "--chunk-size", "64K")
    assert_clean_error(r, errors.EXIT_UNSAFE, "symbolic link owned by uid 65534")


def test_usage_errors_with_json_print_one_document(cli, pool_path):
    for args in (["init", "--json", "--bogus"], ["inspect", "--json", "--pool"],
                 ["nosuch", "--json"]):
        r = cli(*args)
        assert r.code == errors.EXIT_USAGE, args
        assert r.json()["error"]["kind"] == "usage"
        assert len([ln for ln in r.err.splitlines() if ln.strip()]) == 1


def test_empty_paths_are_usage_errors(cli):
    for args in (["init", "--pool", ""], ["format", "--pool", "", "--size", "8M"],
                 ["inspect", "--pool", ""]):
        assert_clean_error(cli(*args), errors.EXIT_USAGE, "empty")


def test_odd_paths_and_labels_are_clean_errors(cli, small_pool, tmp_path):
    r = cli("init", "--pool", small_pool + "/")
    assert r.code in (errors.EXIT_NOT_FOUND, errors.EXIT_DEVICE) and "Traceback" not in r.err
    r = cli("format", "--pool", str(tmp_path / "new.pool") + "/", "--size", "8M")
    assert r.code in (errors.EXIT_NOT_FOUND, errors.EXIT_DEVICE) and "Traceback" not in r.err
    r = cli("format", "--pool", str(tmp_path / ("x" * 300)), "--size", "8M")
    assert_clean_error(r, errors.EXIT_NOT_FOUND, "too long")
    r = cli("format", "--pool", str(tmp_path / "l.pool"), "--size", "8M", "--label", "\udcff")
    assert_clean_error(r, errors.EXIT_USAGE, "UTF-8")


def test_device_option_needs_a_character_device(cli, small_pool):
    assert_clean_error(cli("init", "--device", small_pool), errors.EXIT_USAGE, "not a character")


def test_group_applied_to_an_unchanged_pool(cli, small_pool):
    import grp

    other = next((g for g in grp.getgrall() if g.gr_gid != os.stat(small_pool).st_gid), None)
    if other is None:
        pytest.skip("no second group")
    r = cli("init", "--pool", small_pool, "--group", other.gr_name, "--json")
    assert r.code == 0 and r.json()["action"] == "unchanged"
    assert os.stat(small_pool).st_gid == other.gr_gid
    assert_clean_error(cli("init", "--pool", small_pool, "--group", "no-such-group-zz"),
                       errors.EXIT_USAGE, "no such group")


def test_concurrent_inits_make_one_pool(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "race.pool")
    cmd = [sys.executable, "-c", "import sys; from cxlkv.cli import main; "
           "sys.exit(main(sys.argv[1:]))", "init", "--pool", path, "--size", "64M", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    import json
    actions = sorted(json.loads(o)["action"] for o, _ in outs)
    assert actions == ["created", "unchanged", "unchanged", "unchanged"]
    assert len({json.loads(o)["superblock"]["uuid"] for o, _ in outs}) == 1
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_inspect_defaults_to_the_init_pool(cli, tmp_path, monkeypatch):
    from cxlkv.ops import init as admin

    default = str(tmp_path / "cxlkv-default.pool")
    monkeypatch.setattr(admin, "DEFAULT_POOL_PATH", default)
    # no pool anywhere: the host alone, not an error
    r = cli("inspect", "--json")
    assert r.code == 0 and r.json()["pool"] is None and "host" in r.json()
    assert cli("init", "--size", "8M", "--chunk-size", "64K").code == 0
    r = cli("inspect", "--json")
    assert r.code == 0 and r.json()["pool"]["path"] == default


def test_inspect_shows_mixed_versions(cli, small_pool):
    """During a rolling upgrade nodes of two versions share the pool."""
    import uuid

    import cxlkv

    boot = str(uuid.uuid4())                    # another host: not judged by pid
    fake_node(small_pool, 1, pid=os.getpid(), start_time_ns=1, boot_id=boot, hostname="old")
    with cxlkv.open_pool(small_pool):
        doc = cli("inspect", "--pool", small_pool, "--json").json()["pool"]
        assert doc["versions"]["test/format 1"] == 1 and len(doc["versions"]) == 2
        assert sum(doc["versions"].values()) == len(doc["nodes"]) == 2
        human = cli("inspect", "--pool", small_pool)
        assert "mixed versions" in human.out


def test_format_refuses_while_a_lock_manager_runs(cli, pool_path):
    """Reformatting under a running lock manager broke the pool (it carried on
    with the old geometry): format and init --force refuse, naming it."""
    import subprocess
    import sys

    from cxlkv.ops.init import init_pool

    init_pool(pool_path, {**SMALL, "sync": "manager", "lease_ms": 300})
    mgr = subprocess.Popen([sys.executable, "-m", "cxlkv", "lock-manager", "--pool", pool_path],
                           stderr=subprocess.PIPE, text=True)
    try:
        assert "active" in mgr.stderr.readline()
        for verb in ("format", "init"):
            r = cli(verb, "--pool", pool_path, "--force", "--sync", "manager",
                    "--max-nodes", "64")
            assert r.code == 1, (verb, r.err)
            assert "lock manager is active" in r.err and f"pid {mgr.pid}" in r.err, r.err
            assert "cxlkv-lock-manager@" in r.err
    finally:
        mgr.terminate()
        mgr.wait(10)
    r = cli("format", "--pool", pool_path, "--force", "--sync", "manager", "--max-nodes", "64")
    assert r.code == 0, r.err
