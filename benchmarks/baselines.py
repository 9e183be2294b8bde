"""The physical and peer baselines every figure is compared with, measured in the same run.

* memcpy: ``numpy.copyto`` into a preallocated, already-touched buffer (the floor of
  one copy), and one copy into fresh memory (what any new buffer costs on this VM,
  where first-touch page faults are slow);
* raw loopback one way: a worker process ``sendall``s N bytes on request, we
  ``recv_into`` a reused warm buffer or a freshly allocated one (torch.empty or
  np.empty);
* raw loopback fan-in: sender processes each send N bytes and wait for a byte of
  answer, one ``selectors`` loop here receives them all (a table's writers' pattern);
* raw small round trip: a worker echoes 64 bytes;
* the original tensorshare's approach: ``torch.save`` + a raw socket + ``torch.load``;
* Redis (redis-py against a private redis-server) and ``torch.distributed.TCPStore``.

Functions return seconds per run (lists), or the calls to time (small round trips,
which the section times in turns with ours); the section modules turn them into
figures.
"""

from __future__ import annotations

import io
import os
import selectors
import shutil
import socket
import tempfile
import time
from typing import Callable

import numpy as np
import torch

from tensorshare.disk.areas import LOCAL_BUFFER

from .procs import PeerMissing, RedisServer, Worker
from .stats import time_runs

_LEN_BYTES = 8
TCPSTORE_MAX_VALUE = 8 << 20  # the libuv TCPStore server drops the connection above 8 MiB


def touched(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose pages are all faulted in."""
    buf = np.empty(nbytes, np.uint8)
    buf.fill(1)
    return buf


def memcpy_seconds(nbytes: int, reps: int, warmup: int) -> list[float]:
    """One copy of ``nbytes`` into a preallocated, already-touched buffer."""
    src, dst = touched(nbytes), touched(nbytes)
    return time_runs(lambda: np.copyto(dst, src), reps, warmup)


def fresh_copy_seconds(nbytes: int, reps: int, warmup: int, into: str = "bytes") -> list[float]:
    """One copy of ``nbytes`` into newly allocated memory.

    ``into``: ``bytes`` (``bytes(view)``, what ``dumps`` returns), ``torch`` (a new
    ``torch.empty``, what a received payload lands in) or ``numpy`` (a new
    ``np.empty``, which numpy backs with transparent huge pages when it can).
    """
    src = touched(nbytes)
    view = memoryview(src)
    if into == "bytes":
        return time_runs(lambda: bytes(view), reps, warmup)
    if into == "torch":
        return time_runs(lambda: np.copyto(torch.empty(nbytes, dtype=torch.uint8).numpy(), src), reps, warmup)
    if into == "numpy":
        return time_runs(lambda: np.copyto(np.empty(nbytes, np.uint8), src), reps, warmup)
    raise ValueError(into)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _connect_unix(path: str) -> socket.socket:
    """A Unix socket to ``path``, its send buffer as a same-host client sets it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER)
    sock.settimeout(120)
    sock.connect(path)
    return sock


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:])
        if not r:
            raise ConnectionError("peer closed")
        got += r


def _worker_socket(kind: str, *args: object) -> tuple[Worker, socket.socket]:
    """Start a ``kind`` worker that says ``port N`` and connect to it; the worker is stopped
    if that fails."""
    worker = Worker(kind, *args)
    try:
        return worker, _connect(int(worker.expect(120, "port").split()[1]))
    except BaseException:
        worker.stop()
        raise


def _hang_up(sock: socket.socket, worker: Worker, goodbye: bytes = b"") -> None:
    """Send ``goodbye`` (if any) and close ``sock``, ignoring socket errors; then stop ``worker``."""
    try:
        if goodbye:
            sock.sendall(goodbye)
        sock.close()
    except OSError:
        pass
    worker.stop()


