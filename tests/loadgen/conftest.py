"""Fixtures for the load generator's tests: ``bench(...)`` runs ``edgegw bench`` in this
process (against the fake upstreams of ``tests.fakes``) and hands back the exit status,
the result document it printed with ``--json``, and the tables it wrote."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from loadgen.cli import main
from loadgen.result import BenchResult


@dataclass
class Outcome:
    code: int
    result: BenchResult | None
    err: str  # the tables (on stderr with --json), notes and errors


@pytest.fixture
def bench(capsys):
    def run(*args: str) -> Outcome:
        code = main(["--no-progress", "--json", *args])
        captured = capsys.readouterr()
        result = BenchResult.model_validate(orjson.loads(captured.out)) if captured.out.strip() else None
        return Outcome(code, result, captured.err)

    return run


@pytest.fixture
def dataset(tmp_path):
    """Write JSONL lines (dicts) to a file and return its path."""

    def write(lines: list[dict], name: str = "data.jsonl") -> str:
        path = Path(tmp_path) / name
        path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
        return str(path)

    return write


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1: (certfile, keyfile)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(certfile), str(keyfile)
