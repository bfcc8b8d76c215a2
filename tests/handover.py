"""A ring's state handed from one node to another (rejoin, a hot spare's takeover, a grown
cluster's join): a node trained a few steps sends it, another (another initialisation, dtype or
device) loads it, and both train on alike (tests/unit/test_rejoining.py, tests/gpu)."""

from __future__ import annotations

import json

import torch
from torch import nn

from ravnest.plan.partitioning import OUTPUT, build_stage, profile
from ravnest.train.messages import State, parse
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.optimizing import Optimization
from ravnest.train.rejoining import pack_state, unpack_state
from ravnest.train.settings import Settings


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def node(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    torch.manual_seed(seed)
    gm, prof = profile(Net(), [torch.randn(4, 6)])
    stage = build_stage(gm, 0, len(prof.layers)).to(device=device, dtype=dtype)
    params = list(stage.parameters())
    opt = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    metrics = WorkerMetrics(Identity("j", "", f"n{seed}", "root", 0, 0))
    return stage, Optimization(opt, sched, params, Settings(), metrics)


def train_step(stage, optimization, x, y) -> None:
    p = next(stage.parameters())
    x, y = x.to(p.device, p.dtype), y.to(p.device)
    out = stage(**dict(zip(stage.input_names, [x], strict=True)))[OUTPUT]
    nn.functional.cross_entropy(out, y).backward()
    optimization.step()


def continue_as_sender(joining, atol: float = 0.0):
    """Train a node 3 steps, send its state to `joining` (another initialisation, a fresh
    optimizer and scheduler), and train both 3 more steps on the same batches: they must end
    alike (within `atol`). The joiner and its optimization."""
    sender, sent_opt = node(1)
    joiner, join_opt = joining
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))
               for _ in range(6)]
    for x, y in batches[:3]:
        train_step(sender, sent_opt, x, y)
    names = tuple(sender.stage_state_dict())
    tensors, control = pack_state(sender, sent_opt, names)
    # as a frame carries them: the control through JSON, every tensor a copy
    control = json.loads(json.dumps(control))
    tensors = {k: v.clone() for k, v in tensors.items()}
    state = parse({"op": "state", "ring": "r", "round": 3, "updates": 3, **control})
    assert isinstance(state, State)
    nbytes = unpack_state(joiner, join_opt, names, tensors, state)
    assert nbytes > sum(p.numel() * 4 for p in sender.parameters())  # optimizer state too
    assert join_opt.optimizer.param_groups[0]["lr"] == sent_opt.optimizer.param_groups[0]["lr"]
    assert join_opt.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    for x, y in batches[3:]:  # both go on with the same batches
        train_step(sender, sent_opt, x, y)
        train_step(joiner, join_opt, x, y)
    a, b = sender.stage_state_dict(), joiner.stage_state_dict()
    for k in a:
        torch.testing.assert_close(b[k].to(a[k]), a[k], rtol=0, atol=atol, msg=k,
                                   check_dtype=False)
    assert join_opt.scheduler.get_last_lr() == sent_opt.scheduler.get_last_lr()
    return joiner, join_opt
