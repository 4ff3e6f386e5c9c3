"""`cxlkv remote status`: the remote tier's cluster (Redis Cluster / Valkey)
as this host sees it."""
from __future__ import annotations

import click
from rich.table import Table

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app

REMOTE_CODES = ((0, "ok: every slot served, every node up"),
                (1, "degraded: slots not all covered, a node down or failing, cluster_state "
                    "not ok, or used_memory at max_bytes"),
                (2, "unreachable: no startup node answers (or refuses the credentials); "
                    "or a usage error"),
                (70, "internal error (a bug)"), (130, "interrupted"))


@click.group("remote", epilog=exit_codes_epilog(REMOTE_CODES))
def remote_group():
    """The remote tier: KV blocks shared across racks through a Redis Cluster
    or Valkey cluster.

    Settings come from the [remote] table of a TOML file (--config) and the
    command's options, options winning.  Passwords are read from a file
    (password_file, --password-file) and never printed.
    """


def connection_options(f):
    opts = [
        click.option("--config", "config", metavar="FILE", type=click.Path(dir_okay=False),
                     help="TOML file with a [remote] table (nodes, username, password_file, "
                          "tls..., prefix, max_bytes, ...)."),
        click.option("--nodes", metavar="HOST:PORT,...",
                     help="Startup nodes, comma-separated (IPv6: [addr]:port)."),
        click.option("--username", metavar="NAME", help="ACL user name."),
        click.option("--password-file", metavar="FILE", type=click.Path(dir_okay=False),
                     help="File holding the password (first line)."),
        click.option("--tls/--no-tls", "tls", default=None, help="Connect with TLS."),
        click.option("--tls-ca", metavar="FILE", help="CA certificates to verify the nodes."),
        click.option("--tls-cert", metavar="FILE", help="Client certificate (mutual TLS)."),
        click.option("--tls-key", metavar="FILE", help="Client certificate's private key."),
        click.option("--tls-verify/--no-tls-verify", "tls_verify", default=None,
                     help="Verify the nodes' certificates and host names [default: verify]."),
        click.option("--prefix", metavar="PREFIX", help="Key prefix [default: cxlkv:]."),
        click.option("--max-bytes", metavar="SIZE",
                     help="Memory budget to compare used_memory with (e.g. 200G)."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(0.01, 3600),
                     metavar="SECONDS", help="Connect and socket timeout per node [default: 2]."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def load_config(config, **cli):
    """RemoteConfig from --config and the options (options win)."""
    from cxlkv.remote.config import RemoteConfig

    cfg = RemoteConfig.from_toml(config) if config else RemoteConfig()
    return cfg.with_overrides(**cli).require_nodes()


@remote_group.command("status", epilog=exit_codes_epilog(REMOTE_CODES))
@connection_options
@click.option("--no-scan", is_flag=True,
              help="Skip counting blocks per namespace (SCAN of every master).")
@json_option
@pass_app
def status_cmd(app: Application, config, nodes, username, password_file, tls, tls_ca, tls_cert,
               tls_key, tls_verify, prefix, max_bytes, timeout_s, no_scan, as_json):
    """Show the remote cluster: reachable, cluster_state, slots covered,
    masters and replicas up or down, used_memory against max_bytes, and
    keys and bytes per namespace.

    Read-only.  The cluster's view comes from the first startup node that
    answers (CLUSTER NODES, CLUSTER INFO); every node it lists is then
    reached directly (PING, INFO memory); blocks are counted with SCAN on
    every master that is up (STRLEN pipelined: values are not read) and
    named from the <prefix>ns hash.
    """
    from cxlkv.remote.status import cluster_status

    cfg = load_config(config, nodes=nodes, username=username, password_file=password_file,
                      tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                      tls_verify=tls_verify, prefix=prefix, max_bytes=max_bytes,
                      timeout_s=timeout_s)
    rep = cluster_status(cfg, scan=not no_scan)
    if app.json:
        app.emit_json(rep)
        return rep["exit_code"]
    render(app, rep)
    return rep["exit_code"]


def render(app: Application, rep: dict) -> None:
    from cxlkv.util.sizes import human_size

    out = app.out.print
    if not rep["reachable"]:
        out(f"remote cluster UNREACHABLE: {rep['error']}")
        return
    out(f"remote cluster via {rep['seed']}: cluster_state {rep['cluster_state']}, "
        f"{rep['slots']['covered']} of {rep['slots']['total']} slots covered "
        f"({rep['slots']['assigned']} assigned)")
    m, r = rep["masters"], rep["replicas"]
    out(f"masters: {m['up']} up, {m['down']} down; replicas: {r['up']} up, {r['down']} down")
    mem = rep["memory"]
    used = human_size(mem["used_memory"] or 0)
    if mem["max_bytes"]:
        out(f"memory: {used} used of max_bytes {human_size(mem['max_bytes'])} "
            f"({mem['used_pct']}%)")
    else:
        out(f"memory: {used} used (no max_bytes set)")
    t = Table(title="nodes", title_justify="left")
    for col in ("node", "role", "state", "slots", "used memory", "blocks"):
        t.add_column(col, justify="left" if col in ("node", "role", "state") else "right")
    for n in rep["nodes"]:
        state = "up" if n["up"] else "DOWN"
        bad = [f for f in n["flags"] if f in ("fail", "fail?")]
        if bad:
            state += " (" + ",".join(bad) + ")"
        t.add_row(n["addr"], n["role"], state, str(n["slots"]),
                  "-" if n["used_memory"] is None else human_size(n["used_memory"]),
                  "-" if n["keys"] is None else str(n["keys"]))
    out(t)
    if rep["scanned"] or rep["namespaces"]:
        t = Table(title="namespaces", title_justify="left")
        for col in ("namespace", "digest", "blocks", "bytes"):
            t.add_column(col, justify="left" if col in ("namespace", "digest") else "right",
                         overflow="fold")
        for s in rep["namespaces"]:
            t.add_row(s["namespace"] or "?", s["digest8"], str(s["keys"]), human_size(s["bytes"]))
        out(t)
        out(f"{rep['keys']} blocks, {human_size(rep['bytes'] or 0)} in all")
    if rep.get("scan_error"):
        out(f"blocks not all counted: {rep['scan_error']}")
    for p in rep["problems"]:
        out(f"problem: {p}")
    out("status: " + rep["status"].upper())
