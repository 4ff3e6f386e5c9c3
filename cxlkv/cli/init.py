"""`cxlkv init`: the one-shot, idempotent way to get a formatted pool."""
from __future__ import annotations

import os
import stat

import click

from cxlkv.cli.app import NO_ATTACH, Application, exit_codes_epilog, json_option, pass_app
from cxlkv.cli.format import format_options, given_params, render_result, run_format
from cxlkv.errors import UsageError


@click.command("init", epilog=exit_codes_epilog(only=NO_ATTACH))
@click.option("--pool", "pool", metavar="PATH", envvar="CXLKV_POOL",
              help="Pool file to create or check [env: CXLKV_POOL; default "
                   "/dev/shm/cxlkv-default.pool].")
@click.option("--device", metavar="/dev/daxX.Y",
              help="Format this device-dax device instead of a file.")
@format_options
@json_option
@pass_app
def init_cmd(app: Application, pool, device, size, sync, chunk_size, max_nodes, lease, grace,
             hash_slots, hash_max_load, name_tokens, label, group, force, as_json):
    """Create and format a pool in one step.

    With no arguments: an emulated pool in a file under /dev/shm (1 GiB,
    sync mode cas), mode 0660, space reserved up front.  With --device: that
    device-dax device.

    Idempotent for scripts and runbooks: on a valid pool whose parameters
    match the ones given (options left out are taken from the pool) it changes
    nothing and exits 0.  Different parameters, a damaged pool or foreign data
    are refused unless --force; live nodes are refused even with --force.
    """
    from cxlkv.ops.init import DEFAULT_POOL_PATH, init_pool

    if pool == "" or device == "":
        raise UsageError("empty path given to --pool or --device")
    if pool and device:
        src = click.get_current_context().get_parameter_source("pool")
        if src == click.core.ParameterSource.COMMANDLINE:
            raise UsageError("give either --pool or --device, not both")
        pool = None   # --device wins over $CXLKV_POOL
    path = device or pool or DEFAULT_POOL_PATH
    if device and os.path.exists(device) and not stat.S_ISCHR(os.stat(device).st_mode):
        raise UsageError(f"--device {device} is not a character device; "
                         "for a pool in a file use --pool")
    given = given_params(size, sync, chunk_size, max_nodes, lease, grace, hash_slots,
                         hash_max_load, label, name_tokens)
    res = run_format(app, init_pool, path, given, force=force, group=group,
                     create=device is None)
    render_result(app, res, next_steps=True)
