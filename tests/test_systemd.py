"""The systemd units and cron example: installed by `cxlkv install-units`,
sandboxed, the lock manager as a standby; `systemd-analyze verify` accepts
them where it is installed."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cxlkv.daemons import units as systemd_units

EXE = str(Path(sys.executable).parent / "cxlkv")


def install(cli, tmp_path, *extra):
    r = cli("install-units", "--dest", tmp_path / "units", "--confdir", tmp_path / "etc",
            "--cron", tmp_path / "cron.d" / "cxlkv-health", "--exe", EXE, "--group", "root",
            "--json", *extra)
    assert r.code == 0, r.err
    return r.json()


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


def test_install_writes_the_units_ready_for_this_installation(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(systemd_units, "HOME_DIRS", ())   # CI checks out under /home
    doc = install(cli, tmp_path)
    units = tmp_path / "units"
    assert sorted(p.name for p in units.iterdir()) == sorted(systemd_units.UNITS)
    assert doc["warnings"] == [] and doc["exe"] == EXE
    for name in systemd_units.UNITS:
        text = (units / name).read_text()
        assert "@CXLKV@" not in text and "@CONFDIR@" not in text and "@GROUP@" not in text
    serve = directives((units / "cxlkv-serve@.service").read_text())
    assert serve["ExecStart"] == [f"{EXE} serve --config {tmp_path}/etc/%i.toml"]
    assert serve["EnvironmentFile"] == [f"{tmp_path}/etc/%i.env"]
    assert serve["Type"] == ["notify"]
    lockmgr = directives((units / "cxlkv-lock-manager@.service").read_text())
    assert lockmgr["ExecStart"] == [f"{EXE} lock-manager --pool ${{CXLKV_POOL}} --standby"]
    health = directives((units / "cxlkv-health@.service").read_text())
    assert health["ExecStart"][0].startswith(f"{EXE} health --pool ${{CXLKV_POOL}}")
    # no settings file: the unit does not start, rather than fail and restart in a loop
    assert f"{tmp_path}/etc/%i.toml" in serve["ConditionPathExists"]
    # `cxl list` reads the device health through /dev/cxl/memN
    assert "char-cxl r" in serve["DeviceAllow"] and "char-cxl r" in health["DeviceAllow"]
    for d in (serve, lockmgr, health):          # sandboxed
        assert d["DeviceAllow"][0].startswith("char-dax")
        assert d["DevicePolicy"] == ["closed"]
        assert d["ProtectSystem"] == ["strict"]
        assert d["NoNewPrivileges"] == ["yes"]
        assert d["DynamicUser"] == ["yes"] and d["SupplementaryGroups"] == ["root"]
        assert d["CapabilityBoundingSet"] == [""]
    timer = directives((units / "cxlkv-health@.timer").read_text())
    assert timer["OnUnitActiveSec"] == ["1min"]
    cron = (tmp_path / "cron.d" / "cxlkv-health").read_text()
    assert f"{EXE} health --pool" in cron
    # the examples: the serve unit's config parses as cxlkv serve's settings
    from cxlkv.daemons.config import load_config

    cfg = load_config(str(tmp_path / "etc" / "example.toml"))
    assert cfg["metrics_addr"] == "127.0.0.1:9464"
    assert (tmp_path / "etc" / "example.env").read_text().count("CXLKV_POOL=") == 1


def test_install_keeps_edited_examples_and_dry_run_writes_nothing(cli, tmp_path):
    install(cli, tmp_path)
    (tmp_path / "etc" / "example.toml").write_text("interval = 5\n")
    doc = install(cli, tmp_path)
    assert str(tmp_path / "etc" / "example.toml") in doc["kept"]
    assert (tmp_path / "etc" / "example.toml").read_text() == "interval = 5\n"
    other = tmp_path / "other"
    doc = cli("install-units", "--dest", other, "--confdir", other / "etc", "--exe", EXE,
              "--dry-run", "--json").json()
    assert doc["dry_run"] and doc["written"] and not other.exists()
    r = cli("install-units", "--dest", other, "--exe", "relative/cxlkv")
    assert r.code == 2 and "absolute" in r.err


def test_missing_group_is_a_warning(cli, tmp_path):
    r = cli("install-units", "--dest", tmp_path / "u", "--confdir", tmp_path / "e",
            "--exe", EXE, "--group", "no-such-group-cxlkv")
    assert r.code == 0 and "groupadd no-such-group-cxlkv" in r.err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd)")
def test_systemd_analyze_verify(cli, tmp_path):
    install(cli, tmp_path)
    units = tmp_path / "units"
    r = subprocess.run(["systemd-analyze", "verify", "--man=no",
                        *sorted(str(p) for p in units.iterdir())],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
    # and it would notice a broken unit: the check is not vacuous
    bad = tmp_path / "bad@.service"
    bad.write_text((units / "cxlkv-serve@.service").read_text()
                   .replace("DynamicUser=yes", "DynamicUser=maybe"))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and ("DynamicUser" in r.stderr or "boolean" in r.stderr)


def test_sandbox_warnings(cli, tmp_path):
    """What ProtectHome=, ProtectSystem=strict and PrivateTmp= would break is
    said at install time, with the drop-in that fixes it."""
    w = systemd_units.sandbox_warnings("/home/alice/venv/bin/cxlkv", {})
    assert len(w) == 1 and "ProtectHome" in w[0] and "/home/alice/venv/bin/cxlkv" in w[0]
    script = tmp_path / "cxlkv"
    script.write_text("#!/root/venv/bin/python3\nimport cxlkv\n")
    w = systemd_units.sandbox_warnings(str(script), {})
    assert len(w) == 1 and "interpreter /root/venv/bin/python3" in w[0]
    w = systemd_units.sandbox_warnings("/opt/cxlkv/bin/cxlkv", {
        "kv0": "/srv/pools/kv0.pool", "kv1": "/tmp/kv1.pool", "kv2": "/dev/shm/kv2.pool",
        "kv3": "/dev/dax0.0", "kv4": "/dev/hugepages/kv4.pool"})
    assert len(w) == 2, w
    assert w[0].startswith("kv0:") and "ReadWritePaths=/srv/pools" in w[0]
    assert w[1].startswith("kv1:") and "invisible" in w[1]
    # install-units reads the pools of the NAME.env files present
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "kv0.env").write_text("CXLKV_POOL=/srv/pools/kv0.pool\n")
    r = cli("install-units", "--dest", tmp_path / "units", "--confdir", etc, "--exe",
            "/opt/cxlkv/bin/cxlkv", "--group", "root")
    assert r.code == 0 and "ReadWritePaths=/srv/pools" in r.err, r.err
