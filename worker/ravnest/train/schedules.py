"""Schedules: when the root lets the pipeline drain, and which weights each forward runs on.

- `sync`: the root waits for all microbatches of an update before it feeds the next (a flush per
  optimizer step), which equals single-process training with gradient accumulation; forwards run
  on the live weights;
- `async`: the root keeps up to `maxInFlight` microbatches in the pipeline across updates and
  drains only where every node must act on the same weights (a ring round, a checkpoint, the end
  of an epoch); each forward runs on a stash of the weights of its version, so its backward uses
  the same weights (weight stashing), and the gradients land on the live weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ravnest.train.settings import Settings


def drains(settings: Settings, update: int, rings: bool, epoch_end: bool) -> bool:
    """Whether the root waits for the pipeline to empty once it has fed the batch that completes
    `update` (counted from what was fed: in async mode the optimizer steps run behind the
    feeding). `rings`: the plan has rings (none with one cluster)."""
    s = settings
    return bool(s.schedule == "sync"
                or (rings and update % s.reduce_factor == 0)
                or (s.checkpoint_every and update % s.checkpoint_every == 0)
                or epoch_end)


class WeightStash:
    """The weights a stage's forward passes run on: the live ones (sync), or (async) a copy of
    them taken at the first forward after they changed."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], stashing: bool) -> None:
        self._params = params
        self._stashing = stashing
        self.current: dict[str, torch.Tensor] | None = None
        """The stash of the live weights' version, once a forward has taken it."""

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The stash the next forward runs on (None: the live weights)."""
        if not self._stashing:
            return None
        if self.current is None:
            self.current = {k: p.detach().clone().requires_grad_(p.requires_grad)
                            for k, p in self._params.items()}
        return self.current

    def drop(self) -> None:
        """The live weights changed (an optimizer step, a ring round): stash them again."""
        self.current = None

    def land(self, stash: dict[str, torch.Tensor]) -> None:
        """Add the gradients a backward left on `stash` to the live weights' (taking them: the
        stash's are dropped)."""
        with torch.no_grad():
            for k, live in self._params.items():
                g = stash[k].grad
                if g is not None:
                    live.grad = g if live.grad is None else live.grad.add_(g)
                    stash[k].grad = None
