"""What a client reached when it is not a tensorshare server, told from the first bytes.

A tensorshare server speaks first: its greeting starts with the frame magic
``TSHR`` (PROTOCOL.md §2, §8.1).  A client that gets other bytes first, or nothing
for a while, can say what it reached instead of waiting out its connect timeout:
:func:`recognise` names a peer from the first bytes it sent, and :func:`probe`
draws them out of a peer that waits for its client to speak, as TLS and HTTP
servers do, on a second, short-lived connection.  The probe is a TLS ClientHello
followed by an empty line: a TLS server answers with its ServerHello (or an
alert), an HTTP server with an error status line, and a tensorshare server greets
before it reads anything.
"""

from __future__ import annotations

import socket
import ssl
import time

from ..errors import WrongServerError
from ..wire.frames import MAGIC

TENSORSHARE, TLS, HTTP = "tensorshare", "TLS", "HTTP"
PROBE_AFTER = 1.0  # seconds without a greeting before a client probes (a server greets within milliseconds)
_TLS_RECORDS = range(0x14, 0x19)  # the first byte of a TLS record: change_cipher_spec .. heartbeat


def recognise(first: bytes) -> str | None:
    """Who sent ``first``, the first bytes of a connection: :data:`TENSORSHARE` (as
    far as they go), :data:`TLS`, :data:`HTTP`, or None for anything else."""
    if MAGIC.startswith(first[: len(MAGIC)]):
        return TENSORSHARE
    if first[0] in _TLS_RECORDS and first[1:2] in (b"", b"\x03"):
        return TLS
    if first.startswith(b"HTTP/"):
        return HTTP
    return None


def wrong_server(where: str, first: bytes | None, speaks: str | None) -> WrongServerError:
    """The error for a peer at ``where`` that is not a tensorshare server, saying what
    it is (``first``: the bytes it sent first, if any)."""
    if speaks == TLS:
        return WrongServerError(f"{where} is a TLS server: connect with TLS (tls=True, tls_ca= or "
                                f"tls_fingerprint=)", TLS)
    if speaks == HTTP:
        status = (first or b"").split(b"\r\n", 1)[0].decode("latin-1")[:60]
        return WrongServerError(f"{where} is an HTTP server ({status}), not a tensorshare server: a server's "
                                f"--metrics-port serves HTTP, its data port is another one", HTTP)
    return WrongServerError(f"{where} is not a tensorshare server: it sent {first[:40]!r} first", None)


def plain_server(where: str) -> WrongServerError:
    """The error for a TLS client that met a tensorshare server without TLS."""
    return WrongServerError(f"{where} is a tensorshare server without TLS: connect without tls=, tls_ca= and "
                            f"tls_fingerprint= (or start it with --tls-cert and --tls-key)", TENSORSHARE)


def unreachable_hint(refused: bool, port: int) -> str:
    """What to do when a connection to ``port`` failed (``refused``: nothing listens there)."""
    return f": no server listens there (start one: tensorshare-server --port {port})" if refused else ""


def silence_hint(speaks: str | None) -> str:
    """What to add to "no greeting within the connect timeout" from a plaintext
    connection, given what :func:`probe` found (``speaks``)."""
    if speaks == TENSORSHARE:
        return " (it greets other connections: it is overloaded, or the connect timeout is too short)"
    return " (it accepts connections but says nothing, and answers neither TLS nor HTTP)"


def probe(host: str, port: int, timeout: float) -> tuple[str | None, bytes]:
    """``(speaks, first)``: what the server at ``host:port`` is, told from the first
    bytes it answers a probe with on a connection of its own (see the module
    docstring): :data:`TENSORSHARE`, :data:`TLS`, :data:`HTTP`, or None (no answer
    within ``timeout`` seconds, a close, or something else)."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_client_hello() + b"\r\n\r\n")
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            first = sock.recv(64)
    except OSError:
        return None, b""
    return (recognise(first) if first else None), first


def _client_hello() -> bytes:
    """The bytes a TLS client opens with (made by Python's ssl module, sent nowhere else)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:  # it now waits for the server: the ClientHello is written
        pass
    return outgoing.read()
