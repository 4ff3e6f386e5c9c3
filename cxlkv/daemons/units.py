"""The systemd units and cron example shipped in cxlkv/data/systemd, made
ready for this installation (`cxlkv install-units`).

Templates carry three placeholders: @CXLKV@ (the absolute path of the cxlkv
executable, systemd needs one), @CONFDIR@ (where NAME.env and NAME.toml live,
default /etc/cxlkv) and @GROUP@ (the pool's group: the units run as an
unprivileged dynamic user in that group, and pools are created 0660).

The units are sandboxed (ProtectHome=yes, ProtectSystem=strict,
PrivateTmp=yes): install() warns when that would break them here - the
cxlkv executable (or its interpreter) under /home or /root, a pool named in
CONFDIR/NAME.env that is a file outside /dev (read-only under
ProtectSystem=strict, invisible under /home, /root or /tmp) - and says which
drop-in fixes it.
"""
from __future__ import annotations

import grp
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from cxlkv.errors import UsageError

UNITS = ("cxlkv-serve@.service", "cxlkv-lock-manager@.service", "cxlkv-health@.service",
         "cxlkv-health@.timer")
CRON = "cxlkv-health.cron"
EXAMPLES = ("example.env", "example.toml")
DEFAULT_DEST = "/etc/systemd/system"
DEFAULT_CONFDIR = "/etc/cxlkv"
DEFAULT_GROUP = "cxlkv"


def template(name: str) -> str:
    return resources.files("cxlkv.data").joinpath("systemd", name).read_text()


def cxlkv_executable() -> str:
    """The absolute path of the cxlkv command that is running (or on PATH)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "cxlkv" and os.path.isfile(argv0):
        return os.path.abspath(argv0)
    beside = Path(sys.executable).parent / "cxlkv"
    if beside.is_file():
        return str(beside)
    found = shutil.which("cxlkv")
    if found:
        return os.path.abspath(found)
    raise UsageError("cannot find the cxlkv executable: pass --exe PATH")


def render(name: str, *, exe: str, confdir: str, group: str) -> str:
    if not os.path.isabs(exe):
        raise UsageError(f"--exe {exe}: systemd needs an absolute path")
    return (template(name).replace("@CXLKV@", exe).replace("@CONFDIR@", confdir.rstrip("/"))
            .replace("@GROUP@", group))


#: what ProtectHome=yes hides from the units (install-units warns about paths there)
HOME_DIRS = ("/home", "/root", "/run/user")
_PRIVATE = ("/tmp", "/var/tmp")


def _under(path: str, tops) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in tops)


def _interpreter(exe: str) -> str | None:
    """The #! interpreter of a script (a venv's console script names its python)."""
    try:
        with open(exe, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode("utf-8", "replace").split()
    return parts[0] if parts else None


def env_pools(confdir: str) -> dict[str, str]:
    """{NAME: CXLKV_POOL} of the NAME.env files already in confdir."""
    out = {}
    try:
        files = sorted(Path(confdir).glob("*.env"))
    except OSError:
        return out
    for f in files:
        if f.name == "example.env":
            continue
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, sep, value = line.strip().partition("=")
            if sep and key.strip() == "CXLKV_POOL":
                out[f.stem] = value.strip().strip("\"'")
    return out


def sandbox_warnings(exe: str, pools: dict[str, str]) -> list[str]:
    """What the units' sandbox would break on this installation."""
    out = []
    for what, path in (("the cxlkv executable", exe), ("its interpreter", _interpreter(exe))):
        if not path:
            continue
        for p in dict.fromkeys((path, os.path.realpath(path))):
            if _under(p, HOME_DIRS):
                out.append(f"{what} {p} lies under /home or /root, which the units cannot "
                           "see (ProtectHome=yes): install cxlkv system-wide (e.g. a venv in "
                           "/opt/cxlkv, then --exe /opt/cxlkv/bin/cxlkv), or add "
                           "ProtectHome=read-only in a drop-in (systemctl edit "
                           "cxlkv-serve@NAME)")
                break
    for name, pool in sorted(pools.items()):
        if not pool or (_under(pool, ("/dev",)) and not _under(pool, _PRIVATE)):
            continue                       # a DAX device, /dev/shm, /dev/hugepages: fine
        if _under(pool, HOME_DIRS + _PRIVATE):
            out.append(f"{name}: pool {pool} is invisible to the units (ProtectHome=yes, "
                       "PrivateTmp=yes): move it to /dev/shm, /dev/hugepages or a directory "
                       "elsewhere named in ReadWritePaths=")
        else:
            out.append(f"{name}: pool {pool} is a file outside /dev, read-only to the units "
                       f"(ProtectSystem=strict): add a drop-in with ReadWritePaths="
                       f"{os.path.dirname(pool) or '/'} (systemctl edit cxlkv-serve@{name} and "
                       f"cxlkv-lock-manager@{name}), or keep pools in /dev/shm")
    return out


def install(*, dest: str = DEFAULT_DEST, confdir: str = DEFAULT_CONFDIR,
            group: str = DEFAULT_GROUP, exe: str | None = None, cron: str | None = None,
            dry_run: bool = False) -> dict:
    """Write the units into `dest`, the example NAME.env / NAME.toml into
    `confdir` (never over existing files) and, with `cron`, the cron example
    there.  Returns what was (or, dry_run, would be) written."""
    exe = exe or cxlkv_executable()
    written, kept, warnings = [], [], []
    try:
        grp.getgrnam(group)
    except KeyError:
        warnings.append(f"group {group!r} does not exist: create it (groupadd {group}) and "
                        f"give the pool to it (cxlkv init --group {group}), or pass --group")
    if not os.path.isabs(exe):
        warnings.append(f"--exe {exe} is not an absolute path: systemd needs one in ExecStart=")
    elif not os.access(exe, os.X_OK):
        why = "is not executable" if os.path.exists(exe) else "does not exist"
        warnings.append(f"--exe {exe} {why}: the units fail to start until it does (install "
                        "cxlkv there, or pass the path of the cxlkv to run)")
    warnings += sandbox_warnings(exe, env_pools(confdir))
    plan = [(Path(dest) / n, render(n, exe=exe, confdir=confdir, group=group), True)
            for n in UNITS]
    plan += [(Path(confdir) / n, template(n), False) for n in EXAMPLES]
    if cron:
        plan.append((Path(cron), render(CRON, exe=exe, confdir=confdir, group=group), True))
    for path, text, overwrite in plan:
        if path.exists() and not overwrite:
            kept.append(str(path))
            continue
        written.append(str(path))
        if dry_run:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return {"written": written, "kept": kept, "exe": exe, "group": group, "confdir": confdir,
            "dest": dest, "dry_run": dry_run, "warnings": warnings,
            "next": [f"cp {confdir}/example.env {confdir}/NAME.env   # set CXLKV_POOL",
                     f"cp {confdir}/example.toml {confdir}/NAME.toml",
                     "systemctl daemon-reload",
                     "systemctl enable --now cxlkv-serve@NAME.service cxlkv-health@NAME.timer",
                     "systemctl enable --now cxlkv-lock-manager@NAME.service   "
                     "# pools in sync mode manager, on every host"]}
