"""The code that the benchmark's child processes run: ``python -m benchmarks.workers KIND ARGS``.

Each worker talks to the parent in lines: it prints ``ready`` (or ``port N``) once
set up, answers commands read from stdin, and exits on ``quit`` or when stdin
closes.  Timestamps that cross processes use ``time.monotonic()``
(CLOCK_MONOTONIC: one clock for the whole machine on Linux).

Kinds:

* ``raw-send``          -- raw socket source: on each 8-byte request N, ``sendall`` N bytes
* ``echo``              -- raw socket echo of small messages (round-trip baseline)
* ``torch-recv``        -- the original tensorshare's way: receive torch.save bytes, torch.load them
* ``async-append PORT N WINDOW RUNS WARMUP``
                        -- pipelined appends through AsyncClient, with its own reactor
* ``mixed PORT PEER SIZE ID``
                        -- a client doing put/append/get (PEER ts) or the same through Redis,
                           for ``go SECONDS`` or ``count N`` ops; says its ops, time, latencies and CPU
                           (PEER ts: PORT may list servers, P1,P2, and a command name the K-th: ``count N K``);
                           ``target PORT SIZE``: the same load against other servers, values of SIZE bytes
* ``listen PORT PEER BIN``
                        -- waits for notifications of a bin and fetches it (fan-out)
* ``rl PORT EXPERIMENT LIFETIME [ZERO_COPY]``
                        -- an RLWorker: ``fan REPS TIMEOUT NBYTES`` awaits REPS new versions of
                           the parameters, ``roll COLS T0 SECONDS`` appends rollouts (sections 5, 7),
                           ``hold REPS TIMEOUT`` awaits versions and says what it holds (section 12);
                           ZERO_COPY 0: over TCP only (default 1: same-host zero-copy when it can)
* ``redis-roll PORT KEY LIFETIME``
                        -- the same rollouts' bytes RPUSHed to a Redis list (section 5's baseline)

The ``rl`` and ``redis-roll`` workers also exit by themselves after LIFETIME seconds.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import threading
import time

_LEN = struct.Struct("<Q")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _stdin_closed(event: threading.Event) -> None:
    """Set ``event`` when the parent says quit or goes away."""
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    event.set()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def _serve_one(handler) -> None:
    """Listen on a free loopback port, print it, serve one connection with ``handler``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(60)
    _say(f"port {srv.getsockname()[1]}")
    conn, _ = srv.accept()
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    srv.close()
    try:
        handler(conn)
    except (ConnectionError, OSError):
        pass
    finally:
        conn.close()


def raw_send(max_bytes: str) -> None:
    import numpy as np

    payload = np.ones(int(max_bytes), np.uint8)  # touched: the sender's memory is warm
    view = memoryview(payload)
    req = bytearray(_LEN.size)

    def handler(conn: socket.socket) -> None:
        while True:
            _recv_exact(conn, memoryview(req))
            (n,) = _LEN.unpack(req)
            if n == 0:
                return
            conn.sendall(view[:n])

    _serve_one(handler)


def echo() -> None:
    def handler(conn: socket.socket) -> None:
        while True:
            data = conn.recv(65536)
            if not data:
                return
            conn.sendall(data)

    _serve_one(handler)


def torch_recv() -> None:
    import torch

    def handler(conn: socket.socket) -> None:
        head = bytearray(_LEN.size)
        while True:
            _recv_exact(conn, memoryview(head))
            (n,) = _LEN.unpack(head)
            if n == 0:
                return
            buf = bytearray(n)
            _recv_exact(conn, memoryview(buf))
            torch.load(io.BytesIO(buf))  # the receiver's work: the value is built, then dropped
            conn.sendall(b"k")

    _serve_one(handler)


