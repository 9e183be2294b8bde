"""Fuzz a live server over real sockets: mutated requests, random bytes, truncated
frames and bit-flipped PUTs, while a well-behaved client keeps working beside them.

Reproducible: one seeded generator drives everything (``TENSORSHARE_FUZZ_SEED``
picks another seed; a failure message names the seed and the case).  Bounded: a
fixed number of frames, every socket read has a timeout.
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

import tensorshare
from server.config import ServerConfig
from serverproc import ServerProcess
from tensorshare.protocol import messages as protocol
from tensorshare.wire.codec import encode
from tensorshare.errors import ProtocolError
from tensorshare.wire.frames import PREFIX, CostlyHeader, FrameDecoder, discard_sink, frame_head, unpack_header

SEED = int(os.environ.get("TENSORSHARE_FUZZ_SEED", "20261121"))
# TENSORSHARE_FUZZ_SCALE=10 runs ten times as many cases (a longer hunt, by hand).
_SCALE = float(os.environ.get("TENSORSHARE_FUZZ_SCALE", "1"))
REQUEST_FRAMES = int(5_000 * _SCALE)  # mutated requests on long-lived connections (request-level errors)
BROKEN_CONNECTIONS = int(1_500 * _SCALE)  # one broken frame each (framing errors, truncations, bit flips)
BATCH = 100  # requests pipelined before their replies are read
READ_TIMEOUT = 10.0
RSS_SLACK = 48 << 20  # how far above its warmed-up baseline the server may stay afterwards

VERBS = sorted(protocol.VERBS)
REPLY_CODES = {200, 212, 226, 250, 501, 502, 503, 550, 552, 553}  # to requests that keep the connection


# ------------------------------------------------------------------ generators


class Junk:
    """Random msgpack-able values with str map keys (a header stays a valid map)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def scalar(self):
        r = self.rng
        return r.choice([
            lambda: None, lambda: r.random() < 0.5, lambda: r.randint(-5, 5),
            lambda: r.choice([2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**32, -1, 0]),
            lambda: r.choice([math.nan, math.inf, -math.inf, 1e308, -0.0, r.random()]),
            lambda: self.text(), lambda: r.randbytes(r.randint(0, 40)),
        ])()

    def text(self) -> str:
        r = self.rng
        alphabet = ["a", "Z", "/", ".", " ", "\x00", "\x1f", "\x7f", "é", "\u2028", "\U0001f600", "\ud7ff"]
        return "".join(r.choice(alphabet) for _ in range(r.choice([0, 1, 5, 40, 256, 257, 300])))

    def value(self, depth: int = 0):
        r = self.rng
        roll = r.random()
        if depth > 6 or roll < 0.6:
            return self.scalar()
        if roll < 0.8:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        return {self.text()[:8]: self.value(depth + 1) for _ in range(r.randint(0, 4))}

    def nested(self, depths=(65, 200, 1023, 1500, 5000)) -> object:
        """Deep nesting: past every depth limit, and past msgpack's own stack."""
        value: object = None
        for _ in range(self.rng.choice(depths)):
            value = [value] if self.rng.random() < 0.5 else {"k": value}
        return value


def sample_value(rng: random.Random):
    """A small valid value: tensors of assorted dtypes and shapes in a little structure."""
    dtype = rng.choice([torch.float32, torch.int64, torch.uint8, torch.bfloat16, torch.bool, torch.complex64])
    shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
    tensor = torch.zeros(shape, dtype=dtype) if dtype is torch.bool else torch.randint(0, 100, shape).to(dtype)
    return rng.choice([
        tensor, {"x": tensor, "step": rng.randint(-10, 10)}, [tensor, np.arange(3)], (rng.random(), "s", None),
        rng.randbytes(rng.randint(0, 300)),
        # the kinds beyond plain containers: int keys, numpy scalars, dtypes, sizes, sets
        {"state": {0: {"exp_avg": tensor, "step": np.float32(rng.random())}}, "groups": [{"params": [0]}]},
        {(1, "a"): np.bool_(rng.random() < 0.5), None: np.uint16(rng.randint(0, 9)), 2.5: tensor.dtype},
        [tensor.shape, {1, "x", (2, 3)}, frozenset({rng.randint(0, 9)}), complex(rng.random(), 1), np.dtype("int8")],
    ])


