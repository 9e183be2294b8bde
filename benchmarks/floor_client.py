"""A client's floor: the least a client of tensorshare's framing does for a small put and peek.

The busy-host section (:mod:`benchmarks.busy_bench`) times ``Client.put`` +
``peek`` against redis-py; this client, against the same tensorshare-server,
shows how much of the difference is the client's.  Per call it packs the header,
sends the frame in one ``send()``, waits for the reply (a blocking ``recv`` with a
timeout: ``poll`` then ``recv``, as the real client), unpacks the header, checks
its id and code and, for a peek, makes the tensor from the payload.  What a real
client must do besides is left out: no argument checks, no header validation
beyond msgpack's, no listens, keepalives, reconnects, routing or locks, and the
value's description is made once per dtype and shape (by the real encoder).

It reaches the server as the real client does: over TCP, then through the
server's Unix socket when the greeting offers one this process may trust
(PROTOCOL.md §10.1).  Values: one CPU tensor of a dtype numpy has, nothing else.
"""

from __future__ import annotations

import socket
import struct

import msgpack
import torch

from tensorshare.disk.areas import local_socket
from tensorshare.wire.codec import encode
from tensorshare.wire.description import parse_description
from tensorshare.wire.torch_dtypes import TORCH_DTYPES

_PREFIX = struct.Struct("<4sBBHIQ")
_STORED, _ITEMS = 250, 226


class FloorClient:
    """A minimal blocking client of one server (see the module docstring)."""

    def __init__(self, host: str, port: int, timeout: float = 30.0):
        self.sock = socket.create_connection((host, port), timeout)
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)
        greeting = self._reply()
        path = local_socket(greeting.get("shm"))
        if path is not None:  # the server's Unix socket, as the real client moves there
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(timeout)
            local.connect(path)
            self.sock.close()
            self.sock = local
            self._reply()
        self.rid = 0
        self.descriptions: dict = {}  # (dtype, shape) -> a PUT's description, payload bytes, padding
        self.shapes: dict = {}  # a PEEK reply's description -> (dtype, shape)

    def put(self, name: str, tensor: torch.Tensor) -> int:
        """Replace bin ``name``'s items with ``tensor`` (CPU, contiguous); its item count."""
        key = (tensor.dtype, tensor.shape)
        made = self.descriptions.get(key)
        if made is None:  # (the payload is padded to the layout's alignment: PROTOCOL.md §3.3)
            encoded = encode(tensor)
            made = self.descriptions[key] = (encoded.description, encoded.nbytes, bytes(encoded.nbytes - tensor.nbytes))
        description, nbytes, padding = made
        reply = self._call({"op": "PUT", "bin": name, "value": description}, nbytes, [tensor.numpy().data, padding])
        if reply["code"] != _STORED:
            raise RuntimeError(f"PUT refused: {reply}")
        return reply["n"]

    def peek(self, name: str) -> torch.Tensor:
        """Bin ``name``'s one item, a tensor."""
        reply = self._call({"op": "PEEK", "bin": name})
        if reply["code"] != _ITEMS or len(reply["items"]) != 1:
            raise RuntimeError(f"PEEK: not one item: {reply}")
        blob = reply["items"][0]
        made = self.shapes.get(blob)
        if made is None:
            spec = parse_description(blob, reply["sizes"][0]).arrays[0]
            made = self.shapes[blob] = (TORCH_DTYPES[spec.dtype], spec.shape, spec.nbytes)
        dtype, shape, nbytes = made
        return torch.frombuffer(bytearray(self.payload[:nbytes]), dtype=dtype).reshape(shape)

    def close(self) -> None:
        self.sock.close()

    def _call(self, header: dict, payload_len: int = 0, payload: list | None = None) -> dict:
        self.rid += 1
        header["id"] = self.rid
        packed = msgpack.packb(header)
        head = _PREFIX.pack(b"TSHR", 1, 0, 0, len(packed), payload_len) + packed
        if payload is None:
            self.sock.sendall(head)
        else:
            self.sock.sendmsg([head, *payload])  # (all of a small frame is taken at once)
        reply = self._reply()
        if reply.get("id") != self.rid:
            raise RuntimeError(f"a reply to another request: {reply}")
        return reply

    def _reply(self) -> dict:
        """Read one frame: its header; its payload in ``self.payload``."""
        view, n = self.view, self.sock.recv_into(self.buf)
        if n < _PREFIX.size:
            n += self._more(n, _PREFIX.size)
        magic, _, _, _, header_len, payload_len = _PREFIX.unpack_from(self.buf)
        end = _PREFIX.size + header_len + payload_len
        if magic != b"TSHR" or end > len(self.buf):
            raise RuntimeError("not a small tensorshare frame")
        if n < end:
            n += self._more(n, end)
        self.payload = view[_PREFIX.size + header_len : end]
        return msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + header_len])

    def _more(self, have: int, need: int) -> int:
        got = 0
        while have + got < need:
            n = self.sock.recv_into(self.view[have + got :])
            if not n:
                raise ConnectionError("the server closed the connection")
            got += n
        return got
