"""The verbs both clients offer, written once.

Each method states what it sends and what it returns, in terms of
``self._call(command, fields, ...)``: :class:`tensorshare.Client` answers a call
with its result (blocking), :class:`tensorshare.AsyncClient` with a Deferred of
it.  ``then`` turns the checked :class:`~.connection.Reply` into the result;
``on_error(error)`` may handle an error (returning True) instead of letting it
through; ``member`` sends it on that connection instead of where its route says,
and ``listening`` is the listen handle the call starts or ends (the engine makes
it active, or silent, as the reply arrives, before any later frame).  Both fronts
hold a :class:`~tensorshare.protocol.router.Router` (``self.router``) whose
members have an ``engine``.
"""

from __future__ import annotations

import fnmatch
import os
import time
from typing import Any, Callable

from ..errors import TensorShareError, UsageError
from ..protocol.messages import (
    APPEND, COMMANDS, DELETE, GET, LIST, LISTEN, MAX_WAIT, NOOP, PEEK, PUT, UNLISTEN, Command, Key,
)
from .options import DEFAULT, Timeout
from ..protocol.items import item_table
from .connection import NO_VALUE, ListenSnapshot, Notification
from .listens import Listening
from .tables import TableMethods
from .verb import verb


def _items_and_seq(reply) -> tuple:
    """A GET/PEEK's result with ``with_seq=True``: ``(items, seq)``."""
    return reply.values, reply.header[Key.SEQ]


def bin_fields(name: str, tag: int | None = None) -> dict:
    """The header fields of a request about bin ``name`` (with an item's ``tag``)."""
    return {Key.BIN: name} if tag is None else {Key.BIN: name, Key.TAG: tag}


