"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 / localhost, a client
certificate from the same CA, and one from a CA the server does not trust."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Pki:
    ca: Path  # PEM of the CA that signed the server's and the client's certificates
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from another CA
    stranger_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, cert, key) -> tuple[Path, Path]:
    c, k = folder / f"{name}.crt", folder / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


def make_pki(folder: Path) -> Pki:
    key = lambda: ec.generate_private_key(ec.SECP256R1())  # noqa: E731
    ca_key, other_key = key(), key()
    ca = _issue("kvgen test CA", ca_key, _name("kvgen test CA"), ca_key, ca=True)
    other = _issue("another CA", other_key, _name("another CA"), other_key, ca=True)
    ca_path, _ = _write(folder, "ca", ca, ca_key)
    s_key, c_key, x_key = key(), key(), key()
    server = _write(folder, "server", _issue("kvgen server", s_key, ca.subject, ca_key, server=True), s_key)
    client = _write(folder, "client", _issue("kvgen client", c_key, ca.subject, ca_key), c_key)
    stranger = _write(folder, "stranger", _issue("stranger", x_key, other.subject, other_key), x_key)
    return Pki(ca_path, *server, *client, *stranger)
