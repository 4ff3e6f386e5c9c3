"""The monitoring and deployment files shipped in cxlkv/data, written out for an
operator (`cxlkv install-manifests`), as units.py does for systemd.

    DEST/prometheus/cxlkv-rules.yml       alert and recording rules (rule_files:)
    DEST/prometheus/cxlkv-rules.test.yml  their unit tests: promtool test rules
    DEST/grafana/cxlkv.json               the dashboard (Grafana: import)
    DEST/k8s/                             a kustomization: kubectl apply -k DEST/k8s
    DEST/k8s-emulated/                    its overlay for an emulated pool on one host

The k8s directory also gets prometheusrule.yaml (the rules as a PrometheusRule of the
Prometheus Operator) and grafana-dashboard.yaml (the dashboard as a ConfigMap for
Grafana's sidecar), made here from the rules and the dashboard, so that there is one
copy of each.  `image`, `pool` and `gid` fill in the kustomization's image, the
pool's path and the pool group's GID (the manifests ship with cxlkv:latest,
/dev/dax0.0 and 990).

A file that exists with other content is kept (an operator's edits are not lost)
unless force is given; the report says which.
"""
from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from cxlkv.errors import UsageError

PARTS = ("prometheus", "grafana", "k8s")
PROMETHEUS = ("cxlkv-rules.yml", "cxlkv-rules.test.yml")
GRAFANA = ("cxlkv.json",)
K8S = ("kustomization.yaml", "serve.toml", "namespace.yaml", "serviceaccount.yaml",
       "agent-daemonset.yaml", "lock-manager-deployment.yaml", "lock-manager-pdb.yaml",
       "health-cronjob.yaml", "podmonitor.yaml")
#: made from the rules and the dashboard
K8S_MADE = ("prometheusrule.yaml", "grafana-dashboard.yaml")
#: an overlay of k8s/: an emulated pool in a file on one host
K8S_EMULATED = ("kustomization.yaml", "namespace.yaml", "agent-daemonset.yaml",
                "lock-manager-deployment.yaml", "lock-manager-pdb.yaml", "health-cronjob.yaml",
                "no-device-pod.yaml", "no-device-cronjob.yaml")
DEFAULT_IMAGE = "cxlkv:latest"
DEFAULT_POOL = "/dev/dax0.0"
DEFAULT_GID = 990


def data(part: str, name: str) -> str:
    return resources.files("cxlkv.data").joinpath(part, name).read_text()


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "".join(pad + line if line.strip() else line
                   for line in text.splitlines(keepends=True))


def prometheus_rule() -> str:
    """The rules as a PrometheusRule (monitoring.coreos.com/v1): the rules file,
    comments and all, indented under spec:."""
    return ("# Made by cxlkv install-manifests from prometheus/cxlkv-rules.yml: edit that,\n"
            "# not this.\n"
            "apiVersion: monitoring.coreos.com/v1\n"
            "kind: PrometheusRule\n"
            "metadata:\n"
            "  name: cxlkv\n"
            "  labels:\n"
            "    app.kubernetes.io/name: cxlkv\n"
            "spec:\n" + _indent(data("prometheus", "cxlkv-rules.yml"), 2))


def dashboard_configmap() -> str:
    """The dashboard as a ConfigMap that Grafana's sidecar loads (label grafana_dashboard)."""
    return ("# Made by cxlkv install-manifests from grafana/cxlkv.json.\n"
            "apiVersion: v1\n"
            "kind: ConfigMap\n"
            "metadata:\n"
            "  name: cxlkv-grafana-dashboard\n"
            "  labels:\n"
            "    grafana_dashboard: \"1\"\n"
            "data:\n"
            "  cxlkv.json: |\n" + _indent(data("grafana", "cxlkv.json"), 4))


def _image(image: str) -> tuple[str, str]:
    """NAME[:TAG] -> (name, tag); a registry port is not a tag."""
    if not image or any(c.isspace() for c in image):
        raise UsageError(f"--image {image!r}: expected NAME[:TAG], e.g. "
                         "registry.example/cxlkv:0.9")
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, "latest"
    if not name:
        raise UsageError(f"--image {image!r}: expected NAME[:TAG]")
    return name, tag


