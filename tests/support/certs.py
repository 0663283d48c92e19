"""A throwaway certificate authority for tests, made with the openssl command line tool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterable, Tuple

import pytest

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command line tool to make certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    """A self-signed CA: ``d/name.pem`` and ``d/name.key``."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             cwd=d)


def make_cert(d: Path, name: str, ca: str, san: str = "IP:127.0.0.1") -> None:
    """A leaf certificate signed by ``ca`` with subject alternative name ``san``."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


def make_pki(d: Path, cas: Iterable[str], certs: Iterable[Tuple[str, str, str]]) -> Dict[str, str]:
    """Make the CAs ``cas`` and the certificates ``(name, ca, san)`` in ``d``; return the
    paths: ``paths[name]`` is a PEM certificate, ``paths[f"{name}.key"]`` a leaf's key."""
    paths = {}
    for ca in cas:
        make_ca(d, ca)
        paths[ca] = str(d / f"{ca}.pem")
    for name, ca, san in certs:
        make_cert(d, name, ca, san)
        paths[name], paths[f"{name}.key"] = str(d / f"{name}.pem"), str(d / f"{name}.key")
    return paths


def tls_options(paths: Dict[str, str], cert: str = "worker", ca: str = "ca") -> Dict[str, str]:
    """The backend options that run a worker over TLS with ``cert``, trusting ``ca``."""
    return {"tls_certfile": paths[cert], "tls_keyfile": paths[f"{cert}.key"],
            "tls_cafile": paths[ca]}