class Fuzzer:
    """Makes request frames: valid ones, then mutated."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.junk = Junk(rng)
        self.encoded = [encode(sample_value(rng)) for _ in range(64)]
        self.ids = iter(range(1, 1 << 62))

    def bin_name(self) -> str:
        return f"fz/{self.rng.randint(0, 40)}"

    def valid(self) -> tuple[dict, bytes]:
        """A valid request header and its payload."""
        r = self.rng
        op = r.choice(VERBS)
        header: dict = {"op": op, "id": next(self.ids)}
        payload = b""
        if op in protocol.VERBS_WITH_BIN:
            header["bin"] = self.bin_name()
        if op in protocol.VERBS_WITH_VALUE:
            enc = r.choice(self.encoded)
            header["value"] = enc.description
            payload = enc.payload_bytes()
            if r.random() < 0.3:
                header["tag"] = r.randint(-(2**63), 2**63 - 1)
        return header, payload

    def bad_description(self, blob: bytes) -> bytes:
        r = self.rng
        choice = r.randrange(8)
        if choice == 0:  # bit flips
            data = bytearray(blob)
            for _ in range(r.randint(1, 4)):
                data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            return bytes(data)
        if choice == 1:  # truncated, or with trailing bytes
            return blob[: r.randrange(len(blob))] if r.random() < 0.5 else blob + r.randbytes(r.randint(1, 8))
        if choice == 2:
            return r.randbytes(r.randint(0, 64))
        try:
            doc = msgpack.unpackb(blob, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType)
        except (ValueError, TypeError, msgpack.UnpackException):  # mutated already (TypeError: a list as a map key)
            return r.randbytes(16)
        if not isinstance(doc, dict) or not {"v", "t", "n"} <= set(doc) or not isinstance(doc["t"], list):
            return blob[::-1]
        if choice == 3:  # a field of an array table entry replaced by junk
            if doc["t"]:
                entry = r.choice(doc["t"])
                entry[r.randrange(5)] = r.choice([self.junk.scalar(), [2**48 + 1], [-1], "float128", 7, True,
                                                  [1] * 33, [2**24, 2**24, 2**24]])
            else:
                doc["t"] = [[0, "float32", [1], 0, 4]]
        elif choice == 4:
            doc["n"] = r.choice([doc["n"] + 64, -1, "64", None, 2**64 - 1])
        elif choice == 5:  # the tree: junk, too deep, bad references, foreign extension types
            doc["v"] = r.choice([self.junk.nested(), msgpack.ExtType(1, b"\xff\xff\xff\x7f"),
                                 msgpack.ExtType(1, b"\x00"), msgpack.ExtType(2, b"\x01"),
                                 msgpack.ExtType(3, b""), msgpack.Timestamp(1, 0),
                                 msgpack.ExtType(99, b"x"), {1: 2}, {b"k": 1},
                                 # the newer kinds, malformed: odd pairs, equal or unhashable keys,
                                 # wrong lengths, unknown dtypes
                                 msgpack.ExtType(4, b"\x93\x01\x02\x03"), msgpack.ExtType(4, b"\x94\x01\x00\x01\x00"),
                                 msgpack.ExtType(4, b"\x92\x90\x00"), msgpack.ExtType(5, b"\x92\x01\x01"),
                                 msgpack.ExtType(6, b"\x91\x80"), msgpack.ExtType(7, b"\x07float32\x00"),
                                 msgpack.ExtType(7, b"\x04bool\x07"), msgpack.ExtType(8, b"\x00float128"),
                                 msgpack.ExtType(9, b"\x91\xa1x"), msgpack.ExtType(10, b"\x00" * 15)])
        elif choice == 6:  # keys missing or extra
            doc.pop(r.choice(["v", "t", "n"])) if r.random() < 0.5 else doc.update(x=1)
        else:
            doc = self.junk.value()
        try:
            return msgpack.packb(doc, use_bin_type=True)
        except (ValueError, OverflowError, TypeError):  # junk msgpack itself refuses
            return r.randbytes(16)

    def mutated(self) -> tuple[dict, bytes]:
        """A request with one to three mutations; header keys stay str (no framing error)."""
        r = self.rng
        header, payload = self.valid()
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            m = r.randrange(10)
            if m == 0:
                header["op"] = r.choice(["put", "FROB", "", "PUT ", "GET\x00", self.junk.scalar(),
                                         self.junk.value()])
            elif m == 1:
                header["id"] = r.choice([0, -1, 2**64 - 1, True, None, "7", 1.0, [1], self.junk.scalar()])
            elif m == 2:
                header["bin"] = r.choice([self.junk.text(), self.junk.scalar(), ["fz/1"], "x" * 257])
            elif m == 3 and isinstance(header.get("value"), bytes):
                header["value"] = self.bad_description(header["value"])
            elif m == 4:
                header["value"] = r.choice([self.junk.scalar(), self.junk.value(), "not bytes"])
            elif m == 5:
                header["tag"] = r.choice([2**63, 2**64 - 1, -(2**63) - 1, 1.5, "v1", True, [1]])
            elif m == 6 and header:
                header.pop(r.choice(list(header)), None)
            elif m == 7:  # payload that does not match the description, or on a verb without one
                payload = r.randbytes(r.choice([1, 63, 64, 65, 1000]))
            elif m == 8:
                header[self.junk.text()[:12] or "extra"] = self.junk.value()
            else:
                header["junk"] = self.junk.nested()
        return header, payload

    def framed(self, header: dict, payload: bytes) -> bytes | None:
        """The frame, or None if msgpack cannot pack the header or the server would
        refuse it as a framing error (its limits on the containers of a header:
        broken_frame sends such headers).  A header that decodes to too much memory
        is a request the server refuses (501) and goes on: it stays."""
        try:
            head = frame_head(header, len(payload))
        except (ValueError, OverflowError, TypeError):  # msgpack cannot pack it (e.g. its own depth limit)
            return None
        try:
            unpack_header(head[PREFIX.size:], SERVER_FRAME_LIMITS)
        except CostlyHeader:
            pass
        except ProtocolError:
            return None
        return head + payload


def short(obj) -> str:
    """A bounded repr (headers may nest thousands deep)."""
    try:
        return repr(obj)[:300]
    except RecursionError:
        return "<nested too deep to show>"


def expected_id(header: dict) -> int:
    rid = header.get("id")
    return rid if type(rid) is int and 0 < rid < 1 << 64 else 0


# --------------------------------------------------------------- broken frames


SERVER_FRAME_LIMITS = ServerConfig().frame_limits


def _is_header(body: bytes) -> bool:
    try:
        unpack_header(body)
        return True
    except ProtocolError:
        return False


def broken_frame(fz: Fuzzer) -> tuple[str, bytes, bool]:
    """(kind, bytes, definite): ``definite`` frames are framing errors the server must
    answer with 500 before closing; the others may also just wait for bytes that
    never come (we half-close: the server must then close)."""
    r = fz.rng
    header, payload = fz.valid()
    frame = frame_head(header, len(payload)) + payload
    kind = r.randrange(9)
    if kind == 0:
        return "random bytes", r.randbytes(r.randint(1, 200)), False
    if kind == 1:  # a prefix field out of range
        magic, version, flags, reserved, hlen, plen = PREFIX.unpack(frame[:20])
        field = r.randrange(5)
        if field == 0:
            magic = r.choice([b"TSHr", b"HTTP", b"\x00" * 4])
        elif field == 1:
            version = r.choice([0, 2, 255])
        elif field == 2:
            flags = r.randint(1, 255)
        elif field == 3:
            hlen = r.choice([0, (16 << 20) + 1, 2**32 - 1])
        else:
            plen = r.choice([(16 << 30) + 1, 2**64 - 1])
        return "bad prefix", PREFIX.pack(magic, version, flags, reserved, hlen, plen) + frame[20:], True
    if kind == 2:  # a header that is not one msgpack map with str keys and no ext types
        body = r.choice([
            r.randbytes(r.randint(1, 50)), msgpack.packb([1, 2]), msgpack.packb("op"),
            msgpack.packb({1: "x"}), msgpack.packb({"op": "NOOP", "id": 1, "x": {b"k": 1}}),
            msgpack.packb({"op": "NOOP", "id": 1}) + b"\xc0",
            msgpack.packb({"op": "NOOP", "id": msgpack.ExtType(3, b"\x01" * 9)}),
            msgpack.packb({"op": "NOOP", "id": 1, "t": msgpack.Timestamp(1, 0)}, datetime=False),
            msgpack.packb({"op": "NOOP", "id": 1, "x": [msgpack.ExtType(0, b"")]}),
            b"\x91" * 5000 + b"\xc0", b"\x81\xa1k" * 5000 + b"\xc0",
            msgpack.packb({"op": "NOOP", "id": 1, "x": [[]] * 2000}),  # more containers than its size allows
        ])
        if body and body[0] in (0x80, 0x81, 0x82, 0x83) and r.random() < 0.3:
            cut = body[: r.randrange(1, len(body))]  # a truncated map...
            if not _is_header(cut):  # ...unless cutting a trailing byte left a valid one
                body = cut
        return "bad header", PREFIX.pack(b"TSHR", 1, 0, 0, len(body), 0) + body, True
    if kind in (3, 4):  # truncated: valid frames, the last one cut short
        prefix = b"".join(fz.framed(*fz.valid()) for _ in range(r.randint(0, 2)))
        return "truncated", prefix + frame[: r.randrange(1, len(frame))], False
    # bit flips of a valid PUT frame, mostly in the prefix and header
    enc = r.choice(fz.encoded)
    put = frame_head({"op": "PUT", "id": next(fz.ids), "bin": fz.bin_name(), "value": enc.description},
                     enc.nbytes) + enc.payload_bytes()
    data = bytearray(put)
    head = len(put) - enc.nbytes
    for _ in range(r.choice([1, 1, 2, 3, 8])):
        pos = r.randrange(head) if r.random() < 0.8 or enc.nbytes == 0 else r.randrange(len(data))
        data[pos] ^= 1 << r.randrange(8)
    return "bit flip", bytes(data), False


# ------------------------------------------------------------------ connections


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT)
    return sock


def read_until_closed(sock: socket.socket, context: str) -> list[dict]:
    """Every frame the server sends until it closes (an error if it does not)."""
    decoder = FrameDecoder(discard_sink)
    frames = []
    deadline = time.monotonic() + READ_TIMEOUT
    while True:
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        except socket.timeout:
            raise AssertionError(f"{context}: the server neither answered nor closed") from None
        if not data:
            break
        frames.extend(f.header for f in decoder.feed(data))
        assert time.monotonic() < deadline, f"{context}: the server kept sending"
    return frames


def read_replies(sock: socket.socket, decoder: FrameDecoder, count: int, context: str) -> list[dict]:
    """The next ``count`` frames that are not notifications."""
    replies = []
    while len(replies) < count:
        data = sock.recv(1 << 16)
        assert data, f"{context}: the server closed the connection after {len(replies)} replies"
        replies.extend(f.header for f in decoder.feed(data) if f.header.get("code") != protocol.NOTIFY)
    return replies


class GoodClient(threading.Thread):
    """Put/peek round trips with value checks, all the while the fuzzing goes on."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.ops = 0
        self.errors: list[BaseException] = []

    def run(self) -> None:
        rng = random.Random(SEED + 1)
        try:
            with tensorshare.Client("127.0.0.1", self.port, timeout=30) as client:
                while not self.stop.is_set():
                    name = f"good/{rng.randrange(4)}"
                    value = {"t": torch.randn(rng.randint(1, 2000)), "i": self.ops}
                    client.put(name, value)
                    [back] = client.peek(name)
                    assert back["i"] == value["i"] and torch.equal(back["t"], value["t"])
                    self.ops += 2
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


