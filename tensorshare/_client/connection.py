"""The client side of the protocol, without I/O: request frames in, results out.

Both clients use it: :class:`tensorshare.Client` over a plain socket and
:class:`tensorshare.AsyncClient` over Twisted.  A :class:`ClientConnection` runs the
opening handshake (greeting, then authentication when the server asks for it) and
decodes incoming bytes into frames; the functions here build request frames (header
bytes followed by zero-copy tensor buffers), sort frames into replies and
notifications, and turn a reply into the value the API returns or the exception it
raises.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..protocol import auth
from ..protocol import messages as protocol
from ..errors import (
    NotAuthenticatedError, ProtocolError, TensorShareError, UntrustedServerError, UsageError, ZeroCopyError,
    error_for_code,
)
from ..wire.recycle import Recycler
from ..wire.codec import Encoded, build, empty_payload, encode
from ..wire.description import DEFAULT_LIMITS, DecodeLimits, parse_description
from ..wire.frames import Frame, FrameDecoder, FrameLimits, buffer_sink, frame_head

CLIENT_FRAME_LIMITS = FrameLimits(max_header=1 << 30, max_payload=1 << 42)
NO_VALUE = object()  # "this request carries no value" (None is a value)
PROBE, DEAD = "probe", "dead"  # what Keepalive.due() asks for
log = logging.getLogger("tensorshare.client")


@dataclass(frozen=True)
class Notification:
    """A change to a bin this client listens to.

    ``op`` is the verb that changed it (``PUT``, ``APPEND``, ``GET``, ``DELETE``,
    ``RESTORE``), or ``LISTEN`` for the state found when listening (re)started.
    ``tag`` is the tag of the bin's last item after the change (None if untagged
    or empty): for a put or an append, the tag that was sent with it.
    """

    bin: str
    n_items: int
    seq: int
    op: str
    tag: int | None = None

    def as_dict(self) -> dict:
        return {"bin": self.bin, "n_items": self.n_items, "seq": self.seq, "op": self.op, "tag": self.tag}


@dataclass(frozen=True)
class ListenSnapshot:
    """The state of a bin at the moment listening to it started."""

    exists: bool
    n_items: int
    seq: int
    tag: int | None = None  # tag of the bin's last item


DEFAULT_REUSE = 1 << 30  # bytes of received reply memory a client keeps for reuse
REUSE_IDLE = 10.0  # seconds an unused array is kept


def reply_buffers(max_bytes: int) -> Recycler | None:
    """A client's :class:`~.recycle.Recycler` of reply arrays (None for 0: always new memory)."""
    if max_bytes < 0:
        raise ValueError("reuse must be 0 (off) or more bytes")
    return Recycler(max_bytes, _reply_array, REUSE_IDLE) if max_bytes else None


def _reply_array(nbytes: int):
    # torch's memory, always: the numpy array over it is what every value built on
    # it refers to.  (payload_buffer's small arrays are slices of a numpy array that
    # owns its memory; views refer to that owner, and the slice would look free
    # while they live.)
    return empty_payload(nbytes).numpy()


