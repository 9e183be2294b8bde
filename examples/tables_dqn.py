"""DQN on CartPole with a replay table in the server and actors in their own processes.

    python examples/tables_dqn.py [--actors 2] [--seconds 300] [--torchrl]

Starts ``tensorshare-server`` on a free port and ``--actors`` actor processes; this
process is the learner.  Actors play CartPole-v1 (gymnasium) epsilon-greedily with
the latest Q-network they find in the bin ``dqn/params`` and insert their
transitions, 32 at a time, into the table ``dqn/replay``; the learner samples
batches of 128 from it (in the server: one round trip, stacked tensors), trains a
Q-network against a target network and puts its parameters back every 50 updates.
The table's rate limiter (``samples_per_insert``) keeps the learner from replaying
the same transitions too often when the actors are slow, and the actors from
running far ahead.  With ``--torchrl`` the learner samples through a TorchRL
``ReplayBuffer`` over the same table (``tensorshare.torchrl.TableStorage``, with
TorchRL's own ``RandomSampler``): the rows it reads count as samples of the table,
so the rate limiter paces it as it paces the native path.

Needs ``gymnasium`` (and ``torchrl`` for ``--torchrl``): ``pip install gymnasium torchrl`` (the ``torchrl`` extra).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
from torch import nn

import tensorshare
from extras import need
from launch import server_and_processes

TABLE, PARAMS, RETURNS = "dqn/replay", "dqn/params", "dqn/returns"
COLUMNS = {"obs": ((4,), torch.float32), "action": ((), torch.int64), "reward": ((), torch.float32),
           "next_obs": ((4,), torch.float32), "done": ((), torch.float32)}


def q_network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


# -- the actors


def actor(port: int, seed: int, seconds: float) -> None:
    import gymnasium as gym

    torch.set_num_threads(1)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    net, version, steps, episode_return = q_network(), -1, 0, 0.0
    rng = torch.Generator().manual_seed(seed)
    batch: dict[str, list] = {name: [] for name in COLUMNS}
    end = time.monotonic() + seconds
    with tensorshare.Client("127.0.0.1", port, timeout=60) as client:
        while time.monotonic() < end:
            if steps % 200 == 0:  # the newest parameters, if there are newer ones
                try:
                    [published] = client.peek(PARAMS)
                    if published["version"] != version:
                        version = published["version"]
                        net.load_state_dict(published["params"])
                except tensorshare.NoSuchBinError:
                    pass
            epsilon = max(0.05, 1.0 - max(version, 0) / 10)  # a version every 50 updates
            if torch.rand(1, generator=rng).item() < epsilon:
                action = int(torch.randint(0, 2, (1,), generator=rng).item())
            else:
                with torch.no_grad():
                    action = int(net(torch.as_tensor(obs, dtype=torch.float32)).argmax())
            next_obs, reward, terminated, truncated, _ = env.step(action)
            for name, value in (("obs", obs), ("action", action), ("reward", reward), ("next_obs", next_obs),
                                ("done", float(terminated))):
                batch[name].append(torch.as_tensor(value, dtype=COLUMNS[name][1]))
            episode_return += reward
            steps += 1
            obs = next_obs
            if terminated or truncated:
                client.append(RETURNS, torch.tensor([episode_return]))
                obs, episode_return = env.reset()[0], 0.0
            if len(batch["obs"]) == 32:
                try:
                    client.insert(TABLE, {name: torch.stack(values) for name, values in batch.items()},
                                  timeout=30)  # waits while the learner is behind (samples_per_insert)
                except tensorshare.TimeoutError:
                    pass  # the learner is gone or stuck: keep playing, try again
                batch = {name: [] for name in COLUMNS}


# -- the learner


def setup(client: tensorshare.Client, args) -> nn.Module:
    """The table and the first parameters, before any actor starts."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small network: more threads only contend with the actors
    client.create_table(TABLE, 50_000, COLUMNS, sampler="uniform", remover="fifo", min_size_to_sample=1000,
                        samples_per_insert=float(args.samples_per_insert), error_buffer=50_000.0)
    net = q_network()
    client.put(PARAMS, {"version": 0, "params": net.state_dict()})
    return net


def learn(client: tensorshare.Client, net: nn.Module, args) -> float:
    target = q_network()
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    version = 0
    sample = _sampler(client, args)
    returns: list[float] = []
    start, updates, best = time.monotonic(), 0, 0.0
    while time.monotonic() - start < args.seconds and updates < args.max_updates:
        batch = sample()
        with torch.no_grad():
            best_next = target(batch["next_obs"]).max(dim=1).values
            goal = batch["reward"] + 0.99 * (1 - batch["done"]) * best_next
        q = net(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
        loss = nn.functional.smooth_l1_loss(q, goal)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        updates += 1
        if updates % 250 == 0:
            target.load_state_dict(net.state_dict())
        if updates % 50 == 0:
            version += 1
            client.put(PARAMS, {"version": version, "params": net.state_dict()}, tag=version)
        if updates % args.report_every == 0:
            try:
                returns += [float(r) for r in client.get(RETURNS)]
            except tensorshare.NoSuchBinError:
                pass
            recent = returns[-20:]
            mean = sum(recent) / max(len(recent), 1)
            best = max(best, mean)
            info = client.table_info(TABLE)
            print(f"{time.monotonic() - start:6.1f}s  updates {updates:6d}  episodes {len(returns):5d}  "
                  f"mean return (last 20) {mean:6.1f}  table {info['size']} rows, {info['inserts']} inserted, "
                  f"{info['samples']} sampled", flush=True)
            if len(recent) == 20 and mean >= args.target:
                print(f"solved: mean return {mean:.1f} over the last 20 episodes", flush=True)
                break
    print(f"done: {updates} updates, best mean return {best:.1f}", flush=True)
    return best


def _sampler(client: tensorshare.Client, args):
    if not args.torchrl:
        return lambda: client.sample(TABLE, 128, timeout=60).value  # drawn in the server
    from torchrl.data import ReplayBuffer
    from torchrl.data.replay_buffers import RandomSampler

    from tensorshare.torchrl import TableStorage

    # TorchRL's own sampler draws the indices here; the rows it reads count as samples
    # of the table, so the table's rate limiter paces this learner and the actors alike
    # (and its min_size_to_sample holds the first reads back in the server).
    rb = ReplayBuffer(storage=TableStorage(TABLE, client), sampler=RandomSampler(), batch_size=128)

    def sample():
        while not len(rb):  # (known without a round trip: the server tells of inserts)
            time.sleep(0.05)
        return rb.sample()

    return sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--max-updates", type=int, default=100_000)
    parser.add_argument("--target", type=float, default=195.0, help="mean return that ends the run")
    parser.add_argument("--report-every", type=int, default=500, help="updates between progress lines")
    parser.add_argument("--samples-per-insert", type=float, default=8.0)
    parser.add_argument("--torchrl", action="store_true", help="sample through a TorchRL ReplayBuffer")
    parser.add_argument("--role", choices=("all", "actor"), default="all", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    need("torchrl", "gymnasium", *(["torchrl"] if args.torchrl else []))
    if args.role == "actor":
        actor(args.port, args.seed, args.seconds)
        return 0

    with server_and_processes() as (port, procs), tensorshare.Client("127.0.0.1", port, timeout=60) as client:
        net = setup(client, args)
        for seed in range(args.actors):
            procs.append(subprocess.Popen([sys.executable, __file__, "--role", "actor", "--port", str(port),
                                           "--seed", str(seed), "--seconds", str(args.seconds + 30)]))
        print(f"{args.actors} actor processes started", flush=True)
        learn(client, net, args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
