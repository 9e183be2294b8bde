"""Puts by device reference: the publisher's side of CUDA IPC on one host (PROTOCOL.md §13).

``Client.put(bin, value, by_reference=True)`` of a value in GPU memory, on the
server's host: the value is snapshotted into one block of device memory and shared
(:func:`tensorshare.device.ipc.export`); the PUT carries the reference, not the
bytes, so the server stores the item at once and same-host CUDA readers copy it
device to device.  Then this client's uploader thread sends the snapshot's bytes
(a PUT with ``fill``), for readers elsewhere or without CUDA; an upload still
waiting when a newer value is put by reference to the same bin is dropped (no
reader will ask for the older item's bytes).

:class:`Exports` keeps each snapshot until a reply says the server no longer holds
its reference (``freed``: the item left its bin and every reader released it).
When the connection is lost the server lets go of them all; they are kept a few
seconds more for readers still copying, then dropped.  A server that does not take
references (one with a data directory, or one from before them) gets the value as
any put.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable

from ..errors import TensorShareError, ZeroCopyUnavailableError
from ..protocol.messages import PUT, Key
from ..wire.codec import Encoded, encode
from .connection import NO_VALUE

log = logging.getLogger("tensorshare.client")

RETIRE_S = 10.0  # seconds the snapshots of a lost connection are kept for readers still copying them


def put_by_reference(client, bin: str, value: Any, tag: int | None, timeout, *, wait: bool = True,
                     callback: Callable[[Any, BaseException | None], Any] | None = None) -> Any:
    """``client.put(bin, value, tag=tag)`` by device reference where it can be (see the
    module); the bin's item count.  ``wait=False``: returns at once and
    ``callback(result, error)`` hears of the reply (inline, on the reading thread)."""
    from ..device.ipc import export, shares

    enc = value if type(value) is Encoded else encode(value)
    areas = client._shared_areas()
    if not (enc.nbytes and shares(enc.engine) and areas is not None and areas.device_refs):
        return _put(client, bin, enc, tag, timeout, wait, callback)
    try:
        ref, snapshot = export(enc)
    except RuntimeError as exc:  # torch cannot share this memory (an expandable segment before torch 2.5...)
        log.debug("putting %r by its bytes: its device memory cannot be shared (%s)", bin, exc)
        return _put(client, bin, enc, tag, timeout, wait, callback)
    ident = ref["id"]
    exports = client._exported()
    exports.keep(ident, snapshot)
    fields = {Key.VALUE: enc.description, Key.SIZE: enc.nbytes, Key.CUDA: ref}
    if wait:
        try:
            n = client._call(PUT, {Key.BIN: bin, **({} if tag is None else {Key.TAG: tag}), **fields},
                             timeout=timeout, zero_copy=False)
        except ZeroCopyUnavailableError:  # a server that takes no references: the bytes, as any put
            exports.forget(ident)
            return client.put(bin, snapshot, tag=tag, timeout=timeout)
        except BaseException:
            exports.forget(ident)
            raise
        exports.upload(client, bin, ident, snapshot)
        return n

    def stored(result: Any, error: BaseException | None) -> None:
        if error is None:
            exports.upload(client, bin, ident, snapshot)
        else:
            exports.forget(ident)
            if isinstance(error, ZeroCopyUnavailableError):
                exports.send(client, bin, snapshot, tag, callback)
                return
        callback(result, error)

    client.submit(PUT, bin, NO_VALUE, stored, tag=tag, zero_copy=False, inline=True, fields=fields)
    return None


def _put(client, bin: str, enc: Encoded, tag: int | None, timeout, wait: bool, callback) -> Any:
    if wait:
        return client.put(bin, enc, tag=tag, timeout=timeout)
    client.submit(PUT, bin, enc, callback, tag=tag, inline=True)
    return None


class Exports:
    """A client's snapshots shared by reference, and the thread that uploads their bytes."""

    def __init__(self):
        self._held: dict[int, Encoded] = {}  # reference id -> snapshot, until freed
        self._retired: deque = deque()  # (time, [snapshots]) of lost connections
        self._lock = threading.Lock()
        self._jobs: OrderedDict = OrderedDict()  # bin -> job: the newest upload per bin, oldest bin first
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._busy = False  # an upload is running
        self._closed = False

    def keep(self, ident: int, snapshot: Encoded) -> None:
        with self._lock:
            self._held[ident] = snapshot
            now = time.monotonic()
            while self._retired and now - self._retired[0][0] > RETIRE_S:
                self._retired.popleft()

    def forget(self, ident: int) -> None:
        with self._lock:
            self._held.pop(ident, None)

    def freed(self, idents: list) -> None:
        """The server holds these references no more: their snapshots may go."""
        with self._lock:
            for ident in idents:
                self._held.pop(ident, None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def lost(self) -> None:
        """The connection is gone, and with it the server's references: the snapshots
        go once readers still copying them are surely done."""
        with self._lock:
            if self._held:
                self._retired.append((time.monotonic(), list(self._held.values())))
                self._held.clear()
            self._jobs.clear()  # their items went with the connection

    # -- the uploader

    def upload(self, client, bin: str, ident: int, snapshot: Encoded) -> None:
        """Send the bytes of the item put with reference ``ident`` (in the background)."""
        self._queue(client, bin, ("fill", ident, snapshot))

    def send(self, client, bin: str, snapshot: Encoded, tag: int | None, callback: Callable) -> None:
        """Put ``snapshot`` as any value (in the background, in order with the uploads)."""
        self._queue(client, bin, ("put", snapshot, tag, callback))

    def _queue(self, client, bin: str, job: tuple) -> None:
        with self._cond:
            if self._closed:
                return
            self._jobs.pop(bin, None)  # an older upload to the same bin is no longer wanted
            self._jobs[bin] = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(client,), name="tensorshare-upload",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until no upload waits or runs; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def _run(self, client) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                bin, job = self._jobs.popitem(last=False)
                self._busy = True
            try:
                if job[0] == "fill":
                    _, ident, snapshot = job
                    client._call(PUT, {Key.BIN: bin, Key.VALUE: snapshot.description, Key.FILL: ident}, snapshot)
                else:
                    _, snapshot, tag, callback = job
                    try:
                        result = client.put(bin, snapshot, tag=tag)
                    except TensorShareError as exc:
                        callback(None, exc)
                    else:
                        callback(result, None)
            except TensorShareError as exc:  # readers without CUDA then wait, and may time out (451)
                (log.debug if self._closed else log.warning)(
                    "could not upload the bytes of an item of %r put by device reference: %s", bin, exc)
            except Exception:
                log.exception("uploading the bytes of an item of %r failed", bin)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._held.clear()
            self._retired.clear()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
