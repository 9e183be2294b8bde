"""Section 8: a real actor-learner run -- the same learner over three transports.

A policy-gradient learner on gymnasium's ``CartPole-v1`` with 4 actor processes
(one torch thread each), run for a fixed time per configuration over:

* **tensorshare**: ``RLTrainer`` / ``RLWorker`` against a server process
  (``publish_parameters(wait=False)``, ``get_data(max_items=n, min_items=n)``, the
  experiment capped at ``_CAP`` waiting rollouts);
* **torch.multiprocessing Queues**: one parameter queue per actor (the newest
  version replaces an unread one) and one bounded rollout queue (``_CAP``);
* **Ray actors** (where ``ray`` is installed): one rollout task in flight per actor,
  ``ray.wait`` for the first done, parameters through ``ray.put`` once per version.

Configurations: *synchronous* (every actor plays one rollout with version ``v``;
the learner steps on those 4 and publishes ``v + 1``) and *asynchronous* (actors
play with the newest parameters they have; the learner steps on any 4), each with
an 18.7 KB policy (hidden 64) and a 1 MiB one (hidden 512).  Figures: environment
steps the learner consumed per second after a warm-up, and the mean staleness
(learner version minus the version that played the rollout).  Everything shares
the machine's cores, as it would in a real run on one host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from typing import Any

import torch

from .profiles import Profile
from .record import Recorder
from .stats import Sample

_ACTORS = 4
_BATCH = 4  # rollouts per learner step
_STEPS = 32  # environment steps per rollout
_CAP = 4  # rollouts that may wait for the learner (tensorshare's max_waiting, the Queue's maxsize)
_HIDDEN = {"18.7 KB": 64, "1 MiB": 512}
_ENV = "CartPole-v1"


# ------------------------------------------------------------------ what every transport runs


def make_policy(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                               torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


class Player:
    """One actor's environment and policy: plays rollouts of ``_STEPS`` steps."""

    def __init__(self, hidden: int, seed: int):
        import gymnasium

        torch.set_num_threads(1)
        self.env = gymnasium.make(_ENV)
        self.obs, _ = self.env.reset(seed=seed)
        self.policy = make_policy(hidden)
        self.generator = torch.Generator().manual_seed(seed)

    def load(self, state: dict) -> None:
        self.policy.load_state_dict(state)

    @torch.no_grad()
    def play(self) -> dict:
        obs = torch.empty(_STEPS, 4)
        actions = torch.empty(_STEPS, dtype=torch.int64)
        rewards = torch.empty(_STEPS)
        dones = torch.empty(_STEPS, dtype=torch.bool)
        for t in range(_STEPS):
            obs[t] = torch.as_tensor(self.obs)
            probs = torch.softmax(self.policy(obs[t]), -1)
            action = int(torch.multinomial(probs, 1, generator=self.generator))
            self.obs, reward, terminated, truncated, _ = self.env.step(action)
            actions[t], rewards[t], dones[t] = action, reward, terminated or truncated
            if terminated or truncated:
                self.obs, _ = self.env.reset()
        return {"obs": obs, "actions": actions, "rewards": rewards, "dones": dones}


class Learner:
    """The policy-gradient step all transports feed (returns-to-go, normalised)."""

    def __init__(self, hidden: int):
        torch.set_num_threads(1)
        self.policy = make_policy(hidden)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-3)

    def step(self, rollouts: list[dict]) -> None:
        obs = torch.cat([r["obs"] for r in rollouts])
        actions = torch.cat([r["actions"] for r in rollouts])
        returns = torch.cat([_returns(r["rewards"], r["dones"]) for r in rollouts])
        advantages = (returns - returns.mean()) / (returns.std() + 1e-6)
        logp = torch.log_softmax(self.policy(obs), -1).gather(1, actions.unsqueeze(1)).squeeze(1)
        loss = -(logp * advantages).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def state(self) -> dict:
        return self.policy.state_dict()


