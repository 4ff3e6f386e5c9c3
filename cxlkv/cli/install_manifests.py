"""`cxlkv install-manifests`: write the Prometheus rules, the Grafana dashboard and
the Kubernetes manifests for an operator."""
from __future__ import annotations

import click

from cxlkv.cli.app import Application, exit_codes_epilog, json_option, pass_app
from cxlkv.daemons.manifests import DEFAULT_GID, DEFAULT_IMAGE, DEFAULT_POOL, PARTS


@click.command("install-manifests", epilog=exit_codes_epilog())
@click.option("--dest", metavar="DIR", required=True,
              help="Directory to write into (prometheus/, grafana/, k8s/ below it).")
@click.option("--only", "parts", type=click.Choice(PARTS), multiple=True,
              help="Write only this part (repeatable; default: all three).")
@click.option("--image", metavar="NAME[:TAG]", default=DEFAULT_IMAGE, show_default=True,
              help="k8s: the cxlkv image the pods run.")
@click.option("--pool", "pool", metavar="PATH", default=DEFAULT_POOL, show_default=True,
              help="k8s: the pool's path in the pods (the device the device plugin maps).")
@click.option("--gid", type=click.IntRange(0, 2 ** 31 - 1), default=DEFAULT_GID, metavar="GID",
              show_default=True, help="k8s: the GID of the pool's group on the hosts.")
@click.option("--force", is_flag=True,
              help="Replace files that exist with other content (default: keep them).")
@click.option("--dry-run", is_flag=True, help="Say what would be written; write nothing.")
@json_option
@pass_app
def install_manifests_cmd(app: Application, dest, parts, image, pool, gid, force, dry_run,
                          as_json):
    """Write cxlkv's monitoring and deployment files for an operator.

    prometheus/cxlkv-rules.yml: alert and recording rules (pool-wide series
    aggregated with max by (pool)), with their unit tests for promtool test
    rules; grafana/cxlkv.json: the dashboard; k8s/: a kustomization with the
    agent DaemonSet, the lock manager (active + standby), the health CronJob,
    a PodMonitor, the rules as a PrometheusRule and the dashboard as a
    ConfigMap (kubectl apply -k DIR/k8s).  Files that exist with other
    content are kept unless --force.
    """
    from cxlkv.daemons.manifests import install

    rep = install(dest, parts or PARTS, image=image, pool=pool, gid=gid, force=force,
                  dry_run=dry_run)
    if app.json:
        app.emit_json(rep)
        return 0
    verb = "would write" if dry_run else "wrote"
    for p in rep["written"]:
        app.out.print(f"{verb} {p}")
    for p in rep["unchanged"]:
        app.out.print(f"unchanged {p}")
    for p in rep["kept"]:
        app.warn(f"kept {p}: it differs from this cxlkv's (--force replaces it)")
    app.out.print("next:")
    for line in rep["next"]:
        app.out.print(f"  {line}")
    return 0
