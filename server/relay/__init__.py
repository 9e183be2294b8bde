"""Relay servers: a server that mirrors another's bins and forwards writes to it.

``tensorshare-server --follow HOST:PORT`` (``ServerConfig.follow``) starts one:
:mod:`.follower` keeps the mirror through an upstream client connection,
:mod:`.forward` holds the verb handlers that send writes upstream and answer reads
from the mirror, :mod:`.stream` passes a copy on to the relays that follow this one
while it still arrives.  Imported only by a server that follows another (it uses the
client library, which an ordinary server never loads).
"""

from __future__ import annotations

from tensorshare.errors import UsageError
from tensorshare.protocol.auth import resolve_token

from .follower import Follower
from .forward import relay_handlers


def split_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``; UsageError if it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"not a HOST:PORT address: {text!r}")
    return host, int(port)


def _waited_on(waits, name: str) -> bool:
    """Whether a request of a client waits on bin ``name`` (a PEEK for its next change...)."""
    from ..protocol.longpoll import LANES

    return any(waits.waiting(name + lane) for lane in LANES)


def start_relay(state, config, reactor) -> Follower:
    """Make ``state``'s server a relay of ``config.follow``: its handlers and its follower."""
    from .stream import StreamingClient

    if config.data_dir:
        raise UsageError("a relay keeps no data directory: it fetches its bins again from upstream")
    host, port = split_address(config.follow)
    # Upstream, the relay proves --follow-token-file's token, else its own (a cluster's one token).
    token = resolve_token(None, config.follow_token_file) if config.follow_token_file else config.auth_token()
    tls = True if config.follow_tls else None

    def connect():
        return StreamingClient.connect(host, port, reactor=reactor, timeout=None, token=token, tls=tls,
                                   tls_ca=config.follow_tls_ca, tls_fingerprint=config.follow_tls_fingerprint,
                                   zero_copy=False, reuse=0)

    follower = Follower(reactor, state.storage, state.listeners.publish, connect, f"{host}:{port}",
                        config.follow_bins, config.follow_timeout, max_mirrors=config.max_listens,
                        needed=lambda name: state.listeners.listened(name) or _waited_on(state.waits, name))
    follower.zero_copy_min = config.zero_copy_min
    state.relay = follower
    state.handlers = relay_handlers()
    follower.start()
    return follower


__all__ = ["Follower", "start_relay", "split_address"]
