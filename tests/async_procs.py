"""The AsyncClient against real endpoints (TLS, a server in the same reactor): run by
tests/test_security.py as ``python async_procs.py MODE PORT ARGS...``, one reactor
per process.  Everything else about the AsyncClient is tested in memory
(tests/test_async_client.py)."""

from __future__ import annotations

import sys
import time

import torch
from twisted.internet import defer, task
from tensorshare import AsyncClient
from tensorshare.errors import ConnectionLostError, NotAuthenticatedError, UntrustedServerError


async def expect(error, d, within=None):
    start = time.monotonic()
    try:
        await d
    except error:
        assert within is None or time.monotonic() - start < within, time.monotonic() - start
        return
    raise AssertionError(f"no {error.__name__}")


async def tls(reactor, port, token, ca, pin, wrong_pin):
    client = await AsyncClient.connect("127.0.0.1", port, reactor=reactor, token=token, tls_ca=ca)
    seen = []
    await client.listen("a-tls", seen.append)
    big = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    await client.put("a-tls", big)
    [back] = await client.get("a-tls")
    assert torch.equal(back, big)
    await client.ping()  # answered after the GET's notification
    assert [n.op for n in seen] == ["PUT", "GET"], seen
    client.close()
    pinned = await AsyncClient.connect("127.0.0.1", port, reactor=reactor, token=token, tls_fingerprint=pin)
    assert await pinned.list() is not None
    pinned.close()
    await expect(NotAuthenticatedError, AsyncClient.connect("127.0.0.1", port, reactor=reactor,
                                                            token="not-the-token", tls_ca=ca))
    await expect(UntrustedServerError, AsyncClient.connect("127.0.0.1", port, reactor=reactor, token=token,
                                                           tls_fingerprint=wrong_pin))
    await expect(ConnectionLostError, AsyncClient.connect("127.0.0.1", port, reactor=reactor, token=token,
                                                          connect_timeout=1), within=3)


async def plain(reactor, port, token, ca):
    await expect(ConnectionLostError, AsyncClient.connect("127.0.0.1", port, reactor=reactor, token=token,
                                                          tls_ca=ca), within=3)
    await expect(NotAuthenticatedError, AsyncClient.connect("127.0.0.1", port, reactor=reactor))


async def close(reactor, _port, cert, key, ca):
    # A server in this reactor, to see the connection end when the client closes
    # (a TLS transport with a producer registered would stay open).
    from tensorshare_server import ServerConfig
    from tensorshare_server.app import listen

    for tls in (False, True):
        config = ServerConfig(port=0, tls_cert=cert if tls else None, tls_key=key if tls else None)
        port = listen(config)
        factory = getattr(port.factory, "wrappedFactory", port.factory)
        client = await AsyncClient.connect("127.0.0.1", port.getHost().port, reactor=reactor,
                                           tls_ca=ca if tls else None)
        await client.ping()
        assert len(factory.live) == 1
        client.close()
        for _ in range(100):
            await task.deferLater(reactor, 0.02, lambda: None)
            if not factory.live:
                break
        assert not factory.live, f"tls={tls}: still open after close()"
        await port.stopListening()


async def final(reactor, _port, token):
    # Reconnection authenticates again; once the token is refused, no more tries.
    from tensorshare_server import ServerConfig
    from tensorshare_server.app import listen

    port = listen(ServerConfig(port=0, token=token))
    factory = port.factory
    client = await AsyncClient.connect("127.0.0.1", port.getHost().port, reactor=reactor, token=token)
    factory.disconnect_all()
    for _ in range(200):
        await task.deferLater(reactor, 0.02, lambda: None)
        if client.connected:
            break
    assert await client.ping() >= 0  # authenticated again by itself
    opened = []
    factory.state.token = b"another token entirely"
    real_build = factory.buildProtocol
    factory.buildProtocol = lambda addr: opened.append(addr) or real_build(addr)
    factory.disconnect_all()
    await task.deferLater(reactor, 3.0, lambda: None)  # backoff tops out at 2 s: a loop would show
    assert len(opened) == 1, opened
    await expect(NotAuthenticatedError, client.ping())
    client.close()
    await port.stopListening()


