"""Batch RPC processing: one agent serves the action requests of N CartPole observers.

Re-creates the batch-processing CartPole agent of the "Implementing Batch RPC
Processing Using Asynchronous Executions" tutorial:

* rank 0 is the ``agent``; ranks 1..N are observers, each with its own CartPole
  environment. The agent creates an ``Observer`` on each of them with
  ``rpc.remote`` (the destination given as a ``WorkerInfo``), wraps itself in a
  local ``RRef`` and starts one episode on every observer with
  ``ob_rref.rpc_async().run_episode(agent_rref, n_steps)``.
* for every step each observer calls back into the agent (nested RPC) with
  ``rpc_sync`` to ask for an action.
* in *batched* mode the agent's ``select_action_batch`` is a static
  ``@rpc.functions.async_execution`` function. It stores the observer's state in
  its row of a shared tensor and returns at once a future chained with ``then``
  to the shared "actions" future, keeping only that observer's action. The last
  observer to arrive runs the policy once on all rows and completes the shared
  future, which answers every waiting request together.
* in *unbatched* mode ``select_action`` runs the policy for each request.
* after each episode the agent updates the policy with REINFORCE (Adam).

It prints the reward of each episode with the running reward, both modes' times
and the speed-up of batched over unbatched. It checks that batched mode ran the
policy once per step and unbatched mode once per observer per step.

Differences from the tutorial: one world size (``--observers``, default 3)
instead of a sweep over world sizes; 100 steps and 5 episodes per mode (500 and
10 in the tutorial); gymnasium's new API (``reset(seed=...)``, five-tuple
``step``), or a built-in CartPole with the same dynamics when gymnasium is not
installed; the policy sees a copy of the shared state tensor, so that the next
round's writes do not change tensors saved for the backward pass; the futures
are waited on one by one instead of with ``torch.futures.wait_all``. Do not
expect the tutorial's speed-up on a CPU with few cores: its gain comes from
running one large GPU kernel instead of many small ones, while here batching
saves policy calls but makes every observer wait for the slowest one.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

import torchrpc.rpc as rpc
from torchrpc.examples import _launch
from torchrpc.examples._launch import say

try:
    import gymnasium
except ImportError:  # the built-in CartPole below stands in
    gymnasium = None

AGENT_NAME = "agent"
GAMMA = 0.99
EPS = float(np.finfo(np.float32).eps)


# --------------------------------------------------------------------------- environment


class BuiltinCartPole:
    """CartPole-v1 dynamics (Barto, Sutton and Anderson, 1983) with gymnasium's API."""

    GRAVITY, CART_MASS, POLE_MASS, HALF_POLE, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    X_LIMIT, THETA_LIMIT, MAX_STEPS = 2.4, 12 * 2 * math.pi / 360, 500

    def __init__(self) -> None:
        self._rng = np.random.default_rng()
        self._state = np.zeros(4)
        self._steps = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = self._rng.uniform(-0.05, 0.05, size=4)
        self._steps = 0
        return self._state.astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        x, x_dot, theta, theta_dot = self._state
        force = self.FORCE if action == 1 else -self.FORCE
        total_mass = self.CART_MASS + self.POLE_MASS
        pole_moment = self.POLE_MASS * self.HALF_POLE
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + pole_moment * theta_dot ** 2 * sin) / total_mass
        theta_acc = (self.GRAVITY * sin - cos * temp) / (
            self.HALF_POLE * (4.0 / 3.0 - self.POLE_MASS * cos ** 2 / total_mass))
        x_acc = temp - pole_moment * theta_acc * cos / total_mass
        x, x_dot = x + self.TAU * x_dot, x_dot + self.TAU * x_acc
        theta, theta_dot = theta + self.TAU * theta_dot, theta_dot + self.TAU * theta_acc
        self._state = np.array([x, x_dot, theta, theta_dot])
        self._steps += 1
        terminated = abs(x) > self.X_LIMIT or abs(theta) > self.THETA_LIMIT
        truncated = self._steps >= self.MAX_STEPS
        return self._state.astype(np.float32), 1.0, bool(terminated), truncated, {}


