"""deploy/k8s: the kustomization renders (kubectl kustomize where kubectl is installed, and
deploy/kustomize.py, which must agree with it), the result passes `kubernetes-validate --strict`
offline, and the manifests hold together: probes, drain timing, the headless Service Envoy
resolves, the Envoy config the ConfigMap carries."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.envoy import render as envoy_render
from deploy.kustomize import render as kustomize
from deploy.mesh import build_descriptor_set

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """deploy/k8s with the descriptor set beside it, as `make k8s` leaves it."""
    out = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, out, ignore=shutil.ignore_patterns("kvgen.pb"))
    build_descriptor_set(out / "kvgen.pb")
    return out


@pytest.fixture(scope="module")
def docs(tree) -> list[dict]:
    return kustomize(tree)


def _validate(path: Path) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("kubernetes-validate")
    return subprocess.run([str(cli), "--strict", str(path)], capture_output=True, text=True, timeout=120)


def test_the_rendered_manifests_pass_strict_validation(tree, docs, tmp_path):
    rendered = tmp_path / "all.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    out = _validate(rendered)
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == ["ConfigMap/" + next(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"),
                     "Deployment/envoy", "Deployment/kvgen", "HorizontalPodAutoscaler/kvgen", "Namespace/kvgen",
                     "PodDisruptionBudget/envoy", "PodDisruptionBudget/kvgen", "Service/kvgen",
                     "Service/kvgen-replicas"]
    # the validator is strict indeed: a misspelled field fails
    bad = yaml.safe_load_all(rendered.read_text())
    bad = [d for d in bad if d["kind"] == "Deployment"]
    bad[0]["spec"]["template"]["spec"]["terminationGracePeriod"] = 5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad[0]))
    assert _validate(tmp_path / "bad.yaml").returncode != 0


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_python_renderer_agrees_with_kubectl(tree, docs):
    out = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [d for d in yaml.safe_load_all(out.stdout) if d] == docs


def _get(docs, kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_probes_and_drain_timing_fit_together(docs):
    pod = _get(docs, "Deployment", "kvgen")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    grace_s = float(env["GRACE_S"])
    port = int(env["PORT"])
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": "kvgen.v1.Generator"}
    assert c["startupProbe"]["grpc"] == {"port": port, "service": "kvgen.v1.Generator"}
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": "kvgen.liveness"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # room to load a model
    live = c["livenessProbe"]
    # a draining server answers no probe: liveness must outlast the drain
    assert live["periodSeconds"] * live["failureThreshold"] > grace_s
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace_s + 5
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert {e["name"]: e.get("valueFrom") for e in c["env"]}["REPLICA_ID"] == {
        "fieldRef": {"fieldPath": "metadata.name"}}


def test_envoy_resolves_the_headless_service(docs):
    svc = _get(docs, "Service", "kvgen-replicas")
    assert svc["spec"]["clusterIP"] == "None"
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(cm["data"]["envoy.yaml"])
    ns = svc["metadata"]["namespace"]
    for cluster in cfg["static_resources"]["clusters"]:
        assert cluster["type"] == "STRICT_DNS"
        addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        assert addr == {"address": f"kvgen-replicas.{ns}.svc.cluster.local", "port_value": 50051}
    envoy = _get(docs, "Deployment", "envoy")["spec"]["template"]["spec"]
    assert envoy["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert "kvgen.pb" in cm["binaryData"]


def test_the_configmaps_envoy_config_is_the_rendered_template():
    """deploy/k8s/envoy.yaml is written by `deploy/envoy/render.py --k8s`: edit the template, then
    render again (make k8s-envoy)."""
    committed = (K8S / "envoy.yaml").read_text()
    assert committed == envoy_render.HEADER + envoy_render.dump(envoy_render.render(**envoy_render.K8S))


def test_the_autoscaler_follows_the_queue(docs):
    hpa = _get(docs, "HorizontalPodAutoscaler", "kvgen")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "kvgen" and hpa["minReplicas"] >= 2
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "kvgen_requests_waiting"
    pdb = _get(docs, "PodDisruptionBudget", "kvgen")["spec"]
    assert pdb["maxUnavailable"] == 1
