"""A loopback TCP forwarder whose server-to-client direction can be held at a byte count.

Put between a relay and its upstream, it lets a test stop a copy mid-way at a known
point (the upstream has sent it all; the relay has received only part of it) and let
it go again, so what happens meanwhile is ordered by events, not timing.
"""

from __future__ import annotations

import socket
import threading


class GateProxy:
    """Listens on ``port``; each connection is forwarded to ``127.0.0.1:target``.

    ``hold_after(n)``: from now on, forward at most ``n`` more bytes from the target
    to the clients, then hold the rest until :meth:`release`.  ``held`` tells
    whether bytes are waiting at the gate."""

    def __init__(self, target: int):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._allowance: int | None = None  # None: no limit
        self.held = False
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_after(self, nbytes: int) -> None:
        with self._cond:
            self._allowance = nbytes

    def release(self) -> None:
        with self._cond:
            self._allowance = None
            self.held = False
            self._cond.notify_all()

    def close(self) -> None:
        self._closed = True
        self.release()
        for sock in [self._listener, *self._sockets]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the target is down (restarting): this client is refused, the next may pass
                client.close()
                continue
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, gated: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                while data:
                    chunk = self._admit(data) if gated else data
                    sink.sendall(chunk)
                    data = data[len(chunk):]
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _admit(self, data: bytes) -> bytes:
        """The part of ``data`` the gate lets through now (waits while it lets none)."""
        with self._cond:
            while self._allowance == 0 and not self._closed:
                self.held = True
                self._cond.wait()
            if self._allowance is None:
                return data
            chunk = data[:self._allowance]
            self._allowance -= len(chunk)
            return chunk
