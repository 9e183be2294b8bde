"""Token authentication by challenge and response: the construction both sides share.

PROTOCOL.md §8.4 is the normative description.  The token itself never crosses the
wire: the server's greeting carries a random nonce, the client answers (AUTH) with a
nonce of its own and an HMAC-SHA256 keyed with the token over both nonces, and the
server's 230 reply carries a second HMAC over the same nonces under another label.
Each side thereby proves to the other that it knows the token, so a client is not
fooled by a server that merely accepts it.  Fresh nonces on both sides make every
proof good for one connection only.  Torch-free: the server imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from ..errors import UsageError

MECHANISM = "hmac-sha256"  # the greeting's "auth" field and AUTH's "mech"
NONCE_SIZE = 32  # bytes of each side's nonce
PROOF_SIZE = 32  # bytes of an HMAC-SHA256
TOKEN_ENV = "TENSORSHARE_TOKEN"  # where clients and servers look when given no token
MIN_TOKEN_CHARS = 16  # shorter tokens work but the server warns: proofs can be brute-forced offline

_CLIENT_LABEL = b"tensorshare-auth-v1 client\x00"
_SERVER_LABEL = b"tensorshare-auth-v1 server\x00"


def token_bytes(token: str | bytes) -> bytes:
    """The HMAC key for ``token``: its UTF-8 bytes without surrounding whitespace.

    Stripping lets a token file end in a newline and still match the same token
    given in the environment.  Raises :class:`UsageError` for an empty token.
    """
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, (bytes, bytearray)):
        raise UsageError(f"a token must be str or bytes, not {type(token).__name__}")
    key = bytes(token).strip()
    if not key:
        raise UsageError("the token is empty")
    return key


def resolve_token(token: str | bytes | None = None, token_file: str | os.PathLike | None = None) -> bytes | None:
    """The token to use: ``token``, else the contents of ``token_file``, else the
    ``TENSORSHARE_TOKEN`` environment variable, else None (no authentication)."""
    if token is None and token_file is not None:
        try:
            with open(token_file, "rb") as f:
                token = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read the token file {os.fspath(token_file)!r}: {exc.strerror}") from None
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return None if token is None else token_bytes(token)


def new_nonce() -> bytes:
    """A fresh random nonce (from :mod:`secrets`)."""
    return secrets.token_bytes(NONCE_SIZE)


def proofs(token: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """``(client_proof, server_proof)`` for one handshake.

    ``HMAC-SHA256(token, label ‖ server_nonce ‖ client_nonce)`` with the label
    ``"tensorshare-auth-v1 client\\0"`` or ``"tensorshare-auth-v1 server\\0"``: the
    labels keep either proof from being replayed as the other.
    """
    transcript = server_nonce + client_nonce
    return (hmac.new(token, _CLIENT_LABEL + transcript, hashlib.sha256).digest(),
            hmac.new(token, _SERVER_LABEL + transcript, hashlib.sha256).digest())


def proof_matches(expected: bytes, given: object) -> bool:
    """Whether ``given`` (as read from a header) equals ``expected``, in constant time."""
    return isinstance(given, bytes) and hmac.compare_digest(expected, given)


def is_nonce(value: object) -> bool:
    """Whether a header field holds a nonce of the right size."""
    return isinstance(value, bytes) and len(value) == NONCE_SIZE