def async_append(port: str, n: str, window: str, runs: str, warmup: str) -> None:
    """Pipelined appends through AsyncClient; prints ``result {"rates": [...]}``."""
    import torch
    from twisted.internet import defer, reactor

    from tensorshare import AsyncClient

    port_, n_, window_, runs_, warmup_ = int(port), int(n), int(window), int(runs), int(warmup)
    value = torch.ones(16)
    outcome: dict = {}

    def one_run(client, count: int) -> defer.Deferred:
        finished = defer.Deferred()
        state = {"sent": 0, "done": 0}

        def issue() -> None:
            while state["sent"] < count and state["sent"] - state["done"] < window_:
                state["sent"] += 1
                client.append("async-pipe", value).addCallbacks(completed, failed)

        def completed(_):
            state["done"] += 1
            if state["done"] == count:
                finished.callback(None)
            else:
                issue()

        def failed(f):
            if not finished.called:
                finished.errback(f)

        issue()
        return finished

    @defer.inlineCallbacks
    def main():
        try:
            client = yield AsyncClient.connect("127.0.0.1", port_, timeout=60)
            rates = []
            for i in range(warmup_ + runs_):
                count = n_ if i >= warmup_ else max(n_ // 4, 1)
                start = time.perf_counter()
                yield one_run(client, count)
                elapsed = time.perf_counter() - start
                yield client.delete("async-pipe")
                if i >= warmup_:
                    rates.append(count / elapsed)
            outcome["rates"] = rates
            client.close()
        except Exception as exc:  # reported to the parent, which records the error
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            reactor.callLater(0.05, reactor.stop)

    def too_long():
        outcome.setdefault("error", "timed out")
        reactor.stop()

    reactor.callWhenRunning(main)
    reactor.callLater(300, too_long)
    reactor.run()
    _say("result " + json.dumps(outcome))


def mixed_ops(peer: str, port: int | str, nbytes: int, name: str) -> list:
    """``[(put, bytes), (append, bytes), (get, bytes)]`` of the mixed load on bin (key)
    ``name`` through the real client of ``peer`` (``ts``, or ``redis``: a put is DEL +
    RPUSH and a get LRANGE + DEL, in transactions, the same semantics; ``port`` a path:
    over Redis's Unix socket)."""
    if peer == "ts":
        import torch

        from tensorshare import Client

        value = torch.ones(nbytes // 4)
        client = Client("127.0.0.1", port, timeout=60)
        return [(lambda: client.put(name, value), nbytes), (lambda: client.append(name, value), nbytes),
                (lambda: client.get(name), 2 * nbytes)]
    import numpy as np
    import redis

    r = redis.Redis(unix_socket_path=port, socket_timeout=60) if isinstance(port, str) \
        else redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    value = np.ones(nbytes, np.uint8).tobytes()

    def put():
        pipe = r.pipeline(transaction=True)
        pipe.delete(name)
        pipe.rpush(name, value)
        pipe.execute()

    def get():
        pipe = r.pipeline(transaction=True)
        pipe.lrange(name, 0, -1)
        pipe.delete(name)
        pipe.execute()

    return [(put, nbytes), (lambda: r.rpush(name, value), nbytes), (get, 2 * nbytes)]


def mixed(port: str, peer: str, size: str, wid: str) -> None:
    """put/append/get in a cycle for the duration of each ``go SECONDS`` command."""
    name = f"mixed-{wid}"

    def connect(port: str, size: str) -> list:
        # (the floor bench gives several servers of the same protocol: benchmarks/floor_server.py)
        # (a path: redis-py over Redis's Unix socket)
        return [mixed_ops(peer, each if each.startswith("/") else int(each), int(size), name)
                for each in port.split(",")]

    targets = connect(port, size)
    _say("ready")
    clock = time.perf_counter
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "target":  # a process kept for the next measurement (starting one imports torch)
            targets = connect(cmd[1], cmd[2])
            _say("ready")
            continue
        # ``go SECONDS [K]``: for that long; ``count N [K]``: N ops (CPU per request around a
        # fixed count); K: to the K-th of the ports given (default the first)
        duration, count = (float(cmd[1]), None) if cmd[0] == "go" else (float("inf"), int(cmd[1]))
        ops = targets[int(cmd[2]) if len(cmd) > 2 else 0]
        lat, moved, i = [], 0, 0
        cpu, began = os.times(), clock()  # this process's CPU (every thread), for CPU per request
        end = began + duration
        while True:
            fn, b = ops[i % 3]
            t = clock()
            fn()
            now = clock()
            lat.append(round((now - t) * 1e6))
            moved += b
            i += 1
            if (now >= end or (count is not None and i >= count)) and i % 3 == 0:
                break
        spent = os.times()
        cpu_s = spent.user + spent.system - cpu.user - cpu.system
        _say("result " + json.dumps({"ops": i, "bytes": moved, "seconds": clock() - began, "lat_us": lat,
                                     "cpu_s": cpu_s}))


def listen(port: str, peer: str, bin_name: str) -> None:
    """On every PUT of ``bin_name``: fetch it, print ``done REP MONOTONIC_TIME``."""
    import queue

    stop = threading.Event()
    threading.Thread(target=_stdin_closed, args=(stop,), daemon=True).start()
    if peer == "ts":
        from tensorshare import Client

        client = Client("127.0.0.1", int(port), timeout=60)
        reader = Client("127.0.0.1", int(port), timeout=60)
        notes: queue.SimpleQueue = queue.SimpleQueue()
        client.listen(bin_name, lambda note: notes.put(note) if note.op == "PUT" else None)
        _say("ready")
        while not stop.is_set():
            try:
                notes.get(timeout=0.2)
            except queue.Empty:
                continue
            items = reader.peek(bin_name)
            _say(f"done {items[0]['rep']} {time.monotonic()!r}")
        client.close()
        reader.close()
    else:
        import redis

        r = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=60)
        sub = r.pubsub()
        sub.subscribe(bin_name)
        deadline = time.monotonic() + 30
        while True:  # ready only once the server confirmed the subscription
            msg = sub.get_message(timeout=0.5)
            if msg is not None and msg.get("type") == "subscribe":
                break
            if time.monotonic() > deadline:
                raise SystemExit("redis did not confirm the subscription")
        _say("ready")
        while not stop.is_set():
            msg = sub.get_message(timeout=0.2)
            if msg is None or msg.get("type") != "message":
                continue
            value = r.get(bin_name)
            assert value is not None
            _say(f"done {int(msg['data'])} {time.monotonic()!r}")
        sub.close()


# ------------------------------------------------------------------ section 5: RL


def _watchdog(lifetime: str) -> None:
    """Exit (status 3) after ``lifetime`` seconds whatever happens: no worker outlives its run."""
    timer = threading.Timer(float(lifetime), os._exit, args=(3,))
    timer.daemon = True
    timer.start()


def _commands() -> tuple:
    """(queue of split command lines, None at the end; event set on ``quit`` or EOF)."""
    import queue

    lines: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def read() -> None:
        try:
            for line in sys.stdin:
                words = line.split()
                if words == ["quit"]:
                    break
                if words:
                    lines.put(words)
        finally:
            stop.set()
            lines.put(None)

    threading.Thread(target=read, name="bench-stdin", daemon=True).start()
    return lines, stop


def _start_at(t0: float) -> None:
    while True:
        left = t0 - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.01))


