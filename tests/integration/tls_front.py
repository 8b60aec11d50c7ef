"""A TLS-enabled Temporal for tests: mutual TLS in front of the dev server, which serves plain
gRPC only. Clients must present a certificate signed by the front's CA (as a self-hosted
Temporal with ``requireClientAuth`` asks); behind it the HTTP/2 bytes go to the dev server as
they are. Runs in a thread of the test process, on a free loopback port, until ``close``."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    """A CA, the server's certificate (localhost, 127.0.0.1) and one client's, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = issuer or (name, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return b.sign(signer, hashes.SHA256())


def make_pki(out: Path) -> Pki:
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("trainguard test CA", ca_key, None)
    files: dict[str, bytes] = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM)}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[f"{who}.pem"] = _cert(who, key, (ca.subject, ca_key)).public_bytes(serialization.Encoding.PEM)
        files[f"{who}.key"] = _key_pem(key)
    for name, data in files.items():
        (out / name).write_bytes(data)
        (out / name).chmod(0o600)
    return Pki(out / "ca.pem", out / "server.pem", out / "server.key", out / "client.pem", out / "client.key")


class TlsFront:
    """Listens with mutual TLS; each accepted connection is piped to ``backend`` (host, port)."""

    def __init__(self, pki: Pki, backend: tuple[str, int]) -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["h2"])  # gRPC clients ask for HTTP/2 by ALPN
        self.backend = backend
        self.accepted = 0  # connections that completed the handshake with a valid certificate
        self.port = 0
        self._ctx = ctx
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._serve, name="tls-front", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the TLS front did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0, ssl=self._ctx)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        b_reader, b_writer = await asyncio.open_connection(*self.backend)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, b_writer), copy(b_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
