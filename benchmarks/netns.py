"""Several hosts on one machine: network namespaces joined by a switch over shaped links.

:class:`Network` makes ``hosts`` network namespaces, each with one interface
(``eth0``, address ``10.77.0.<i+1>``) joined by a veth pair to a bridge that lives
in a namespace of its own (the switch), and shapes every link in both directions
with ``tc``: a token bucket (``tbf``) at ``rate``, plus ``netem`` delay where the
kernel has it.  So each host has its own NIC: what one host sends to eight others
goes through its one link, as on real machines.  :meth:`Network.spawn` runs a
command inside a host's namespace.  Everything is named with a random tag and
removed by :meth:`Network.close` (processes first), so runs side by side never
collide.  Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and ``ip``/``tc``:
:func:`unavailable` says why not, for tests and benchmarks to skip with.

The tests (tests/test_multihost.py) and the benchmark (benchmarks/multihost_bench.py)
use it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

SUBNET = "10.77.0"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, check=check, timeout=20)


_why_not: str | None | bool = False  # False: not checked yet


def unavailable() -> str | None:
    """Why namespaces with shaped links cannot be made here (None: they can)."""
    global _why_not
    if _why_not is not False:
        return _why_not
    if not (shutil.which("ip") and shutil.which("tc")):
        _why_not = "needs the ip and tc commands (iproute2)"
    elif os.geteuid() != 0:
        _why_not = "needs root to make network namespaces"
    else:
        try:
            with Network(1):
                _why_not = None
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or exc
            _why_not = f"cannot make network namespaces with shaped links here: {str(detail).strip()[:200]}"
    return _why_not


class Network:
    """``hosts`` namespaces on one switch (see the module docstring)."""

    def __init__(self, hosts: int, rate: str = "1gbit", delay: str | None = "0.25ms", burst: str = "256kb"):
        if not 1 <= hosts <= 200:
            raise ValueError("1 to 200 hosts")
        self.tag = "ts" + secrets.token_hex(3)
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.rate, self.delay = rate, delay
        self.delayed = False  # netem delay applied (the kernel may lack netem)
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        try:
            self._build(burst)
        except BaseException:
            self.close()
            raise

    def _build(self, burst: str) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.hosts, self.addresses)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            host_end, switch_end = f"v{self.tag}{i}a"[:15], f"v{self.tag}{i}b"[:15]
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", self.switch)
            _ip("-n", ns, "link", "set", host_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", switch_end, "up")
            for where, dev in ((ns, "eth0"), (self.switch, switch_end)):  # both directions of the link
                self._shape(where, dev, burst)

    def _shape(self, ns: str, dev: str, burst: str) -> None:
        if self.delay:
            # netem for the delay, tbf under it for the rate; tbf alone where there is no netem
            done = _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", self.delay,
                       check=False)
            if done.returncode == 0:
                self.delayed = True
                _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "tbf", "rate", self.rate,
                    "burst", burst, "latency", "50ms")
                return
        _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", burst, "latency", "50ms")

    def spawn(self, host: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside host ``host``'s namespace; stopped by :meth:`close`."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], **popen)
        self._procs.append(proc)
        return proc

    def python(self, host: int, args: list[str], **popen) -> subprocess.Popen:
        """``python args...`` in host ``host``: this interpreter, importing this checkout first."""
        env = dict(popen.pop("env", None) or os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        return self.spawn(host, [sys.executable, *args], cwd=popen.pop("cwd", REPO), env=env, **popen)

    def stop_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()

    def close(self) -> None:
        """Stop what runs in the hosts and delete every namespace (and with them the links)."""
        self.stop_processes()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_server(net: Network, host: int, *args: str, port: int = 0,
                 timeout: float = 30.0) -> tuple[subprocess.Popen, int]:
    """A ``tensorshare-server`` in host ``host``, bound to its address; ``(process, port)``."""
    return start_servers(net, [(host, args)], port=port, timeout=timeout)[0]


def start_servers(net: Network, servers: list[tuple[int, tuple]], port: int = 0,
                  timeout: float = 60.0) -> list[tuple[subprocess.Popen, int]]:
    """Servers started side by side (their start-ups overlap): ``[(host, args), ...]``
    gives ``[(process, port), ...]`` in the same order."""
    import re

    procs = [net.python(host, ["-m", "tensorshare_server", "--host", net.addresses[host], "--port", str(port),
                               *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for host, args in servers]
    started = []
    deadline = time.monotonic() + timeout
    for (host, _), proc in zip(servers, procs):
        line = proc.stdout.readline()  # the server prints it first thing (EOF if it died)
        match = re.search(r"listening on [\d.]+:(\d+)", line or "")
        if not match or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"server in {net.hosts[host]} did not start: {line!r}")
        started.append((proc, int(match.group(1))))
    return started
