"""A connection's authentication, server side: the challenge of its greeting and the check of its AUTH (PROTOCOL.md §8.4).

A server with a token greets each connection with a fresh nonce; until the peer
has proved that it knows the token (:func:`tensorshare.protocol.auth.proofs`), its
frames may carry no payload and only a small header (an AUTH frame is about 150
bytes), so an unauthenticated peer cannot make the server buffer anything
sizeable, and anything but a right AUTH gets 530 and the connection closes.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tensorshare.errors import RemoteError
from tensorshare.protocol import auth
from tensorshare.protocol.messages import AUTH, NOT_AUTHENTICATED, Key
from tensorshare.wire.frames import FrameLimits

log = logging.getLogger("tensorshare.server")

PRE_AUTH_MAX_HEADER = 4096


class Login:
    """The challenge of one connection to a server with a ``token`` (see the module docstring)."""

    def __init__(self, token: bytes):
        self.token = token
        self.nonce = auth.new_nonce()  # the challenge of our greeting

    @staticmethod
    def frame_limits(limits: FrameLimits) -> FrameLimits:
        """What the connection may send before it has authenticated."""
        return replace(limits, max_header=min(PRE_AUTH_MAX_HEADER, limits.max_header), max_payload=0)

    def greeting(self, greeting: dict) -> dict:
        """``greeting`` with the challenge."""
        greeting.update({Key.MSG: "tensorshare ready; authenticate", Key.AUTH: auth.MECHANISM, Key.NONCE: self.nonce})
        return greeting

    def check(self, rid: int, header: dict) -> dict:
        """The 230 reply to a right AUTH request; a :class:`Refused` (with the reason
        to log and the 530 to answer, after which the connection closes) otherwise."""
        if header.get(Key.OP) != AUTH.verb or rid == 0:
            raise Refused(f"{header.get(Key.OP)!r:.40} before authenticating", "authentication required")
        try:
            request = AUTH.parse_request(header, rid, None, 0)
            if request.mech != auth.MECHANISM or not auth.is_nonce(request.nonce):
                raise RemoteError("malformed AUTH")
        except RemoteError:
            raise Refused("malformed AUTH", f"AUTH needs mech {auth.MECHANISM!r} and a {auth.NONCE_SIZE}-byte "
                                            f"nonce") from None
        client_proof, server_proof = auth.proofs(self.token, self.nonce, request.nonce)
        if not auth.proof_matches(client_proof, request.proof):
            raise Refused("wrong proof", "authentication failed")
        return AUTH.reply(rid, **{Key.PROOF: server_proof})


class Refused(RemoteError):
    """An AUTH (or a frame instead of it) refused: ``reason`` for the log, the 530's message to the peer."""

    def __init__(self, reason: str, message: str):
        super().__init__(message, NOT_AUTHENTICATED)
        self.reason = reason


def failed(session, reason: str) -> None:
    """Log (and count) a failed authentication of ``session``'s connection."""
    log.warning("conn %d authentication failed (%s): %s", session.stats.id, session.peer, reason,
                extra={"conn": session.stats.id, "event": "auth_failed"})
    if session.counters is not None:
        session.counters.auth_failures += 1
