"""`cxlkv install-manifests` and the Kubernetes manifests it writes.

The kustomization is rendered by `kubectl kustomize` (offline) and every object
validated with kubernetes-validate (PyPI: Kubernetes' own OpenAPI schemas as
JSON schemas, strict: unknown fields are errors) against Kubernetes 1.30.  The
Prometheus Operator's kinds have no schema there: the PrometheusRule's rules go
through `promtool check rules`, the PodMonitor is checked against the pods it
selects.  Then the deployment itself: least privilege (restricted Pod Security
Standard, no privileged pod, no host namespace or path), the agent DaemonSet,
the lock manager active + standby on two hosts, the health CronJob, the
settings from the ConfigMap (read by cxlkv serve's own config loader).
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from cxlkv.daemons.config import load_config
from cxlkv.daemons.manifests import K8S, K8S_EMULATED, K8S_MADE

KUBE_VERSION = "1.30"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (scripts/setup --test installs Debian's "
                            "kubernetes-client where apt-get and root exist)")
PROMTOOL = shutil.which("promtool")

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate",
                         reason="kubernetes-validate is not installed (pip install -e '.[test]')")


@pytest.fixture
def written(cli, tmp_path):
    dest = tmp_path / "out"
    r = cli("install-manifests", "--dest", dest, "--image", "registry.example:5000/cxlkv:0.2",
            "--pool", "/dev/dax1.0", "--gid", "4242", "--json")
    assert r.code == 0, r.err
    return dest, json.loads(r.out)


def render(k8s_dir) -> list[dict]:
    r = subprocess.run([KUBECTL, "kustomize", str(k8s_dir)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs) -> dict:
    out: dict = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def pod_specs(docs):
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] == "CronJob":
            yield d, spec["jobTemplate"]["spec"]["template"]
        elif "template" in spec:
            yield d, spec["template"]


def test_writes_every_part(written):
    dest, rep = written
    rel = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert rel == {"prometheus/cxlkv-rules.yml", "prometheus/cxlkv-rules.test.yml",
                   "grafana/cxlkv.json", *(f"k8s/{n}" for n in K8S + K8S_MADE),
                   *(f"k8s-emulated/{n}" for n in K8S_EMULATED)}
    assert sorted(rep["written"]) == sorted(str(dest / r) for r in rel)
    assert rep["kept"] == [] and rep["unchanged"] == []
    assert any("kubectl apply -k" in x for x in rep["next"])
    # the image and the pool were given: nothing left to edit, only the hosts to label
    assert not any("edit" in x for x in rep["next"]), rep["next"]
    assert any(x.startswith("label the hosts") for x in rep["next"]), rep["next"]


def test_again_keeps_edits_unless_forced(cli, written):
    dest, _ = written
    args = ("install-manifests", "--dest", dest, "--image", "registry.example:5000/cxlkv:0.2",
            "--pool", "/dev/dax1.0", "--gid", "4242")
    r = cli(*args, "--json")
    assert r.code == 0 and json.loads(r.out)["written"] == []
    edited = dest / "k8s" / "serve.toml"
    edited.write_text(edited.read_text() + "interval = 2.0\n")
    r = cli(*args)
    assert r.code == 0
    assert f"kept {edited}" in r.err and "--force" in r.err
    assert edited.read_text().endswith("interval = 2.0\n")
    r = cli(*args, "--force", "--dry-run")
    assert r.code == 0 and f"would write {edited}" in r.out
    assert edited.read_text().endswith("interval = 2.0\n")
    r = cli(*args, "--force")
    assert r.code == 0 and not edited.read_text().endswith("interval = 2.0\n")


def test_only_and_dry_run(cli, tmp_path):
    r = cli("install-manifests", "--dest", tmp_path / "x", "--only", "grafana", "--dry-run")
    assert r.code == 0 and "would write" in r.out and "grafana/cxlkv.json" in r.out
    assert not (tmp_path / "x").exists()
    r = cli("install-manifests", "--dest", tmp_path / "x", "--only", "prometheus")
    assert r.code == 0
    assert sorted(p.name for p in (tmp_path / "x").rglob("*") if p.is_file()) == [
        "cxlkv-rules.test.yml", "cxlkv-rules.yml"]
    # what --image / --pool left at the shipped default is named as still to edit
    r = cli("install-manifests", "--dest", tmp_path / "z", "--only", "k8s", "--image",
            "registry.example/cxlkv:0.2", "--json")
    nxt = r.json()["next"]
    assert any("kustomization.yaml (pool)" in x for x in nxt), nxt


@pytest.mark.parametrize("args, message", [
    (("--image", "bad image"), "--image"),
    (("--image", ":tag"), "--image"),
    (("--pool", "relative/path"), "--pool"),
    (("--only", "helm"), "--only"),
    (("--gid", "-1"), "--gid"),
])
def test_bad_input_is_a_usage_error(cli, tmp_path, args, message):
    r = cli("install-manifests", "--dest", tmp_path / "y", *args)
    assert r.code == 2 and message in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "y").exists()


@needs_kubectl
def test_manifests_validate_against_the_kubernetes_schemas(written):
    dest, _ = written
    docs = render(dest / "k8s")
    kinds = by_kind(docs)
    assert set(kinds) == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Deployment",
                          "PodDisruptionBudget", "CronJob", "PodMonitor", "PrometheusRule"}
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        assert kv.validate(d, KUBE_VERSION, strict=True) == KUBE_VERSION
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "cxlkv", d["metadata"]
    # the validator does reject what Kubernetes would
    ds = json.loads(json.dumps(kinds["DaemonSet"][0]))
    ds["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, KUBE_VERSION, strict=True)
    ds = json.loads(json.dumps(kinds["DaemonSet"][0]))
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9464"
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, KUBE_VERSION, strict=True)


@needs_kubectl
@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian's prometheus)")
def test_prometheus_rule_and_pod_monitor(written, tmp_path):
    dest, _ = written
    kinds = by_kind(render(dest / "k8s"))
    (rule,) = kinds["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    f = tmp_path / "from-prometheusrule.yml"
    f.write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rule["spec"] == yaml.safe_load((dest / "prometheus" / "cxlkv-rules.yml").read_text())

    (pm,) = kinds["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) == {"jobLabel", "selector", "podMetricsEndpoints"}
    (ds,) = kinds["DaemonSet"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    sel = pm["spec"]["selector"]["matchLabels"]
    assert sel.items() <= pod_labels.items()
    # the job is "cxlkv": what the agent-down alert selects
    assert pod_labels[pm["spec"]["jobLabel"]] == "cxlkv"
    assert 'up{job="cxlkv"}' in (dest / "prometheus" / "cxlkv-rules.yml").read_text()
    ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", ())}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
    # nothing else carries the agent's labels (the lock managers serve no metrics)
    others = [d for k, ds_ in kinds.items() if k != "DaemonSet" for d, t in pod_specs(ds_)
              if sel.items() <= t["metadata"]["labels"].items()]
    assert others == []
    (cm,) = [c for c in kinds["ConfigMap"] if c["metadata"]["name"] == "cxlkv-grafana-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["cxlkv.json"]) == json.loads(
        (dest / "grafana" / "cxlkv.json").read_text())


@needs_kubectl
def test_least_privilege(written):
    dest, _ = written
    docs = render(dest / "k8s")
    kinds = by_kind(docs)
    (ns,) = kinds["Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert kinds["ServiceAccount"][0]["automountServiceAccountToken"] is False
    check_pods(docs, device=True)
    (cfg,) = [c for c in kinds["ConfigMap"] if c["metadata"]["name"].startswith("cxlkv-config")]
    assert cfg["data"]["CXLKV_POOL"] == "/dev/dax1.0"


def check_pods(docs, device: bool):
    """Least privilege in every pod; `device`: the pool is the plugin's device
    (else a hostPath directory /dev/shm/cxlkv, the emulated overlay's)."""
    specs = list(pod_specs(docs))
    assert {d["kind"] for d, _ in specs} == {"DaemonSet", "Deployment", "CronJob"}
    for d, t in specs:
        spec = t["spec"]
        name = d["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False, name
        for host in ("hostPID", "hostIPC", "hostNetwork"):
            assert not spec.get(host), (name, host)
        paths = [v["hostPath"] for v in spec.get("volumes", ()) if "hostPath" in v]
        assert paths == ([] if device else [{"path": "/dev/shm/cxlkv", "type": "Directory"}])
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert psc["supplementalGroups"] == [4242], name           # --gid: the pool's group
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert c["image"] == "registry.example:5000/cxlkv:0.2"
            limits = c["resources"]["limits"]
            if device:
                assert limits["squat.ai/dax"] == 1              # the device, by its plugin
            else:
                assert "squat.ai/dax" not in limits
                assert "/dev/shm/cxlkv" in {m["mountPath"] for m in c["volumeMounts"]}
            env = {e["name"]: e for e in c["env"]}
            ref = env["CXLKV_POOL"]["valueFrom"]["configMapKeyRef"]
            assert ref["key"] == "CXLKV_POOL" and ref["name"].startswith("cxlkv-config")


@needs_kubectl
def test_emulated_overlay(written):
    """One host, the pool a file in /dev/shm/cxlkv made by the agent's init container."""
    dest, _ = written
    docs = render(dest / "k8s-emulated")
    for d in docs:
        if not d["apiVersion"].startswith("monitoring.coreos.com/"):
            assert kv.validate(d, KUBE_VERSION, strict=True) == KUBE_VERSION
    kinds = by_kind(docs)
    assert "PodDisruptionBudget" not in kinds
    (ns,) = kinds["Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    check_pods(docs, device=False)
    (cfg,) = [c for c in kinds["ConfigMap"] if c["metadata"]["name"].startswith("cxlkv-config")]
    assert cfg["data"]["CXLKV_POOL"] == "/dev/shm/cxlkv/kv0"
    assert "serve.toml" in cfg["data"]                          # merged, not replaced
    (ds,) = kinds["DaemonSet"]
    (init,) = ds["spec"]["template"]["spec"]["initContainers"]
    assert init["args"][0] == "init" and "--sync" in init["args"]
    assert kinds["Deployment"][0]["spec"]["replicas"] == 1


@needs_kubectl
def test_what_runs(written, tmp_path):
    dest, _ = written
    kinds = by_kind(render(dest / "k8s"))
    (ds,) = kinds["DaemonSet"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    assert agent["args"][:1] == ["serve"]
    assert agent["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["livenessProbe"]["httpGet"]["path"] == "/metrics"
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    (cfg,) = [c for c in kinds["ConfigMap"] if c["metadata"]["name"].startswith("cxlkv-config")]
    vol = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    cfg_vol = vol[mounts["/etc/cxlkv"]["name"]]
    assert cfg_vol["configMap"]["name"] == cfg["metadata"]["name"]
    # serve's settings, read as `cxlkv serve --config` reads them
    conf_path = agent["args"][agent["args"].index("--config") + 1]
    assert conf_path == "/etc/cxlkv/serve.toml"
    f = tmp_path / "serve.toml"
    f.write_text(cfg["data"]["serve.toml"])
    settings = load_config(str(f))
    _, port = settings["metrics_addr"].rsplit(":", 1)
    assert int(port) == agent["ports"][0]["containerPort"]
    assert settings["stop_timeout"] < ds["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]

    (dep,) = kinds["Deployment"]
    assert dep["spec"]["replicas"] == 2                        # active + standby
    (lm,) = dep["spec"]["template"]["spec"]["containers"]
    assert lm["args"] == ["lock-manager", "--standby"]
    anti = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1

    (cj,) = kinds["CronJob"]
    assert cj["spec"]["schedule"] == "* * * * *"
    (hc,) = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert hc["args"][0] == "health"
