"""How the server meets the network: message size bounds, keepalive and connection age (so a
mesh's load balancer sees dead peers and rebalances long-lived connections), and TLS / mTLS."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvgen.service.settings import Settings


def server_options(s: Settings) -> list[tuple[str, int]]:
    """grpc channel arguments for the server. Both message sizes are set explicitly: grpc's own
    defaults are 4 MB to receive and no limit to send. An oversized message gets
    RESOURCE_EXHAUSTED from grpc itself, before any of our code runs."""
    ms = lambda seconds: max(1, int(seconds * 1000))  # noqa: E731
    options = [
        ("grpc.max_receive_message_length", s.max_receive_bytes),
        ("grpc.max_send_message_length", s.max_send_bytes),
        ("grpc.keepalive_time_ms", ms(s.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(s.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),  # probes and idle pooled connections may ping
        # a client pinging more often than this is told GOAWAY (too_many_pings) after a few strikes
        ("grpc.http2.min_ping_interval_without_data_ms", ms(s.keepalive_min_ping_s)),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if s.max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", ms(s.max_connection_age_s)),
                    ("grpc.max_connection_age_grace_ms", ms(s.max_connection_age_grace_s))]
    return options


def credentials(s: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from TLS_CERT / TLS_KEY (None: plaintext); TLS_CLIENT_CA requires clients
    to present a certificate that CA signed. A half-configured TLS is an error, never plaintext."""
    if not (s.tls_cert or s.tls_key or s.tls_client_ca):
        return None
    if not (s.tls_cert and s.tls_key):
        raise ValueError("TLS needs both TLS_CERT and TLS_KEY (TLS_CLIENT_CA alone cannot serve TLS)")
    chain, key = Path(s.tls_cert).read_bytes(), Path(s.tls_key).read_bytes()
    ca = Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)
