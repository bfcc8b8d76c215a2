"""A cross-entropy loss that waits while a gate file exists (`GATE_ENV` names it): a job whose
spec.training.criterion names it (`gated_loss:criterion`) has its leaves stop at their next
micro-batch, and so their clusters at a round, until a test opens the gate. The roots still
answer controls meanwhile (they wait for the leaves' gradients while handling frames), so a
restarted cluster asks where training is, and picks its join round, as it would; the clusters
stopped at the gate cannot finish before it is back: what was a race with the machine's speed
is an order the test sets (tests/integration/test_operator.py)."""

from __future__ import annotations

import os
import time

import torch
from torch.nn import functional

GATE_ENV = "GATED_LOSS_GATE"
SLOW = ".slow"
"""While a file named as the gate plus this exists, the leaves take SLOW_SECONDS more per
micro-batch: training goes on, slowly enough that a test sees what happens while it does."""
SLOW_SECONDS = 0.05
"""(The slow file may name other seconds, as its text.)"""


def _slow(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read().strip() or SLOW_SECONDS)
    except ValueError:
        return SLOW_SECONDS


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    gate = os.environ.get(GATE_ENV)
    while gate and os.path.exists(gate):
        time.sleep(0.05)
    if gate and os.path.exists(gate + SLOW):
        try:
            time.sleep(_slow(gate + SLOW))
        except FileNotFoundError:  # (taken away meanwhile)
            pass
    return functional.cross_entropy(output, target)
