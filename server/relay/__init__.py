"""Relay servers: a server that mirrors another's bins and forwards writes to it.

``tensorshare-server --follow HOST:PORT`` (``ServerConfig.follow``) starts one:
:mod:`.follower` keeps the mirror through an upstream client connection,
:mod:`.forward` holds the verb handlers that send writes upstream and answer reads
from the mirror, :mod:`.stream` passes a copy on to the relays that follow this one
while it still arrives, and :mod:`.upstream` drives the clients' engine and router
to its upstream (torch-free: no server process loads torch or the client library),
one connection per worker of a multi-worker upstream.
"""

from __future__ import annotations

from tensorshare.errors import UsageError
from tensorshare.protocol.auth import resolve_token
from tensorshare.protocol.tls import TLSSettings

from .follower import Follower
from .forward import relay_handlers
from .upstream import Upstream


def split_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``; UsageError if it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"not a HOST:PORT address: {text!r}")
    return host, int(port)


def start_relay(state, config, reactor) -> Follower:
    """Make ``state``'s server a relay of ``config.follow``: its handlers and its follower."""
    if config.data_dir:
        raise UsageError("a relay keeps no data directory: it fetches its bins again from upstream")
    host, port = split_address(config.follow)
    # Upstream, the relay proves --follow-token-file's token, else its own (a cluster's one token).
    token = resolve_token(None, config.follow_token_file) if config.follow_token_file else config.auth_token()
    tls = TLSSettings.from_options(True if config.follow_tls else None, config.follow_tls_ca,
                                   config.follow_tls_fingerprint)
    upstream = Upstream(reactor, host, port, token=token, tls=tls)
    follower = Follower(reactor, state.storage, upstream, config.follow_bins,
                        config.follow_timeout, max_mirrors=config.max_listens,
                        needed=lambda name: state.listeners.listened(name) or state.waits.waiting_on(name))
    follower.zero_copy_min = config.zero_copy_min
    state.relay = follower
    state.handlers = relay_handlers()
    follower.start()
    return follower


__all__ = ["Follower", "start_relay", "split_address"]