# ------------------------------------------------------------------------- test


@pytest.fixture
def fuzz_server(tmp_path):
    proc = ServerProcess(log_path=tmp_path / "server.log")
    yield proc
    proc.stop()


def test_fuzz_live_server(fuzz_server):
    rng = random.Random(SEED)
    fz = Fuzzer(rng)
    port = fuzz_server.port
    where = f"(TENSORSHARE_FUZZ_SEED={SEED})"

    # Warm up, then take the memory baseline the server must come back to.
    with tensorshare.Client("127.0.0.1", port) as client:
        for i in range(200):
            client.put(f"fz/{i % 41}", sample_value(rng))
            client.peek(f"fz/{i % 41}")
        for name in client.list():
            client.delete(name)
    baseline = fuzz_server.rss()

    good = GoodClient(port)
    good.start()
    start = time.monotonic()
    sent = answered = 0
    codes: dict[int, int] = {}
    try:
        # 1. Mutated requests, pipelined in batches on long-lived connections: each
        #    one gets exactly one reply, in order, with its id (0 if it had no usable one).
        sock, decoder = None, None
        while sent < REQUEST_FRAMES:
            if sock is None or rng.random() < 0.05:
                if sock is not None:
                    sock.close()
                sock, decoder = connect(port), FrameDecoder(discard_sink)
                [greeting] = read_replies(sock, decoder, 1, where)
                assert greeting["code"] == protocol.GREETING
            batch = []
            while len(batch) < BATCH:
                header, payload = fz.mutated() if rng.random() < 0.85 else fz.valid()
                data = fz.framed(header, payload)
                if data is not None:
                    batch.append((header, data))
            sock.sendall(b"".join(data for _, data in batch))
            replies = read_replies(sock, decoder, len(batch), where)
            for (header, _), reply in zip(batch, replies):
                if reply.get("code") not in REPLY_CODES or reply.get("id") != expected_id(header):
                    raise AssertionError(f"{where} request {short(header)} got {short(reply)}")
                codes[reply["code"]] = codes.get(reply["code"], 0) + 1
            sent += len(batch)
            answered += len(replies)
        sock.close()

        # 2. One broken frame per connection: a 500 then a close, or (for frames
        #    that may only be incomplete) a close once we stop sending.
        closed_with_500 = 0
        for i in range(BROKEN_CONNECTIONS):
            kind, data, definite = broken_frame(fz)
            context = f"{where} broken case {i} ({kind}): {data[:120]!r}"
            sock = connect(port)
            try:
                sock.sendall(data)
                if not definite:
                    sock.shutdown(socket.SHUT_WR)
                frames = read_until_closed(sock, context)
            except (BrokenPipeError, ConnectionResetError):  # closed while we still sent
                raise AssertionError(f"{context}: reset before the server's reply could be read") from None
            finally:
                sock.close()
            assert frames and frames[0]["code"] == protocol.GREETING, context
            for header in frames[1:]:
                assert header.get("code") in REPLY_CODES | {protocol.NOTIFY, protocol.BAD_FRAME}, context
            if protocol.BAD_FRAME in [h["code"] for h in frames]:
                assert frames[-1]["code"] == protocol.BAD_FRAME, context  # nothing after the 500
                closed_with_500 += 1
            elif definite:
                raise AssertionError(f"{context}: closed without a 500: {frames!r:.300}")
            sent += 1
        elapsed = time.monotonic() - start
    finally:
        good.stop.set()
        good.join(30)

    assert not good.errors, f"{where} the well-behaved client failed: {good.errors[0]!r}"
    assert good.ops > 100
    assert fuzz_server.proc.poll() is None, "the server died"
    log = fuzz_server.log()
    assert "Traceback" not in log and "Unhandled" not in log, log[-3000:]

    # Memory: clear what the fuzzing stored; the server comes back near its baseline.
    with tensorshare.Client("127.0.0.1", port) as client:
        for name in client.list():
            client.delete(name)
        assert client.ping() < 5
    after = fuzz_server.rss()
    print(f"\nfuzz: {sent} frames ({answered} pipelined requests answered, {closed_with_500} connections "
          f"closed with 500) in {elapsed:.1f} s; reply codes {dict(sorted(codes.items()))}; good client "
          f"{good.ops} ops; server RSS {baseline / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB after")
    assert after - baseline < RSS_SLACK, f"server RSS grew from {baseline} to {after} bytes"
