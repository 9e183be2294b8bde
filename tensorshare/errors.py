"""The one error hierarchy of tensorshare, and the table from reply codes to it.

Two branches, as in h11: :class:`UsageError` when *this* side used the API wrong
(nothing was sent), and :class:`RemoteError` when the peer answered with an error
reply code (see PROTOCOL.md).  :class:`ProtocolError` means bytes that break the wire
format, whichever side they came from; :class:`ConnectionLostError` and
:class:`TimeoutError` are about the transport.  :class:`AuthenticationError` gathers
the failures of authentication, whichever side failed to prove itself: the clients
never reconnect after one.
"""

from __future__ import annotations

import builtins

__all__ = [
    "TensorShareError",
    "UsageError",
    "EncodeError",
    "ProtocolError",
    "ConnectionLostError",
    "WrongServerError",
    "TimeoutError",
    "RemoteError",
    "TransientError",
    "PermanentError",
    "NoSuchBinError",
    "StorageFullError",
    "ServerLocalError",
    "TooLargeError",
    "BadNameError",
    "BadRequestError",
    "UnknownVerbError",
    "AuthenticationError",
    "NotAuthenticatedError",
    "UntrustedServerError",
    "ServerUnavailableError",
    "ZeroCopyError",
    "DeviceReferenceError",
    "DeviceError",
    "ZeroCopyUnavailableError",
    "WrongWorkerError",
    "error_for_code",
]


class TensorShareError(Exception):
    """Base class of every error tensorshare raises on purpose."""


class UsageError(TensorShareError, ValueError):
    """The local API was used wrongly (bad argument, closed client...)."""


class EncodeError(UsageError, TypeError):
    """A value cannot be put on the wire (an unsupported type, an object array...).

    ``path`` locates the part that cannot be sent inside the value: the dict keys
    and list or tuple indexes leading to it, as in
    ``value['info']['terminal_observation'][3]: numpy.ndarray of object dtype has no
    wire form``; ``reason`` is the message without the path.
    """

    def __init__(self, reason: str, path: tuple[object, ...] = ()):
        super().__init__(reason)
        self.reason = reason
        self.path = tuple(path)

    def inside(self, segment: object) -> "EncodeError":
        """This error, one level further down: ``segment`` (a key or index) leads to it."""
        self.path = (segment, *self.path)
        return self

    def __str__(self) -> str:
        if not self.path:
            return self.reason
        return "value" + "".join(f"[{segment!r}]" for segment in self.path) + ": " + self.reason

    def __reduce__(self) -> tuple[type[EncodeError], tuple[str, tuple[object, ...]]]:
        return type(self), (self.reason, self.path)


class DeviceError(TensorShareError):
    """A reply's values could not be put on the device asked for (out of its memory,
    say).  ``items`` holds them, built in host memory: what a ``get`` took from the
    server is never lost with the error."""

    def __init__(self, message: str, items: list[object] | None = None):
        super().__init__(message)
        self.items = items


class ProtocolError(TensorShareError):
    """Bytes that break the wire format: bad magic, truncated header, bad offsets..."""


class ConnectionLostError(TensorShareError, ConnectionError):
    """The connection to the peer closed or failed before the reply arrived."""


class WrongServerError(ConnectionLostError):
    """What answered at the address is not a tensorshare server (as this client was
    told to speak to it): a TLS server reached without TLS, an HTTP server (a
    server's metrics port), anything else.  ``speaks`` is ``"TLS"``, ``"HTTP"`` or
    None (unknown).  Connecting again would meet the same peer: the clients do not
    retry it."""

    def __init__(self, message: str, speaks: str | None = None):
        super().__init__(message)
        self.speaks = speaks


class TimeoutError(TensorShareError, builtins.TimeoutError):  # noqa: A001 - deliberate
    """A blocking call did not complete within its timeout."""


class AuthenticationError(TensorShareError):
    """Authentication failed, on either side; permanent: the clients do not reconnect.

    Either the server refused this client (:class:`NotAuthenticatedError`, 530) or
    the server failed to prove that it is the one meant (:class:`UntrustedServerError`).
    """