def render_k8s(part: str, name: str, *, image: str, pool: str, gid: int) -> str:
    """A file of k8s/ or k8s-emulated/ with the image, the pool (k8s/ only: the
    overlay has its own) and the GID filled in."""
    if part == "k8s" and name == "prometheusrule.yaml":
        return prometheus_rule()
    if part == "k8s" and name == "grafana-dashboard.yaml":
        return dashboard_configmap()
    text = data(part, name)
    if name == "kustomization.yaml":
        iname, tag = _image(image)
        text = text.replace("    newName: cxlkv\n    newTag: latest\n",
                            f"    newName: {iname}\n    newTag: \"{tag}\"\n")
        if part == "k8s":
            text = text.replace(f"CXLKV_POOL={DEFAULT_POOL}", f"CXLKV_POOL={pool}")
    return text.replace(f"supplementalGroups: [{DEFAULT_GID}]", f"supplementalGroups: [{gid}]")


def plan(parts=PARTS, *, image: str = DEFAULT_IMAGE, pool: str = DEFAULT_POOL,
         gid: int = DEFAULT_GID) -> list[tuple[str, str]]:
    """[(relative path, text)] of what the parts write."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise UsageError(f"unknown part {unknown[0]!r}: choose from {', '.join(PARTS)}")
    if not pool.startswith("/") or re.search(r"\s", pool):
        raise UsageError(f"--pool {pool!r}: expected an absolute path without blanks")
    if not 0 <= gid < 2 ** 31:
        raise UsageError(f"--gid {gid}: expected a group id")
    out: list[tuple[str, str]] = []
    if "prometheus" in parts:
        out += [(f"prometheus/{n}", data("prometheus", n)) for n in PROMETHEUS]
    if "grafana" in parts:
        out += [(f"grafana/{n}", data("grafana", n)) for n in GRAFANA]
    if "k8s" in parts:
        out += [(f"k8s/{n}", render_k8s("k8s", n, image=image, pool=pool, gid=gid))
                for n in K8S + K8S_MADE]
        out += [(f"k8s-emulated/{n}", render_k8s("k8s-emulated", n, image=image, pool=pool,
                                                 gid=gid)) for n in K8S_EMULATED]
    return out


def install(dest: str, parts=PARTS, *, image: str = DEFAULT_IMAGE, pool: str = DEFAULT_POOL,
            gid: int = DEFAULT_GID, force: bool = False, dry_run: bool = False) -> dict:
    """Write the parts under `dest`.  Returns what was (dry_run: would be) written,
    what was already there unchanged, and what was kept because it differs."""
    if not dest:
        raise UsageError("--dest DIR is needed")
    written, unchanged, kept = [], [], []
    for rel, text in plan(parts, image=image, pool=pool, gid=gid):
        path = Path(dest) / rel
        try:
            old = path.read_text() if path.exists() else None
        except (OSError, UnicodeDecodeError):
            old = ""                                  # unreadable: differs
        if old == text:
            unchanged.append(str(path))
            continue
        if old is not None and not force:
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
    d = Path(dest)
    nxt = []
    if "prometheus" in parts:
        nxt += [f"promtool test rules {d / 'prometheus' / 'cxlkv-rules.test.yml'}",
                f"add {d / 'prometheus' / 'cxlkv-rules.yml'} to rule_files: of prometheus.yml "
                "(scrape the agents as job \"cxlkv\")"]
    if "grafana" in parts:
        nxt.append(f"import {d / 'grafana' / 'cxlkv.json'} into Grafana")
    if "k8s" in parts:
        # only what --image / --pool left at the shipped default still needs an edit
        left = [w for w, v, dflt in (("image", image, DEFAULT_IMAGE), ("pool", pool, DEFAULT_POOL))
                if v == dflt]
        edit = (f"edit {d / 'k8s' / 'kustomization.yaml'} ({', '.join(left)}) and "
                if left else "")
        nxt += [f"{edit}label the hosts: kubectl label node HOST cxlkv.io/pool=kv0",
                f"kubectl apply -k {d / 'k8s'}   (one host, an emulated pool: "
                f"{d / 'k8s-emulated'})"]
    return {"dest": str(dest), "parts": list(parts), "written": written,
            "unchanged": unchanged, "kept": kept, "dry_run": dry_run, "next": nxt}