class ClientConnection:
    """Per-connection protocol state of a client: the opening handshake and the
    incoming frames.

    ``token`` (the HMAC key, see :mod:`.auth`) is what the client proves it knows
    when the server asks; a client with a token also requires the server to prove
    that it knows the token, and refuses a server that does not ask for one.
    ``reuse`` holds the arrays large replies were received into, for later replies
    of the same size once the values built on them are dropped (see
    :func:`~.wire.frames.buffer_sink`).
    """

    def __init__(self, frame_limits: FrameLimits = CLIENT_FRAME_LIMITS, token: bytes | None = None,
                 reuse: Recycler | None = None):
        sinks = buffer_sink if reuse is None else partial(buffer_sink, reuse=reuse)
        self.decoder = FrameDecoder(sinks, frame_limits)
        self.greeting: dict | None = None
        self.ready = False  # the handshake is over: requests may be sent
        self._token = token
        self._auth: tuple[int, bytes] | None = None  # (AUTH request id, the server proof expected)
        self.areas = None  # zerocopy.SharedAreas: what the greeting offered and this client verified

    def feed(self, data: bytes) -> list[Frame]:
        return self.decoder.feed(data)

    def opening(self, frame: Frame) -> bytes | None:
        """Advance the opening handshake with a frame from the server.

        Returns a frame to send (the AUTH request) or None; :attr:`ready` turns True
        once requests may be sent.  Raises the :class:`RemoteError` of an error
        reply (421 when the server has too many connections, 530),
        :class:`NotAuthenticatedError` when the server asks for a token and we have
        none, :class:`UntrustedServerError` when it cannot prove that it knows ours,
        :class:`ProtocolError` for anything else.
        """
        header = check_reply(frame)
        if self.greeting is None:
            if header.get("code") != protocol.GREETING:
                raise ProtocolError(f"expected a 220 greeting, got {header!r:.200}")
            self.greeting = header
            return self._authenticate(header)
        if self._auth is None or header.get("id") != self._auth[0] or header.get("code") != protocol.AUTHENTICATED:
            raise ProtocolError(f"unexpected frame while authenticating: {header!r:.200}")
        if not auth.proof_matches(self._auth[1], header.get("proof")):
            raise UntrustedServerError("the server's authentication proof is wrong: it does not know the token")
        if protocol.SHM in header:  # a same-host offer comes only once authenticated (PROTOCOL.md §10.1)
            self.greeting[protocol.SHM] = header[protocol.SHM]
        self._auth = None
        self.ready = True
        return None

    def _authenticate(self, greeting: dict) -> bytes | None:
        """The AUTH request answering ``greeting``'s challenge, or None if none is due."""
        mechanism, server_nonce = greeting.get("auth"), greeting.get("nonce")
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
        rid = next_request_id()
        self._auth = (rid, server_proof)
        return frame_head({"op": protocol.AUTH, "id": rid, "mech": auth.MECHANISM, "nonce": client_nonce,
                           "proof": client_proof}, 0)


class Keepalive:
    """When to probe a silent server and when to give up on it (both clients).

    After ``interval`` seconds with nothing heard from the server (counted from the
    later of the last bytes received and the last request sent) the client sends a
    NOOP; if nothing at all arrives within ``interval`` seconds of that probe, the
    connection is presumed dead.  The clients keep the clock and the socket.
    """

    def __init__(self, interval: float):
        self.interval = interval
        self.probe_at: float | None = None  # when the outstanding probe was sent

    def due(self, now: float, last_heard: float, last_sent: float) -> tuple[str | None, float]:
        """``(action, next_check)``: action is :data:`PROBE` (send a NOOP, then call
        :meth:`probed`), :data:`DEAD` (drop the connection) or None."""
        if self.probe_at is not None:
            if last_heard <= self.probe_at:
                if now - self.probe_at >= self.interval:
                    return DEAD, now
                return None, self.probe_at + self.interval
            self.probe_at = None  # answered (or anything else heard)
        quiet_since = max(last_heard, last_sent)
        if now - quiet_since < self.interval:
            return None, quiet_since + self.interval
        return PROBE, now + self.interval

    def probed(self, now: float) -> None:
        self.probe_at = now


def report_unsolicited(frame: Frame, where: str) -> None:
    """Log an id-0 frame that is neither a notification nor harmless: an error the
    server could not tie to a request, or its 421 before it closes an idle
    connection (a 110 keepalive passes silently).  If the connection cannot go on,
    the server closes it next."""
    try:
        check_reply(frame)
    except TensorShareError as exc:
        level = logging.INFO if getattr(exc, "code", None) == protocol.UNAVAILABLE else logging.WARNING
        log.log(level, "error reply from %s for no request: %s", where, exc)


def request_frame(rid: int, op: str, name: str | None = None, value: Any = NO_VALUE,
                  tag: int | None = None, extra: dict | None = None) -> list:
    """The parts of a request frame: header bytes, then the value's payload buffers.

    ``value`` may be given already encoded (an :class:`Encoded`); ``extra`` holds
    more header fields (same-host zero-copy, PROTOCOL.md §10).  Raises
    :class:`UsageError` for a bad bin name or tag and :class:`EncodeError` for a
    value with no wire form, before anything is sent.
    """
    header: dict = {"op": op, "id": rid}
    if name is not None:
        if type(name) is not str or name not in _checked_names:
            problem = protocol.check_bin_name(name)
            if problem:
                raise UsageError(problem)
            if len(_checked_names) >= 4096:
                _checked_names.clear()
            _checked_names.add(name)
        header["bin"] = name
    if tag is not None:
        problem = protocol.check_tag(tag)
        if problem:
            raise UsageError(problem)
        header["tag"] = tag
    if extra:
        header.update(extra)
    if value is NO_VALUE:
        return [frame_head(header, 0)]
    enc = value if type(value) is Encoded else encode(value)
    header["value"] = enc.description
    return [frame_head(header, enc.nbytes), *enc.buffers]


