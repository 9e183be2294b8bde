"""The RL demo on Ray: trainer and workers are Ray actors, parameters go through a relay per node.

    pip install 'ray[default]'   # the ray extra
    python examples/ray_rl.py [--workers 4] [--versions 20] [--address auto]

``tensorshare.ray.start()`` runs the head server (on the driver's node) and one relay
on every node of the cluster; the trainer publishes to the head, each worker reads
the parameters from its own node's relay (``tensorshare.ray.local_address()``:
same-host zero-copy, each version crosses the network once per node) and sends
its rollouts through it to the head.  Without ``--address`` a local Ray instance is
started.
"""

import argparse
import os
import time

from extras import need

need("ray", "ray")
import ray  # noqa: E402  (after the check that says which extra it is)
import torch

import tensorshare.ray

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, experiment: str, deployment: str):
        from rl_common import make_policy
        from tensorshare import RLTrainer

        torch.manual_seed(0)
        self.policy = make_policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.02)
        self.trainer = RLTrainer(*tensorshare.ray.head_address(deployment), experiment=experiment)
        self.trainer.publish_parameters(self.policy.state_dict())

    def train(self, versions: int, batch: int) -> list:
        from rl_trainer import reinforce_loss

        rewards, version = [], 0
        while version < versions:
            rollouts = []
            while len(rollouts) < batch:
                rollouts.extend(self.trainer.get_data(timeout=30))
            rewards.append(float(torch.stack([r["rewards"].sum() for r in rollouts]).mean()))
            self.optimizer.zero_grad()
            reinforce_loss(self.policy, rollouts).backward()
            self.optimizer.step()
            version = self.trainer.publish_parameters(self.policy.state_dict())
        self.trainer.stop()
        return rewards


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self, experiment: str, deployment: str, seed: int):
        from rl_common import Corridor, make_policy
        from tensorshare import RLWorker

        torch.set_num_threads(1)
        self.env = Corridor(torch.Generator().manual_seed(seed))
        self.policy = make_policy()
        self.address = tensorshare.ray.local_address(deployment)  # this node's relay
        self.worker = RLWorker(*self.address, experiment=experiment)

    def play(self, versions: int) -> dict:
        from rl_common import run_episode

        params = self.worker.get_parameters() or self.worker.await_new_parameters(timeout=30)
        self.policy.load_state_dict(params)
        episodes = 0
        while self.worker.version < versions:
            self.worker.add_data(run_episode(self.policy, self.env))
            episodes += 1
            newer = self.worker.get_parameters()
            if newer is not params:
                params = newer
                self.policy.load_state_dict(params)
        self.worker.stop()
        return {"episodes": episodes, "relay": self.address, "node": ray.get_runtime_context().get_node_id()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start one here)")
    args = parser.parse_args()

    # The actors import the demo's modules (rl_common, rl_trainer) from this directory.
    path = os.pathsep.join([EXAMPLES, os.path.dirname(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    ray.init(address=args.address, runtime_env={"env_vars": {"PYTHONPATH": path}})
    name = "ray-rl-example"
    deployment = tensorshare.ray.start(name)
    try:
        experiment = f"corridor-{os.getpid()}"
        trainer = Trainer.remote(experiment, name)
        ray.get(trainer.__ray_ready__.remote())
        workers = [Worker.remote(experiment, name, seed) for seed in range(args.workers)]
        start = time.monotonic()
        played = [w.play.remote(args.versions) for w in workers]
        rewards = ray.get(trainer.train.remote(args.versions, args.batch))
        results = ray.get(played, timeout=120)
        for version, reward in enumerate(rewards, 1):
            print(f"version {version:3d}  mean reward {reward:+.3f}")
        print(f"{sum(r['episodes'] for r in results)} episodes from {len(results)} workers in "
              f"{time.monotonic() - start:.1f}s, reading parameters from relays "
              f"{sorted({tuple(r['relay']) for r in results})}")
        print(f"learnt: mean reward {rewards[0]:+.3f} -> {rewards[-1]:+.3f}", flush=True)
    finally:
        deployment.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
