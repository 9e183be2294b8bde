"""A tiny environment and policy for the RL examples, in plain torch (no gym needed).

The environment is a corridor of ``LENGTH`` cells: the agent starts in a random
cell, moves left or right, and the episode ends at either end: +1 at the right
end, -1 at the left, with a small cost per step.  A random policy scores about 0;
a policy that has learnt to walk right scores close to +1.
"""

from __future__ import annotations

import torch

LENGTH = 9
MAX_STEPS = 30


class Corridor:
    """The environment: ``reset() -> obs``, ``step(action) -> (obs, reward, done)``."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.position = 0
        self.steps = 0

    def observe(self) -> torch.Tensor:
        obs = torch.zeros(LENGTH)
        obs[self.position] = 1.0
        return obs

    def reset(self) -> torch.Tensor:
        self.position = int(torch.randint(1, LENGTH - 1, (1,), generator=self.generator))
        self.steps = 0
        return self.observe()

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        self.position += 1 if action == 1 else -1
        self.steps += 1
        if self.position == LENGTH - 1:
            return self.observe(), 1.0, True
        if self.position == 0:
            return self.observe(), -1.0, True
        return self.observe(), -0.01, self.steps >= MAX_STEPS


def make_policy() -> torch.nn.Module:
    """A small network from observation to the logits of the two actions."""
    return torch.nn.Sequential(torch.nn.Linear(LENGTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def run_episode(policy: torch.nn.Module, env: Corridor) -> dict:
    """Play one episode with ``policy``; returns the rollout as tensors."""
    obs, actions, rewards = [], [], []
    o, done = env.reset(), False
    with torch.no_grad():
        while not done:
            probs = torch.softmax(policy(o), dim=-1)
            a = int(torch.multinomial(probs, 1, generator=env.generator))
            obs.append(o)
            actions.append(a)
            o, r, done = env.step(a)
            rewards.append(r)
    return {"obs": torch.stack(obs), "actions": torch.tensor(actions), "rewards": torch.tensor(rewards)}