class ClientMethods(TableMethods):
    """The public verbs of a tensorshare client (see the module docstring); the table
    verbs are :class:`~.tables.TableMethods`'."""

    router: Any  # protocol.router.Router: the members (connections) calls go on
    values: Any  # values.Values: the value layer
    timeout: float | None
    _closed: bool

    def _call(self, command, fields: dict | None = None, value: Any = NO_VALUE, *, timeout=DEFAULT,
              then: Callable | None = None, on_error: Callable | None = None, decode: bool = True,
              zero_copy: bool | None = True, member: Any = None, listening: Listening | None = None) -> Any:
        raise NotImplementedError

    def _submit(self, command: Command, fields: dict | None, value: Any, callback: Callable, *,
                zero_copy: bool | None = True, timeout=DEFAULT, then: Callable | None = None,
                on_error: Callable | None = None, decode: bool = True, raw: bool = False, inline: bool = False,
                member: Any = None, listening: Listening | None = None) -> None:
        """Send a call whose ``callback(result, error)`` runs once it is settled."""
        raise NotImplementedError

    def _done(self, value: Any) -> Any:
        """``value`` as a call's result (a Deferred of it for the AsyncClient)."""
        raise NotImplementedError

    def _shared_areas(self):
        """The current connection's verified shared areas (None without zero-copy)."""
        raise NotImplementedError

    def submit(self, op: "str | Command", bin: str | None = None, value: Any = NO_VALUE,
               callback: Callable[[Any, BaseException | None], Any] | None = None, *, tag: int | None = None,
               zero_copy: bool = True, inline: bool = False, fields: dict | None = None,
               by_reference: bool = False) -> None:
        """Send a request without waiting; ``callback(result, error)`` runs when the
        reply arrives (the blocking client: on its dispatcher thread).  ``op`` is a
        verb (``"PUT"``...) or its :class:`~tensorshare.protocol.messages.Command`;
        the result is what the matching method returns.  The value has been copied
        out when this returns, so later changes to it are not sent.
        ``zero_copy=False``: over TCP only.  ``inline=True`` (the blocking client)
        runs the callback on the thread that reads the socket, with no hand-off to
        the dispatcher: for a quick callback that never calls the client.
        ``fields``: more header fields of the verb (``{"below": 64, "wait": 10.0}``).
        ``by_reference=True`` (the blocking client's PUT): as :meth:`put`'s; the
        caller's thread only queues the value's copy on its device, and the callback
        runs on a thread of the client (keep it quick).  :meth:`flush` waits for
        such puts."""
        command = op if isinstance(op, Command) else COMMANDS[op]
        if by_reference and not (fields or {}).get(Key.EPHEMERAL):  # (ephemeral: as put's, over TCP)
            if not self._blocking or command is not PUT:
                raise UsageError("by_reference is for the blocking Client's PUT")
            from .exports import put_by_reference

            put_by_reference(self, bin, value, tag, DEFAULT, wait=False, callback=callback)
            return
        extra = fields
        fields = None if bin is None else bin_fields(bin, tag)
        if extra:
            fields = {**(fields or {}), **extra}
        if inline:
            self._submit(command, fields, value, callback or _ignore, zero_copy=zero_copy, inline=True)
        else:
            self._submit(command, fields, value, callback or _ignore, zero_copy=zero_copy)

    # -- storing

    _blocking = False  # the blocking Client's calls return their results (put by_reference needs that)

    @verb
    def put(self, bin: str, value: Any, *, tag: int | None = None, ephemeral: bool = False,
            timeout: Timeout = DEFAULT, progress: Callable[[int, int], Any] | None = None,
            by_reference: bool = False) -> int:
        """Replace the items of ``bin`` with ``value``; returns the bin's item count (1).

        ``tag``, an optional 64-bit integer stored with the item, reaches listeners
        in the notification (a version number, say), so they need not download it.
        The value has been sent (or copied into the server's shared memory) when
        this returns: changing it afterwards is safe.  ``progress(done, total)``
        hears of the bytes sent (blocking ``Client`` only; ``_client/progress.py``).

        ``ephemeral=True``: the bin lasts only as long as this connection (the
        server deletes it, and tells its listeners, when the connection ends: a
        presence marker).  It is kept in memory, never in the data directory; a
        client that reconnects must put it again.

        ``by_reference=True`` (blocking ``Client``), for a value in GPU memory on the
        server's host: the value is copied once on the GPU and the server keeps a
        reference to that copy (CUDA IPC) instead of its bytes.  Readers on this
        host that read onto a CUDA device copy it device to device; the client
        sends the bytes in the background for everyone else.  The copy is freed
        once the server says no reader holds it.  Elsewhere, as any put.  With
        ``ephemeral``, as an ephemeral put (an ephemeral value comes over TCP; a
        reference would outlive the connection that ends the bin).
        """
        if by_reference and not ephemeral:
            if not self._blocking:
                raise UsageError("by_reference is for the blocking Client")
            from .exports import put_by_reference

            return put_by_reference(self, bin, value, tag, timeout)
        if ephemeral:
            fields = bin_fields(bin, tag)
            fields[Key.EPHEMERAL] = True
            return self._call(PUT, fields, value, timeout=timeout, zero_copy=False, **_progress(progress))
        return self._call(PUT, bin_fields(bin, tag), value, timeout=timeout, **_progress(progress))

    @verb
    def append(self, bin: str, value: Any, *, tag: int | None = None, below: int | None = None,
               timeout: Timeout = DEFAULT, progress: Callable[[int, int], Any] | None = None) -> int:
        """Add ``value`` as one more item of ``bin``; returns the bin's new item count.
        ``progress``: as for :meth:`put`.

        With ``below``, the item is stored only once the bin holds fewer than
        ``below`` items: the server holds the request until a reader takes some
        (other clients are served meanwhile), up to ``timeout`` seconds (the
        client's, by default), then refuses it with :class:`~tensorshare.errors.BusyError`
        (a ``TimeoutError``), storing nothing.  Backpressure for producers that
        must not outrun their consumer.
        """
        fields = bin_fields(bin, tag)
        if below is not None:
            fields[Key.BELOW] = below
            timeout = self._server_wait(fields, timeout)
        return self._call(APPEND, fields, value, timeout=timeout, **_progress(progress))

    # -- reading

    @verb
    def get(self, bin: str, timeout: Timeout = DEFAULT, *, max_items: int | None = None, with_seq: bool = False,
            wait: float | None = None, least: int | None = None,
            progress: Callable[[int, int], Any] | None = None, device: Any = None) -> Any:
        """Take all items out of ``bin`` (it stays, empty); returns them in order.

        ``max_items``: take only the first that many (the rest stay).  With
        ``with_seq=True`` returns ``(items, seq)``: seq is this take's sequence
        number, so a listener can tell the notifications of later changes (higher
        seq) from those of earlier ones.  ``progress(done, total)`` hears of the
        reply's bytes as they arrive (blocking ``Client`` only).

        ``wait``: while the bin holds fewer than ``least`` items (default 1; a bin
        that does not exist holds none), the server holds the request up to that
        many seconds and answers as soon as they are there: a consumer's blocking
        take, with no notification or polling in between.  When ``wait`` runs out
        the take goes ahead with what there is (perhaps nothing; a bin that still
        does not exist raises :class:`~tensorshare.errors.NoSuchBinError`).

        ``device`` (``"cuda"``...): the items' tensors arrive there, instead of on the
        client's ``device`` (a large reply is copied to the device as it arrives,
        through pinned buffers: docs/design.md, "GPU data path").
        """
        fields = bin_fields(bin)
        if max_items is not None:
            fields[Key.MAX] = max_items
        if least is not None:
            fields[Key.LEAST] = least
        if wait is not None:
            timeout = self._hold_for(fields, wait, timeout)
        then = _items_and_seq if with_seq else None
        if device is None:
            return self._call(GET, fields, timeout=timeout, then=then, **_progress(progress))
        return self._call(GET, fields, timeout=timeout, then=then, device=device, **_progress(progress))

    @verb
    def peek(self, bin: str, timeout: Timeout = DEFAULT, *, with_seq: bool = False, since: int | None = None,
             wait: float | None = None, progress: Callable[[int, int], Any] | None = None, device: Any = None,
             into: Any = None) -> Any:
        """Return all items of ``bin`` without removing them (``progress``,
        ``with_seq``: as for :meth:`get`).

        ``since``: a conditional read.  While the bin is still at sequence number
        ``since`` (from an earlier ``with_seq`` reply or a notification) nothing new
        is sent: the result is ``[]``.  With ``wait`` too, a long poll for the
        bin's next change: the server holds the request up to ``wait`` seconds and
        answers as soon as the bin changes, so a reader gets the next version in
        the reply itself (and ``[]`` if nothing changed within ``wait``).

        ``device``: as for :meth:`get`.  ``into``: tensors to receive the items'
        arrays in place, a value shaped like the items (``{"w": model.weight}``
        receives an item ``{"w": tensor}`` into ``model.weight``); an array goes
        into the tensor at its place if that one has its dtype and shape, is
        contiguous and is on the device the items go to, and the result holds
        that tensor itself.  If the read fails midway, such a tensor may hold part
        of the new bytes.
        """
        fields = bin_fields(bin)
        if since is not None:
            fields[Key.SINCE] = since
        if wait is not None:
            timeout = self._hold_for(fields, wait, timeout)
        then = _items_and_seq if with_seq else None
        if device is None and into is None:
            return self._call(PEEK, fields, timeout=timeout, then=then, **_progress(progress))
        return self._call(PEEK, fields, timeout=timeout, then=then, device=device, into=into, **_progress(progress))

    @verb
    def save(self, bin: str, path: str | os.PathLike[str], *, overwrite: bool = False, timeout: Timeout = DEFAULT,
             progress: Callable[[int, int], Any] | None = None) -> int:
        """Write the items of ``bin`` (which keeps them) to the local directory ``path``.

        The bytes the server sent go straight to memory-mappable files, one
        numbered subdirectory per item (tensordict's layout); nothing is decoded or
        pickled.  On the server's host, items the server keeps in files it shares
        (shared memory, spill files) are copied file to file by the kernel instead
        of travelling over TCP.  ``tensorshare.load_memmap(path)`` maps them back.
        Returns the number of items saved.  ``progress(done, total)`` hears of the
        bytes as they arrive (blocking ``Client`` only).
        """
        def write(reply) -> int:
            from ..memmap import save_items

            frame = reply.frame
            payload = memoryview(frame.payload) if frame.payload_len else memoryview(b"")
            stored = reply.stored
            items, base = [], 0
            for i, (blob, size, ref) in enumerate(item_table(reply.header, frame.payload_len)):
                if ref is not None:  # checked files in a shared area (core._read): the kernel copies them
                    items.append((blob, stored[i], size))
                    continue
                items.append((blob, payload[base : base + size], size))
                base += size
            save_items(path, items, overwrite=overwrite)
            return len(items)

        return self._call(PEEK, bin_fields(bin), timeout=timeout, then=write, decode=False, **_progress(progress))

    def shared(self, value: Any) -> Any:
        """A copy of ``value`` whose tensors and arrays live in the server's shared memory.

        Compute into them as into any tensor; a ``put``/``append`` of a value holding
        one of them (whole, as returned here) then hands its pages to the server
        instead of copying them.  From then on the tensor is copy-on-write: later
        changes copy the pages they touch and are not seen by the server, and the next
        put copies it as any tensor.  A tensor on the ``meta`` device gives a
        zero-filled tensor of its shape and dtype, with nothing copied.  Without
        same-host zero-copy this returns ``value`` (meta tensors as zeros).
        """
        from .zerocopy import shared_copy

        areas = self._shared_areas()
        if areas is None or areas.incoming is None:
            return shared_copy(value, None)
        return areas.shared(value)

    @verb
    def list(self, pattern: str | None = None, timeout: Timeout = DEFAULT) -> dict[str, int]:
        """``{bin: n_items}`` for every bin on the server (tables included: a table's
        count is its rows), or for those whose name matches ``pattern``, a shell-style
        glob (``"replay*"``; ``fnmatch``'s rules, case-sensitive)."""
        if pattern is None:
            return self._call(LIST, timeout=timeout)
        if not isinstance(pattern, str):
            raise UsageError(f"pattern must be a str (a glob such as 'replay*'), not {pattern!r}")
        return self._call(LIST, timeout=timeout, then=lambda reply: matching(reply.result, pattern))

    @verb
    def relay_status(self, timeout: Timeout = DEFAULT) -> dict[str, Any] | None:
        """A relay's state (PROTOCOL.md §11): ``{"upstream", "connected", "bins"
        (mirrored), "behind" (of which with changes not yet mirrored), "lag" (seconds
        the oldest of them waits)}``; None from a server that relays nothing."""
        return self._call(LIST, timeout=timeout, then=lambda reply: reply.header.get(Key.RELAY))

    @verb
    def delete(self, bin: str, timeout: Timeout = DEFAULT) -> None:
        """Remove ``bin`` and its items."""
        return self._call(DELETE, bin_fields(bin), timeout=timeout)

    @verb
    def flush(self, timeout: Timeout = DEFAULT) -> None:
        """Wait until every request this client sent before, with or without waiting
        (``submit``, ``submit(..., by_reference=True)``), is answered: replies come in
        request order on each connection.  (Their callbacks may still be running.)
        Raises the error of a request sent without waiting (``update_priorities(...,
        wait=False)``) that failed."""
        if self._unawaited:
            self._settle_unawaited(timeout)
        exports = self.values.exports
        if exports is not None:  # puts by reference still to publish (the blocking client's)
            from ..errors import TimeoutError

            if not exports.published(self.timeout if timeout is DEFAULT else timeout):
                raise TimeoutError("puts by reference still not sent in time")
        return self._call(NOOP, timeout=timeout, then=_nothing)

    @verb
    def ping(self, timeout: Timeout = DEFAULT) -> float:
        """Round-trip a NOOP; returns the seconds it took."""
        start = time.perf_counter()
        return self._call(NOOP, timeout=timeout, then=lambda reply: time.perf_counter() - start)

    # -- listening

    @verb
    def listen(self, bin: str, callback: Callable[[Notification], Any], timeout: Timeout = DEFAULT, *,
               every_append: bool = True) -> Listening:
        """Call ``callback(notification)`` on every change to ``bin``, from now on;
        returns a :class:`Listening` handle once the server listens.

        ``every_append=False`` skips the APPENDs to a bin that already holds items
        (a reader that takes every item at once only needs to know that the bin is
        no longer empty: one notification per batch instead of one per item).

        No change after the call returns is missed.  ``handle.snapshot`` is the
        bin's state at that moment; ``handle.stop()`` stops listening.  The
        blocking client runs callbacks in order on its dispatcher thread, never on
        a thread that reads the socket; the AsyncClient on the reactor thread.  A
        client that falls far behind (PROTOCOL.md §8.7) gets only the latest
        change per bin: ``seq`` always grows but may skip.  After a reconnection
        the client listens again and calls back with a ``LISTEN`` notification of
        the bin's state then.
        """
        # The listen is its bin's owner's connection's: the engine makes the handle
        # active as the reply arrives, before any later frame (a notification right
        # behind the reply finds it), and listens again on every new connection.
        handle = Listening(self, bin, callback, every_append)
        member = self.router.owner(bin)

        def started(reply) -> Listening:
            handle.snapshot = ListenSnapshot.of(reply.header)
            return self._listening(member, handle)

        def give_up(error: BaseException) -> bool:
            from ..errors import TimeoutError

            if isinstance(error, TimeoutError) and handle not in member.engine.listens.handles(bin):
                self._forget_listen(member, bin)  # the server may listen by now: ask it to stop
            return False

        return self._call(LISTEN, member.engine.listen_fields(handle), timeout=timeout, then=started,
                          on_error=give_up, member=member, listening=handle)

    @verb
    def unlisten(self, bin: str, callback: Callable[[Notification], Any] | None = None) -> None:
        """Stop the listens of ``bin`` (only those calling ``callback``, if given)."""
        member = self.router.owner(bin)
        results = [self._unlisten(handle) for handle in member.engine.listens.handles(bin)
                   if callback is None or handle.callback == callback]
        return results[-1] if results else self._done(None)

    def _unlisten(self, handle: Listening, callback: Callable | None = None) -> Any:
        """Stop ``handle``; with ``callback``, without waiting: ``callback(None, error)``
        once done.  It hears every notification the server sends before it answers
        the request that ends this listen: UNLISTEN if this was the bin's last
        handle, else a NOOP (changes made before the server read it are all told)."""
        member = self.router.owner(handle.bin)
        stop = None if self._closed else member.stop_listening(handle)
        if stop is None:
            member.forget_listen(handle)
            if callback is None:
                return self._done(None)
            self._later(callback, None, None)
            return None
        command, fields = stop

        def failed(error: BaseException) -> bool:
            member.forget_listen(handle)
            return _lost_connection(error)

        if callback is None:
            return self._call(command, fields, on_error=failed, member=member, listening=handle)
        self._submit(command, fields, NO_VALUE, lambda reply, error: callback(None, error), on_error=failed,
                     member=member, listening=handle)
        return None

    def _listening(self, member: Any, handle: Listening) -> Listening:
        """A listen has started on ``member`` (the blocking client makes sure a thread reads)."""
        return handle

    def _forget_listen(self, member: Any, name: str) -> None:
        """Ask the server, without waiting, to stop notifying ``member`` of bin ``name``."""
        try:
            self._submit(UNLISTEN, bin_fields(name), NO_VALUE, _ignore, member=member)
        except TensorShareError:
            pass

    def _server_wait(self, fields: dict, timeout) -> float | None:
        """Ask the server to hold the request up to ``timeout`` (``fields`` get
        ``wait``); returns the call's own timeout, a little longer, so that the
        server's answer comes first.  (Also APPEND ``below``'s.)"""
        if timeout is DEFAULT:
            timeout = self.timeout
        wait = MAX_WAIT if timeout is None else timeout
        return self._hold_for(fields, wait, wait)

    def _hold_for(self, fields: dict, wait: float, timeout) -> float | None:
        """Ask the server to hold a request up to ``wait`` seconds (``fields`` get
        ``wait``); returns the call's timeout (``timeout``, the client's by default),
        made long enough for the server's answer to come first."""
        wait = min(max(float(wait), 0.0), MAX_WAIT)
        fields[Key.WAIT] = wait
        if timeout is DEFAULT:
            timeout = self.timeout
        held = wait + max(1.0, wait / 10)
        return None if timeout is None else max(float(timeout), held)

    def _later(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` where the client runs callbacks, after this call returns."""
        raise NotImplementedError


def matching(bins: dict[str, int], pattern: str) -> dict[str, int]:
    """The entries of a LIST result whose name matches the glob ``pattern``."""
    return {name: count for name, count in bins.items() if fnmatch.fnmatchcase(name, pattern)}


def _ignore(result: Any, error: Any) -> None:
    pass


def _nothing(reply: Any) -> None:
    return None


def _progress(progress: Callable | None) -> dict:
    """The keyword that passes a progress callback on (none when there is none, so
    that a client without progress reports keeps its signature)."""
    if progress is None:
        return {}
    if not callable(progress):
        raise UsageError("progress must be a callable taking (done, total)")
    return {"progress": progress}


def _lost_connection(error: BaseException | None) -> bool:
    """A lost connection ends an UNLISTEN's work anyway: the next one will not listen."""
    from ..errors import ConnectionLostError

    return isinstance(error, ConnectionLostError)
