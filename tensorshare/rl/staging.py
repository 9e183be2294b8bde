"""A trainer's versions in device memory: snapshotted on the device at publish, sent from there in the background.

``publish_parameters(wait=False)`` must not hold the learner while a state in GPU
memory travels (a 1 GiB state takes a quarter of a second over loopback TCP).  So
a publish of device tensors is encoded on the learner's thread (the device engine
marks the learner's stream there: what it queued before the call is what is sent),
the tensors that training will change are copied, device to device, into one new
block (:meth:`~tensorshare.device.engine.Engine.snapshot`: under a millisecond per
GiB), and the requests go to one sender thread, which sends them in order through
the engine's pinned buckets.  At most :data:`QUEUED` publishes wait for it; a
learner that publishes faster than the link carries waits there (each waiting
publish holds a snapshot).  Host values are sent as always, on the caller's thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

from ..wire.codec import Encoded

QUEUED = 2  # publishes waiting for the sender thread, at most


def snapshot(enc: Encoded) -> Encoded:
    """``enc`` with its payload copied into one new block of device memory (device
    arrays device to device, host bytes up): later changes to the tensors do not
    reach it.  The copy is queued on the engine's stream; sending waits for it."""
    from ..device.engine import DeviceSpan

    engine = enc.engine
    index = next(b.index for b in enc.buffers if type(b) is DeviceSpan)
    flat, event = engine.snapshot(enc.buffers, index)
    span = DeviceSpan(flat, engine, index)
    span.mark = event
    return Encoded(enc.description, [span], enc.nbytes, enc.arrays, engine)


class Sender:
    """One thread sending a client's requests in order (see the module docstring)."""

    def __init__(self, client):
        self.client = client
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def send(self, op, bin: str, enc: Encoded, tag: int | None,
             callback: Callable[[Any, BaseException | None], Any]) -> None:
        """Queue ``op`` (PUT, APPEND) of ``enc`` to ``bin``; ``callback(result, error)``
        hears of its reply (inline, on the reading thread, as ``submit(inline=True)``)."""
        with self._cond:
            while len(self._queue) >= QUEUED and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the trainer is stopping")
            self._queue.append((op, bin, enc, tag, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorshare-versions", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued request has been handed to the client; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                op, bin, enc, tag, callback = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()
            try:
                self.client.submit(op, bin, enc, callback, tag=tag, inline=True)
            except BaseException as exc:  # the connection is gone, say: the next publish raises it
                try:
                    callback(None, exc)
                except Exception:
                    pass
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