def _append_for(append, t0: float, seconds: float) -> None:
    """Call ``append()`` as fast as possible from monotonic ``t0`` for ``seconds``; print the count."""
    _start_at(t0)
    end, n = t0 + seconds, 0
    while True:
        append()
        n += 1
        if time.monotonic() >= end:
            break
    _say("result " + json.dumps({"appends": n, "seconds": time.monotonic() - t0}))


def _obey(commands, roll, **others) -> None:
    """Run the split command lines from ``commands`` (see ``_commands``) until its None.

    ``roll COLS T0 SECONDS``: ``roll(COLS)`` (untimed) gives the append function, which
    ``_append_for`` then calls from T0 for SECONDS.  Any other command NAME goes whole to
    ``others[NAME]`` if given; unknown commands are ignored."""
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        if cmd[0] == "roll":
            cols, t0, seconds = int(cmd[1]), float(cmd[2]), float(cmd[3])
            _append_for(roll(cols), t0, seconds)
        elif cmd[0] in others:
            others[cmd[0]](cmd)


def rl(port: str, experiment: str, lifetime: str, zero_copy: str = "1", device: str = "") -> None:
    """An RLWorker (on ``device``, if given).  ``fan REPS TIMEOUT NBYTES``: say ``fanning``, then REPS times await a new
    version and say ``done VERSION MONOTONIC_TIME OK`` (OK: 1 if the state dict has NBYTES bytes
    and every tensor's first and last element equal the version).  ``roll COLS T0 SECONDS``:
    append ``{"obs": float32 [32, COLS], "reward": float32 [32]}`` from T0 for SECONDS."""
    _watchdog(lifetime)
    import torch

    from tensorshare import RLWorker

    commands, stop = _commands()
    worker = RLWorker("127.0.0.1", int(port), experiment=experiment, timeout=120, connect_timeout=30,
                      zero_copy=zero_copy == "1", device=device or None)

    def next_version(timeout: float) -> tuple:
        """``(parameters, monotonic time they came)`` of the next version, or
        ``(None, ...)`` after ``timeout`` seconds or a stop."""
        deadline = time.monotonic() + timeout
        params = None
        while params is None and not stop.is_set() and time.monotonic() < deadline:
            params = worker.await_new_parameters(timeout=min(0.5, max(deadline - time.monotonic(), 0)))
        return params, time.monotonic()

    def fan(cmd: list[str]) -> None:
        reps, timeout, nbytes = int(cmd[1]), float(cmd[2]), int(cmd[3])
        _say("fanning")
        for _ in range(reps):
            params, now = next_version(timeout)
            if params is None:
                _say("timeout")
                break
            v = float(worker.version)
            ok = (sum(t.nbytes for t in params.values()) == nbytes
                  and all(float(t[0]) == v and float(t[-1]) == v for t in params.values()))
            params = None
            _say(f"done {worker.version} {now!r} {int(ok)}")

    def roll(cols: int):
        rollout = {"obs": torch.ones(32, cols), "reward": torch.ones(32)}
        worker.get_parameters()  # rollouts carry the version held (untimed: before T0)
        return lambda: worker.add_data(rollout)

    def hold(cmd: list[str]) -> None:
        """``hold REPS TIMEOUT``: say ``holding``, then REPS times await a new version and
        say ``held VERSION MONOTONIC_TIME CHECKSUM PARAMETER_BYTES`` (section 12)."""
        reps, timeout = int(cmd[1]), float(cmd[2])
        _say("holding")
        for _ in range(reps):
            params, now = next_version(timeout)
            if params is None:
                _say("timeout")
                break
            checksum = sum(float(params[k].double().sum()) for k in sorted(params))
            _say(f"held {worker.version} {now!r} {checksum!r} {worker.parameter_bytes}")

    _say("ready")
    try:
        _obey(commands, roll, fan=fan, hold=hold)
    finally:
        worker.stop()


