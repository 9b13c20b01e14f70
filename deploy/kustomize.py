"""`kubectl kustomize` for a machine without kubectl, as far as deploy/k8s needs it and no further:
resources, namespace, labels (metadata only), images, and a configMapGenerator of files, with
kustomize's content-hash suffix on the generated name and the references to it rewritten.
tests/deploy/test_k8s.py checks it renders what kubectl does, where kubectl is there.

    python -m deploy.kustomize deploy/k8s > kvgen.yaml
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path

import yaml

# kustomize writes resources in this order of kinds (then by name); the rest come after.
ORDER = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
         "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret",
         "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim",
         "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget"]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "StorageClass",
                  "PersistentVolume", "PriorityClass"}
SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "resources", "configMapGenerator", "images"}


def _go_json(value) -> str:
    """JSON as Go's encoding/json writes it (what kustomize hashes): sorted keys, no spaces, and
    <, >, & escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def config_map_hash(cm: dict) -> str:
    """kustomize's name suffix for a ConfigMap: sha256 of the JSON of its kind, data and binaryData
    (and its name, which kustomize 5 looks up by a path that finds nothing, so it hashes ""), the
    first 10 hex digits with 0 1 3 a e swapped for letters (so it is never all digits)."""
    fields = {"kind": "ConfigMap", "name": "", "data": cm.get("data", {})}
    if cm.get("binaryData"):
        fields["binaryData"] = cm["binaryData"]
    digest = hashlib.sha256(_go_json(fields).encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _base64_lines(raw: bytes, width: int = 70) -> str:
    """Base64 in lines of 70, each ending in a newline, as kustomize writes binaryData (unless it
    all fits one line)."""
    text = base64.b64encode(raw).decode()
    if len(text) < width:
        return text
    return "".join(text[i:i + width] + "\n" for i in range(0, len(text), width))


def _generate(root: Path, spec: dict) -> dict:
    data, binary = {}, {}
    for entry in spec.get("files", []):
        key, _, path = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        raw = (root / path).read_bytes()
        try:
            data[key] = raw.decode("utf-8")
        except UnicodeDecodeError:
            binary[key] = _base64_lines(raw)
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": spec["name"]}}
    if binary:
        cm["binaryData"] = binary
    if data:
        cm["data"] = data
    return cm


def _containers(doc: dict) -> list[dict]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def _rename_config_maps(doc: dict, names: dict[str, str]) -> None:
    """Point a workload's volumes and env sources at the generated (suffixed) ConfigMap names."""
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    for v in pod.get("volumes", []):
        if "configMap" in v and v["configMap"].get("name") in names:
            v["configMap"]["name"] = names[v["configMap"]["name"]]
    for c in _containers(doc):
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef")
            if ref and ref.get("name") in names:
                ref["name"] = names[ref["name"]]
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref and ref.get("name") in names:
                ref["name"] = names[ref["name"]]


def render(root: Path) -> list[dict]:
    root = Path(root)
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise ValueError(f"this renderer does not do {sorted(unknown)}: use kubectl kustomize")
    docs = [d for r in k.get("resources", []) for d in yaml.safe_load_all((root / r).read_text()) if d]
    names = {}
    for spec in k.get("configMapGenerator", []):
        cm = _generate(root, spec)
        cm["metadata"]["name"] = names[spec["name"]] = f"{spec['name']}-{config_map_hash(cm)}"
        docs.append(cm)
    for doc in docs:
        meta = doc.setdefault("metadata", {})
        if k.get("namespace") and doc["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = k["namespace"]
        for group in k.get("labels", []):
            meta.setdefault("labels", {}).update(group["pairs"])
        for image in k.get("images", []):
            for c in _containers(doc):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
        _rename_config_maps(doc, names)
    rank = {kind: i for i, kind in enumerate(ORDER)}
    return sorted(docs, key=lambda d: (rank.get(d["kind"], len(ORDER)), d["metadata"]["name"]))


def main(argv: list[str] | None = None) -> None:
    root = Path((argv or sys.argv[1:] or ["deploy/k8s"])[0])
    sys.stdout.write(yaml.safe_dump_all(render(root), sort_keys=False))


if __name__ == "__main__":
    main()
