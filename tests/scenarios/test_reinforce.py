"""A policy gradient loop the way pytorch/examples' ``reinforcement_learning/reinforce.py`` writes it.

Modelled on that script (not copied): the policy is called once per environment step, each step's
``log_prob`` is kept on the policy through the episode, and one optimizer step per episode uses them all
(then ``del policy.saved_log_probs[:]``). The environment is replaced by random states and episodes of
random length. A plain ``Monitor(policy)`` at defaults, with the optimizer passed or not.

Without the optimizer, the monitor learns of it only at the first episode's end. A forward with no
optimizer known opens the next step only after a backward (a loop that updates weights by hand has one
per step): were every forward a step, the first episode's forwards would be steps whose graphs the
saved log-probs keep together, and that reads as a graph chain (a false alarm).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributions import Categorical

from helpers import open_problems
from memcallbacks import Monitor

pytestmark = pytest.mark.usefixtures("one_thread")

EPISODES = 100


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)
        self.saved_log_probs: list[torch.Tensor] = []
        self.rewards: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.dropout(self.affine1(x)))
        return torch.softmax(self.affine2(x), dim=1)


def finish_episode(policy: Policy, optimizer: torch.optim.Optimizer, gamma: float = 0.99) -> None:
    R, returns = 0.0, []
    for r in policy.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    returns_t = torch.tensor(returns)
    returns_t = (returns_t - returns_t.mean()) / (returns_t.std() + 1e-6)
    policy_loss = torch.cat([-log_prob * R for log_prob, R in zip(policy.saved_log_probs, returns_t)]).sum()
    optimizer.zero_grad()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


@pytest.mark.parametrize("pass_optimizer", [True, False], ids=["optimizer", "no-optimizer"])
def test_reinforce_is_one_step_an_episode_and_raises_no_false_alarm(tmp_path: Path, pass_optimizer: bool) -> None:
    torch.manual_seed(543)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    monitor = Monitor(policy, optimizer if pass_optimizer else None, output_dir=str(tmp_path / "mem"))
    for _ in range(EPISODES):
        state = torch.randn(4)
        for _ in range(int(torch.randint(20, 200, ()))):
            m = Categorical(policy(state.unsqueeze(0)))
            action = m.sample()
            policy.saved_log_probs.append(m.log_prob(action))
            state = torch.randn(4) + 0.01 * action.item()
            policy.rewards.append(1.0)
        finish_episode(policy, optimizer)
    monitor.close()
    report = json.loads((tmp_path / "mem" / "report.json").read_text())
    assert report["summary"]["steps_seen"] == EPISODES  # the first episode too, with no optimizer passed
    false_alarms = open_problems(report)
    assert false_alarms == [], [f["message"] for f in false_alarms]
