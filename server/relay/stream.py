"""Cut-through forwarding: a copy of a bin passed on to the relays that follow this one while it still arrives.

A relay that fetched each copy whole before its followers could start made a chain
of relays cost one transfer time per hop.  Here the relay's upstream connection
(:class:`StreamingClient`) receives a fetched copy into a :class:`TeeSink`, which
reports every read; the copy becomes an :class:`Incoming` the moment its reply
header is in.  Relays that follow this one and asked for it (a PEEK with
``incoming``, PROTOCOL.md §11) hear of it at once (an ``INCOMING`` notification
carrying the number the copy will have here), and a PEEK ``incoming`` of theirs is
answered with it, streamed: the 226 header first, then the payload in pieces of
:data:`PIECE` bytes as they arrive (:class:`Stream`).  So the last relay of a chain
holds a version about one transfer time plus a few pieces' latency after the first
began to receive it.

Readers never see part of a copy: the relay's own bin changes only when the copy is
complete (:meth:`~.follower.Follower._apply`), and a follower applies the streamed
reply only once its frame is whole.  A copy whose upstream fails mid-way is dropped
here, and every connection it was being streamed to is closed without another byte
(:meth:`~server.protocol.session.ServerSession.cut_off`), so the follower sees its
frame cut short, drops it too and fetches again once reconnected.
"""

from __future__ import annotations

import logging
from typing import Callable

from tensorshare.async_client import AsyncClient
from tensorshare.errors import RemoteError
from tensorshare.protocol.messages import ITEMS, NOTIFICATION, PEEK, UNAVAILABLE, Key
from tensorshare.wire.frames import BufferSink, frame_head

log = logging.getLogger("tensorshare.server.relay")

PIECE = 128 << 10  # bytes of a streamed copy sent on together (each piece delays the next hop this much)
INCOMING = "INCOMING"  # the op of the notification that announces a copy arriving (§11)


class TeeSink(BufferSink):
    """A reply payload received into one array, reporting how much is in after each read."""

    def __init__(self, nbytes: int, on_bytes: Callable[[int], None]):
        super().__init__(nbytes)
        self.on_bytes = on_bytes

    @property
    def view(self) -> memoryview:
        return self._view

    def write(self, data) -> None:
        super().write(data)
        self._report()

    def buffer_updated(self, n: int) -> None:
        super().buffer_updated(n)
        self._report()

    def _report(self) -> None:
        try:
            self.on_bytes(self._filled)
        except Exception:  # a bug in passing it on must not break the upstream connection
            log.exception("relay: passing on a copy as it arrives failed")


class StreamingClient(AsyncClient):
    """The relay's upstream client: a PEEK sent with ``incoming`` has its reply payload
    received into the sink ``arriving(bin, header, nbytes)`` returns (None: as usual)."""

    arriving: Callable | None = None

    def _new_connection(self):
        conn = super()._new_connection()
        plain = conn.decoder.sink_factory

        def sinks(header: dict, nbytes: int):
            rid = header.get(Key.ID)
            if nbytes and self.arriving is not None and header.get(Key.CODE) == ITEMS and type(rid) is int:
                call = self._calls.get(rid)
                if call is not None and call.command is PEEK and call.fields and call.fields.get(Key.INCOMING):
                    sink = self.arriving(call.fields[Key.BIN], header, nbytes)
                    if sink is not None:
                        return sink
            return plain(header, nbytes)

        conn.decoder.sink_factory = sinks
        return conn


class Incoming:
    """A copy of bin ``name`` arriving from upstream: the reply header's item table,
    the number (``seq``) and verb (``op``) its change will have here, and the
    streams passing it on."""

    def __init__(self, name: str, blobs: list, sizes: list, tags: list, total: int, seq: int, op: str):
        self.name = name
        self.blobs, self.sizes, self.tags = blobs, sizes, tags
        self.total = total
        self.seq = seq
        self.op = op
        self.sink = TeeSink(total, self._progress)
        self.streams: list[Stream] = []

    @property
    def received(self) -> int:
        return self.sink._filled

    def notification(self) -> bytes:
        """The 151 ``INCOMING`` frame that announces this copy."""
        tag = self.tags[-1] if self.tags else None
        return frame_head(NOTIFICATION.build(bin=self.name, n=len(self.sizes), seq=self.seq, op=INCOMING,
                                             tag=tag), 0)

    def stream_to(self, session, request, done: Callable[[BaseException | None], None]) -> None:
        """Answer ``request`` (a PEEK ``incoming``) with this copy, as it arrives;
        ``done(None)`` once all of it is queued, ``done(error)`` if it never will be."""
        stream = Stream(self, session, request, done)
        self.streams.append(stream)
        stream.start()

    def _progress(self, filled: int) -> None:
        for stream in self.streams:
            stream.more(filled)

    def complete(self) -> None:
        """All of it is in: every stream sends the rest and ends."""
        streams, self.streams = self.streams, []
        for stream in streams:
            stream.finish()

    def fail(self, reason: str) -> None:
        """It will never be whole: every stream's connection is cut off."""
        streams, self.streams = self.streams, []
        for stream in streams:
            stream.cut(reason)


class Stream:
    """One streamed 226 reply to a PEEK ``incoming``: the header at once (the
    payload's length is known), then the payload as it arrives."""

    def __init__(self, incoming: Incoming, session, request, done: Callable):
        self.incoming, self.session, self.request, self.done = incoming, session, request, done
        self.sent = 0

    def start(self) -> None:
        incoming, request = self.incoming, self.request
        header = PEEK.reply(request.id)
        header[Key.SEQ], header[Key.ITEMS], header[Key.SIZES] = incoming.seq, incoming.blobs, incoming.sizes
        if request.tags:
            header[Key.TAGS] = incoming.tags
        header[Key.CHANGE] = incoming.op
        self.session.streams += 1  # no keepalive may come between its pieces
        self.session.send([frame_head(header, incoming.total)])
        self.more(incoming.received)

    def more(self, filled: int) -> None:
        if filled - self.sent >= PIECE or (filled == self.incoming.total and filled > self.sent):
            self.session.send([self.incoming.sink.view[self.sent:filled]])
            self.sent = filled

    def finish(self) -> None:
        self.more(self.incoming.total)
        self._end(None)

    def cut(self, reason: str) -> None:
        self._end(RemoteError(f"relay: the copy of bin {self.incoming.name!r} being passed on was lost "
                              f"upstream: {reason}", UNAVAILABLE))

    def _end(self, error: BaseException | None) -> None:
        self.session.streams -= 1
        self.done(error)


def stream_reply(session, request, incoming: Incoming) -> None:
    """Answer a PEEK ``incoming`` with ``incoming``, holding the connection's later
    requests and notifications until it is all queued (they follow it); if the copy
    is lost, the connection is cut off mid-frame."""
    def finish(error) -> None:
        if error is not None:
            session.cut_off(str(error))

    session.wait_for(lambda done: incoming.stream_to(session, request, done), finish)


__all__ = ["INCOMING", "Incoming", "StreamingClient", "TeeSink", "stream_reply"]