class RawLoopback:
    """Raw Python sockets, one way: ask a sender process for N bytes, receive them."""

    def __init__(self, max_bytes: int):
        self.worker, self.sock = _worker_socket("raw-send", max_bytes)
        self.warm = touched(max_bytes)

    def one_way(self, nbytes: int, reps: int, warmup: int, buffer: str = "warm") -> list[float]:
        """Seconds from the request to the last byte in the buffer.

        ``buffer``: ``warm`` (the same, already-touched buffer every time), ``torch``
        (a new ``torch.empty`` each time, as a client receiving a new value does) or
        ``numpy`` (a new ``np.empty``, which numpy backs with huge pages when it can).
        """
        request = nbytes.to_bytes(_LEN_BYTES, "little")
        warm = memoryview(self.warm)[:nbytes]
        new = {"warm": lambda: warm,
               "torch": lambda: memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy()),
               "numpy": lambda: memoryview(np.empty(nbytes, np.uint8))}[buffer]

        def once():
            self.sock.sendall(request)
            _recv_exact(self.sock, new())

        return time_runs(once, reps, warmup)

    def close(self) -> None:
        _hang_up(self.sock, self.worker, bytes(_LEN_BYTES))

    def __enter__(self) -> "RawLoopback":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def raw_fan_in(pool, senders: int, nbytes: int, run_s: float, lead_s: float, unix: bool = False) -> float:
    """Bytes per second from ``senders`` processes of ``pool`` to this one over raw
    loopback sockets, each sending messages of ``nbytes`` and waiting for a byte of
    answer before the next (a table's writers' pattern, without the table), for
    ``run_s`` seconds; this process receives with one ``selectors`` loop, as a
    server does, into a warm buffer per connection.  ``unix``: over a Unix socket,
    its buffers as a same-host client's and the server's (``LOCAL_BUFFER``)."""
    where = tempfile.mkdtemp(prefix="fan-in-") if unix else None
    if where is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: object = os.path.join(where, "s")
        listener.bind(address)
        listener.listen(senders)
    else:
        listener = socket.create_server(("127.0.0.1", 0), backlog=senders)
        address = listener.getsockname()[1]
    conns: dict = {}
    try:
        start = time.time() + lead_s
        done = pool.starmap_async(_fan_in_sender, [(address, nbytes, start, run_s)] * senders)
        listener.settimeout(120)
        for _ in range(senders):
            conn, _ = listener.accept()
            conn.setblocking(False)
            if where is not None:  # (as the server sets a same-host client's)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_BUFFER)
            conns[conn] = [memoryview(touched(nbytes)), 0]
        give_up = start + run_s + 120  # (a sender that never hangs up does not hold the bench)
        with selectors.DefaultSelector() as sel:
            for conn in conns:
                sel.register(conn, selectors.EVENT_READ)
            while conns and time.time() < give_up:
                for key, _ in sel.select(1.0):
                    conn = key.fileobj
                    state = conns[conn]
                    try:
                        got = conn.recv_into(state[0][state[1]:])
                    except BlockingIOError:
                        continue
                    if not got:  # (the sender is done)
                        sel.unregister(conn)
                        conn.close()
                        del conns[conn]
                        continue
                    state[1] += got
                    if state[1] == nbytes:
                        state[1] = 0
                        conn.send(b"k")
        return sum(done.get(120)) * nbytes / run_s
    finally:
        for conn in conns:
            conn.close()
        listener.close()
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)


def _fan_in_sender(address: int | str, nbytes: int, start: float, run_s: float) -> int:
    """One sender of :func:`raw_fan_in` (to a port, or a Unix socket's path):
    messages of ``nbytes`` from ``start`` on for ``run_s`` seconds, each answered;
    returns how many it sent."""
    message, answer = memoryview(touched(nbytes)), bytearray(1)
    with _connect(address) if isinstance(address, int) else _connect_unix(address) as sock:
        time.sleep(max(0.0, start - time.time()))
        sent = 0
        while time.time() < start + run_s:
            sock.sendall(message)
            sock.recv_into(answer)
            sent += 1
        return sent


class RawEcho:
    """Raw Python sockets: round trips of 64 bytes to an echo process."""

    def __init__(self):
        self.worker, self.sock = _worker_socket("echo")

    def round_trip(self) -> Callable[[], None]:
        """One 64-byte round trip, as a call to time."""
        msg, buf = b"x" * 64, bytearray(64)
        view = memoryview(buf)

        def rt():
            self.sock.sendall(msg)
            _recv_exact(self.sock, view)

        return rt

    def close(self) -> None:
        _hang_up(self.sock, self.worker)