def make_env() -> Any:
    """gymnasium's CartPole-v1 when installed, else the built-in one."""
    if gymnasium is not None:
        return gymnasium.make("CartPole-v1")
    return BuiltinCartPole()


# --------------------------------------------------------------------------- observer


class Observer:
    """Lives on an observer rank: steps its own environment, asking the agent for actions."""

    def __init__(self, batch: bool) -> None:
        self.id = rpc.get_worker_info().id - 1   # observers are ranks 1..N
        self.env = make_env()
        self.env.reset(seed=self.id)
        self.select = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref: rpc.RRef, n_steps: int) -> tuple[list[float], list[bool]]:
        """Run ``n_steps`` steps; return the rewards and where CartPole episodes ended.

        An ended episode is reset at once, so that every step gathers exactly
        one state from every observer (batched mode needs all of them).
        """
        state, _ = self.env.reset()
        rewards: list[float] = []
        ends: list[bool] = []
        for _ in range(n_steps):
            action = rpc.rpc_sync(agent_rref.owner(), self.select,
                                  args=(agent_rref, self.id, torch.as_tensor(state)))
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(float(reward))
            ends.append(bool(terminated or truncated))
            if terminated or truncated:
                state, _ = self.env.reset()
        return rewards, ends


# --------------------------------------------------------------------------- agent


class Policy(nn.Module):
    """The tutorial's policy: 4 -> 128 -> 2 with dropout and a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=-1)


class Agent:
    """Lives on rank 0: owns the policy and drives the observers."""

    def __init__(self, num_observers: int, batch: bool) -> None:
        torch.manual_seed(0)
        self.num_observers = num_observers
        self.ob_rrefs = [
            rpc.remote(rpc.get_worker_info(f"observer{rank}"), Observer, args=(batch,))
            for rank in range(1, num_observers + 1)
        ]
        self.agent_rref = rpc.RRef(self)
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.lock = threading.Lock()
        self.saved_log_probs: list[list[torch.Tensor]] = [[] for _ in range(num_observers)]
        self.policy_calls = 0
        # Batched mode: one row per observer, and the future that the round's actions complete.
        self.states = torch.zeros(num_observers, 4)
        self.waiting = num_observers
        self.future_actions: torch.futures.Future = torch.futures.Future()

    @staticmethod
    def select_action(agent_rref: rpc.RRef, ob_id: int, state: torch.Tensor) -> int:
        """Unbatched: run the policy for this one observer and answer at once."""
        self = agent_rref.local_value()
        with self.lock:
            dist = Categorical(self.policy(state.unsqueeze(0)))
            action = dist.sample()
            self.saved_log_probs[ob_id].append(dist.log_prob(action)[0])
            self.policy_calls += 1
        return int(action.item())

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref: rpc.RRef, ob_id: int,
                            state: torch.Tensor) -> torch.futures.Future:
        """Batched: park the request; the last observer of the round runs the policy for all."""
        self = agent_rref.local_value()
        completed: torch.futures.Future | None = None
        with self.lock:
            self.states[ob_id].copy_(state)
            mine = self.future_actions.then(lambda fut: int(fut.wait()[ob_id].item()))
            self.waiting -= 1
            if self.waiting == 0:
                dist = Categorical(self.policy(self.states.clone()))
                actions = dist.sample()
                for i, log_prob in enumerate(dist.log_prob(actions)):
                    self.saved_log_probs[i].append(log_prob)
                self.policy_calls += 1
                self.waiting = self.num_observers
                completed, self.future_actions = self.future_actions, torch.futures.Future()
        if completed is not None:
            completed.set_result(actions)   # answers every parked request of this round
        return mine

    def run_episode(self, n_steps: int) -> float:
        """Run one episode on every observer, update the policy; return the mean CartPole reward."""
        futures = [ob.rpc_async().run_episode(self.agent_rref, n_steps) for ob in self.ob_rrefs]
        results = [fut.wait() for fut in futures]
        return self.finish_episode(results)

    def finish_episode(self, results: list[tuple[list[float], list[bool]]]) -> float:
        """REINFORCE update over all observers' steps; return reward per CartPole episode."""
        log_probs: list[torch.Tensor] = []
        returns: list[float] = []
        total_reward, episodes = 0.0, 0
        for ob_id, (rewards, ends) in enumerate(results):
            ob_returns: list[float] = []
            running = 0.0
            for reward, end in zip(reversed(rewards), reversed(ends), strict=True):
                running = reward + (0.0 if end else GAMMA * running)
                ob_returns.insert(0, running)
            returns.extend(ob_returns)
            log_probs.extend(self.saved_log_probs[ob_id])
            total_reward += sum(rewards)
            episodes += sum(ends) + (0 if ends and ends[-1] else 1)
        if len(log_probs) != len(returns):
            raise RuntimeError(f"agent saw {len(log_probs)} action requests for {len(returns)} steps")
        scaled = torch.tensor(returns)
        scaled = (scaled - scaled.mean()) / (scaled.std() + EPS)
        loss = -(torch.stack(log_probs) * scaled).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.saved_log_probs = [[] for _ in range(self.num_observers)]
        return total_reward / episodes


