"""TLS settings of the clients: whom to trust, and the check of a pinned certificate.

Both clients take the same three options and turn them into a :class:`TLSSettings`:
``tls=True`` (verify the server against the system's CA store and the host name),
``tls_ca="ca.pem"`` (verify against these CA certificates instead) and
``tls_fingerprint="AB:CD:…"`` (pin the server certificate's SHA-256 fingerprint; on
its own it replaces CA and host-name checks, as for a self-signed certificate;
with ``tls_ca`` both must pass).  Either of the last two turns TLS on by itself.
The blocking client builds a stdlib :class:`ssl.SSLContext`, the AsyncClient
Twisted's connection options (which need the ``tls`` extra: pyOpenSSL,
service_identity).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import ssl
from dataclasses import dataclass

from ..errors import UntrustedServerError, UsageError

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def fingerprint_text(der: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate as ``AB:CD:…`` (as openssl prints it)."""
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def parse_fingerprint(text: str) -> bytes:
    """The 32 bytes of a SHA-256 fingerprint given as hex, colons, spaces and a
    ``sha256:`` prefix allowed; :class:`UsageError` otherwise."""
    cleaned = re.sub(r"[\s:]", "", str(text))
    if cleaned.lower().startswith("sha256"):
        cleaned = cleaned[6:].lstrip("=")
    try:
        digest = bytes.fromhex(cleaned)
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise UsageError(f"tls_fingerprint must be a SHA-256 fingerprint (64 hex digits), not {text!r:.80}")
    return digest


def pem_certificates(path: str) -> list[bytes]:
    """The PEM certificate blocks of a file (a CA bundle or a certificate chain)."""
    try:
        with open(path, "rb") as f:
            blocks = _PEM_CERT.findall(f.read())
    except OSError as exc:
        raise UsageError(f"cannot read certificates from {path!r}: {exc.strerror}") from None
    if not blocks:
        raise UsageError(f"no PEM certificate in {path!r}")
    return blocks


@dataclass(frozen=True)
class TLSSettings:
    """How a client checks the server's certificate."""

    ca: str | None = None  # PEM file of trusted CA certificates; None: the system's store
    fingerprint: bytes | None = None  # pinned SHA-256 of the server certificate (DER)

    @classmethod
    def from_options(cls, tls: bool | None, tls_ca: str | None, tls_fingerprint: str | None) -> "TLSSettings | None":
        """The settings for the clients' ``tls``/``tls_ca``/``tls_fingerprint``
        options, or None for a plaintext connection."""
        if tls is False and (tls_ca is not None or tls_fingerprint is not None):
            raise UsageError("tls=False contradicts tls_ca/tls_fingerprint")
        if not (tls or tls_ca is not None or tls_fingerprint is not None):
            return None
        pin = None if tls_fingerprint is None else parse_fingerprint(tls_fingerprint)
        return cls(ca=None if tls_ca is None else str(tls_ca), fingerprint=pin)

    @property
    def pinned_only(self) -> bool:
        """True when only the pin is checked (no CA chain, no host name)."""
        return self.fingerprint is not None and self.ca is None

    def check_certificate(self, der: bytes | None) -> None:
        """Raise :class:`UntrustedServerError` unless the server's certificate (DER)
        matches the pinned fingerprint (nothing to check without a pin)."""
        if self.fingerprint is None:
            return
        if not der:
            raise UntrustedServerError("the server presented no certificate")
        if not hmac.compare_digest(hashlib.sha256(der).digest(), self.fingerprint):
            raise UntrustedServerError(f"the server's certificate {fingerprint_text(der)} is not the pinned one")

    def check_transport(self, transport) -> None:
        """:meth:`check_certificate` of a Twisted TLS transport's peer (once its handshake is over)."""
        if self.fingerprint is None:
            return
        from OpenSSL import crypto

        x509 = transport.getPeerCertificate()
        self.check_certificate(None if x509 is None else crypto.dump_certificate(crypto.FILETYPE_ASN1, x509))

    def ssl_context(self) -> ssl.SSLContext:
        """A stdlib context for the blocking client."""
        if self.pinned_only:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # the pin, checked after the handshake, replaces it
        else:
            context = ssl.create_default_context(cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def twisted_options(self, host: str):
        """Twisted client connection options for the AsyncClient and a relay's upstream (needs pyOpenSSL)."""
        try:
            from twisted.internet import ssl as twisted_ssl
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise UsageError(f"TLS in the AsyncClient needs pyOpenSSL (the tls extra: pip install pyOpenSSL "
                             f"service_identity): {exc}") from None
        if self.pinned_only:
            return twisted_ssl.CertificateOptions(verify=False, raiseMinimumTo=twisted_ssl.TLSVersion.TLSv1_2)
        trust = None
        if self.ca is not None:
            trust = twisted_ssl.trustRootFromCertificates(
                [twisted_ssl.Certificate.loadPEM(block) for block in pem_certificates(self.ca)])
        return twisted_ssl.optionsForClientTLS(
            host, trustRoot=trust, extraCertificateOptions={"raiseMinimumTo": twisted_ssl.TLSVersion.TLSv1_2})