def _family(client) -> int:
    return client.router.home.wire.transport.getHandle().family


async def local(reactor, port):
    # A same-host AsyncClient talks through the server's Unix socket (PROTOCOL.md
    # §10.1), beside one kept on TCP by zero_copy=False; a restarted server (a new
    # socket) is found again.
    import socket

    from serverproc import ServerProcess

    client = await AsyncClient.connect("127.0.0.1", port, reactor=reactor, timeout=30)
    tcp = await AsyncClient.connect("127.0.0.1", port, reactor=reactor, timeout=30, zero_copy=False)
    assert _family(client) == socket.AF_UNIX and client.router.home.local.endswith("server.sock")
    assert _family(tcp) == socket.AF_INET and tcp.router.home.local is None
    seen = []
    await tcp.listen("als-small", seen.append)
    value, large = torch.arange(16.0), torch.rand(3 << 20)  # (12 MiB: many reads and writes)
    await client.put("als-small", value)
    await client.append("als-small", value + 1)
    assert [t.tolist() for t in await tcp.peek("als-small")] == [value.tolist(), (value + 1).tolist()]
    await tcp.ping()  # (answered after the notifications of everything before it)
    assert [n.op for n in seen] == ["PUT", "APPEND"], seen
    await tcp.put("als-large", large)
    [back] = await client.get("als-large")
    assert torch.equal(back, large)
    client.close()
    tcp.close()
    proc = ServerProcess()
    try:
        client = await AsyncClient.connect("127.0.0.1", proc.port, reactor=reactor, timeout=30, max_backoff=0.2)
        await client.put("als-restart", torch.ones(2))
        before = client.router.home.local
        proc.restart()  # a new area, a new socket: the old path is gone
        for _ in range(200):  # (it reconnects by itself: the old socket fails, TCP names the new one)
            await task.deferLater(reactor, 0.05, lambda: None)
            if client.connected and client.router.home.local not in (None, before):
                break
        assert client.router.home.local not in (None, before), (before, client.router.home.local)
        assert _family(client) == socket.AF_UNIX
        await client.put("als-restart", torch.zeros(2))
        assert (await client.peek("als-restart"))[0].tolist() == [0.0, 0.0]
        client.close()
    finally:
        proc.stop()
    import tempfile  # a token server of two workers: each worker's own socket, the token asked there too
    secret = "a-long-enough-token-for-this-test-0123456789"
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/token", "w") as f:
            f.write(secret + "\n")
        proc = ServerProcess("--token-file", f"{tmp}/token", "--workers", "2")
        try:
            client = await AsyncClient.connect("127.0.0.1", proc.port, reactor=reactor, timeout=30, token=secret)
            for i in range(8):  # bins on both workers
                await client.put(f"als-w{i}", torch.full((4,), float(i)))
            assert [(await client.peek(f"als-w{i}"))[0][0].item() for i in range(8)] == [float(i) for i in range(8)]
            members = [m for m in client.router.members if m is not None]
            assert len(members) == 2 and len({m.local for m in members}) == 2, [m.local for m in members]
            assert {m.wire.transport.getHandle().family for m in members} == {socket.AF_UNIX}
            client.close()
            await expect(NotAuthenticatedError, AsyncClient.connect("127.0.0.1", proc.port, reactor=reactor,
                                                                    token="wrong-" + "x" * 40))
        finally:
            proc.stop()


def main(reactor, mode, port, *args):
    modes = {"tls": tls, "plain": plain, "close": close, "final": final, "local": local}
    coro = modes[mode](reactor, int(port), *args)
    return defer.ensureDeferred(coro).addCallback(lambda _: print(mode, "ok"))


if __name__ == "__main__":
    task.react(main, sys.argv[1:])