def _returns(rewards: torch.Tensor, dones: torch.Tensor, gamma: float = 0.99) -> torch.Tensor:
    out, running = torch.empty_like(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running * (0.0 if dones[t] else 1.0)
        out[t] = running
    return out


class Meter:
    """Env steps consumed and staleness, counted after the warm-up."""

    def __init__(self, warmup_s: float, run_s: float):
        self.start = time.monotonic()
        self.counting_from = self.start + warmup_s
        self.until = self.counting_from + run_s
        self.steps, self.stale, self.rollouts = 0, 0, 0

    def running(self) -> bool:
        return time.monotonic() < self.until

    def took(self, learner_version: int, versions: list[int]) -> None:
        if time.monotonic() >= self.counting_from:
            self.rollouts += len(versions)
            self.steps += _STEPS * len(versions)
            self.stale += sum(learner_version - v for v in versions)

    def result(self) -> tuple[float, float]:
        elapsed = time.monotonic() - self.counting_from
        return self.steps / elapsed, self.stale / max(self.rollouts, 1)


# ------------------------------------------------------------------ tensorshare


def _ts_actor(port: int, experiment: str, hidden: int, seed: int, sync: bool) -> None:
    from tensorshare import RLWorker

    player = Player(hidden, seed)
    with RLWorker("127.0.0.1", port, experiment=experiment, timeout=120) as worker:
        while not worker.stop_requested:
            params = worker.await_new_parameters(timeout=0.5) if sync else worker.get_parameters()
            if params is None:
                if not sync:
                    worker.await_new_parameters(timeout=0.5)
                continue
            player.load(params)
            worker.add_data(player.play())


def _run_tensorshare(hidden: int, sync: bool, warmup_s: float, run_s: float) -> tuple[float, float]:
    from tensorshare import RLTrainer

    from .procs import Server

    server = Server()
    experiment = f"bench-al-{os.getpid()}-{hidden}-{sync}"
    ctx = mp.get_context("spawn")
    actors = [ctx.Process(target=_ts_actor, args=(server.port, experiment, hidden, seed, sync), daemon=True)
              for seed in range(_ACTORS)]
    try:
        with RLTrainer("127.0.0.1", server.port, experiment=experiment, filter_version=False,
                       max_waiting=_CAP, timeout=120) as trainer:
            for actor in actors:
                actor.start()
            learner = Learner(hidden)
            _wait_for(lambda: len(trainer.workers) == _ACTORS, 120)
            version = trainer.publish_parameters(learner.state(), wait=False)
            meter = Meter(warmup_s, run_s)
            while meter.running():
                batch = []
                while len(batch) < _BATCH:
                    want = _BATCH - len(batch)
                    got = trainer.get_data(max_items=want, min_items=want, timeout=30, return_info=True)
                    batch += [r for r in got if not sync or r.version == version]
                learner.step([r.data for r in batch])
                meter.took(version, [r.version for r in batch])
                version = trainer.publish_parameters(learner.state(), wait=False)
            trainer.stop_workers()
            return meter.result()
    finally:
        _end(actors)
        server.stop()


# ------------------------------------------------------------------ torch.multiprocessing Queues


def _queue_actor(params_q, rollouts_q, ready, stop, hidden: int, seed: int, sync: bool) -> None:
    player = Player(hidden, seed)
    ready.put(seed)
    version = -1
    while not stop.is_set():
        try:
            if sync or version < 0:
                version, state = params_q.get(timeout=0.5)
            else:
                try:  # the newest, if one came
                    version, state = params_q.get_nowait()
                except queue.Empty:
                    state = None
            if state is not None:
                player.load(state)
            rollout = player.play()
            while not stop.is_set():
                try:
                    rollouts_q.put((version, rollout), timeout=0.5)
                    break
                except queue.Full:
                    pass
        except queue.Empty:
            continue


def _run_queues(hidden: int, sync: bool, warmup_s: float, run_s: float) -> tuple[float, float]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    stop = ctx.Event()
    params_qs = [ctx.Queue(maxsize=1) for _ in range(_ACTORS)]
    rollouts_q, ready = ctx.Queue(maxsize=_CAP), ctx.Queue()
    actors = [ctx.Process(target=_queue_actor, args=(params_qs[i], rollouts_q, ready, stop, hidden, i, sync),
                          daemon=True) for i in range(_ACTORS)]
    for actor in actors:
        actor.start()
    try:
        for _ in actors:  # every actor has started (as tensorshare's have joined)
            ready.get(timeout=120)
        learner = Learner(hidden)
        version = 0

        def publish(v: int) -> None:
            state = {k: t.clone() for k, t in learner.state().items()}  # a snapshot, as tensorshare sends
            for q in params_qs:
                try:
                    q.get_nowait()  # an unread older version is replaced
                except queue.Empty:
                    pass
                q.put((v, state))

        publish(version)
        meter = Meter(warmup_s, run_s)
        while meter.running():
            batch = []
            while len(batch) < _BATCH:
                v, rollout = rollouts_q.get(timeout=60)
                if not sync or v == version:
                    batch.append((v, rollout))
            learner.step([r for _, r in batch])
            meter.took(version, [v for v, _ in batch])
            version += 1
            publish(version)
        return meter.result()
    finally:
        stop.set()
        _end(actors)


# ------------------------------------------------------------------ Ray


def _ray_child(configs: list, warmup_s: float, run_s: float, out) -> None:
    """Every Ray run, in a process of its own: a Ray that cannot start (or whose
    GCS dies on a loaded machine, which ends its driver) costs only this process."""
    import ray

    try:
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        for hidden, sync in configs:
            out.put(((hidden, sync), _run_ray(hidden, sync, warmup_s, run_s)))
    finally:
        ray.shutdown()


def _ray_runs(configs: list, warmup_s: float, run_s: float, runs: int) -> dict | str:
    """``{(hidden, sync): [(rate, staleness)...]}``, or why Ray could not run."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install ray)"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    results: dict = {}
    for _ in range(runs):
        child = ctx.Process(target=_ray_child, args=(configs, warmup_s, run_s, out), daemon=True)
        child.start()
        for _ in configs:
            try:
                key, value = out.get(timeout=300)
            except queue.Empty:
                break
            if key == "error":
                child.join(30)
                return f"ray did not start: {value}"
            results.setdefault(key, []).append(value)
        child.join(60)
        if child.is_alive():
            child.kill()
    return results


def _run_ray(hidden: int, sync: bool, warmup_s: float, run_s: float) -> tuple[float, float]:
    import ray

    @ray.remote(num_cpus=0)
    class Actor:
        def __init__(self, seed: int):
            self.player = Player(hidden, seed)

        def rollout(self, version: int, state: dict) -> tuple[int, dict]:
            self.player.load(state)
            return version, self.player.play()

    actors = [Actor.remote(i) for i in range(_ACTORS)]
    learner = Learner(hidden)
    version = 0
    ref = ray.put(learner.state())
    ray.get([a.__ray_ready__.remote() for a in actors])
    meter = Meter(warmup_s, run_s)
    try:
        if sync:
            while meter.running():
                batch = ray.get([a.rollout.remote(version, ref) for a in actors])
                learner.step([r for _, r in batch])
                meter.took(version, [v for v, _ in batch])
                version += 1
                ref = ray.put(learner.state())
            return meter.result()
        pending = {a.rollout.remote(version, ref): a for a in actors}  # one task in flight per actor
        batch = []
        while meter.running():
            [done], _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(done)
            batch.append(ray.get(done))
            pending[actor.rollout.remote(version, ref)] = actor
            if len(batch) >= _BATCH:
                learner.step([r for _, r in batch])
                meter.took(version, [v for v, _ in batch])
                batch = []
                version += 1
                ref = ray.put(learner.state())
        return meter.result()
    finally:
        for a in actors:
            ray.kill(a)


# ------------------------------------------------------------------ the section


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the actors did not all join")
        time.sleep(0.05)


def _end(procs: list) -> None:
    for proc in procs:
        proc.join(10)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


_TRANSPORTS = {"ts": ("tensorshare RLTrainer/RLWorker", _run_tensorshare),
               "queues": ("torch.multiprocessing Queues", _run_queues)}


def run(rec: Recorder, p: Profile, peers: Any) -> None:
    rec.begin("8. Actor-learner (CartPole, 4 actors)")
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        rec.skip("actor-learner runs", "gymnasium is not installed (pip install gymnasium)")
        return
    configs = [(hidden, sync) for hidden in _HIDDEN.values() for sync in (True, False)]
    rec.say(f"  Ray runs first, in a process of their own ({len(configs)} configurations)")
    ray = _ray_runs(configs, p.al_warmup_s, p.al_run_s, p.al_runs)
    if isinstance(ray, str):
        rec.skip("Ray actors", ray)
        ray = {}
    for size, hidden in _HIDDEN.items():
        for sync in (True, False):
            mode = "sync" if sync else "async"
            what = f"{mode}, {size} policy"
            rec.say(f"  -- {what}: {p.al_run_s:g}s per run after {p.al_warmup_s:g}s of warm-up")
            results = {name: [runner(hidden, sync, p.al_warmup_s, p.al_run_s) for _ in range(p.al_runs)]
                       for name, (label, runner) in _TRANSPORTS.items()}
            labels = {name: label for name, (label, _) in _TRANSPORTS.items()}
            if ray.get((hidden, sync)):
                results["ray"], labels["ray"] = ray[(hidden, sync)], "Ray actors"
            for name, runs in results.items():
                key = f"al.{mode}.{hidden}.{name}"
                stale = [s for _, s in runs]
                rec.figure(key, f"{labels[name]}, {what}: env steps/s", Sample.of([r for r, _ in runs]),
                           "steps/s", baseline=name != "ts",
                           note=f"mean staleness {sum(stale) / len(stale):.2f} versions",
                           chart={"name": "actor-learner", "series": labels[name], "x": what})
                rec.figure(f"{key}.stale", f"{labels[name]}, {what}: mean staleness", Sample.of(stale),
                           "versions", better="lower", baseline=name != "ts")
            ts = f"al.{mode}.{hidden}.ts"
            rec.goal_ratio(f"actor-learner {what}: tensorshare >= 1.2x torch.multiprocessing Queues",
                           ts, f"al.{mode}.{hidden}.queues", ">=", 1.2)
            if "ray" in results:
                rec.goal_ratio(f"actor-learner {what}: tensorshare >= 1.0x Ray actors", ts,
                               f"al.{mode}.{hidden}.ray", ">=", 1.0)
