"""The server's TLS set-up: Twisted context options from PEM files (needs pyOpenSSL)."""

from __future__ import annotations

from tensorshare.errors import UsageError
from tensorshare.protocol.tls import fingerprint_text, pem_certificates


def server_tls_options(cert_file: str, key_file: str | None = None):
    """``(options, fingerprint)``: Twisted's TLS options for ``listenSSL`` and the
    SHA-256 fingerprint of the server certificate (for clients that pin it).

    ``cert_file`` holds the certificate, optionally followed by its chain;
    ``key_file`` the private key (default: also ``cert_file``).  TLS 1.2 at least.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from twisted.internet import ssl
    except ImportError as exc:
        raise UsageError(f"TLS needs pyOpenSSL (the tls extra: pip install pyOpenSSL service_identity): {exc}") from None
    blocks = pem_certificates(cert_file)
    try:
        with open(key_file or cert_file, "rb") as f:
            key_pem = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read the TLS key {key_file or cert_file!r}: {exc.strerror}") from None
    try:
        chain = [x509.load_pem_x509_certificate(block) for block in blocks]
        key = serialization.load_pem_private_key(key_pem, password=None)
        # cryptography objects: pyOpenSSL (>= 24.3) deprecates its own X509 and PKey here.
        options = ssl.CertificateOptions(privateKey=key, certificate=chain[0], extraCertChain=chain[1:],
                                         raiseMinimumTo=ssl.TLSVersion.TLSv1_2)
        options.getContext()  # checks that the key matches the certificate, now rather than per connection
    except Exception as exc:  # bad PEM, an encrypted key, a key that does not match
        raise UsageError(f"bad TLS certificate or key ({cert_file}, {key_file or cert_file}): {exc}") from None
    return options, fingerprint_text(chain[0].public_bytes(serialization.Encoding.DER))
