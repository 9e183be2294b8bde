"""Puts by device reference: the publisher's side of CUDA IPC on one host (PROTOCOL.md §13).

``Client.put(bin, value, by_reference=True)`` of a value in GPU memory, on the
server's host: the value is snapshotted into one block of device memory
(:func:`tensorshare.device.ipc.snapshot`) and shared (:func:`~tensorshare.device.ipc.share`);
the PUT carries the reference, not the bytes, so the server stores the item at
once and same-host CUDA readers copy it device to device.  Then the snapshot's
bytes follow (a PUT with ``fill``) on a connection of their own, for readers
elsewhere or without CUDA (:mod:`.uploads`).  With ``wait=False`` the caller's
thread only queues the snapshot's copies: a thread of the client waits for them
and sends the PUT.

:class:`Exports` keeps each snapshot until a reply says the server no longer holds
its reference (``freed``: the item left its bin and every reader released it).
When the connection is lost the server lets go of them all; they are kept a few
seconds more for readers still copying, then dropped.  A server that does not take
references (one with a data directory, or one from before them), and memory torch
cannot share, get the value as any put.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from ..errors import TensorShareError, ZeroCopyUnavailableError
from ..protocol.messages import PUT, Key
from ..wire.codec import Encoded, encode
from .uploads import Publisher, Uploader

log = logging.getLogger("tensorshare.client")

RETIRE_S = 10.0  # seconds the snapshots of a lost connection are kept for readers still copying them


def put_by_reference(client, bin: str, value: Any, tag: int | None, timeout, *, wait: bool = True,
                     callback: Callable[[Any, BaseException | None], Any] | None = None) -> Any:
    """``client.put(bin, value, tag=tag)`` by device reference where it can be (see the
    module); the bin's item count.  ``wait=False``: returns once the snapshot's
    copies are queued, and ``callback(result, error)`` hears of the reply (on a
    thread of the client: keep it quick)."""
    from ..device.ipc import shares, snapshot

    enc = value if type(value) is Encoded else encode(value)
    areas = client._shared_areas()
    if not (enc.nbytes and shares(enc.engine) and areas is not None and areas.device_refs):
        return _put(client, bin, enc, tag, timeout, wait, callback)
    exports = client._exported()
    taken = snapshot(enc)  # the copies are queued behind the caller's work; the host does not wait
    if wait:
        exports.published(10.0)  # after the puts made before it without waiting
        return exports.publish(client, bin, taken, tag, timeout)
    exports.publish_later(client, bin, taken, tag, callback)
    return None


def _put(client, bin: str, enc: Encoded, tag: int | None, timeout, wait: bool, callback) -> Any:
    if wait:
        return client.put(bin, enc, tag=tag, timeout=timeout)
    client.submit(PUT, bin, enc, callback, tag=tag, inline=True)
    return None


class Exports:
    """A client's snapshots shared by reference, and the threads that publish them and upload their bytes."""

    def __init__(self):
        self._held: dict[int, Encoded] = {}  # reference id -> snapshot, until freed
        self._retired: deque = deque()  # (time, [snapshots]) of lost connections
        self._lock = threading.Lock()
        self._publisher = Publisher(self._publish_job)
        self._uploader: Uploader | None = None

    # -- publishing

    def publish(self, client, bin: str, taken, tag: int | None, timeout=None) -> Any:
        """Share ``taken`` (a :class:`~tensorshare.device.ipc.Snapshot`, waiting for its
        copies), put it by reference, and queue its bytes; the bin's item count."""
        from ..device.ipc import Unshareable, cannot_share, share

        try:
            ref, snapshot = share(taken)
        except Unshareable as exc:  # torch cannot share this memory (an expandable segment...)
            cannot_share(exc)
            return client.put(bin, taken.enc, tag=tag, timeout=timeout)
        ident = ref["id"]
        self.keep(ident, snapshot)
        fields = {Key.BIN: bin, Key.VALUE: snapshot.description, Key.SIZE: snapshot.nbytes, Key.CUDA: ref}
        if tag is not None:
            fields[Key.TAG] = tag
        try:
            n = client._call(PUT, fields, timeout=timeout, zero_copy=False)
        except ZeroCopyUnavailableError:  # a server that takes no references: the bytes, as any put
            self.forget(ident)
            return client.put(bin, snapshot, tag=tag, timeout=timeout)
        except BaseException:
            self.forget(ident)
            raise
        self._uploads(client).add(bin, ident, snapshot)
        return n

    def publish_later(self, client, bin: str, taken, tag: int | None, callback: Callable | None) -> None:
        """:meth:`publish` on the publisher thread; ``callback(result, error)`` hears of it."""
        self._publisher.add((client, bin, taken, tag, callback))

    def _publish_job(self, job: tuple) -> None:
        client, bin, taken, tag, callback = job
        try:
            result, error = self.publish(client, bin, taken, tag), None
        except TensorShareError as exc:
            result, error = None, exc
        if callback is not None:
            callback(result, error)

    def published(self, timeout: float | None = None) -> bool:
        """Wait until the puts made with ``wait=False`` are answered; False on timeout."""
        return self._publisher.idle(timeout)

    def _uploads(self, client) -> Uploader:
        with self._lock:
            if self._uploader is None:
                self._uploader = Uploader(client)
            return self._uploader

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until every put is answered and every upload sent; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._publisher.idle(timeout):
            return False
        uploader = self._uploader
        return uploader is None or uploader.idle(None if deadline is None else max(deadline - time.monotonic(), 0))

    # -- the snapshots held

    def keep(self, ident: int, snapshot: Encoded) -> None:
        with self._lock:
            self._held[ident] = snapshot
            self._prune()

    def _prune(self) -> None:
        """Drop the retired snapshots whose time is up (the lock held)."""
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
                # dropped then even if nothing is put by reference again (a device's memory)
                timer = threading.Timer(RETIRE_S + 0.5, self._pruned)
                timer.daemon = True
                timer.start()
            uploader = self._uploader
        if uploader is not None:
            uploader.clear()  # their items went with the connection

    def _pruned(self) -> None:
        with self._lock:
            self._prune()

    def retired(self) -> int:
        """Batches of snapshots kept for readers of a lost connection."""
        with self._lock:
            return len(self._retired)

    def close(self) -> None:
        self._publisher.close()
        if self._uploader is not None:
            self._uploader.close()
        with self._lock:
            self._held.clear()
            self._retired.clear()
