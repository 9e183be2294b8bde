"""``TensorShare``: the original tensorshare's callback API, on the blocking client.

Every call returns at once; its optional callback later receives
``{'status': 'OK'}`` (with ``'data'`` for ``get``, ``peek`` and ``list``) or
``{'status': 'ERR', 'msg': text}``, shaped as the original's.  Listen callbacks
receive ``{'status': 'OK', 'bin': name, 'n_items': n, 'seq': s, 'op': verb}``.
``start()`` blocks until ``stop()``.  Unlike the original, requests are pipelined
on one connection, values are sent before a call returns (later changes to them are
not sent), callbacks run on a dispatcher thread (never the thread reading the
socket), and a failed connection raises instead of hanging.  README's
"Compatibility" section lists every difference.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, TypeVar

from .client import NO_VALUE
from .client import Client, Listening, connect
from .errors import NoSuchBinError
from .protocol import messages as protocol

_Self = TypeVar("_Self", bound="StartStop")
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

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TensorShare(StartStop):
    """Callback-style client, as in the original tensorshare README.

    Every call returns at once; its callback later gets a dict (see the module
    docstring).  As in the original, ``get``/``peek`` give the bin's one item
    itself, or a list when it holds several, and an ``'ERR'`` for an empty or
    missing bin; ``list`` shows the bins that hold items; ``delete`` of a missing
    bin succeeds.  ``client_options`` go to :class:`~tensorshare.Client` (``token``,
    ``tls``, ``tls_ca``, ``tls_fingerprint``, ``keepalive``...).
    """

    STATUS_OK = "OK"
    STATUS_ERR = "ERR"

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, timeout: float = 60.0,
                 connect_timeout: float | None = None, **client_options: Any) -> None:
        super().__init__()
        self._client = connect(host, port, timeout=timeout, retry_for=connect_timeout, **client_options)
        self._listening: dict[str, Listening] = {}

    # -- data calls (non-blocking)

    def put(self, bin: str, obj: Any, callback: Callback = None) -> None:
        """Replace what ``bin`` holds with ``obj``; ``{'status': 'OK'}``."""
        self._submit(protocol.PUT, bin, obj, callback, _done)

    def append(self, bin: str, obj: Any, callback: Callback = None) -> None:
        """Add ``obj`` to ``bin`` (into an empty bin: as ``put``); ``{'status': 'OK'}``."""
        self._submit(protocol.APPEND, bin, obj, callback, _done)

    def get(self, bin: str, callback: Callback = None) -> None:
        """Take what ``bin`` holds: ``{'status': 'OK', 'data': obj or [obj, ...]}``."""
        self._submit(protocol.GET, bin, NO_VALUE, callback, _contents)

    def peek(self, bin: str, callback: Callback = None) -> None:
        """Read what ``bin`` holds, leaving it: ``{'status': 'OK', 'data': obj or [obj, ...]}``."""
        self._submit(protocol.PEEK, bin, NO_VALUE, callback, _contents)

    def delete(self, bin: str, callback: Callback = None) -> None:
        """Remove ``bin`` (a missing one too); ``{'status': 'OK'}``."""
        self._submit(protocol.DELETE, bin, NO_VALUE, callback, _done, missing_ok=True)

    def list(self, callback: Callback = None) -> None:
        """``{'status': 'OK', 'data': {bin: n_items}}`` for the bins that hold items."""
        self._submit(protocol.LIST, None, NO_VALUE, callback, _holding)

    # -- notifications

    def listen(self, bin: str, callback: Callable[[dict], Any]) -> None:
        """Call ``callback`` with ``{'status': 'OK', 'bin', 'n_items', 'seq', 'op'}`` on
        every change to ``bin``.  Returns once the server listens: no later change is
        missed."""
        handle = self._listening.pop(bin, None)
        if handle is not None:
            handle.stop()
        self._listening[bin] = self._client.listen(bin, lambda note: callback({"status": self.STATUS_OK,
                                                                               **note.as_dict()}))

    def ignore(self, bin: str, callback: Callback = None) -> None:
        """Stop listening to ``bin``; ``{'status': 'OK'}`` once the server has stopped."""
        handle = self._listening.pop(bin, None)
        reply = _Replier(callback, _done)
        if handle is None:
            self._client.callbacks().submit(reply, None, None)
        else:
            handle.stop(callback=reply)

    def _shut(self) -> None:
        self._client.close()
        _stop_in_process_servers()

    def _submit(self, op, bin: str | None, value: Any, callback: Callback, shape: Callable,
                missing_ok: bool = False) -> None:
        self._client.submit(op, bin, value, callback=_Replier(callback, shape, missing_ok))


class _Replier:
    """A ``(result, error)`` callback that calls ``callback`` with the original's dict.

    An object with slots, not a closure: a call in flight keeps one object alive for
    it instead of a function and three cells, so a long pipeline of appends promotes
    fewer objects into the collector's oldest generation, whose full passes over
    every object of the process (torch's among them) cost a pipelined run a fifth of
    its time."""

    __slots__ = ("callback", "shape", "missing_ok")

    def __init__(self, callback: Callback, shape: Callable, missing_ok: bool = False):
        self.callback, self.shape, self.missing_ok = callback, shape, missing_ok

    def __call__(self, result: Any, error: BaseException | None) -> None:
        callback = self.callback
        if callback is None:
            return
        if error is not None and not (self.missing_ok and isinstance(error, NoSuchBinError)):
            callback({"status": TensorShare.STATUS_ERR, "msg": str(error)})
            return
        try:
            message = self.shape(result)
        except _Refusal as refusal:
            message = {"status": TensorShare.STATUS_ERR, "msg": str(refusal)}
        callback(message)


class _Refusal(Exception):
    """A reply that is an error in the original's terms (an empty bin)."""


def _done(result: Any) -> dict:
    return {"status": TensorShare.STATUS_OK}


def _contents(items: list) -> dict:
    if not items:
        raise _Refusal("the bin is empty")
    return {"status": TensorShare.STATUS_OK, "data": items[0] if len(items) == 1 else items}


def _holding(bins: dict) -> dict:
    return {"status": TensorShare.STATUS_OK, "data": {name: n for name, n in bins.items() if n}}


def _stop_in_process_servers() -> None:
    """End servers this process started with ``run_server(port, start_reactor=False)``,
    as the original's ``stop()`` ended them (with the reactor)."""
    server_app = sys.modules.get("tensorshare_server.app")
    if server_app is not None:
        server_app.stop_in_process_servers()
