"""``TensorShare``: the original tensorshare's callback API, on the blocking client.

Every call returns at once; its optional callback later receives
``{'status': 'OK', 'data': result}`` or ``{'status': 'ERR', 'msg': text}``.  Listen
callbacks receive ``{'bin': name, 'n_items': n, 'seq': s, 'op': verb}``.
``start()`` blocks until ``stop()``.  Unlike the original, requests are pipelined
on one connection, values are sent before a call returns (later changes to them are
not sent), callbacks run on a dispatcher thread (never the thread reading the
socket), and a failed connection raises instead of hanging.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .protocol import messages as protocol
from .client import Client, Listening, connect
from ._client.connection import NO_VALUE

Callback = Callable[[dict], Any] | None


class StartStop:
    """The original API's lifetime: ``start()`` blocks until ``stop()``; also a
    context manager.  Subclasses release their resources in :meth:`_shut`."""

    _client: Client

    def __init__(self):
        self._stopped = threading.Event()
        self._stopper: threading.Thread | None = None

    @property
    def client(self) -> Client:
        """The underlying blocking :class:`Client` (for blocking calls)."""
        return self._client

    def start(self) -> None:
        """Block until :meth:`stop` is called (from any thread) or Ctrl-C."""
        try:
            while not self._stopped.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.stop()
        # stop() usually comes from another thread (a callback, the user's worker
        # thread), which is still finishing.  Wait for it: a thread that ends while
        # the interpreter shuts down can abort the process (torch's thread-local
        # destructors then need the GIL: "terminate called without an active exception").
        self._client.join()
        stopper = self._stopper
        if stopper is not None and stopper is not threading.current_thread():
            stopper.join(10.0)

    def stop(self) -> None:
        """Release everything, then let :meth:`start` return."""
        self._stopper = threading.current_thread()
        self._shut()
        self._stopped.set()  # last: start() returns only once everything is closed

    def close(self) -> None:
        self.stop()

    def _shut(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class TensorShare(StartStop):
    """Callback-style client, as in the original tensorshare README.

    ``client_options`` go to :class:`~tensorshare.Client` (``token``, ``tls``,
    ``tls_ca``, ``tls_fingerprint``, ``keepalive``...).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, timeout: float = 60.0,
                 connect_timeout: float = 30.0, **client_options):
        super().__init__()
        self._client = connect(host, port, timeout=timeout, retry_for=connect_timeout, **client_options)
        self._listening: dict[str, Listening] = {}

    # -- data calls (non-blocking)

    def put(self, bin: str, value: Any, callback: Callback = None) -> None:
        self._submit(protocol.PUT, bin, value, callback)

    def append(self, bin: str, value: Any, callback: Callback = None) -> None:
        self._submit(protocol.APPEND, bin, value, callback)

    def get(self, bin: str, callback: Callback = None) -> None:
        self._submit(protocol.GET, bin, NO_VALUE, callback)

    def peek(self, bin: str, callback: Callback = None) -> None:
        self._submit(protocol.PEEK, bin, NO_VALUE, callback)

    def delete(self, bin: str, callback: Callback = None) -> None:
        self._submit(protocol.DELETE, bin, NO_VALUE, callback)

    def list(self, callback: Callback = None) -> None:
        self._submit(protocol.LIST, None, NO_VALUE, callback)

    # -- notifications

    def listen(self, bin: str, callback: Callable[[dict], Any]) -> None:
        """Call ``callback`` with ``{'bin', 'n_items', 'seq', 'op'}`` on every change
        to ``bin``.  Returns once the server listens: no later change is missed."""
        self.ignore(bin)
        self._listening[bin] = self._client.listen(bin, lambda note: callback(note.as_dict()))

    def ignore(self, bin: str) -> None:
        """Stop listening to ``bin``."""
        handle = self._listening.pop(bin, None)
        if handle is not None:
            handle.stop()

    def _shut(self) -> None:
        self._client.close()

    def _submit(self, op: str, bin: str | None, value: Any, callback: Callback) -> None:
        def reply(result: Any, error: BaseException | None) -> None:
            if callback is None:
                return
            if error is None:
                callback({"status": "OK", "data": result})
            else:
                callback({"status": "ERR", "msg": str(error)})

        self._client.submit(op, bin, value, callback=reply)

