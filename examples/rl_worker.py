"""An RL worker: pulls the latest policy, plays episodes, pushes rollouts.

    python examples/rl_worker.py --port 8000 [--experiment corridor] [--seed 1]

Workers can be started, killed and restarted at any time; they stop when the
trainer asks them to.  A server that restarts costs a worker the rollout it was
sending: it goes on once the server is back.
"""

import argparse
import time

import torch

from rl_common import Corridor, make_policy, run_episode
from tensorshare import RLWorker
from tensorshare.errors import ConnectionLostError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--experiment", default="corridor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    env = Corridor(torch.Generator().manual_seed(args.seed))
    policy = make_policy()
    with RLWorker(args.host, args.port, experiment=args.experiment, worker_id=f"worker-{args.seed}") as worker:
        params = worker.get_parameters()
        while params is None and not worker.stop_requested:
            params = worker.await_new_parameters(timeout=5)
        if params is not None:
            policy.load_state_dict(params)
        while not worker.stop_requested:  # until the trainer calls stop_workers()
            try:
                worker.add_data(run_episode(policy, env))
                newer = worker.get_parameters()  # downloads only when a newer version exists
            except ConnectionLostError:  # the server is restarting: the client reconnects by itself
                time.sleep(1.0)
                continue
            if newer is not params:
                params = newer
                policy.load_state_dict(params)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        pass
