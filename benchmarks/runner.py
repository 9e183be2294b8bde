"""Runs the sections of a profile, each guarded, and returns the results dict.

A section that raises is recorded as an error and the next one runs; the peers
(Redis, TCPStore) are started once, on first use, and stopped at the end; every
child process is stopped whatever happens.  The run stops starting sections once
the profile's time limit has passed (the command line also enforces it with an
alarm, see :mod:`benchmarks.__main__`).
"""

from __future__ import annotations

import os
import time

from . import actor_learner, busy_bench, client_bench, disk_bench, machine, multihost_bench, rl_bench, small_ops, scaling, wire_bench, zerocopy_bench
from . import ops_bench
from . import tables_bench
from . import scale_bench
from . import versions_bench
from . import gpu_bench
from . import floor_bench
from .baselines import RedisPeer, TCPStorePeer
from .procs import ChildError, PeerMissing, stop_all
from .profiles import Profile
from .record import Recorder

SECTIONS = {
    "wire": lambda rec, p, peers: wire_bench.run(rec, p),
    "large": client_bench.run,
    "small": small_ops.run,
    "scaling": scaling.run,
    "rl": rl_bench.run,
    "disk": disk_bench.run,
    "zerocopy": zerocopy_bench.run,
    "actors": actor_learner.run,
    "ops": ops_bench.run,
    "multihost": multihost_bench.run,
    "tables": tables_bench.run,
    "scale": scale_bench.run,
    "versions": versions_bench.run,
    "busy": busy_bench.run,
    "floor": floor_bench.run,
    "gpu": gpu_bench.run,
}


class Stopped(BaseException):
    """The run must stop now (a BaseException, so that no section's handler swallows it)."""


class RunTimeout(Stopped):
    """The profile's time limit passed."""


class Interrupted(Stopped):
    """SIGTERM or Ctrl-C."""


class Peers:
    """The peers to compare with, started on first use; a missing one is skipped with a line."""

    def __init__(self):
        self._redis: RedisPeer | None = None
        self._store: TCPStorePeer | None = None
        self._why: dict[str, str] = {}

    def redis(self, rec: Recorder, what: str) -> RedisPeer | None:
        if self._redis is None and "redis" not in self._why:
            try:
                self._redis = RedisPeer()
            except (PeerMissing, ChildError) as exc:
                self._why["redis"] = str(exc)
        if self._redis is None:
            rec.skip(what, self._why["redis"])
        return self._redis

    def tcpstore(self, rec: Recorder, what: str) -> TCPStorePeer | None:
        if self._store is None and "tcpstore" not in self._why:
            try:
                self._store = TCPStorePeer()
            except PeerMissing as exc:
                self._why["tcpstore"] = str(exc)
            except RuntimeError as exc:  # DistNetworkError and friends
                self._why["tcpstore"] = f"TCPStore did not start: {exc}"
        if self._store is None:
            rec.skip(what, self._why["tcpstore"])
        return self._store

    def close(self) -> None:
        for peer in (self._redis, self._store):
            if peer is not None:
                try:
                    peer.close()
                except Exception:
                    pass
        self._redis = self._store = None


def run(profile: Profile, sections: tuple[str, ...] | None = None, rec: Recorder | None = None) -> dict:
    """Run ``profile`` (or only ``sections`` of it); returns the results dict."""
    rec = rec or Recorder(profile.name)
    info = machine.describe()
    rec.say(f"tensorshare benchmarks, profile {profile.name}: {machine.one_line(info)}")
    load = info.get("load_avg_1m_at_start")
    if load is not None and info.get("usable_cores") and load > info["usable_cores"] / 2:
        rec.note(f"the machine was busy at the start (load average {load:.2f} on {info['usable_cores']} cores): "
                 "figures are noisier than usual; ratios to baselines of the same run hold up better")
    deadline = time.monotonic() + profile.time_limit_s
    peers = Peers()
    took: dict[str, float] = {}  # section -> seconds it ran
    try:
        for name in sections or profile.sections:
            if time.monotonic() > deadline:
                rec.skip(f"section {name}", f"the {profile.time_limit_s}s time limit of the profile has passed")
                continue
            began = time.monotonic()
            try:
                SECTIONS[name](rec, profile, peers)
            except (Stopped, KeyboardInterrupt) as exc:
                rec.error(f"section {name}", exc)
                rec.note("the run was stopped early; the results are partial")
                break
            except Exception as exc:
                rec.error(f"section {name}", exc)
            finally:
                took[name] = round(time.monotonic() - began, 1)
    finally:
        peers.close()
        stop_all()
    results = rec.as_dict()
    results["machine"] = info
    results["section_s"] = took
    try:
        info["load_avg_1m_at_end"] = os.getloadavg()[0]
    except OSError:
        pass
    results["profile_settings"] = {k: v for k, v in vars(profile).items()}
    passed = sum(g["status"] == "PASS" for g in rec.goals)
    missed = sum(g["status"] == "MISS" for g in rec.goals)
    rec.say(f"done in {results['duration_s']}s: {passed} goal(s) PASS, {missed} MISS, "
            f"{len(rec.goals) - passed - missed} SKIP, {len(rec.errors)} error(s)")
    return results