def redis_roll(port: str, key: str, lifetime: str) -> None:
    """``roll COLS T0 SECONDS``: RPUSH the bytes of the same rollout (obs + reward) to ``key``."""
    _watchdog(lifetime)
    import numpy as np
    import redis

    commands, _stop = _commands()
    r = redis.Redis(host="127.0.0.1", port=int(port), socket_timeout=60)
    r.ping()

    def roll(cols: int):
        data = np.ones((32, cols), np.float32).tobytes() + np.ones(32, np.float32).tobytes()
        return lambda: r.rpush(key, data)

    _say("ready")
    try:
        _obey(commands, roll)
    finally:
        r.close()


def cuda_peek(port: str, lifetime: str) -> None:
    """``peek BIN REPS``: REPS times ``peek(BIN, device="cuda")`` until the device holds
    it (by device reference on the server's host: another process than the
    publisher's); says ``peeked MS...`` (section 13)."""
    _watchdog(lifetime)
    import torch

    import tensorshare

    commands, _stop = _commands()
    with tensorshare.Client("127.0.0.1", int(port), timeout=120, device="cuda") as client:
        torch.empty(1, device="cuda")  # CUDA up before the first read
        _say("ready")
        while True:
            cmd = commands.get()
            if cmd is None or cmd[0] == "quit":
                return
            times = []
            for _ in range(int(cmd[2])):
                start = time.perf_counter()
                held = client.peek(cmd[1])
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
                del held
            _say("peeked " + " ".join(f"{t:.3f}" for t in times))


KINDS = {"raw-send": raw_send, "echo": echo, "torch-recv": torch_recv, "async-append": async_append,
         "mixed": mixed, "listen": listen, "rl": rl, "redis-roll": redis_roll, "cuda-peek": cuda_peek}


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in KINDS:
        raise SystemExit(f"usage: python -m benchmarks.workers {{{'|'.join(KINDS)}}} ARGS...")
    KINDS[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
