"""TLS for the mesh's servers (nats-server, etcd): a private CA made for one mesh, a
certificate per server signed by it, and the client side that trusts only that CA.

``kvmesh up`` / ``LocalMesh`` make a fresh CA at each start (``<workdir>/auth/tls/``);
``kvmesh credentials`` makes one for the deployment files. The CA's key is used once, to
sign the server certificates, and is never written: a new server certificate means a new CA.
Services get the CA certificate's *path* (``--nats-tls-ca``, ``--etcd-tls-ca``).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.security.credentials import write_private

LOCAL_HOSTS = ("127.0.0.1", "localhost")
VALID_DAYS = 365


@dataclass(slots=True, frozen=True)
class ServerCertificate:
    """Paths of one server's certificate and private key (mode 0600)."""

    cert_file: Path
    key_file: Path


@dataclass(slots=True, frozen=True)
class MeshTLS:
    """The CA certificate clients trust and the servers' certificates, by server name."""

    ca_file: Path
    servers: dict[str, ServerCertificate]

    def server(self, name: str) -> ServerCertificate:
        return self.servers[name]

    @classmethod
    def generate(cls, directory: Path, servers: dict[str, Iterable[str]], *, days: int = VALID_DAYS) -> MeshTLS:
        """A new CA in ``directory`` (``ca.crt``) and, per server name, a certificate for its
        host names and IP addresses (``<name>.crt``, ``<name>.key``)."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh mesh CA {now:%Y-%m-%dT%H:%M:%SZ}")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        ca_file = directory / "ca.crt"
        ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        made = {}
        for name, hosts in servers.items():
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256())
            )
            cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
            cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            write_private(key_file, key_pem.decode())
            made[name] = ServerCertificate(cert_file, key_file)
        return cls(ca_file, made)


def _names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if not names:
        raise ValueError("a server certificate needs at least one host name or address")
    return names


def client_context(ca_file: str | Path) -> ssl.SSLContext:
    """A client context that trusts ``ca_file`` only (not the system's CAs), checks the
    server's name, and speaks TLS 1.2 or later."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def read_ca(ca_file: str | Path) -> bytes:
    """The CA certificate's PEM bytes (what gRPC, and so etcd's client, takes)."""
    return Path(ca_file).read_bytes()
