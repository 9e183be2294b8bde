"""A client connection's opening, without I/O: the greeting, then AUTH when the server asks (PROTOCOL.md §8.1, §8.4).

Every client end uses it: both clients (``tensorshare/_client/connection.py``) and a
relay's connection to its upstream (``server/relay/upstream.py``).  A client with a
token proves that it knows it when the greeting carries a challenge, and requires
the server to prove that it knows the token too: it refuses a server that does
not ask for one, or whose proof is wrong.  Torch-free: the server imports it.
"""

from __future__ import annotations

from typing import Callable

from ..errors import NotAuthenticatedError, ProtocolError, UntrustedServerError
from ..wire.frames import Frame, FrameLimits, frame_head
from . import auth
from .messages import AUTH, GREETING, GREETING_MESSAGE, MAX_REPLY_HEADER, Key, reply_error

# What a client accepts from a server: headers up to the largest reply header a
# server sends, payloads as large as memory allows.
CLIENT_FRAME_LIMITS = FrameLimits(max_header=MAX_REPLY_HEADER, max_payload=1 << 42)


class Handshake:
    """The opening handshake of one client connection (see the module docstring).

    ``token``: the HMAC key to prove (None: a server that asks for one is refused);
    ``request_id()`` gives the AUTH request its id.  :attr:`greeting` is the
    server's greeting (with the same-host offer of a 230, if any), :attr:`ready`
    turns True once requests may be sent."""

    def __init__(self, token: bytes | None, request_id: Callable[[], int]):
        self.greeting: dict | None = None
        self.ready = False  # the handshake is over: requests may be sent
        self._token = token
        self._request_id = request_id
        self._auth: tuple[int, bytes] | None = None  # (AUTH request id, the server proof expected)

    def opening(self, frame: Frame) -> bytes | None:
        """Advance the opening handshake with a frame from the server.

        Returns a frame to send (the AUTH request) or None; :attr:`ready` turns True
        once requests may be sent.  Raises the :class:`RemoteError` of an error
        reply (421 when the server has too many connections, 530),
        :class:`NotAuthenticatedError` when the server asks for a token and we have
        none, :class:`UntrustedServerError` when it cannot prove that it knows ours,
        :class:`ProtocolError` for anything else.
        """
        header = frame.header
        if self.greeting is None:
            if header.get(Key.CODE) != GREETING:
                raise reply_error(header, "greeting")
            self.greeting = GREETING_MESSAGE.check(header)
            return self._authenticate(header)
        if self._auth is None or header.get(Key.ID) != self._auth[0]:
            raise ProtocolError(f"unexpected frame while authenticating: {header!r:.200}")
        try:
            AUTH.check_reply(header)
        except NotAuthenticatedError as exc:  # our proof was wrong: the tokens differ
            raise NotAuthenticatedError(f"{exc.message}: this token is not the server's (check token=, "
                                        f"{auth.TOKEN_ENV} or the server's --token-file)", exc.code) from None
        if not auth.proof_matches(self._auth[1], header[Key.PROOF]):
            raise UntrustedServerError("the server's authentication proof is wrong: it does not know the token")
        if Key.SHM in header:  # a same-host offer comes only once authenticated (PROTOCOL.md §10.1)
            self.greeting[Key.SHM] = header[Key.SHM]
        self._auth = None
        self.ready = True
        return None

    def _authenticate(self, greeting: dict) -> bytes | None:
        """The AUTH request answering ``greeting``'s challenge, or None if none is due."""
        mechanism, server_nonce = greeting.get(Key.AUTH), greeting.get(Key.NONCE)
        if self._token is None:
            if mechanism is not None:
                raise NotAuthenticatedError(f"the server requires a token: pass token=... or set {auth.TOKEN_ENV}")
            self.ready = True
            return None
        if mechanism is None:
            raise UntrustedServerError("the server asks for no token, so it cannot prove that it knows ours")
        if mechanism != auth.MECHANISM or not auth.is_nonce(server_nonce):
            raise ProtocolError(f"unsupported authentication {mechanism!r:.40} or a bad nonce in the greeting")
        client_nonce = auth.new_nonce()
        client_proof, server_proof = auth.proofs(self._token, server_nonce, client_nonce)
        rid = self._request_id()
        self._auth = (rid, server_proof)
        return frame_head(AUTH.request(rid, {Key.MECH: auth.MECHANISM, Key.NONCE: client_nonce,
                                             Key.PROOF: client_proof}), 0)