def run_mode(num_observers: int, batch: bool, args: argparse.Namespace) -> float:
    """Train for ``args.episodes`` episodes in one mode; return seconds per episode.

    The first episode is not timed: it also pays for first connections and calls.
    """
    label = "batched" if batch else "unbatched"
    agent = Agent(num_observers, batch)
    running_reward: float | None = None
    started = time.perf_counter()
    for episode in range(1, args.episodes + 1):
        if episode == 2:
            started = time.perf_counter()   # episode 1 pays for connections and first calls
        reward = agent.run_episode(args.steps)
        running_reward = reward if running_reward is None else 0.9 * running_reward + 0.1 * reward
        say(f"[{label:>9}] episode {episode}: reward {reward:6.2f}  "
            f"running reward {running_reward:6.2f}")
    seconds = (time.perf_counter() - started) / max(args.episodes - 1, 1)
    expected = args.episodes * args.steps * (1 if batch else num_observers)
    if agent.policy_calls != expected:
        raise RuntimeError(f"{label}: policy ran {agent.policy_calls} times, expected {expected}")
    per_step = agent.policy_calls / (args.episodes * args.steps)
    say(f"[{label:>9}] {seconds:.3f} s per episode after the first, "
        f"policy calls per step: {per_step:g}")
    return seconds


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Entry point of one rank: 0 is the agent, the others are observers."""
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        num_observers = world_size - 1
        env_name = "gymnasium CartPole-v1" if gymnasium is not None else "built-in CartPole"
        say(f"{AGENT_NAME}: {num_observers} observers on {env_name}, "
            f"{args.episodes} episodes of {args.steps} steps per mode")
        batched = run_mode(num_observers, True, args)
        unbatched = run_mode(num_observers, False, args)
        say(f"\nseconds per episode\nobservers  batched s  unbatched s  speed-up\n"
            f"{num_observers:>9}  {batched:>9.3f}  {unbatched:>11.3f}  "
            f"{unbatched / batched:>7.2f}x")
    else:
        rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the agent and observers; return the exit status."""
    parser = _launch.base_parser(__doc__.splitlines()[0], default_timeout=300)
    parser.add_argument("--observers", type=int, default=None, help="default 3, or 2 with --smoke")
    parser.add_argument("--episodes", type=int, default=None,
                        help="per mode, the first one untimed; default 5, or 2 with --smoke")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per observer per episode; default 100, or 20 with --smoke")
    args = parser.parse_args(argv)
    _launch.smoke_defaults(parser, args, observers=(2, 3), episodes=(2, 5), steps=(20, 100))
    return _launch.launch(run_rank, args.observers + 1, args)


if __name__ == "__main__":
    # Run through the package module so that RPC peers and spawned ranks see the
    # functions and classes under their importable names, not under __main__.
    sys.exit(importlib.import_module("torchrpc.examples.batch_rl").main())
