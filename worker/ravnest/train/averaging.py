"""Averaging: which tensors a node's rings average, and the ring reducers a node gets by default.

A node takes part in one ring per group of parameters it shares with nodes of other clusters
(`Plan.rings_of`). Each ring averages those parameters and buffers of the stage, and with
`averageOptimizer` their optimizer state too; with an outer optimizer (`training.outer`,
train/outer.py) the parameters' pseudo-gradients stand in for the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

from ravnest.comm.inboxes import Inbox
from ravnest.comm.sending import RingSender
from ravnest.plan.partitioning import Stage
from ravnest.plan.plans import Plan
from ravnest.train.allreducing import RingReducer
from ravnest.train.optimizing import Optimization
from ravnest.train.outer import OuterStep
from ravnest.train.settings import Settings

RingTensors = Callable[[], tuple[list[torch.Tensor], int, int]]
"""A ring's tensors at the time of a round, how many of the first are movable and how many of
those may be quantized (see `RingReducer.average`)."""


def ring_reducers(plan: Plan, node: str, links: Mapping[str, RingSender], inbox: Inbox,
                  settings: Settings,
                  lost: Callable[[int], Collection[str]] | None = None) -> list[RingReducer]:
    """A reducer for each ring of `node`, which reaches its successor through `links` (by node
    name) and takes pieces from `inbox`; given `lost`, its rounds go on among the members
    present."""
    return [RingReducer(r, node, links, inbox, settings.reduce_timeout,
                        compression=settings.compression, lost=lost)
            for r in plan.rings_of(node)]


def ring_tensors(stage: Stage, names: tuple[str, ...],
                 optimization: Optimization | None, outer: OuterStep | None = None
                 ) -> RingTensors:
    """A ring's tensors: the stage's own parameters and buffers `names` (movable: the reducer
    keeps them as views of its buffer), then, given `optimization` (averageOptimizer), the
    optimizer's state of those parameters. Given `outer`, its parameters' pseudo-gradients come
    first, in their place (they are movable, the parameters are not: the outer step writes
    them), and with int8 compression only they are quantized."""
    params = dict(stage.named_parameters())
    stepped = set(outer.names) if outer is not None else set()

    def tensors() -> tuple[list[torch.Tensor], int, int]:
        state = stage.stage_state_dict(keep_vars=True)
        if outer is not None:
            deltas = outer.pseudo_gradients()  # (the outer step's own: movable)
            out = deltas + [state[n] for n in names if n not in stepped]
            movable = quantized = len(deltas)
        else:
            out = [state[n] for n in names]
            movable, quantized = len(out), 0
        if optimization is not None:
            for n in names:
                opt_state = optimization.state_of(params.get(f"graph_module.{n}"))
                out += [v for k, v in sorted(opt_state.items())
                        if isinstance(v, torch.Tensor) and k != "step" and v.dim() > 0]
        return out, movable, quantized

    return tensors
