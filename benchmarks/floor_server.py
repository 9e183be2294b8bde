"""The stack's floor: a minimal Twisted server of tensorshare's framing (``python -m benchmarks.floor_server``).

It speaks enough of the protocol for the real ``Client`` to run the scaling
section's mixed load against it (greeting, PUT, APPEND, GET, PEEK, DELETE, NOOP):
the same frames (prefix, msgpack header, payload) and the same replies, from a
dict of lists, with nothing else: no limits, no checks of names or values, no
flow control, no notifications.  It takes the two shortcuts past Twisted that the
real server takes (events dispatched without ``callWithLogger``, a reply sent with
one ``send()`` while the transport holds nothing unsent), so what it costs per
request is what Twisted, the kernel and msgpack cost: the floor the real server's
CPU per request is compared with (benchmarks/floor_bench.py).

Like the real server, it also listens on a Unix socket in a private directory
and names it to same-host clients in its greeting (PROTOCOL.md §10.1), so the
client reaches both servers the same way.

Prints ``listening on 127.0.0.1:PORT`` once it listens; runs until stopped.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile

import msgpack
from twisted.internet import protocol, reactor

from tensorshare.disk.areas import new_token, write_token
from tensorshare_server.net import twisted_internals

_PREFIX = struct.Struct("<4sBBHIQ")
_LENGTHS = struct.Struct("<IQ")
_START = _PREFIX.pack(b"TSHR", 1, 0, 0, 0, 0)[:8]


def _frame(header: dict, payload_len: int = 0) -> bytes:
    packed = msgpack.packb(header)
    return _START + _LENGTHS.pack(len(packed), payload_len) + packed


class Floor(protocol.Protocol):
    """One connection: whole frames out of what arrived, a reply for each."""

    bins: dict[str, list[tuple[bytes, bytes]]]  # shared by every connection (set by the factory)

    offer: dict | None = None  # the same-host offer of the greeting (set by main)

    def connectionMade(self) -> None:
        if hasattr(self.transport.getPeer(), "host"):  # (TCP; not the Unix socket)
            self.transport.setTcpNoDelay(True)
        self.sock = twisted_internals.direct_socket(self.transport)
        self.pending = b""
        greeting = {"code": 220, "id": 0, "msg": "floor"}
        if self.offer is not None:
            greeting["shm"] = self.offer
        self._write(_frame(greeting))

    def dataReceived(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else data
        out, pos, end = [], 0, len(buf)
        while end - pos >= 20:
            header_len, payload_len = _LENGTHS.unpack_from(buf, pos + 8)
            start = pos + 20 + header_len
            stop = start + payload_len
            if stop > end:
                break
            header = msgpack.unpackb(buf[pos + 20 : start])
            out += self._answer(header, buf[start:stop])
            pos = stop
        self.pending = buf[pos:]
        if out:
            self._write(b"".join(out))

    def _answer(self, header: dict, payload: bytes) -> list[bytes]:
        op, rid, name = header.get("op"), header.get("id"), header.get("bin")
        bins = self.bins
        Floor.seq = seq = Floor.seq + 1
        if op == "PUT" or op == "APPEND":
            if op == "PUT":
                items = bins[name] = []
            else:
                items = bins.setdefault(name, [])
            items.append((header["value"], payload))
            return [_frame({"code": 250, "id": rid, "n": len(items), "seq": seq})]
        if op == "GET" or op == "PEEK":
            items = bins.pop(name, []) if op == "GET" else bins.get(name, [])
            sizes = [len(p) for _, p in items]
            head = _frame({"code": 226, "id": rid, "seq": seq, "items": [d for d, _ in items], "sizes": sizes},
                          sum(sizes))
            return [head, *(p for _, p in items)]
        if op == "DELETE":
            bins.pop(name, None)
            return [_frame({"code": 250, "id": rid, "n": 0, "seq": seq})]
        if op == "NOOP":
            return [_frame({"code": 200, "id": rid})]
        return [_frame({"code": 502, "id": rid, "msg": f"the floor server does not serve {op!r}"})]

    def _write(self, data: bytes) -> None:
        t = self.transport
        if self.sock is not None and twisted_internals.transport_idle(t):
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        t.write(data)


Floor.seq = 0


def main() -> None:
    factory = protocol.Factory.forProtocol(Floor)
    Floor.bins = {}
    twisted_internals.dispatch_directly(reactor)
    port = reactor.listenTCP(int(sys.argv[1]) if len(sys.argv) > 1 else 0, factory, interface="127.0.0.1")
    area = tempfile.mkdtemp(prefix="tensorshare-floor-")  # (mode 0700, as the real server's area)
    reactor.addSystemEventTrigger("after", "shutdown", shutil.rmtree, area, True)
    token, path = new_token(), os.path.join(area, "server.sock")
    write_token(area, token)
    twisted_internals.listen_unix(path, factory)
    Floor.offer = {"token": token, "areas": [area], "socket": path}
    address = port.getHost()
    print(f"listening on {address.host}:{address.port}", flush=True)
    reactor.run()


if __name__ == "__main__":
    main()
