"""The writers that wait for the end of one connection's read (see :class:`WriteBatch`)."""

from __future__ import annotations


class WriteBatch:
    """The writers that got frames while one connection's read is handled.

    Handling a read touches other connections too: a pipelined run of APPENDs from
    one client makes a notification for each listener per APPEND.  Each such writer
    joins the batch (holding its frames) and all write at its end, so a listener
    gets one ``send()`` for the run, not one per change.  The writer of the
    connection being read opens it (:meth:`FrameWriter.begin_read`) and ends it.
    One batch per server, used on the reactor thread only."""

    def __init__(self):
        self.open = False
        self.joined: list = []  # (read by FrameWriter.end_read: most reads have none to release)

    def join(self, writer) -> None:
        writer.hold()
        self.joined.append(writer)

    def end(self) -> None:
        """Let every writer that joined write what it holds."""
        self.open = False
        if self.joined:
            joined, self.joined = self.joined, []
            for writer in joined:
                writer.release()
