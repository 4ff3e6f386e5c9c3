"""cxlkv command line: the root group and main().

Each subcommand lives in its own module and is imported only when it runs
(so `cxlkv --help` stays fast); commands parse, call one layer below, render
the result and leave errors to main(), which maps them to exit codes.
"""
from __future__ import annotations

import difflib
import errno
import importlib
import signal
import sys

import click

from cxlkv import __version__, errors
from cxlkv.cli.app import Application, exit_codes_epilog, log_to_stderr

COMMANDS = {
    "init": ("cxlkv.cli.init", "init_cmd", "Create and format a pool in one step (idempotent)."),
    "format": ("cxlkv.cli.format", "format_cmd", "Format a pool file or device-dax device."),
    "inspect": ("cxlkv.cli.inspect", "inspect_cmd", "Show this host's CXL memory and a pool."),
    "fsck": ("cxlkv.cli.fsck", "fsck_cmd",
             "Check a pool's shared state; --repair fixes what it can."),
    "lock-manager": ("cxlkv.cli.lockmgr", "lockmgr_cmd",
                     "Run the lock manager of a pool in sync mode manager."),
    "bench": ("cxlkv.cli.bench", "bench_cmd", "Measure the pool against same-run baselines."),
    "stress": ("cxlkv.cli.stress", "stress_cmd",
               "Torture-test a pool's shared state (kill -9 included)."),
    "kv": ("cxlkv.cli.kv", "kv_group", "The KV cache in a pool: stats, ls, drop, secret."),
    "snapshot": ("cxlkv.cli.snapshot", "snapshot_cmd",
                 "Write a pool's KV blocks to a directory, while nodes keep serving."),
    "restore": ("cxlkv.cli.snapshot", "restore_cmd",
                "Restore a KV snapshot into a pool without KV blocks (warm restart)."),
    "doctor": ("cxlkv.cli.doctor", "doctor_cmd",
               "Check this host and its pool for the known CXL pitfalls."),
    "provision": ("cxlkv.cli.provision", "provision_group",
                  "Turn raw CXL capacity into a devdax pool: plan, apply, teardown."),
    "serve": ("cxlkv.cli.serve", "serve_cmd",
              "Run the node agent: heartbeats, reaping, watermark, metrics, /healthz."),
    "health": ("cxlkv.cli.health", "health_cmd",
               "Check a pool's health for cron and Nagios (exit 0/1/2/3), read-only."),
    "install-units": ("cxlkv.cli.install_units", "install_units_cmd",
                      "Install the systemd units (serve, lock manager, health timer)."),
    "install-manifests": ("cxlkv.cli.install_manifests", "install_manifests_cmd",
                          "Write the Prometheus rules, Grafana dashboard and k8s manifests."),
    "remote": ("cxlkv.cli.remote", "remote_group",
               "The remote tier's Redis / Valkey cluster: status (exit 0/1/2)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            near = difflib.get_close_matches(args[0], list(COMMANDS), n=2) if args else []
            if near and "No such command" in e.message:
                e.message = f"{e.message} Did you mean {' or '.join(near)}?"
            raise

    def format_commands(self, ctx, formatter):
        rows = [(name, help_) for name, (_, _, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, epilog=exit_codes_epilog(),
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="cxlkv")
def cli():
    """cxlkv: a CXL shared-memory pool and a rack-scale, prefix-aware LLM KV cache.

    Start with `cxlkv init` (an emulated pool in /dev/shm when there is no CXL
    device), then `cxlkv inspect --pool PATH`.  Every command takes --help;
    man pages: cxlkv(1), cxlkv-VERB(1), cxlkv-pool(5).
    """


def _os_error(e: OSError) -> errors.CxlkvError:
    """An OSError from the environment (not a bug): a clean error with its path."""
    where = f"{e.filename}: " if e.filename else ""
    cls = errors.PoolNotFound if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                                        errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP) \
        else errors.DeviceError
    return cls(f"{where}{e.strerror or e}")


def usage_message(e: click.ClickException) -> str:
    """click's message, plus where else the value may come from."""
    msg = e.format_message()
    param = getattr(e, "param", None)
    if isinstance(e, click.MissingParameter) and param is not None and param.envvar:
        msg = msg.rstrip(".") + f" (or set {param.envvar})."
    return msg


def command_name(args: list[str]) -> str:
    """"cxlkv kv drop" for `cxlkv kv drop --pool P`: the prefix of messages,
    down to the subcommand of a group."""
    words = [a for a in (args[:args.index("--")] if "--" in args else args)
             if not a.startswith("-")]
    if not words or words[0] not in COMMANDS:
        return "cxlkv"
    name = f"cxlkv {words[0]}"
    if COMMANDS[words[0]][1].endswith("_group") and len(words) > 1 and \
            args.index(words[1]) == args.index(words[0]) + 1:
        name += f" {words[1]}"
    return name


def main(argv: list[str] | None = None) -> int:
    log_to_stderr()
    app = Application()
    args = sys.argv[1:] if argv is None else argv
    app.command = command_name(args)
    # known before parsing, so that a usage error still prints one JSON document
    app.json = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
    try:
        rv = cli.main(args=args, prog_name="cxlkv", obj=app, standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        code = e.exit_code
    except click.exceptions.NoArgsIsHelpError as e:
        # `cxlkv` or `cxlkv kv` alone: the help, as --help shows it (not an error)
        sys.stdout.write(e.ctx.get_help() + "\n")
        code = 0
    except click.ClickException as e:
        code = app.fail(errors.UsageError(f"{usage_message(e)} (see {app.command} --help)"))
    except (click.exceptions.Abort, KeyboardInterrupt):
        code = app.fail(errors.CxlkvError("interrupted"), errors.EXIT_INTERRUPTED)
    except errors.CxlkvError as e:
        code = app.fail(e)
    except BrokenPipeError:
        code = 0
    except OSError as e:
        code = app.fail(_os_error(e))
    except Exception as e:  # noqa: BLE001 - last resort: never a bare traceback
        code = app.internal(e)
    sys.stdout.flush()
    return code


def entry() -> None:  # pragma: no cover - console script shim
    # `cxlkv inspect | head` ends quietly, as other Unix tools do
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
