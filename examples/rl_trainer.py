"""An RL trainer: REINFORCE on the rollouts that workers send, publishing each new policy.

    python examples/rl_trainer.py --port 8000 [--versions 40] [--batch 32]

Prints, per version: mean episode reward, rollouts per second (all workers together,
over the whole loop), and how many rollouts were dropped for being made with a
policy more than ``max_staleness`` versions old; every ten versions, the
live workers (the version each holds, its rollouts/s). Workers that join or leave
are announced; at the end the trainer asks them to stop.
"""

import argparse
import time

import torch

from rl_common import make_policy
from tensorshare import RLTrainer


def reinforce_loss(policy: torch.nn.Module, rollouts: list) -> torch.Tensor:
    """Policy-gradient loss with the batch's mean return as baseline."""
    returns = torch.stack([r["rewards"].sum() for r in rollouts])
    advantages = returns - returns.mean()
    loss = 0.0
    for rollout, advantage in zip(rollouts, advantages):
        logp = torch.log_softmax(policy(rollout["obs"]), dim=-1)
        chosen = logp.gather(1, rollout["actions"].unsqueeze(1)).sum()
        loss = loss - advantage * chosen
    return loss / len(rollouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--experiment", default="corridor")
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--host-server", action="store_true", help="run the server inside this process")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="every N versions, store policy and optimizer state in the server")
    parser.add_argument("--resume", action="store_true", help="start from the checkpoint stored in the server")
    parser.add_argument("--no-stop", action="store_true", help="leave the workers running at the end")
    args = parser.parse_args()

    torch.manual_seed(0)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.02)
    with RLTrainer(args.host, args.port, host_server=args.host_server, experiment=args.experiment,
                   max_waiting=args.batch,  # workers wait rather than run far ahead of the learner
                   on_join=lambda w: print(f"worker {w.id} joined", flush=True),
                   on_leave=lambda w: print(f"worker {w.id} left", flush=True)) as trainer:
        checkpoint_bin = f"{args.experiment}/checkpoint"
        if args.resume:  # a learner that failed over: its state as last checkpointed
            [saved] = trainer.client.peek(checkpoint_bin)
            policy.load_state_dict(saved["policy"])
            optimizer.load_state_dict(saved["optimizer"])
            print(f"resumed from the checkpoint of version {saved['version']}; "
                  f"the server's latest version is {trainer.version}", flush=True)
        version = trainer.publish_parameters(policy.state_dict())
        first_reward = None
        last = time.monotonic()
        while version < args.versions:
            batch = []
            while len(batch) < args.batch:  # wakes on arrival; never polls
                batch.extend(trainer.get_data(max_items=args.batch - len(batch), timeout=30))
            # The rate of the whole loop (waiting, training, publishing), which is what the
            # workers sustain together: rollouts wait in the server while the learner trains,
            # so the wait for one batch alone says how fast the learner takes, not how fast
            # they come.
            now = time.monotonic()
            elapsed, last = now - last, now
            mean_reward = float(torch.stack([r["rewards"].sum() for r in batch]).mean())
            first_reward = mean_reward if first_reward is None else first_reward
            optimizer.zero_grad()
            reinforce_loss(policy, batch).backward()
            optimizer.step()
            version = trainer.publish_parameters(policy.state_dict(), wait=False)  # the learner goes on at once
            print(f"version {version:3d}  mean reward {mean_reward:+.3f}  "
                  f"{len(batch) / elapsed:7.1f} rollouts/s  dropped (older than max_staleness) {trainer.dropped}",
                  flush=True)
            if args.checkpoint_every and version % args.checkpoint_every == 0:
                # Optimizer state too (its int-keyed dicts travel as they are); with the server's
                # --data-dir it outlives both this process and the server.
                trainer.client.put(checkpoint_bin, {"version": version, "policy": policy.state_dict(),
                                                    "optimizer": optimizer.state_dict()})
                print(f"checkpoint at version {version}", flush=True)
            if version % 10 == 0:
                live = ", ".join(f"{w.id} (v{w.version}, {w.rate:.0f}/s)" for w in trainer.workers.values())
                print(f"live workers: {live}", flush=True)
        print(f"learnt: mean reward {first_reward:+.3f} -> {mean_reward:+.3f}", flush=True)
        if not args.no_stop:
            trainer.stop_workers()


if __name__ == "__main__":
    main()
