"""The CLI's Application object: owns output, errors and exit codes.

Data goes to stdout, messages to stderr.  With --json a command prints
exactly one JSON document on stdout - its result, or {"error": {...}} when it
fails - and nothing else.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from contextlib import contextmanager

import click
from rich.console import Console

from cxlkv import errors


class _StderrHandler(logging.Handler):
    """Writes to the sys.stderr of the moment (tests swap it)."""

    def emit(self, record) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


def log_to_stderr() -> None:
    """Show the library's warnings on stderr as "cxlkv: MSG" (once per process).

    The library logs through logging.getLogger(__name__) and installs no
    handler; this is the CLI's."""
    top = logging.getLogger("cxlkv")
    if not any(isinstance(h, _StderrHandler) for h in top.handlers):
        h = _StderrHandler(logging.WARNING)
        h.setFormatter(logging.Formatter("cxlkv: %(message)s"))
        top.addHandler(h)


#: the width tables get when stdout is not a terminal (they take what their
#: content needs, up to this): `cxlkv kv stats | grep` sees whole names
PIPE_WIDTH = 4096


class Application:
    def __init__(self) -> None:
        self.json = False
        self.command = "cxlkv"
        # piped or redirected: full names, never wrapped or folded to a guessed width
        wide = None if sys.stdout.isatty() else PIPE_WIDTH
        self.out = Console(file=sys.stdout, markup=False, highlight=False, soft_wrap=True,
                           width=wide)
        self.err = Console(file=sys.stderr, markup=False, highlight=False, soft_wrap=True)
        self._emitted = False

    # -- output ----------------------------------------------------------
    def emit_json(self, doc) -> None:
        if self._emitted:  # pragma: no cover - a bug in a command
            raise RuntimeError("a command tried to print two JSON documents")
        self._emitted = True
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
        sys.stdout.flush()

    def info(self, text: str) -> None:
        """A message for people, on stderr."""
        self.err.print(text)

    def warn(self, text: str) -> None:
        self.err.print(f"{self.command}: warning: {text}")

    @contextmanager
    def progress(self, description: str, total: int):
        """A progress bar on stderr (none with --json or when stderr is not a terminal).

        Yields a callback (done, total).
        """
        if self.json or not self.err.is_terminal:
            yield lambda done, total: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(),
                      DownloadColumn(binary_units=True),
                      TimeRemainingColumn(), console=self.err, transient=True) as p:
            task = p.add_task(description, total=total)
            yield lambda done, tot: p.update(task, completed=done, total=tot)

    # -- errors ----------------------------------------------------------
    def fail(self, exc: errors.CxlkvError, exit_code: int | None = None) -> int:
        """Report an error; exit_code overrides the general table (fsck, health)."""
        code = exc.exit_code if exit_code is None else exit_code
        if self.json and not self._emitted:
            self.emit_json({"error": {**exc.to_json(), "exit_code": code}})
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        self.err.print(f"{self.command}: error: {exc.message}{hint}")
        return code

    def internal(self, exc: BaseException) -> int:
        msg = f"internal error: {type(exc).__name__}: {exc}"
        if self.json and not self._emitted:
            self.emit_json({"error": {"kind": "internal", "message": msg,
                                      "exit_code": errors.EXIT_INTERNAL}})
        if os.environ.get("CXLKV_DEBUG"):
            traceback.print_exc()
        self.err.print(f"{self.command}: {msg} (a bug: rerun with CXLKV_DEBUG=1 for a "
                       "traceback and report it)")
        return errors.EXIT_INTERNAL


pass_app = click.make_pass_decorator(Application)


#: the general codes a command that opens no pool can return
NO_POOL = (errors.EXIT_OK, errors.EXIT_USAGE, errors.EXIT_NOT_FOUND, errors.EXIT_INTERNAL,
           errors.EXIT_INTERRUPTED)
#: ... one that opens a pool without attaching to it (no lock manager needed)
NO_ATTACH = tuple(c for c, _ in errors.EXIT_CODES if c != errors.EXIT_NO_MANAGER)


def exit_codes_epilog(rows=errors.EXIT_CODES, only=None) -> str:
    """Exit-code table for a command's --help (kept verbatim by click via \\b);
    `only`: the codes of `rows` the command can return."""
    lines = ["\b", "Exit codes:"] + [f"  {code:<3} {text}" for code, text in rows
                                      if only is None or code in only]
    return "\n".join(lines)


def pool_option(required: bool = True):
    return click.option(
        "--pool", "pool", metavar="PATH", envvar="CXLKV_POOL", required=required,
        help="Pool file or /dev/daxX.Y device [env: CXLKV_POOL].")


def json_option(f):
    def set_json(ctx, param, value):
        if value:
            ctx.find_object(Application).json = True
        return value

    return click.option("--json", "as_json", is_flag=True, expose_value=True,
                        callback=set_json, is_eager=True,
                        help="Print one JSON document on stdout.")(f)
