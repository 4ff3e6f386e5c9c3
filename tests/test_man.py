"""Man pages render without warnings and document every option --help shows."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cxlkv.cli import COMMANDS, cli

MAN = Path(__file__).resolve().parent.parent / "man"
pytestmark = pytest.mark.skipif(shutil.which("man") is None,
                                reason="man is not installed (scripts/setup --test installs man-db)")


def render(page: Path) -> tuple[str, str]:
    r = subprocess.run(["man", "--warnings", "-E", "ascii", "-l", str(page)],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": ""})
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


PAGES = sorted(MAN.glob("*.[1-8]"))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_renders_without_warnings(page):
    out, err = render(page)
    assert err == ""
    assert "NAME" in out


def options_of(command) -> set[str]:
    """The command's options, and for a group those of every subcommand."""
    flags = set()
    for p in command.params:
        flags.update(o for o in list(p.opts) + list(p.secondary_opts) if o.startswith("-"))
    for sub in getattr(command, "commands", {}).values():
        if command is not cli:
            flags |= options_of(sub)
    return flags | {"--help"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_documented(name):
    page = MAN / f"cxlkv-{name}.1"
    assert page.exists(), f"no man page for cxlkv {name}"
    module, attr, _ = COMMANDS[name]
    command = getattr(importlib.import_module(module), attr)
    text, _ = render(page)
    missing = sorted(o for o in options_of(command) if o not in text)
    assert not missing, f"{page.name} does not document {missing}"


def test_main_page_lists_every_command_and_option():
    text, _ = render(MAN / "cxlkv.1")
    for name in COMMANDS:
        assert f"cxlkv-{name}(1)" in text
    assert not [o for o in options_of(cli) if o not in text]
    assert (MAN / "cxlkv-pool.5").exists()