_ids = itertools.count(1)
_checked_names: set = set()  # bin names already found valid (programs reuse a few)


def next_request_id() -> int:
    """A process-wide unique request id (ids are never reused across reconnects)."""
    return next(_ids)


def notification_of(frame: Frame) -> Notification | None:
    """The notification a frame carries, or None if it is not one."""
    h = frame.header
    if h.get("code") != protocol.NOTIFY:
        return None
    try:
        return Notification(str(h["bin"]), int(h["n"]), int(h["seq"]), str(h["op"]), _tag(h))
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"malformed notification header {h!r}") from None


def int_field(header: dict, key: str) -> int:
    """``header[key]``, which must be an integer; ProtocolError otherwise."""
    value = header.get(key)
    if type(value) is not int:
        raise ProtocolError(f"reply field {key!r} must be an integer, got {value!r:.40}")
    return value


def _tag(header: dict) -> int | None:
    tag = header.get("tag")
    if tag is not None and type(tag) is not int:
        raise ProtocolError(f"tag must be an integer, got {tag!r}")
    return tag


def check_reply(frame: Frame) -> dict:
    """The reply header, or raise the :class:`RemoteError` its code stands for."""
    header = frame.header
    code = header.get("code")
    if type(code) is not int:
        raise ProtocolError(f"reply without a code: {header!r}")
    if code >= 400:
        raise error_for_code(code, str(header.get("msg", "")))
    return header


def reply_value(op: str, frame: Frame, device: Any = None, limits: DecodeLimits = DEFAULT_LIMITS,
                areas: Any = None) -> Any:
    """What the API returns for a successful reply to ``op`` (``areas``: the
    connection's :class:`~tensorshare.zerocopy.SharedAreas`, to map referenced items)."""
    header = check_reply(frame)
    if op in (protocol.GET, protocol.PEEK):
        return decode_items(header, frame.payload, frame.payload_len, device, limits, areas)
    if op in (protocol.PUT, protocol.APPEND):
        return int_field(header, "n")
    if op == protocol.LIST:
        bins = header.get("bins")
        if not isinstance(bins, dict):
            raise ProtocolError("LIST reply without a bins map")
        return bins
    if op == protocol.LISTEN:
        return ListenSnapshot(bool(header.get("exists")), int_field(header, "n"), int_field(header, "seq"),
                              _tag(header))
    return None


def item_table(header: dict, payload_len: int) -> list[tuple[Any, int, Any]]:
    """``[(description blob, payload bytes, reference or None), ...]`` of an ITEMS (226)
    reply, checked: the items without a reference fill the payload."""
    blobs, sizes = header.get("items"), header.get("sizes")
    if not (isinstance(blobs, list) and isinstance(sizes, list) and len(blobs) == len(sizes)):
        raise ProtocolError("items reply needs equally long 'items' and 'sizes' lists")
    refs = header.get(protocol.REFS)
    if refs is None:
        refs = [None] * len(sizes)
    elif not (isinstance(refs, list) and len(refs) == len(sizes)):
        raise ProtocolError("items reply needs a 'refs' list as long as 'items'")
    if (not all(type(s) is int and s >= 0 for s in sizes)
            or sum(s for s, ref in zip(sizes, refs) if ref is None) != payload_len):
        raise ProtocolError(f"item sizes {sizes!r} do not add up to the payload's {payload_len} bytes")
    return list(zip(blobs, sizes, refs))


def decode_items(header: dict, payload, payload_len: int, device: Any = None,
                 limits: DecodeLimits = DEFAULT_LIMITS, areas: Any = None) -> list:
    """The values of an ITEMS (226) reply; their arrays view the one payload buffer, or,
    for items the reply refers to, the server's files mapped copy-on-write (``areas``)."""
    values, base = [], 0
    for blob, size, ref in item_table(header, payload_len):
        if ref is not None:
            if areas is None:
                raise ZeroCopyError("the reply refers to shared memory this connection cannot map")
            values.append(areas.load(ref, blob, size, device, limits))
            continue
        desc = parse_description(blob, size, limits)
        try:
            values.append(build(desc, payload, base, device))
        except (ValueError, TypeError, RuntimeError) as exc:  # e.g. a shape numpy cannot hold
            raise ProtocolError(f"cannot build item {len(values)}: {exc}") from None
        base += size
    return values
