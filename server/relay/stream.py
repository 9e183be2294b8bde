"""Cut-through forwarding: a copy of a bin passed on to the relays that follow this one while it still arrives.

A relay that fetched each copy whole before its followers could start made a chain
of relays cost one transfer time per hop.  Here the relay's upstream connection
(:class:`~.upstream.Upstream`) receives a copy (a fetch's 226, or a copy pushed to
it) into a :class:`TeeSink`, which reports every read; the copy becomes an
:class:`Incoming` the moment its frame header is in, and the frame, once whole,
carries that :class:`Incoming` as its payload (so the copy's bytes and the news
that it is complete come to the follower together).  Each connection of a relay
following this one that asked for it (a PEEK with ``incoming``, PROTOCOL.md §11)
gets it pushed at once, in the same reactor turn (:class:`Stream`, through the
connection's :class:`~..protocol.gate.StreamGate`): a 151 ``INCOMING``
notification whose header names the items and the number the copy will have here,
and whose payload follows in pieces of :data:`PIECE` bytes as they arrive, views of
the one receive array.  So the last relay of a chain holds a version about one
transfer time plus a few pieces' latency after the first began to receive it.  A
connection already being streamed another copy is told of this one without its
bytes (it gets it once it is whole here).

Readers never see part of a copy: the relay's own bin changes only when the copy is
complete (:meth:`~.follower.Follower._install`), and a follower installs a pushed
copy only once its frame is whole.  A copy whose upstream fails mid-way is dropped
here, and every connection it was being streamed to is closed without another byte
(:meth:`~server.protocol.session.ServerSession.cut_off`), so the follower sees its
frame cut short, drops it too and fetches again once reconnected.
"""
from __future__ import annotations

import logging
from typing import Callable

from tensorshare.protocol.messages import NOTIFICATION, Key
from tensorshare.wire.frames import frame_head

from ..protocol.gate import open_stream
from .upstream import INCOMING, ArraySink

log = logging.getLogger("tensorshare.server.relay")

PIECE = 128 << 10  # bytes of a streamed copy sent on together (each piece delays the next hop this much)


class TeeSink(ArraySink):
    """A copy's payload received into one array, reporting how much is in after each
    read; the frame's payload, once whole, is the copy (``owner``)."""

    def __init__(self, nbytes: int, on_bytes: Callable[[int], None], owner):
        super().__init__(nbytes)
        self.on_bytes, self.owner = on_bytes, owner

    def write(self, data) -> None:
        super().write(data)
        try:
            self.on_bytes(self.filled)
        except Exception:  # a bug in passing it on must not break the upstream connection
            log.exception("relay: passing on a copy as it arrives failed")

    def finish(self):
        return self.owner


class Incoming:
    """A copy of bin ``name`` arriving from upstream: the item table its frame header
    carried, the upstream's number for it (``upstream_seq``), the number (``seq``)
    and verb (``op``) its change will have here, whether upstream pushed it
    (``pushed``: an ``INCOMING`` notification) or we fetched it, and the streams
    passing it on."""

    def __init__(self, name: str, blobs: list, sizes: list, tags: list, total: int, upstream_seq: int, seq: int,
                 op: str, pushed: bool):
        self.name = name
        self.blobs, self.sizes, self.tags = blobs, sizes, tags
        self.total = total
        self.upstream_seq = upstream_seq
        self.seq = seq
        self.op = op
        self.pushed = pushed
        self.sink = TeeSink(total, self._progress, self)
        self.streams: list[Stream] = []

    @property
    def received(self) -> int:
        return self.sink.filled

    @property
    def whole(self) -> bool:
        return self.sink.filled == self.total

    def copy(self) -> list[tuple]:
        """The copy's items once it is whole, as ``(description, payload segments,
        payload bytes, tag)`` (their bytes are read-only views of the one array)."""
        view, base, copy = self.sink.view.toreadonly(), 0, []
        for blob, size, tag in zip(self.blobs, self.sizes, self.tags):
            copy.append((blob, (view[base:base + size],) if size else (), size, tag))
            base += size
        return copy

    def header(self) -> dict:
        """The 151 ``INCOMING`` header that announces this copy (its payload follows)."""
        return NOTIFICATION.build(bin=self.name, n=len(self.sizes), seq=self.seq, op=INCOMING,
                                  tag=self.tags[-1] if self.tags else None,
                                  **{Key.ITEMS: self.blobs, Key.SIZES: self.sizes, Key.TAGS: self.tags,
                                     Key.CHANGE: self.op})

    def push_to(self, session) -> None:
        """Send this copy to ``session`` (a relay following this one) as it arrives; if
        another copy is being streamed to it, announce this one without its bytes
        (the follower fetches it)."""
        gate = open_stream(session)
        if gate is not None:
            stream = Stream(self, gate)
            self.streams.append(stream)
            stream.start()
        else:
            header = self.header()
            for key in (Key.ITEMS, Key.SIZES, Key.TAGS, Key.CHANGE):
                del header[key]
            session.notify(self.name, frame_head(header, 0))

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
            stream.gate.session.cut_off(f"relay: the copy of bin {self.name!r} being passed on was lost upstream: "
                                   f"{reason}")


class Stream:
    """One copy pushed to one connection, through its gate: the 151 ``INCOMING``
    header at once (the payload's length is known), then the payload in pieces as
    it arrives."""

    def __init__(self, incoming: Incoming, gate):
        self.incoming, self.gate = incoming, gate
        self.sent = 0

    def start(self) -> None:
        self.gate.piece([frame_head(self.incoming.header(), self.incoming.total)])
        self.more(self.incoming.received)

    def more(self, filled: int) -> None:
        if filled - self.sent >= PIECE or (filled == self.incoming.total and filled > self.sent):
            self.gate.piece([self.incoming.sink.view[self.sent:filled]])
            self.sent = filled

    def finish(self) -> None:
        self.more(self.incoming.total)
        self.gate.close()


__all__ = ["INCOMING", "Incoming", "TeeSink"]
