"""deploy/envoy: the Envoy config and its renderer."""
