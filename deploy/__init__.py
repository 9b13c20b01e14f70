"""Deployment: Envoy in front of kvgen replicas (envoy/), Kubernetes manifests (k8s/), and the tools
that render and run them."""
