"""A relay's mirror of its upstream server's bins, kept on the reactor thread.

:class:`Follower` talks to its upstream through :class:`~.upstream.Upstream` (the
clients' engine and router, driven torch-free on the relay's own reactor, so
nothing leaves the reactor thread; one connection per worker of a multi-worker
upstream).  A followed bin is mirrored from the first time a client of the relay reads or
listens to it: the follower listens to it upstream, and on every notification
fetches the bin whole with one PEEK (raw descriptions and payload, never decoded,
with every item's tag) and replaces the local copy in one store change.  So a
mirrored bin always holds exactly what the upstream bin held at one moment: never
a torn item, never a mix of two versions.  Notifications that come while a fetch
is in flight are coalesced into one more fetch: each change is fetched at most
once, and a reader far behind skips to the latest state.

Relays may follow this one (cut-through, :mod:`.stream`): a fetch asks upstream
for later copies to be pushed as they arrive (PEEK ``incoming``), a pushed copy is
installed once its frame is whole, and every copy this relay receives, fetched or
pushed, is pushed on to the relays following it while it arrives.  A copy is
installed only if it is newer than the one held (the upstream's ``seq``), so a
fetch answered after a push never takes the mirror back.

Mirrors are bounded (``max_mirrors``, the relay's ``--max-listens``: its one
upstream connection listens to each, and the upstream allows a connection as many).
A mirror nobody needs is dropped: one whose bin the upstream lacks, once no client
of the relay listens to it or waits on it (a name read once costs nothing
after), and, when a new bin must be mirrored past the bound, the least recently read
mirror no client listens to.  Only a relay whose every mirror is listened to
refuses a new one (552).

Sequence numbers on the relay are its own (its store's counter), so they only
grow on the relay even when the upstream restarts without its data and numbers
again from 1; the follower remembers, per bin, the upstream ``seq`` its copy
reflects, for writes forwarded upstream that must see their change mirrored
before they are acknowledged (:meth:`Follower.after`).

When the upstream connection drops, it reconnects with jittered backoff and
listens again; each bin is then fetched again and everything the follower knew
of the upstream's numbering is forgotten (an upstream restarted without its data
directory numbers its changes from 1 again, and may hold other items under the
same numbers).  Meanwhile the
relay keeps serving the last whole copies and says in :meth:`status` (LIST's
``relay`` field) that it is disconnected and how far behind it is.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import secrets
import weakref
from typing import Callable

from twisted.internet import defer

from tensorshare.errors import (
    AuthenticationError, ConnectionLostError, NoSuchBinError, ProtocolError, RemoteError, ServerLocalError,
    ServerUnavailableError, TensorShareError, TooLargeError,
)
from tensorshare.protocol.items import item_table, item_tags
from tensorshare.protocol.messages import DELETE, NOTIFY, PEEK, Key

from .stream import Incoming
from .upstream import INCOMING, Upstream


log = logging.getLogger("tensorshare.server.relay")

_RETRY_FIRST, _RETRY_MAX = 0.02, 1.0  # seconds before a failed fetch is tried again: doubling from, up to


class _Mirror:
    """What the follower knows of one followed bin."""

    __slots__ = ("name", "synced", "fetching", "again", "noted", "applied", "noted_at", "op", "waiters", "incoming",
                 "watchers", "have", "used_at", "dropped", "retry")

    def __init__(self, name: str):
        self.name = name
        self.synced = False  # the local copy reflects the upstream bin at some moment
        self.fetching = False  # a PEEK is in flight
        self.retry = _RETRY_FIRST  # seconds before a failed fetch is tried again (doubling)
        self.again = False  # a notification came while fetching: fetch once more
        self.noted = -1  # the highest upstream seq notified
        self.applied = -1  # the upstream seq the local copy reflects
        self.have = -1  # the upstream's seq of the copy installed (a copy not newer is not installed)
        self.noted_at: float | None = None  # when the oldest change not yet mirrored was notified
        self.op = "PUT"  # the upstream verb of the last change notified
        self.waiters: list[tuple[int, Callable]] = []  # (upstream seq, callback(error)) until applied reaches it
        self.incoming: Incoming | None = None  # the copy arriving now, passed on as it arrives
        self.watchers = weakref.WeakSet()  # connections of relays following this one that are told of it
        self.used_at = 0.0  # when a client of the relay last asked for it (the least recent is evicted first)
        self.dropped = False  # no longer mirrored (its upstream listen stopped)


class Follower:
    """Mirrors the upstream's followed bins into ``storage`` through ``upstream`` (see
    the module docstring; the storage tells local listeners of each mirrored
    change).  ``needed(name)`` says whether a client of the relay listens to (or
    waits on) a bin."""

    def __init__(self, reactor, storage, upstream: Upstream, pattern: str = "*",
                 timeout: float = 30.0, max_mirrors: int = 10_000, needed: Callable[[str], bool] = lambda name: False):
        self.reactor = reactor
        self.storage = storage
        self.upstream = upstream
        self.where = upstream.where
        self.pattern = pattern
        self.timeout = timeout  # how long a read waits for a bin's first copy
        self.zero_copy_min = 128 << 10  # an item this large is worth putting in shared memory (the config's)
        self.failure: str | None = None  # why the upstream cannot be used at all (a wrong token, say)
        self.mirrors: dict[str, _Mirror] = {}
        self.max_mirrors = max_mirrors
        self.needed = needed
        self._owner_key = secrets.token_bytes(16)  # makes this run's owner values its own (owner_value)
        self.started = False  # the upstream was reached since the relay started (it may be lost since)
        self._stopped = False
        upstream.on_ready, upstream.on_lost, upstream.on_refused = self._ready, self._upstream_lost, self._refused
        upstream.arriving = self._arriving

    # -- the upstream connection

    def start(self) -> None:
        """Connect upstream (retrying with backoff until it answers, and again whenever it drops)."""
        self.upstream.start()

    def _ready(self) -> None:
        """A connection upstream (to one of its workers) is open: the bins it reaches
        that were asked for while it was away are listened to, and the copies owed
        to them (changes noted, not fetched) are fetched."""
        if not self.upstream.connected:
            if not self.started:
                return  # (the first start waits for every worker)
        elif not self.started:
            log.info("relay: following %s", self.where)
        self.started = True
        for mirror in list(self.mirrors.values()):
            if not self.upstream.reaches(mirror.name):
                continue
            if not self.upstream.listening(mirror.name):
                self._listen(mirror)
            elif mirror.noted > mirror.applied and not mirror.fetching:
                self._fetch(mirror)

    def _refused(self, error: BaseException) -> None:
        self.failure = f"upstream {self.where} refused us: {error}"
        log.error("relay: %s; not following", self.failure)
        self._fail_waiters(ServerUnavailableError(self.failure))

    def stop(self) -> None:
        self._stopped = True
        for mirror in self.mirrors.values():
            self._lost_incoming(mirror, "the relay is shutting down")
        self.upstream.close()
        self._fail_waiters(ServerUnavailableError("the relay is shutting down"))

    def when_started(self, done: Callable[[BaseException | None], None], name: str | None = None) -> None:
        """``done(None)`` once the upstream connection is open (to the worker that owns
        bin ``name``, if given), if it ever was; a relay that has not reached its
        upstream yet (just started) waits up to ``timeout`` seconds for it, and one
        that lost it answers at once (``done(error)``)."""
        if self.upstream.reaches(name):
            done(None)
            return
        if self.started or self.failure or self._stopped:
            done(ServerUnavailableError(self.failure or f"relay: upstream {self.where} is not connected; "
                                                        f"try again"))
            return
        deadline = self.reactor.seconds() + self.timeout

        def check() -> None:
            if self.started or self.failure or self._stopped:
                self.when_started(done, name)
            elif self.reactor.seconds() >= deadline:
                done(ServerUnavailableError(f"relay: upstream {self.where} not reached within {self.timeout:g}s"))
            else:
                self.reactor.callLater(0.05, check)

        self.reactor.callLater(0.05, check)

    @property
    def connected(self) -> bool:
        return self.upstream.connected

    def forward(self, command, fields: dict, value=None, timeout: float | None = None,
                alone: bool = False) -> defer.Deferred:
        """Send a request upstream as it came: ``value`` is ``(description, payload
        parts, payload bytes)`` for a verb that carries one; a Deferred of the raw
        reply (:class:`~.upstream.Reply`).  ``alone``: a request the upstream may hold,
        on a connection of its own (cancelling the Deferred calls it off there:
        :meth:`~.upstream.Upstream.call_alone`)."""
        if alone:
            return self.upstream.call_alone(command, fields, value, timeout)
        return self.upstream.call(command, fields, value, timeout)

    def follows(self, name: str) -> bool:
        """True for a bin this relay mirrors (and forwards writes to)."""
        return fnmatch.fnmatchcase(name, self.pattern)

    # -- mirroring

    def when_synced(self, name: str, done: Callable[[BaseException | None], None]) -> None:
        """Mirror bin ``name`` from now on; ``done(None)`` once its local copy reflects
        the upstream bin (at once if it does), ``done(error)`` if that takes longer
        than ``timeout`` seconds."""
        if self.failure:
            done(ServerUnavailableError(self.failure))
            return
        mirror = self._mirror(name)
        if mirror.synced:
            done(None)
            return
        self._wait(mirror, 0, done)

    def after(self, name: str, upstream_seq: int, done: Callable[[BaseException | None], None]) -> None:
        """``done(None)`` once bin ``name``'s copy reflects upstream change
        ``upstream_seq`` (at once for a bin not mirrored: nothing to wait for)."""
        mirror = self.mirrors.get(name)
        if mirror is None or (mirror.synced and mirror.applied >= upstream_seq):
            done(None)
            return
        mirror.noted = max(mirror.noted, upstream_seq)
        self._wait(mirror, upstream_seq, done)

    def _wait(self, mirror: _Mirror, seq: int, done: Callable) -> None:
        mirror.waiters.append((seq, done))

        def expire() -> None:
            waiting = [w for w in mirror.waiters if w[1] is done]  # (its seq may have been reset)
            if waiting:
                mirror.waiters.remove(waiting[0])
                state = "connected" if self.connected else "not connected"
                done(ServerUnavailableError(f"relay: no copy of bin {mirror.name!r} from upstream {self.where} "
                                            f"within {self.timeout:g}s ({state})"))

        self.reactor.callLater(self.timeout, expire)

    def _mirror(self, name: str) -> _Mirror:
        mirror = self.mirrors.get(name)
        if mirror is None:
            if len(self.mirrors) >= self.max_mirrors and not self._evict():
                raise TooLargeError(f"relay: {len(self.mirrors)} bins are mirrored, the most it may (--max-listens), "
                                    f"and clients listen to each of them")
            mirror = self.mirrors[name] = _Mirror(name)
            mirror.noted_at = self.reactor.seconds()
            if self.upstream.reaches(name):
                self._listen(mirror)
        mirror.used_at = self.reactor.seconds()
        return mirror

    def _idle(self, mirror: _Mirror) -> bool:
        """Nobody needs ``mirror`` now: no client listens to or waits on its bin, and no
        copy of it is on its way."""
        return (not mirror.waiters and not mirror.fetching and mirror.incoming is None
                and not self.needed(mirror.name))

    def _evict(self) -> bool:
        """Drop the least recently read idle mirror; False if every one is needed."""
        idle = [m for m in self.mirrors.values() if self._idle(m)]
        if not idle:
            return False
        self._drop(min(idle, key=lambda m: m.used_at))
        return True

    def _drop(self, mirror: _Mirror) -> None:
        """Mirror the bin no more: stop listening upstream, and remove the local copy
        (it would go stale)."""
        mirror.dropped = True
        del self.mirrors[mirror.name]
        if self.upstream.listening(mirror.name):
            self.upstream.unlisten(mirror.name)
        self.storage.unmirror(mirror.name)  # (its listeners are told)

    def _listen(self, mirror: _Mirror) -> None:
        """Listen to the bin upstream; its snapshot starts the first fetch."""
        def listening(snapshot: dict) -> None:
            if mirror.dropped:
                if mirror.name not in self.mirrors and self.upstream.listening(mirror.name):
                    self.upstream.unlisten(mirror.name)
                return
            self._noted(mirror, snapshot[Key.SEQ], "PUT")

        def failed(failure) -> None:
            if self._stopped or mirror.dropped:
                return
            log.info("relay: cannot listen to %r upstream yet: %s", mirror.name, failure.getErrorMessage())
            if failure.check(TooLargeError) and not self._evict():  # the upstream's quota of listens: make room
                waiters, mirror.waiters = mirror.waiters, []
                self._drop(mirror)
                for _seq, done in waiters:
                    done(failure.value)
                return
            if not failure.check(ConnectionLostError):  # (a new connection listens to every bin asked for)
                self.reactor.callLater(0.2, again)

        def again() -> None:
            if not self.upstream.listening(mirror.name) and self.connected and not self._stopped \
                    and not mirror.dropped:
                self._listen(mirror)

        try:
            d = self.upstream.listen(mirror.name, lambda header, payload: self._noted(mirror, header[Key.SEQ],
                                                                                       header[Key.OP], payload))
        except TensorShareError:
            d = defer.fail()
        d.addCallbacks(listening, failed)

    def _noted(self, mirror: _Mirror, seq: int, op: str, payload=None) -> None:
        """An upstream change (or, ``op`` LISTEN, a listen begun again): fetch the bin.
        A copy pushed to us arrives whole as the payload of its ``INCOMING``: installed."""
        if mirror.dropped:  # (notifications sent before the upstream stopped listening)
            return
        if op == "LISTEN":  # listening again after a reconnection: whatever is there now
            # The upstream may have restarted without its data and numbers its changes
            # from 1 again: nothing of the old numbering may stand (a copy not newer than
            # an old seq would be taken for one already held).  Who waits for a change
            # of the old numbering is answered by the copy fetched now.
            self._lost_incoming(mirror, "listening again")
            mirror.applied = mirror.have = mirror.noted = -1
            mirror.waiters = [(0, done) for _seq, done in mirror.waiters]
            op = "PUT"
        elif op == INCOMING:
            if isinstance(payload, Incoming) and payload.pushed and payload.whole:  # a copy pushed to us is in
                if mirror.incoming is payload:
                    mirror.incoming = None
                payload.complete()  # (the streams pass it on whole before we install it)
                self._install(mirror, payload.copy(), payload.op, seq, payload.seq, seq)
            return  # (announced without its bytes: its ordinary notification follows when it is in)
        elif mirror.synced and seq <= mirror.applied:  # the copy already shows it (it was passed on to us)
            return
        mirror.noted = max(mirror.noted, seq)
        mirror.op = op
        if mirror.noted_at is None:
            mirror.noted_at = self.reactor.seconds()
        if mirror.fetching:
            mirror.again = True
            return
        self._fetch(mirror)

    def _fetch(self, mirror: _Mirror) -> None:
        mirror.fetching, mirror.again = True, False
        target, op = mirror.noted, mirror.op
        if not self.upstream.reaches(mirror.name):
            mirror.fetching = False  # (owed: fetched once its worker is reached again, _ready)
            return

        def fetched(reply) -> None:
            try:
                took(reply)
            except ProtocolError as exc:  # items that do not add up: a broken upstream
                failed(exc)

        def took(reply) -> None:
            frame, copy_seq = reply.frame, reply.header[Key.SEQ]
            incoming = frame.payload if isinstance(frame.payload, Incoming) else None  # ours, passed on as it arrived
            if incoming is not None:
                if mirror.incoming is incoming:
                    mirror.incoming = None
                incoming.complete()
                self._fetched(mirror, incoming.copy(), incoming.op, max(target, copy_seq), incoming.seq, copy_seq)
                return
            if mirror.synced and 0 <= mirror.have and copy_seq <= mirror.have:
                self._fetched(mirror, None, op, max(target, copy_seq), stale=True)  # we hold it, or newer
                return
            self._fetched(mirror, _copy(reply.header, frame), op, max(target, copy_seq), None, copy_seq)

        def failed(error) -> None:
            if mirror.incoming is not None and not mirror.incoming.pushed:
                self._lost_incoming(mirror, str(error))
            if isinstance(error, NoSuchBinError):
                self._fetched(mirror, None, "DELETE", target)
                return
            mirror.fetching = False
            # A lost connection is followed by a new listen, whose snapshot fetches again.
            if not isinstance(error, (ConnectionLostError, AuthenticationError)):
                delay, mirror.retry = mirror.retry, min(mirror.retry * 2, _RETRY_MAX)
                (log.debug if isinstance(error, ServerLocalError) else log.info)(
                    "relay: fetching %r from upstream failed: %s; again in %gs", mirror.name, error, delay)
                self.reactor.callLater(delay, self._noted, mirror, target, op)
            else:
                log.info("relay: fetching %r from upstream failed: %s", mirror.name, error)

        try:
            # wait 0: an item whose bytes are still in its publisher's GPU (PROTOCOL.md
            # §13.2) is refused at once (451, fetched again above), not held at the head
            # of the one connection every other request of this relay goes on.
            d = self.upstream.call(PEEK, {Key.BIN: mirror.name, Key.TAGS: True, Key.INCOMING: True, Key.WAIT: 0})
        except TensorShareError as exc:
            failed(exc)
            return
        d.addCallbacks(fetched, lambda failure: failed(failure.value))

    def _fetched(self, mirror: _Mirror, copy: list[tuple] | None, op: str, upstream_seq: int,
                 seq: int | None = None, copy_seq: int = -1, stale: bool = False) -> None:
        """A fetch is over: install its copy (unless ``stale``: one not newer than the
        copy held) and fetch again if changes were noted meanwhile."""
        mirror.retry = _RETRY_FIRST
        if not stale:
            self._install(mirror, copy, op, upstream_seq, seq, copy_seq)
        else:
            self._settle(mirror, upstream_seq)
        mirror.fetching = False
        if mirror.again:
            self._fetch(mirror)
        else:
            mirror.noted_at = None
            if not self.storage.state(mirror.name).exists and self._idle(mirror) and not mirror.dropped:
                self._drop(mirror)  # the upstream lacks it and nobody waits for it: a made-up name costs nothing

    def _install(self, mirror: _Mirror, copy: list[tuple] | None, op: str, upstream_seq: int,
                 seq: int | None = None, copy_seq: int = -1) -> None:
        """Replace the local copy in one change (numbered ``seq`` if one was reserved
        for it; ``copy`` None: the bin is gone upstream) and tell local listeners."""
        name, storage = mirror.name, self.storage
        try:  # (the storage tells local listeners)
            if copy is None:
                storage.unmirror(name)
            else:
                op = _as_one_change(op, len(copy), storage.count(name))
                storage.mirror(name, copy, op, seq, share_from=self.zero_copy_min)
        except RemoteError as exc:  # a limit of this relay (max_bins...)
            log.warning("relay: cannot mirror bin %r: %s", name, exc)
        mirror.synced = True
        mirror.have = copy_seq
        self._settle(mirror, upstream_seq)
        if not mirror.fetching:
            mirror.noted_at = None

    def _settle(self, mirror: _Mirror, upstream_seq: int) -> None:
        """The copy reflects upstream change ``upstream_seq``: release who waited for it."""
        mirror.applied = max(mirror.applied, upstream_seq)
        ready = [w for w in mirror.waiters if w[0] <= mirror.applied]
        mirror.waiters = [w for w in mirror.waiters if w[0] > mirror.applied]
        for _seq, done in ready:
            done(None)

    # -- cut-through: passing a copy on while it arrives (.stream)

    def watch(self, name: str, session) -> None:
        """Push to ``session`` (a relay following this one) every copy of bin ``name``
        that starts arriving here, as it arrives (an ``INCOMING`` notification)."""
        self._mirror(name).watchers.add(session)

    def _arriving(self, name: str, header: dict, nbytes: int):
        """The header of a copy of bin ``name`` is in (a fetch's 226, or a copy pushed
        to us): the sink to receive its payload into, passing it on to the relays
        that follow this one as it arrives; None: received as usual."""
        mirror = self.mirrors.get(name)
        if mirror is None or not mirror.synced or mirror.incoming is not None:
            return None
        pushed = header.get(Key.CODE) == NOTIFY
        upstream_seq = header.get(Key.SEQ)
        if (not pushed and not mirror.fetching) or type(upstream_seq) is not int or upstream_seq <= mirror.have:
            return None
        state = self.storage.state(name)
        if not state.exists:  # a first copy takes a fresh number when it is in (see PROTOCOL.md §11)
            return None
        try:
            table = item_table(header, nbytes)
        except ProtocolError:
            return None  # a fetch fails with it; a pushed copy is fetched instead
        if any(ref is not None for _blob, _size, ref in table):
            return None
        tags = item_tags(header, len(table))
        change = header.get(Key.CHANGE)
        op = _as_one_change(change if type(change) is str else mirror.op, len(table), state.n_items)
        incoming = Incoming(name, [blob for blob, _, _ in table], [size for _, size, _ in table], tags, nbytes,
                            upstream_seq, self.storage.reserve_seq(), op, pushed)
        mirror.incoming = incoming
        for session in list(mirror.watchers):
            if session.closed or name not in session.listening:
                mirror.watchers.discard(session)
            else:
                incoming.push_to(session)
        return incoming.sink

    def _upstream_lost(self, reason: str, serves: Callable[[str], bool]) -> None:
        """A connection upstream dropped: the copies arriving on it (``serves(bin)``) are lost."""
        for mirror in self.mirrors.values():
            if serves(mirror.name):
                self._lost_incoming(mirror, reason)

    def _lost_incoming(self, mirror: _Mirror, reason: str) -> None:
        incoming, mirror.incoming = mirror.incoming, None
        if incoming is not None:
            log.info("relay: copy of %r lost mid-way (%d of %d bytes): %s", mirror.name, incoming.received,
                     incoming.total, reason)
            incoming.fail(reason)

    def _fail_waiters(self, error: BaseException) -> None:
        for mirror in self.mirrors.values():
            waiters, mirror.waiters = mirror.waiters, []
            for _seq, done in waiters:
                done(error)

    def owner_value(self, session, given: bytes | None) -> bytes:
        """The ``owner`` an ephemeral PUT of ``session`` (a client of this relay) carries
        upstream: one per client connection of this relay run, and, for a relay
        following this one, per client of that relay (``given``) too (PROTOCOL.md §4.6)."""
        key = self._owner_key + session.stats.id.to_bytes(8, "little") + (given or b"")
        return hashlib.sha256(key).digest()[:16]

    def delete_upstream(self, name: str, owner: bytes | None) -> None:
        """Delete bin ``name`` upstream, without an answer to wait for: an ephemeral bin
        forwarded for a client of this relay whose connection ended.  With ``owner``
        (its PUT's), the upstream deletes it only if no other client has put it since."""
        if not self.upstream.reaches(name):
            return  # its worker dropped this relay's ephemeral bins with its connection
        fields = {Key.BIN: name} if owner is None else {Key.BIN: name, Key.OWNER: owner}
        try:
            d = self.upstream.call(DELETE, fields)
        except TensorShareError as exc:  # (its connection went meanwhile: the bin went with it)
            log.info("relay: could not delete ephemeral bin %r upstream: %s", name, exc)
            return
        d.addErrback(lambda failure: log.info("relay: could not delete ephemeral bin %r upstream: %s", name,
                                              failure.getErrorMessage()))

    # -- status

    def status(self) -> dict:
        """How this relay stands (LIST's ``relay`` field, PROTOCOL.md §11)."""
        now = self.reactor.seconds()
        pending = [m.noted_at for m in self.mirrors.values() if m.noted_at is not None]
        state = {
            "upstream": self.where,
            "connected": self.connected,
            "bins": len(self.mirrors),  # bins mirrored
            "behind": len(pending),  # of which with upstream changes not yet mirrored
            "lag": round(now - min(pending), 6) if pending else 0.0,  # seconds the oldest of them waits
        }
        arriving = {m.name: [m.incoming.received, m.incoming.total] for m in self.mirrors.values()
                    if m.incoming is not None}
        if arriving:
            state["arriving"] = arriving  # copies being received (and passed on): [bytes in, bytes]
        if self.failure:
            state["error"] = self.failure
        return state


def _copy(header: dict, frame) -> list[tuple]:
    """A fetched copy's items, as :meth:`~..bins.storage.Storage.mirror` takes them
    (raw: descriptions and payload bytes as received, with their tags)."""
    payload = frame.payload if frame.payload_len else memoryview(b"")
    table = item_table(header, frame.payload_len)
    copy, base = [], 0
    for (blob, size, _ref), tag in zip(table, item_tags(header, len(table))):
        copy.append((blob, (payload[base:base + size],) if size else (), size, tag))
        base += size
    return copy


def _as_one_change(op: str, n_items: int, before: int) -> str:
    """The verb a mirrored copy's change is told with: several upstream APPENDs in one
    copy are a new content to listeners, not one more item (a first-append listener
    must hear of an empty bin filling up)."""
    return "PUT" if op == "APPEND" and n_items != before + 1 else op