class UntrustedServerError(AuthenticationError):
    """The server did not prove its identity: its TLS certificate failed verification
    or the pinned fingerprint, or it could not prove that it knows the token."""


class RemoteError(TensorShareError):
    """The peer answered with an error reply code.

    ``code`` is the 3-digit reply code and ``message`` the peer's explanation.
    """

    code = 500

    def __init__(self, message: str = "", code: int | None = None):
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code} {message}".strip())


class TransientError(RemoteError):
    """4xx: the request was refused for now; trying again later may succeed."""

    code = 450


class PermanentError(RemoteError):
    """5xx: the request is wrong and will fail again unchanged."""

    code = 500


class ServerUnavailableError(TransientError):
    """421: the server is shutting down or refuses more connections."""

    code = 421


class ZeroCopyError(ProtocolError):
    """A value could not be read from the server's shared memory (files gone or not
    trusted).  The clients then fall back to TCP by themselves where they can; a GET
    whose items were taken but could not be mapped raises it."""


class DeviceReferenceError(ZeroCopyError):
    """An item the server referred to in another process's GPU memory (CUDA IPC)
    could not be read from there (a device this process does not see, a publisher
    that is gone, a copy that does not match its digest).  The clients then read
    the item's bytes instead, by themselves."""


class ZeroCopyUnavailableError(TransientError):
    """425: the server did not take a value through shared memory (zero-copy off for
    this connection, or the files it was pointed to were refused); the value must
    travel over TCP.  The clients do that by themselves."""

    code = 425


class WrongWorkerError(TransientError):
    """427: another worker of this multi-worker server owns the bin (PROTOCOL.md §14);
    nothing changed.  A client whose map of the workers is out of date (the server
    restarted with other workers) gets it; the clients map the workers again and
    send the request to its owner by themselves."""

    code = 427


class BusyError(TransientError, TimeoutError):
    """450: what the request waited for in the server (room in a bin for an APPEND
    with ``below``...) did not come within its wait; nothing changed.  Also a
    :class:`TimeoutError`."""

    code = 450


class ServerLocalError(TransientError):
    """451: the server could not read what it stores (a disk error); nothing changed."""

    code = 451


class StorageFullError(TransientError):
    """452: the server has no room (memory budget or disk) for the value."""

    code = 452


class BadRequestError(PermanentError):
    """500/501: a malformed request header or arguments."""

    code = 501


class UnknownVerbError(PermanentError):
    """502: the server does not implement the verb."""

    code = 502


class NotAuthenticatedError(PermanentError, AuthenticationError):
    """530: authentication is required or failed (no token, a wrong one, or a request
    before authenticating); the server closes the connection after it."""

    code = 530


class NoSuchBinError(PermanentError, KeyError):
    """550: the bin does not exist."""

    code = 550

    def __str__(self) -> str:  # KeyError would repr() the message
        return RemoteError.__str__(self)


class TooLargeError(PermanentError):
    """552: a count limit was reached (bins, items in a bin, listens per connection).

    An oversized frame or header is a protocol error instead: the server answers
    500 and closes the connection, since it cannot skip the bytes safely."""

    code = 552


class BadNameError(PermanentError):
    """553: the bin name is not allowed."""

    code = 553


_BY_CODE: dict[int, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        ServerUnavailableError,
        ZeroCopyUnavailableError,
        WrongWorkerError,
        BusyError,
        ServerLocalError,
        StorageFullError,
        UnknownVerbError,
        NotAuthenticatedError,
        NoSuchBinError,
        TooLargeError,
        BadNameError,
    )
}
_BY_CODE[500] = BadRequestError
_BY_CODE[501] = BadRequestError


def error_for_code(code: int, message: str) -> RemoteError:
    """The exception instance that stands for an error reply ``code``."""
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = TransientError if 400 <= code < 500 else PermanentError
    return cls(message, code)
