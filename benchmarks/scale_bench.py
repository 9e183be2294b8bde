"""Section: scale -- tables of 10^7-10^8 rows, tables larger than RAM, sequences (issue #41).

Each part makes its files in one scratch directory on the disk, removed at the end,
and checks the free disk first (a part that does not fit is shrunk or skipped, and
says so).  Rows are 64-byte transitions (``obs`` 14 float32 + ``action`` int64),
but for the table larger than RAM (28,232-byte Atari-like rows).

* **A table of ``big_rows`` rows** (quick: 10^7; full: 10^8, the goals' size) whose
  columns are files in the spill area and whose per-row state is in memory, under
  ``--memory-limit`` 2.5 GiB: the server's anonymous RSS; a prioritized sample of
  256 (server time: round trip less a NOOP's; and the round trip); priority updates
  in batches of 1,024 (rows/s); 256 sequences of 32 rows; inserts of 1 MiB from
  ``big_writers`` processes into the full table, beside raw loopback (one stream of
  1 MiB messages, taken before each run of inserts), raw sockets with the writers'
  pattern (over loopback TCP and over a Unix socket) and the disk's own rate for such
  writes (the same bytes overwritten in a file of the columns' kind, until
  ``fdatasync``), with the CPU per MiB of the server and of the writers (on 2 cores
  what bounds the rate); the writers as Clients made with their defaults (on the
  server's host, for this table in files: through shared memory, the goal's figure),
  on the Unix socket (``shared=False``) and over TCP (``zero_copy=False``), runs
  taken in turn.  Then the same rows in a durable table: seconds from
  starting the server to its first sample, after a clean stop and after kill -9.
* **Side by side at ``big_side_rows``** (10^7): TorchRL's ``LazyMemmapStorage`` +
  ``PrioritizedSampler`` in one process against the table over TCP, sample + update
  of 256 (the update sent without waiting for its reply, as a learner's loop does;
  and, beside it, waited for), and the memory of each (its process's, the server's).  TorchRL runs in a
  process of its own (:mod:`.torchrl_side`), in ``.venv-torchrl`` where the
  project's torch is not the one its C++ sampler was built for (``make bench``
  makes it), timed in turns with the table's loops (the machine's speed wanders);
  where the sampler cannot load at all, the table engine in that process stands
  in, said so.
* **A table larger than RAM** (full: twice the machine's memory if the disk has the
  room, else the most it has; quick: ``big_ram_table_bytes``): uniform samples of
  256 rows from pages not in the page cache (the server restarted after its files
  were evicted), beside random reads of 256 rows of the same file by 16 threads of
  ``preadv`` (evicted before each), in three rounds taken in turn, and the server's
  anonymous RSS against its ``--memory-limit``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tensorshare import Client

from .baselines import RawLoopback, raw_fan_in
from .procs import Server, _status
from .profiles import Profile
from .record import Recorder
from .stats import Sample, median, time_runs

BATCH, SEQ_LEN, UPDATE = 256, 32, 1024
WARM_SAMPLES = 200  # samples run after the first ones, before the goals' (see _prioritized)
PIPELINED_RUNS = 3  # runs of priority updates sent without waiting for each reply
EPISODE = 1000  # rows of an episode in the filled tables
ROW = 64
GiB = 1 << 30
DISK_RESERVE = 12 * GiB  # left free for everyone else on the disk (a table of twice 24 GiB fits beside it on 66 GiB free)


def columns() -> dict:
    return {"obs": ((14,), torch.float32), "action": ((), torch.int64)}


def rows(first: int, n: int) -> tuple[dict, torch.Tensor]:
    ids = torch.arange(first, first + n)
    return {"obs": ids.view(n, 1).expand(n, 14).float(), "action": ids}, (ids % EPISODE) == EPISODE - 1


def run(rec: Recorder, p: Profile, peers) -> None:
    rec.begin("16. Replay at scale")
    scratch = tempfile.mkdtemp(prefix="tensorshare-scale-", dir=p.big_dir or None)
    try:
        rec.say(f"  scratch directory {scratch}: {_free(scratch) / GiB:.1f} GiB free, "
                f"{_ram() / GiB:.1f} GiB of memory, load average {os.getloadavg()[0]:.1f}")
        _big_table(rec, p, scratch)
        _restart(rec, p, scratch)
        _side_by_side(rec, p, scratch)
        _larger_than_ram(rec, p, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- helpers


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _anon(server: Server) -> int:
    return _status(server.pid)["RssAnon"]


def _fill(client: Client, name: str, n: int, chunk: int = 1 << 18, priorities: bool = False) -> None:
    g = torch.Generator().manual_seed(0)
    for first in range(0, n, chunk):
        k = min(chunk, n - first)
        batch, ends = rows(first, k)
        client.insert(name, batch, torch.rand(k, generator=g) + 0.01 if priorities else None, ends=ends)


def _ms(s: float) -> float:
    return s * 1e3


def _label(n: int) -> str:
    exp = int(round(np.log10(n))) if n > 0 else 0
    return f"10^{exp}" if 10 ** exp == n else f"{n:,}"


# -- 10^8 rows


def _big_table(rec: Recorder, p: Profile, scratch: str) -> None:
    n = p.big_rows
    need = n * ROW + min(n * ROW, DISK_WRITE_MAX) + (1 << 30)
    if _free(scratch) - need < DISK_RESERVE // 4:
        rec.skip(f"scale: the table of {_label(n)} rows", f"{need / GiB:.1f} GiB of disk needed")
        return
    size = _label(n)
    limit = max(256 << 20, int(n * 25.6))  # its per-row state (about 22.6 bytes a row) fits, its columns do not
    server = Server("--memory-limit", str(limit), "--spill-dir", os.path.join(scratch, "spill"))
    try:
        with Client("127.0.0.1", server.port, timeout=600, zero_copy=False) as client:
            client.create_table("big", n, columns(), sampler="prioritized", priority_exponent=0.6, remover="fifo")
            started = time.perf_counter()
            _fill(client, "big", n, priorities=True)
            rec.say(f"  filled {size} rows of {ROW} B in {time.perf_counter() - started:.1f}s")
            _prioritized(rec, p, client, size)
            rec.figure("scale.anon_rss", f"server anonymous RSS, a table of {size} rows ({n * ROW / GiB:.1f} GiB "
                       f"of columns in files, --memory-limit {limit / GiB:.2f} GiB)", Sample.of([_anon(server) / GiB]),
                       "GiB", better="lower", note=f"VmRSS {_status(server.pid)['VmRSS'] / GiB:.2f} GiB")
        _writers(rec, p, server, size, scratch)
        rec.figure("scale.anon_rss_after_inserts", f"server anonymous RSS after the writers, {size} rows",
                   Sample.of([_anon(server) / GiB]), "GiB", better="lower")
    finally:
        server.stop()
    if n >= 10 ** 8:
        rec.goal_value("10^8 rows of 64 B: server anonymous RSS <= 2.5 GiB", "scale.anon_rss", "<=", 2.5)
        rec.goal_value("10^8 rows: prioritized sample of 256, p50 server time <= 2 ms", "scale.prio_server", "<=", 2.0)
        rec.goal_value("10^8 rows: prioritized sample of 256, p50 round trip <= 5 ms", "scale.prio_rt", "<=", 5.0)
        rec.goal_value("10^8 rows: priority updates in batches of 1,024 >= 1 M rows/s", "scale.updates", ">=", 1e6)
        rec.goal_value("10^8 rows: 256 sequences of 32 steps, p50 <= 10 ms", "scale.sequences", "<=", 10.0)
        rec.goal_ratio("10^8 rows: inserts from 8 writers >= 0.5x raw loopback", "scale.inserts", "scale.loopback",
                       ">=", 0.5)
    else:
        rec.note(f"the scale goals are stated at 10^8 rows (make bench-full); this run measured {size}")


def _prioritized(rec: Recorder, p: Profile, client: Client, size: str) -> None:
    reps, warm = p.big_reps, p.warmup
    # The first samples after the fill pay for cold address translation, not for the
    # table: gathering 512 random rows of 64 B from a 6 GB mapping just written (every
    # page mapped, no fault) took 6.4 ms, then less with each gather, 0.05 ms after 30,
    # in a process of its own on this virtual machine.  Those are a figure of their own;
    # the goals' are taken once WARM_SAMPLES more have run.
    def sample():
        return client.sample("big", BATCH)

    first = time_runs(sample, reps, 0)
    rec.figure("scale.prio_first", f"the first {reps} prioritized samples of {BATCH} after filling {size} rows, "
               f"round trip", Sample.of(first).map(_ms), "ms", better="lower")
    time_runs(sample, WARM_SAMPLES, 0)
    pings = time_runs(client.ping, reps, warm)
    noop = median(pings)
    rec.figure("scale.noop", "a NOOP round trip", Sample.of(pings).map(_ms), "ms", better="lower", baseline=True)
    times = time_runs(sample, reps, warm)
    rec.figure("scale.prio_rt", f"prioritized sample of {BATCH} from {size} rows, round trip",
               Sample.of(times).map(_ms), "ms", better="lower", vs=["scale.noop"])
    rec.figure("scale.prio_server", f"prioritized sample of {BATCH} from {size} rows, server time (less a NOOP)",
               Sample.of([max(t - noop, 0.0) for t in times]).map(_ms), "ms", better="lower")
    keys: list = []
    new = torch.rand(UPDATE) + 0.01
    times = time_runs(lambda: client.update_priorities("big", keys[-1], new), reps, warm,
                      setup=lambda: keys.append(client.sample("big", UPDATE).keys))
    rec.figure("scale.updates", f"priority updates in batches of {UPDATE} on {size} rows (round trips)",
               Sample.of(times).map(lambda t: UPDATE / t), "rows/s")
    # Sent back to back with update_priorities_nowait, as a learner that sends several
    # updates a step would.  Each such call first settles the one before it (its error,
    # if any, is raised a call late, never later: tensorshare/_client/unawaited.py), so
    # one is in flight at a time: this is a round trip's rate less the client's turn
    # between them, not the server's alone.
    rates = []
    for _ in range(PIPELINED_RUNS):
        batches = [client.sample("big", UPDATE).keys for _ in range(reps)]
        start = time.perf_counter()
        for batch in batches:
            client.update_priorities_nowait("big", batch, new)
        client.flush()
        rates.append(reps * UPDATE / (time.perf_counter() - start))
    rec.figure("scale.updates_pipelined", f"priority updates in batches of {UPDATE} on {size} rows, "
               f"{reps} sent back to back with update_priorities_nowait (each settles the one before it: one "
               f"in flight)", Sample.of(rates), "rows/s",
               vs=["scale.updates"])
    times = time_runs(lambda: client.sample("big", BATCH, length=SEQ_LEN), reps, warm)
    rec.figure("scale.sequences", f"{BATCH} sequences of {SEQ_LEN} rows (episodes of {EPISODE}) from {size} rows, "
               f"prioritized, round trip", Sample.of(times).map(_ms), "ms", better="lower")


def _writer(port: int, start: float, run_s: float, batch: int, zero_copy: bool, shared: bool | None) -> tuple[int, float]:
    """Rows inserted in ``run_s`` seconds from ``start`` on, and the CPU seconds it took."""
    data, ends = rows(0, batch)
    done = 0
    with Client("127.0.0.1", port, timeout=120, zero_copy=zero_copy) as client:
        time.sleep(max(0.0, start - time.time()))
        cpu = time.process_time()
        while time.time() < start + run_s:
            client.insert("big", data, ends=ends, shared=shared)
            done += batch
        return done, time.process_time() - cpu


# How the writers reach the server: figure suffix -> (Client's zero_copy, insert's shared, in words)
WAYS = {
    # as a Client made with its defaults on the server's host does: its connection on the
    # server's Unix socket (PROTOCOL.md §10.1), and for this table in files, told so by the
    # first insert's reply, its batches through shared memory (§10.4) (the goal's figure)
    "": (True, None, "each a Client with its defaults (on the server's host: through shared memory)"),
    # shared=False: the rows in the request, on the server's Unix socket
    "_unix": (True, False, "on the server's Unix socket (insert(..., shared=False))"),
    # zero_copy=False: the socket is TCP, as from another host (here over loopback)
    "_tcp": (False, False, "over TCP (Client(zero_copy=False))"),
}


def _writers(rec: Recorder, p: Profile, server: Server, size: str, scratch: str) -> None:
    """Inserts of 1 MiB from ``big_writers`` processes, each way of :data:`WAYS` in
    turn, beside raw sockets' baselines taken in the same turns: one stream over
    loopback TCP (the goal's), and the writers' pattern over loopback TCP and over a
    Unix socket (no table)."""
    batch = (1 << 20) // ROW
    _disk_write(rec, scratch, min(p.big_rows * ROW, DISK_WRITE_MAX))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensorshare.client", "benchmarks.scale_bench"])
    rates: dict = {k: [] for k in WAYS}
    server_ms: dict = {k: [] for k in WAYS}
    writers_ms: dict = {k: [] for k in WAYS}
    loopback: list[float] = []
    fan_in: dict = {False: [], True: []}  # unix -> GB/s
    with ctx.Pool(p.big_writers) as pool, RawLoopback(1 << 20) as raw:
        pool.map(abs, range(p.big_writers))
        for _ in range(p.tables_runs):
            # the writers' pattern over raw sockets: what the machine's loopback and CPUs
            # give 8 processes sending to one (the goal is against the one stream)
            for unix in fan_in:
                fan_in[unix].append(raw_fan_in(pool, p.big_writers, 1 << 20, p.big_run_s, p.pool_lead_s, unix) / 1e9)
            for way, (zero_copy, shared, _) in WAYS.items():
                # The baseline in turns with the inserts: on this machine it moved from
                # 1.5 to 4.9 GB/s between runs an hour apart, far more than they did.
                loopback += raw.one_way(1 << 20, max(p.big_reps, 20) // 2, p.warmup)
                start = time.time() + p.pool_lead_s  # each connects first
                before = server.cpu_seconds()
                done = pool.starmap(_writer, [(server.port, start, p.big_run_s, batch, zero_copy, shared)]
                                    * p.big_writers)
                mib = sum(n for n, _ in done) * ROW / (1 << 20)
                rates[way].append(mib * (1 << 20) / p.big_run_s / 1e9)
                # (the server's CPU from before the writers connect to after the last reply: a little more than theirs)
                server_ms[way].append((server.cpu_seconds() - before) / mib * 1e3)
                writers_ms[way].append(sum(c for _, c in done) / mib * 1e3)
    rec.figure("scale.loopback", "raw loopback, one stream of 1 MiB messages (taken before each run of inserts)",
               Sample.of(loopback).map(lambda t: (1 << 20) / t / 1e9), "GB/s", baseline=True)
    pattern = f"{p.big_writers} processes each sending 1 MiB messages to one receiver and waiting for a byte of answer"
    rec.figure("scale.loopback_fan_in", f"raw loopback TCP, {pattern} (the writers' pattern, no table)",
               Sample.of(fan_in[False]), "GB/s", baseline=True)
    rec.figure("scale.unix_fan_in", f"raw Unix socket, {pattern} (the writers' pattern, no table; buffers as a "
               "same-host client's)", Sample.of(fan_in[True]), "GB/s", baseline=True)
    what = f"inserts of 1 MiB ({batch} rows) from {p.big_writers} processes into the full table of {size} rows"
    against = {"": ["scale.loopback", "scale.unix_fan_in", "scale.loopback_fan_in", "scale.disk_write"],
               "_unix": ["scale.loopback", "scale.unix_fan_in", "scale.inserts"],
               "_tcp": ["scale.loopback", "scale.loopback_fan_in", "scale.inserts"]}
    for way, (_, _, how) in WAYS.items():
        rec.figure(f"scale.inserts{way}", f"{what}, {how}", Sample.of(rates[way]), "GB/s", vs=against[way])
    for way, (_, _, how) in WAYS.items():
        rec.figure(f"scale.insert_server_cpu{way}", f"the server's CPU per MiB inserted, writers {how} (user + system)",
                   Sample.of(server_ms[way]), "ms", better="lower")
        rec.figure(f"scale.insert_writers_cpu{way}", f"the {p.big_writers} writers' CPU per MiB inserted, {how}",
                   Sample.of(writers_ms[way]), "ms", better="lower")


DISK_WRITE_MAX = 8 * GiB  # past the kernel's dirty-page limits (20% of the memory here): what the disk sustains


def _disk_write(rec: Recorder, directory: str, nbytes: int) -> None:
    """The disk's own rate for the writes inserts make: ``nbytes`` into a file of the
    columns' kind (its blocks reserved, then written once, as a filled table's are),
    overwritten with pwrite of 1 MiB in order, as a ring's inserts overwrite its
    rows, until ``fdatasync`` returns (then its pages leave the page cache: the
    table's stay)."""
    path = os.path.join(directory, "disk-write.bin")
    chunk = np.frombuffer(os.urandom(1 << 20), np.uint8)
    nbytes -= nbytes % len(chunk)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        times = []
        for _ in range(2):  # the first pass writes the file, the second overwrites it
            started = time.perf_counter()
            for offset in range(0, nbytes, len(chunk)):
                os.pwrite(fd, chunk, offset)
            os.fdatasync(fd)
            times.append(time.perf_counter() - started)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        os.unlink(path)
    rec.figure("scale.disk_write", f"the disk's own write rate: {nbytes / 1e9:.2f} GB overwritten in a file of the "
               "columns' kind, pwrite of 1 MiB in order, until fdatasync", Sample.of([nbytes / times[1] / 1e9]), "GB/s",
               baseline=True, note=f"written the first time: {nbytes / times[0] / 1e9:.2f} GB/s")


# -- restart


def _serving(*args: str) -> tuple[Server, float]:
    """A server started with ``args``; the seconds until it answered a sample of its table."""
    started = time.perf_counter()
    server = Server(*args, start_timeout=600)
    try:
        with Client("127.0.0.1", server.port, timeout=600, zero_copy=False) as client:
            client.sample("durable", BATCH)
    except BaseException:
        server.stop()  # (kills it if need be, and waits for it)
        raise
    return server, time.perf_counter() - started


def _restart(rec: Recorder, p: Profile, scratch: str) -> None:
    n = p.big_rows
    if _free(scratch) - n * 30 - (1 << 30) < DISK_RESERVE // 4:
        rec.skip("scale: durable restart", "not enough disk")
        return
    data = os.path.join(scratch, "data")
    size = _label(n)
    servers = [Server("--data-dir", data)]  # every one started, each stopped (killed and waited for) at the end
    try:
        with Client("127.0.0.1", servers[0].port, timeout=600, zero_copy=False) as client:
            client.create_table("durable", n, columns(), sampler="prioritized", priority_exponent=0.6)
            _fill(client, "durable", n, priorities=True)
        servers[0].stop()  # SIGTERM: a clean stop
        server, clean = _serving("--data-dir", data)
        servers.append(server)
        server.proc.kill()  # SIGKILL
        server.proc.wait(30)
        server, killed = _serving("--data-dir", data)
        servers.append(server)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(data, ignore_errors=True)
    rec.figure("scale.restart", f"a durable table of {size} rows: from start to its first sample, after a clean stop",
               Sample.of([clean]), "s", better="lower")
    rec.figure("scale.restart_killed", f"a durable table of {size} rows: from start to its first sample, after "
               f"kill -9 (its trees rebuilt from its rows)", Sample.of([killed]), "s", better="lower")
    if n >= 10 ** 8:
        rec.goal_value("a durable table of 10^8 rows serves within 5 s of start", "scale.restart", "<=", 5.0)


# -- side by side with TorchRL, in process


class _TorchRLSide:
    """TorchRL's LazyMemmapStorage + PrioritizedSampler of ``n`` rows in a process of its
    own (:mod:`.torchrl_side`, under ``TENSORSHARE_TORCHRL_PYTHON`` where set: an
    environment whose TorchRL loads its C++ sampler), timed a turn at a time.  Where
    the sampler cannot load, the process starts again with the table's engine
    standing in for it (:attr:`what` says so).  It fills its buffer while the caller
    fills the table."""

    def __init__(self, n: int, scratch: str):
        self._args = (str(n), scratch)
        self._errors = tempfile.TemporaryFile(mode="w+")
        self.proc = self._start(os.environ.get("TENSORSHARE_TORCHRL_PYTHON") or sys.executable)
        self.what = ""

    def _start(self, python: str, *more: str) -> subprocess.Popen:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.Popen([python, "-m", "benchmarks.torchrl_side", *self._args, *more], cwd=root, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors)

    def ready(self) -> None:
        """Wait until its buffer is filled (started again with the stand-in if need be)."""
        said = self._line()
        if "error" in said:
            self.proc.wait(60)
            self.proc = self._start(sys.executable, "--stand-in", said["error"])
            said = self._line()
        self.what = said["ready"]

    def run(self, reps: int, warm: int) -> list[float]:
        """Seconds of each of ``reps`` learner's steps (after ``warm`` untimed)."""
        self.proc.stdin.write(f"run {reps} {warm}\n")
        self.proc.stdin.flush()
        return self._line()["times"]

    def finish(self) -> tuple[int, int]:
        """The anonymous and resident memory its process grew by; it exits."""
        self.proc.stdin.close()
        said = self._line()
        self.proc.wait(60)
        return said["anon"], said["rss"]

    def stop(self) -> None:
        self._end()
        self._errors.close()

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def _line(self, timeout: float = 1800) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self._end()
            self._errors.seek(0)
            raise RuntimeError(f"the TorchRL side {'exited' if ready else 'took too long'} "
                               f"({self.proc.returncode}): {self._errors.read()[-500:]}")
        return json.loads(line)


# Turns of the side by side: short ones (a dozen steps of each form in the quick profile),
# so that this machine's slow spells, which come and go within seconds, fall on TorchRL's
# steps and the table's alike (in 5 turns of 60 steps the ratio of medians went from 0.82x
# to 1.14x between runs), the forms in turn first, and each warmed again at each turn.
TURNS = 25
WARM_STEPS = 4


def _side_by_side(rec: Recorder, p: Profile, scratch: str) -> None:
    n = p.big_side_rows
    size = _label(n)
    if not os.environ.get("TENSORSHARE_TORCHRL_PYTHON"):
        try:
            import torchrl  # noqa: F401
        except ImportError as exc:
            rec.skip("scale: side by side with TorchRL", f"torchrl is not installed ({exc})")
            return
    reps = 10 * p.big_reps  # (a millisecond each: enough of them for a steady median)
    side = _TorchRLSide(n, os.path.join(scratch, "torchrl"))  # (fills its buffer while the table fills)
    try:
        server = Server()
        try:
            with Client("127.0.0.1", server.port, timeout=600, zero_copy=False) as client:
                client.create_table("side", n, columns(), sampler="prioritized", priority_exponent=0.6)
                _fill(client, "side", n, priorities=True)
                new = torch.rand(BATCH) + 0.01

                def once():  # a learner's loop: the update is not waited for (the next sample reads its reply)
                    s = client.sample("side", BATCH)
                    client.update_priorities_nowait("side", s.keys, new)

                def waited():
                    s = client.sample("side", BATCH)
                    client.update_priorities("side", s.keys, new)

                last = [client.sample("side", BATCH).keys]

                def carried():  # the last update rides on the next sample: one request a step
                    last[0] = client.sample("side", BATCH, update=(last[0], new)).keys

                side.ready()
                local, times, waits, ones = [], [], [], []
                turns = min(TURNS, reps)
                each, warm = reps // turns, max(p.warmup, WARM_STEPS)

                def nowait_runs():
                    runs = time_runs(once, each, warm)
                    client.flush()  # (the last update's outcome: an error would be raised here)
                    return runs

                forms = [(local, lambda: side.run(each, warm)), (times, nowait_runs),
                         (waits, lambda: time_runs(waited, each, warm)), (ones, lambda: time_runs(carried, each, warm))]
                for turn in range(turns):  # in turns, TorchRL's too: load from elsewhere falls on all alike
                    for k in range(len(forms)):  # (each form first in a turn as often as the others)
                        runs, run = forms[(turn + k) % len(forms)]
                        runs.extend(run())
                status = _status(server.pid)
        finally:
            server.stop()
        anon, rss = side.finish()
    finally:
        side.stop()
        shutil.rmtree(os.path.join(scratch, "torchrl"), ignore_errors=True)
    rec.figure("scale.local_prio", f"in process, {size} rows: LazyMemmapStorage + {side.what}, sample + update of "
               f"{BATCH}", Sample.of(local).map(_ms), "ms", better="lower", baseline=True,
               note=f"its memory: anonymous {anon / GiB:.2f} GiB, resident {rss / GiB:.2f} GiB")
    rec.figure("scale.table_prio", f"the table over TCP, {size} rows: sample + update of {BATCH} "
               f"(update_priorities_nowait, as a learner's loop)",
               Sample.of(times).map(_ms), "ms", better="lower", vs=["scale.local_prio"],
               note=f"the server's memory: anonymous {status['RssAnon'] / GiB:.2f} GiB "
                    f"(columns {n * ROW / GiB:.2f} GiB in it)")
    rec.figure("scale.table_prio_waited", f"the table over TCP, {size} rows: sample + update of {BATCH}, "
               f"each update waited for", Sample.of(waits).map(_ms), "ms", better="lower", vs=["scale.local_prio"])
    rec.figure("scale.table_prio_one", f"the table over TCP, {size} rows: sample + update of {BATCH}, the "
               f"update carried by the next sample (sample(update=...): one request a step)",
               Sample.of(ones).map(_ms), "ms", better="lower", vs=["scale.local_prio"])
    # The goal is a learner's loop at its best: the update carried by the next sample (the same
    # order of operations as update_priorities_nowait + sample, one request instead of two);
    # the other two forms are recorded beside it.
    rec.goal_ratio(f"{size} rows: sample + update of 256 through the table <= 1.0x the in-process time",
                   "scale.table_prio_one", "scale.local_prio", "<=", 1.0)


# -- larger than RAM


OBS = (4, 84, 84)
WIDE = 4 * 84 * 84 + 8 + 4  # obs, action (int64), reward (float32)


def _wide(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randint(0, 256, (n, *OBS), dtype=torch.uint8, generator=g),
            "action": torch.randint(0, 6, (n,), generator=g), "reward": torch.rand(n, generator=g)}


def _evict(directory: str) -> None:
    """Drop the clean pages of every file under ``directory`` from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


WIDTHS = {"obs": 4 * 84 * 84, "action": 8, "reward": 4}
RAM_ROUNDS = 3


def _preads(table: str, n: int, reps: int, warm: int, directory: str) -> list[float]:
    """Seconds per read of 256 random rows of the table's column files (each row's
    part of every column) by 16 threads of preadv, the files evicted before each."""
    outs = {c: np.empty((BATCH, w), np.uint8) for c, w in WIDTHS.items()}
    rng = np.random.default_rng(3)
    fds = {c: os.open(os.path.join(table, f"{c}.memmap"), os.O_RDONLY) for c in WIDTHS}
    try:
        with ThreadPoolExecutor(16) as pool:
            def once():
                idx = rng.integers(0, n, BATCH)

                def part(ks):
                    for k in ks:
                        for c, w in WIDTHS.items():
                            os.preadv(fds[c], [memoryview(outs[c][k])], int(idx[k]) * w)

                list(pool.map(part, np.array_split(np.arange(BATCH), 16)))

            return time_runs(once, reps, warm, setup=lambda: _evict(directory))
    finally:
        for fd in fds.values():
            os.close(fd)


def _larger_than_ram(rec: Recorder, p: Profile, scratch: str) -> None:
    ram, free = _ram(), _free(scratch)
    want = p.big_ram_table_bytes or 2 * ram
    room = free - DISK_RESERVE
    nbytes = min(want, room)
    if nbytes < min(want, 256 << 20):
        rec.skip("scale: the table larger than RAM", f"{free / GiB:.1f} GiB free, {DISK_RESERVE / GiB:.0f} GiB kept "
                 "for others")
        return
    if nbytes < want:
        rec.note(f"the table meant to be {want / GiB:.1f} GiB is {nbytes / GiB:.1f} GiB: the disk had "
                 f"{free / GiB:.1f} GiB free and {DISK_RESERVE / GiB:.0f} GiB are left for others")
    n = nbytes // WIDE
    data = os.path.join(scratch, "wide")
    limit = "512MiB"
    name = "wide"
    directory = os.path.join(data, "tables", hashlib.sha256(name.encode()).hexdigest()[:32])
    server = Server("--data-dir", data, "--memory-limit", limit)
    try:
        with Client("127.0.0.1", server.port, timeout=600, zero_copy=False) as client:
            client.create_table(name, n, {"obs": (OBS, torch.uint8), "action": ((), torch.int64),
                                          "reward": ((), torch.float32)}, remover="fifo")
            chunk = _wide(64, 0)
            started = time.perf_counter()
            for first in range(0, n, 64):
                k = min(64, n - first)
                client.insert(name, {c: v[:k] for c, v in chunk.items()} if k < 64 else chunk)
            rec.say(f"  filled {n:,} rows of {WIDE} B ({n * WIDE / GiB:.1f} GiB, {n * WIDE / ram:.2f}x the memory) "
                    f"in {time.perf_counter() - started:.0f}s")
        server.stop()
        reads, times, anons = [], [], []
        reps = max(1, p.tables_reps // RAM_ROUNDS)
        rate = (lambda t: BATCH * WIDE / t / 1e9)

        def read() -> None:
            _evict(data)
            reads.extend(_preads(directory, n, reps, p.warmup, data))

        def sample() -> None:
            _evict(data)
            server = Server("--data-dir", data, "--memory-limit", limit, start_timeout=600)
            try:
                with Client("127.0.0.1", server.port, timeout=600, zero_copy=False) as client:
                    times.extend(time_runs(lambda: client.sample(name, BATCH), reps, p.warmup))
                    anons.append(_anon(server))
            finally:
                server.stop()

        # In turns, a busy disk (shared) slowing both alike, and each first in as many
        # rounds: a virtual disk's burst allowance, spent by the first, slowed the second.
        for turn in range(RAM_ROUNDS):
            for step in ((read, sample) if turn % 2 == 0 else (sample, read)):
                step()
            rec.say(f"  round {turn + 1} ({'reads' if turn % 2 == 0 else 'samples'} first): samples "
                    f"{rate(median(times[-reps:])):.3f} GB/s, reads {rate(median(reads[-reps:])):.3f} GB/s")
        rec.figure("scale.preads", f"random reads of {BATCH} rows of the same files (its 3 columns), 16 threads of "
                   "preadv, from disk", Sample.of(reads).map(rate), "GB/s", baseline=True)
        rec.figure("scale.ram_sample", f"uniform sample of {BATCH} from a table of {nbytes / ram:.2f}x the memory "
                   f"({n:,} rows of {WIDE} B), from disk (the server started on an evicted page cache, "
                   f"{RAM_ROUNDS} rounds in turn with the reads)", Sample.of(times).map(rate), "GB/s",
                   vs=["scale.preads"])
        rec.figure("scale.ram_anon", f"server anonymous RSS serving it (--memory-limit {limit})",
                   Sample.of([max(anons) / (1 << 20)]), "MiB", better="lower")
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    rec.goal_ratio("a table larger than RAM: uniform samples of 256 >= 0.8x the random-read rate of its files",
                   "scale.ram_sample", "scale.preads", ">=", 0.8)
    rec.goal_value("a table larger than RAM: server anonymous RSS within --memory-limit (512 MiB)", "scale.ram_anon",
                   "<=", 512)
