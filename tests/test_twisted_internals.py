"""The Twisted internals the server relies on (server/net/twisted_internals.py) are
there in the installed Twisted: this fails loudly on a Twisted that changed them."""

from __future__ import annotations

import socket

import twisted
from twisted.internet import protocol
from twisted.internet.testing import MemoryReactor

from tensorshare_server.net import twisted_internals


def test_every_internal_the_server_uses_exists_on_a_real_connection():
    assert twisted_internals.check() == [], f"Twisted {twisted.__version__} lacks what the server uses"
    assert twisted_internals.COMPATIBLE
    a, b = socket.socketpair()
    # A reactor that never runs: nothing writes Twisted's buffer out behind the test's back.
    transport = twisted_internals.ReceivingServer(a, protocol.Protocol(), ("127.0.0.1", 1), None, 0,
                                                  MemoryReactor())
    try:
        assert twisted_internals.check(transport) == []
        assert twisted_internals.direct_socket(transport) is a
        assert twisted_internals.transport_idle(transport)
        transport.write(b"x" * 10)  # buffered by Twisted until the reactor writes it
        assert not twisted_internals.transport_idle(transport)
        buffered, _kernel = twisted_internals.unsent(transport)
        assert buffered == 10
        twisted_internals.set_send_limit(transport, 1 << 20)
        twisted_internals.set_read_size(transport, 1 << 20)
        assert (transport.SEND_LIMIT, transport.bufferSize) == (1 << 20, 1 << 20)
    finally:
        transport.stopReading()
        transport.stopWriting()
        a.close()
        b.close()


def test_other_transports_never_get_the_direct_path():
    from twisted.internet.testing import StringTransport

    assert twisted_internals.direct_socket(StringTransport()) is None