class TorchSaveSocket:
    """The original tensorshare's way: torch.save to bytes, raw socket, torch.load on arrival."""

    def __init__(self):
        self.worker, self.sock = _worker_socket("torch-recv")

    def send_seconds(self, value, reps: int, warmup: int) -> list[float]:
        """Seconds for torch.save + send + receive + torch.load + a one-byte ack."""
        ack = bytearray(1)

        def once():
            buf = io.BytesIO()
            torch.save(value, buf)
            data = buf.getbuffer()
            self.sock.sendall(len(data).to_bytes(_LEN_BYTES, "little"))
            self.sock.sendall(data)
            del data
            _recv_exact(self.sock, memoryview(ack))

        return time_runs(once, reps, warmup)

    def close(self) -> None:
        _hang_up(self.sock, self.worker, bytes(_LEN_BYTES))


class RedisPeer:
    """redis-py against a private redis-server (raises PeerMissing if either is absent)."""

    def __init__(self):
        self.server = RedisServer()
        self.r = self.server.client()

    def set_get_seconds(self, data: bytes, reps: int, warmup: int) -> tuple[list[float], list[float]]:
        """Seconds per SET and per GET of ``data`` (one key)."""
        key = "bench:big"
        sets = time_runs(lambda: self.r.set(key, data), reps, warmup)
        holder = []
        gets = time_runs(lambda: holder.append(self.r.get(key)), reps, warmup, setup=holder.clear)
        holder.clear()
        self.r.delete(key)
        return sets, gets

    def mset_mget_seconds(self, values: dict[str, bytes], reps: int, warmup: int) -> tuple[list[float], list[float]]:
        """Seconds to SET and to GET every value of a dict, pipelined (one round trip)."""
        def put():
            pipe = self.r.pipeline(transaction=False)
            for k, v in values.items():
                pipe.set(k, v)
            pipe.execute()

        holder = []

        def get():
            pipe = self.r.pipeline(transaction=False)
            for k in values:
                pipe.get(k)
            holder.append(pipe.execute())

        sets = time_runs(put, reps, warmup)
        gets = time_runs(get, reps, warmup, setup=holder.clear)
        holder.clear()
        self.r.delete(*values)
        return sets, gets

    def small_calls(self) -> tuple[Callable[[], object], Callable[[], object]]:
        """SET and GET of 64 bytes, as calls to time."""
        value = bytes(64)
        return lambda: self.r.set("bench:small", value), lambda: self.r.get("bench:small")

    def pipelined_rpush_rates(self, n: int, runs: int, warmup: int, batch: int = 256) -> list[float]:
        """RPUSH of 64 bytes per second, ``batch`` commands per pipeline round trip."""
        value = bytes(64)

        def once():
            left = n
            while left:
                k = min(batch, left)
                pipe = self.r.pipeline(transaction=False)
                for _ in range(k):
                    pipe.rpush("bench:pipe", value)
                pipe.execute()
                left -= k
            self.r.delete("bench:pipe")

        return [n / t for t in time_runs(once, runs, warmup)]

    def close(self) -> None:
        try:
            self.r.close()
        finally:
            self.server.stop()


class TCPStorePeer:
    """``torch.distributed.TCPStore``: a master in this process, used through a client store."""

    MAX_VALUE = TCPSTORE_MAX_VALUE

    def __init__(self):
        try:
            import torch.distributed as dist

            if not dist.is_available():
                raise ImportError("torch.distributed is not available in this torch build")
            self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=__import__("datetime").timedelta(seconds=120))
            self.store = dist.TCPStore("127.0.0.1", self.master.port, is_master=False, wait_for_workers=False,
                                       timeout=__import__("datetime").timedelta(seconds=120))
        except (ImportError, AttributeError) as exc:
            raise PeerMissing(f"TCPStore unavailable: {exc}") from None

    def set_get_seconds(self, data: bytes, reps: int, warmup: int) -> tuple[list[float], list[float]]:
        if len(data) > self.MAX_VALUE:
            raise ValueError("over TCPStore's payload cap")
        sets = time_runs(lambda: self.store.set("big", data), reps, warmup)
        gets = time_runs(lambda: self.store.get("big"), reps, warmup)
        self.store.delete_key("big")
        return sets, gets

    def small_calls(self) -> tuple[Callable[[], object], Callable[[], object]]:
        """set and get of 64 bytes, as calls to time."""
        value = bytes(64)
        self.store.set("small", value)
        return lambda: self.store.set("small", value), lambda: self.store.get("small")

    def close(self) -> None:
        self.store = self.master = None
        time.sleep(0)  # the stores close when collected
