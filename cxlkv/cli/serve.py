"""`cxlkv serve`: run the node agent (cxlkv.daemons.agent) in the foreground."""
from __future__ import annotations

import click

from cxlkv.cli.app import Application, exit_codes_epilog, pass_app
from cxlkv.errors import EXIT_CODES

SERVE_CODES = ((0, "stopped by SIGTERM or SIGINT after detaching cleanly (or, with a warning, "
                   "after --stop-timeout)"),) + tuple(
    r for r in EXIT_CODES if r[0] not in (0, 1, 130)) + (
    (1, "refused: no free node slot, metrics address in use, --with-lock-manager on a "
        "cas pool, --spill-dir owned by another process, --kv-events address in use"),)


def _config(ctx, param, value):
    """--config is read first: its settings become the defaults the flags override."""
    if value:
        from cxlkv.daemons.config import load_config

        conf = load_config(value)
        if "remote" in conf:                   # a table, not a flag
            ctx.meta["cxlkv.remote"] = conf.pop("remote")
        if "kv_events_table" in conf:          # the [kv_events] table
            ctx.meta["cxlkv.kv_events"] = conf.pop("kv_events_table")
        ctx.default_map = {**(ctx.default_map or {}), **conf}
    return value


def _numa(ctx, param, value):
    if value is None:
        return None
    value = str(value)
    if value != "auto" and not value.isdigit():
        raise click.BadParameter("expected a NUMA node number or 'auto'")
    return value


@click.command("serve", epilog=exit_codes_epilog(sorted(SERVE_CODES)))
@click.option("--config", metavar="FILE", is_eager=True, expose_value=False, callback=_config,
              help="TOML file with the same settings as the flags (keys as the long flag "
                   "names, top level or in a [serve] table); flags win.")
@click.option("--pool", "pool", metavar="PATH", envvar="CXLKV_POOL",
              help="Pool file or /dev/daxX.Y device [env: CXLKV_POOL].")
@click.option("--pool-uuid", metavar="UUID", envvar="CXLKV_POOL_UUID",
              help="The pool this host pins: refuse to attach to any other pool at the path "
                   "(a wrong region, device or format) [env: CXLKV_POOL_UUID].")
@click.option("--metrics-addr", metavar="HOST:PORT",
              help="Serve Prometheus /metrics and /healthz here (e.g. 127.0.0.1:9464; port 0 "
                   "picks one and logs it).  Default: no HTTP server.")
@click.option("--with-lock-manager/--without-lock-manager", default=False,
              help="Also run the pool's lock manager (sync mode manager): standby while "
                   "another is active, taking over when it stops.")
@click.option("--numa-node", metavar="N|auto", callback=_numa,
              help="Bind the agent to NUMA node N, or to the node of the pool's DAX device.")
@click.option("--interval", type=click.FloatRange(0.01, 3600), default=1.0, show_default=True,
              metavar="SECONDS", help="Maintenance tick: watermark, lock probe, metrics "
                                      "snapshot, health.")
@click.option("--log-json/--log-text", default=False,
              help="Log one JSON object per line (for log shippers) instead of text.")
@click.option("--warn-used", type=float, default=80.0, show_default=True, metavar="PCT",
              help="/healthz and metrics: WARNING at PCT % unevictable.")
@click.option("--crit-used", type=float, default=95.0, show_default=True, metavar="PCT",
              help="/healthz: 503 (CRITICAL) at PCT % unevictable.")
@click.option("--warn-temp", type=float, default=70.0, show_default=True, metavar="C",
              help="WARNING at device temperature C.")
@click.option("--crit-temp", type=float, default=85.0, show_default=True, metavar="C",
              help="CRITICAL (503) at device temperature C.")
@click.option("--force", is_flag=True, default=False,
              help="Attach to a world-readable or world-writable pool.")
@click.option("--stop-timeout", type=click.FloatRange(0.1, 3600), default=5.0,
              show_default=True, metavar="SECONDS",
              help="On SIGTERM, exit within SECONDS: when the clean detach cannot finish "
                   "by then (another node holds the pool lock), stop heartbeating and exit "
                   "0 anyway, leaving the node to be reaped.")
@click.option("--spill-dir", metavar="DIR",
              help="Own this host's spill store in DIR (local NVMe): the blocks the agent "
                   "evicts to keep the watermark are written there instead of dropped; "
                   "serving processes that enable the same directory attach as readers.  "
                   "Needs --spill-bytes.")
@click.option("--spill-bytes", metavar="SIZE",
              help="Size limit of the spill store, in file bytes (K/M/G/T suffixes, "
                   "e.g. 64G).")
@click.option("--spill-queue-bytes", metavar="SIZE",
              help="Bound of the queue of evicted blocks waiting for the spill writers "
                   "(default 64M); past it blocks are dropped and counted.")
@click.option("--remote-nodes", metavar="HOST:PORT,...",
              help="The remote tier's Redis Cluster / Valkey startup nodes (over the nodes "
                   "of the [remote] table of --config, which holds the other settings: "
                   "password_file, tls, ttl_s, max_bytes, wait_replicas ...).")
@click.option("--remote-push", metavar="NAMESPACE", multiple=True,
              help="Push the published blocks of this namespace (a name or a shell pattern, "
                   "e.g. 'hf/llama/*'; repeatable) to the remote tier, off the serving path.")
@click.option("--remote-push-policy", type=click.Choice(["all", "reused"]), default="reused",
              show_default=True,
              help="all: every published block; reused: blocks loaded at least once after "
                   "the agent first saw them.")
@click.option("--remote-push-interval", type=click.FloatRange(0.05, 3600), default=5.0,
              show_default=True, metavar="SECONDS",
              help="How often the write-behind scans the hash table.")
@click.option("--kv-events", metavar="tcp://HOST:PORT",
              help="Publish the pool's block events for KV-aware routers in vLLM's KV-events "
                   "format (ZeroMQ PUB here, replay on PORT+1); one agent of the pool "
                   "publishes.  More settings: a [kv_events] table in --config.")
@pass_app
def serve_cmd(app: Application, **opts):
    """Run the node agent of this host for a pool, in the foreground.

    Attaches as a node and heartbeats; reaps dead nodes (revokes their lock,
    drops their pins, reclaims their reservations) - every lease/4, a dead
    node of another host once its heartbeat has stopped for a lease; keeps
    free space above the KV low watermark in the background by evicting
    unpinned blocks (with --spill-dir, into this host's spill store, which
    it owns); optionally hosts the lock manager; serves Prometheus
    metrics and /healthz (200 healthy, 503 not).  Logs to stderr.  SIGTERM
    or SIGINT detaches cleanly and exits 0 within --stop-timeout; when the
    detach cannot finish by then it stops heartbeating and exits 0 with a
    warning (the other nodes reap it).  A second signal exits at once.
    """
    from cxlkv.daemons.agent import serve
    from cxlkv.daemons.config import AgentConfig
    from cxlkv.daemons.service import make_logger

    opts["remote_push"] = tuple(opts.get("remote_push") or ())
    meta = click.get_current_context().meta
    cfg = AgentConfig(**opts, remote=meta.get("cxlkv.remote"),
                      kv_events_table=meta.get("cxlkv.kv_events"))
    return serve(cfg, make_logger(cfg.log_json))
