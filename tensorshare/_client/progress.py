"""Progress reports of one blocking call: bytes of its request sent, of its reply received.

``Client.put(..., progress=fn)`` (and append, get, peek, save) calls
``fn(done, total)`` as a large request leaves, in pieces of :data:`PIECE` bytes,
and as a large reply arrives, after each read of the socket; ``done == total``
comes last.  The callback runs on the calling thread and must be quick (a
progress bar).  Values sent through shared memory report only the small frame
that refers to them.
"""

from __future__ import annotations

from typing import Callable, Iterator

PIECE = 4 << 20  # bytes sent between reports
QUIET_REQUEST = 64 << 10  # a request smaller than this is not reported as it leaves (a GET's, say)


class Progress:
    def __init__(self, callback: Callable[[int, int], None], rid: int):
        self.callback = callback
        self.rid = rid
        self.total_out = self.done_out = 0
        self.last_in = -1

    def sending(self, parts: list) -> list:
        self.total_out = sum(map(len, parts))
        return parts

    def pieces(self, parts: list) -> Iterator[list]:
        """``parts`` regrouped into lists of about :data:`PIECE` bytes (large ones sliced)."""
        piece, size = [], 0
        for part in parts:
            view = memoryview(part).cast("B") if len(part) > PIECE else part
            start = 0
            while start < len(view):
                take = min(len(view) - start, PIECE - size)
                piece.append(view[start:start + take] if (start or take < len(view)) else view)
                size += take
                start += take
                if size >= PIECE:
                    yield piece
                    piece, size = [], 0
        if piece or not parts:
            yield piece

    def sent(self, piece: list) -> None:
        self.done_out += sum(map(len, piece))
        if self.total_out >= QUIET_REQUEST:
            self.callback(self.done_out, self.total_out)

    def received(self, receiving) -> None:
        """After a read: report the reply's payload if it is ours and arriving."""
        if receiving is None:
            return
        header, done, total = receiving
        if header.get("id") == self.rid and done != self.last_in:
            self.last_in = done
            self.callback(done, total)

    def finished(self, outcome) -> None:
        total = getattr(outcome, "payload_len", None)
        if total and self.last_in != total:
            self.last_in = total
            self.callback(total, total)
        elif not total and 0 < self.total_out < QUIET_REQUEST:  # a small put: done at once
            self.callback(self.total_out, self.total_out)
