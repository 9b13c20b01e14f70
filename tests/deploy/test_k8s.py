"""deploy/k8s: the kustomization renders (kubectl kustomize where kubectl is installed, and
deploy/kustomize.py, which must agree with it), the result passes `kubernetes-validate --strict`
offline, and the manifests hold together: probes, drain timing, the headless Service Envoy
resolves, the Envoy config the ConfigMap carries, smg's discovery of the kvgen pods; and deploy/gie
(the Gateway API Inference Extension's InferencePool and endpoint picker) renders, validates where
Kubernetes has schemas (not for the InferencePool and HTTPRoute CRDs) and names what kvgen serves."""

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
GIE = ROOT / "deploy" / "gie"


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
                     "Deployment/envoy", "Deployment/kvgen", "Deployment/smg", "HorizontalPodAutoscaler/kvgen",
                     "Namespace/kvgen", "PodDisruptionBudget/envoy", "PodDisruptionBudget/kvgen",
                     "PodDisruptionBudget/smg", "Role/smg-discovery", "RoleBinding/smg-discovery", "Service/kvgen",
                     "Service/kvgen-replicas", "Service/smg", "ServiceAccount/smg"]
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


def _kvgen_http_port(docs) -> tuple[dict, int]:
    """The kvgen pods' labels and the HTTP port they serve (HTTP_PORT, the container's "http" port)."""
    pod = _get(docs, "Deployment", "kvgen")["spec"]["template"]
    c = pod["spec"]["containers"][0]
    port = int({e["name"]: e.get("value") for e in c["env"]}["HTTP_PORT"])
    assert {"name": "http", "containerPort": port} in c["ports"]
    return pod["metadata"]["labels"], port


def _args(container: dict) -> dict[str, str]:
    """--flag=value and --flag value arguments, as a dict."""
    out, args = {}, container.get("args", [])
    for i, a in enumerate(args):
        if a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            out[key] = value if eq else (args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--")
                                         else "")
    return out


def test_smg_discovers_the_kvgen_pods_on_their_http_port(docs):
    labels, http_port = _kvgen_http_port(docs)
    smg = _get(docs, "Deployment", "smg")["spec"]["template"]["spec"]
    args = _args(smg["containers"][0])
    key, _, value = args["selector"].partition("=")
    assert labels[key] == value
    assert int(args["service-discovery-port"]) == http_port and "service-discovery" in args
    assert args["service-discovery-namespace"] == _get(docs, "Deployment", "kvgen")["metadata"]["namespace"]
    assert args["policy"] == "cache_aware" and int(args["health-check-interval-secs"]) <= 5
    # discovery needs to list and watch pods, as smg's own service account
    role = _get(docs, "Role", "smg-discovery")["rules"][0]
    assert role["resources"] == ["pods"] and {"list", "watch"} <= set(role["verbs"])
    binding = _get(docs, "RoleBinding", "smg-discovery")
    assert binding["subjects"][0]["name"] == smg["serviceAccountName"] and binding["roleRef"]["name"] == "smg-discovery"
    # the probes ask smg's own health port, which smg serves apart from its request runtime
    health = int(args["health-check-port"])
    ports = {p["name"]: p["containerPort"] for p in smg["containers"][0]["ports"]}
    assert ports["health"] == health
    assert ports["http"] == int(args["port"]) == _get(docs, "Service", "smg")["spec"]["ports"][0]["port"]
    kvgen_svc = {p["name"]: p["port"] for p in _get(docs, "Service", "kvgen-replicas")["spec"]["ports"]}
    assert kvgen_svc["http"] == http_port


@pytest.fixture(scope="module")
def gie() -> list[dict]:
    return kustomize(GIE)


def test_the_gie_manifests_validate_where_kubernetes_has_schemas(gie, tmp_path):
    builtin = [d for d in gie if d["kind"] not in ("InferencePool", "HTTPRoute")]
    (tmp_path / "gie.yaml").write_text(yaml.safe_dump_all(builtin))
    out = _validate(tmp_path / "gie.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in gie)
    assert [k for k in kinds if not k.startswith("ConfigMap/")] == [
        "Deployment/kvgen-epp", "HTTPRoute/kvgen", "InferencePool/kvgen", "Role/kvgen-epp", "RoleBinding/kvgen-epp",
        "Service/kvgen-epp", "ServiceAccount/kvgen-epp"]


def test_the_inference_pool_is_the_kvgen_pods_http_port_picked_by_the_epp(docs, gie):
    labels, http_port = _kvgen_http_port(docs)
    pool = _get(gie, "InferencePool", "kvgen")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["targetPorts"] == [{"number": http_port}]
    epp_svc = _get(gie, "Service", spec["endpointPickerRef"]["name"])
    assert spec["endpointPickerRef"]["port"]["number"] == epp_svc["spec"]["ports"][0]["port"]
    epp = _get(gie, "Deployment", "kvgen-epp")["spec"]["template"]["spec"]
    args = _args(epp["containers"][0])
    assert args["pool-name"] == pool["metadata"]["name"] and args["pool-namespace"] == pool["metadata"]["namespace"]
    assert int(args["grpc-port"]) == epp_svc["spec"]["ports"][0]["port"]
    route = _get(gie, "HTTPRoute", "kvgen")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "kvgen")
    # the picker's config file is the ConfigMap's, and every plugin a profile uses is declared
    mount = epp["containers"][0]["volumeMounts"][0]["mountPath"]
    cm = next(d for d in gie if d["kind"] == "ConfigMap")
    assert epp["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    (key,) = cm["data"]
    assert args["config-file"] == f"{mount}/{key}"
    config = yaml.safe_load(cm["data"][key])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared


def test_the_epp_reads_gauges_kvgen_serves(gie, tiny_gguf):
    """The metric names the endpoint picker is given are served by a kvgen engine's /metrics,
    as gauges, and the cache info carries the labels its prefix scorer reads."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvgen.engine.generator import EngineOptions, Generator
    from kvgen.service.metrics import Metrics

    gen = Generator.load(tiny_gguf, EngineOptions(kv_cache_mb=16))
    try:
        text = generate_latest(Metrics(gen).registry).decode()
    finally:
        gen.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    args = _args(_get(gie, "Deployment", "kvgen-epp")["spec"]["template"]["spec"]["containers"][0])
    named = [args[k] for k in ("total-queued-requests-metric", "total-running-requests-metric",
                               "kv-cache-usage-percentage-metric", "cache-info-metric")]
    assert named == ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:cache_config_info"]
    for name in named:
        assert families[name].type == "gauge", name
    (info,) = families["vllm:cache_config_info"].samples
    assert int(info.labels["block_size"]) == gen.pool.block_size and int(info.labels["num_gpu_blocks"]) > 0
    prefix = next(p for p in yaml.safe_load(next(d for d in gie if d["kind"] == "ConfigMap")["data"][
        "epp-config.yaml"])["plugins"] if p["type"] == "prefix-cache-scorer")
    assert prefix["parameters"]["blockSize"] == gen.pool.block_size


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_python_renderer_agrees_with_kubectl_on_gie(gie):
    """The same documents (kustomize orders kinds it does not know, the CRDs' among them, by its own rule)."""
    out = subprocess.run(["kubectl", "kustomize", str(GIE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    def key(d):
        return d["kind"], d["metadata"]["name"]

    assert sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=key) == sorted(gie, key=key)
