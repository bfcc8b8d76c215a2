"""Outer steps (DiLoCo, `training.outer`): a ring's members train on their own between rounds
(the inner optimizer, the job's), and at each round all-reduce their *pseudo-gradient*, the
parameters they held after the last round minus those they hold now, and apply one step of an
outer optimizer (SGD with Nesterov or heavy-ball momentum) to the parameters of the last round.

Every member holds the same parameters after a round (the same start, the same mean, the same
step), so the mean pseudo-gradient is the last round's parameters minus the mean of the members'
current ones: outer SGD with lr 1 and no momentum is the plain mean rings take without an outer
optimizer. A round that is skipped changes nothing here: the next one's pseudo-gradient covers
both intervals. A round a member holds alone (the others are missing) applies the outer step to
its own pseudo-gradient. The final round, after training, takes the plain mean (`step`).

The outer state of a ring (the parameters of the last round, the *anchor*, and the outer
optimizer's momentum) is part of a node's checkpoint, and goes with a ring's state to a node that
rejoins, takes over or joins a grown job (`rejoining.pack_state`).

Only the ring's parameters take outer steps; its buffers (BatchNorm's running statistics), and
with `averageOptimizer` the inner optimizer's state, are averaged as they are without one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ravnest.errors import RavnestError
from ravnest.plan.partitioning import Stage
from ravnest.spec import OuterSpec

ANCHOR, MOMENTUM = "anchor", "momentum_buffer"


class OuterStep:
    """The outer optimizer of one ring at one node, over the ring's parameters `params` (by
    their names in the stage's state dict)."""

    def __init__(self, spec: OuterSpec, params: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        self._params = dict(params)
        self.anchors = {n: torch.zeros_like(p, memory_format=torch.contiguous_format)
                        for n, p in self._params.items()}
        self._optimizer = torch.optim.SGD(
            list(self.anchors.values()), lr=spec.lr, momentum=spec.momentum,
            nesterov=spec.optimizer == "nesterov")
        self._deltas = [torch.empty_like(a) for a in self.anchors.values()]
        """The pseudo-gradients' tensors, made once and written anew each round."""
        self._in_round = False
        """Whether `pseudo_gradients` began a round that no `step` or `dropped` ended."""
        self.anchor()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._params)

    def anchor(self) -> None:
        """Take the parameters as they are now for those of the last round (a node's start, or
        a checkpoint without outer state); the momentum is dropped."""
        with torch.no_grad():
            for n, p in self._params.items():
                self.anchors[n].copy_(p.detach())
        self._optimizer.state.clear()

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """The tensors this node sends into the round: the last round's parameters minus now,
        one per parameter in `names` order (the ring averages them in place). They are the
        same tensors round after round, written anew: a reducer may keep them as views of its
        buffer (`RingReducer.average`'s movable tensors), read in place."""
        with torch.no_grad():
            for delta, anchor, p in zip(self._deltas, self.anchors.values(),
                                        self._params.values(), strict=True):
                torch.sub(anchor, p.detach(), out=delta)
        self._in_round = True
        return list(self._deltas)

    def step(self, final: bool = False) -> None:
        """The round completed and the pseudo-gradients hold the members' mean: one outer step
        from the last round's parameters, which the parameters and the anchor both become.

        `final` (the round every node joins after training): the plain mean instead, the last
        round's parameters minus the mean pseudo-gradient, momentum untouched. It follows a
        round with no update in between when the job's updates are a multiple of
        reduceFactor, and a step of momentum alone would move the trained parameters again."""
        if not self._in_round:
            raise RavnestError("outer step without the round's pseudo-gradients")
        if final:
            with torch.no_grad():
                for anchor, delta in zip(self.anchors.values(), self._deltas, strict=True):
                    anchor.sub_(delta)
        else:
            for anchor, delta in zip(self.anchors.values(), self._deltas, strict=True):
                anchor.grad = delta
            self._optimizer.step()
        with torch.no_grad():
            for n, p in self._params.items():
                anchor = self.anchors[n]
                anchor.grad = None
                p.copy_(anchor)
        self._in_round = False

    def dropped(self) -> None:
        """The round was skipped: the parameters train on from where they are."""
        self._in_round = False

    # ------------------------------------------------------------------------ state

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each parameter's anchor and (once a step made it) momentum buffer."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for n, anchor in self.anchors.items():
            out[n] = {ANCHOR: anchor.detach()}
            buf = self._optimizer.state.get(anchor, {}).get(MOMENTUM)
            if isinstance(buf, torch.Tensor):
                out[n][MOMENTUM] = buf.detach()
        return out

    def load(self, tensors: Mapping[str, Mapping[str, torch.Tensor]], what: str) -> int:
        """Load `tensors` (as `tensors()` gives them) for every parameter; the bytes loaded.
        Raises RavnestError naming `what` (where they came from) when they do not fit."""
        nbytes = 0
        missing = [n for n in self.anchors if ANCHOR not in (tensors.get(n) or {})]
        if missing:
            raise RavnestError(f"{what}: no outer state for {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''} (training.outer)")
        self._optimizer.state.clear()
        with torch.no_grad():
            for n, anchor in self.anchors.items():
                got = tensors[n]
                for key, value in got.items():
                    if key not in (ANCHOR, MOMENTUM) or value.shape != anchor.shape:
                        raise RavnestError(f"{what}: outer state {n}/{key} does not fit this "
                                           f"stage ({tuple(value.shape)} vs "
                                           f"{tuple(anchor.shape)})")
                anchor.copy_(got[ANCHOR])
                if MOMENTUM in got:
                    self._optimizer.state[anchor] = {
                        MOMENTUM: got[MOMENTUM].to(device=anchor.device, dtype=anchor.dtype,
                                                   copy=True)}
                nbytes += sum(t.numel() * t.element_size() for t in got.values())
        return nbytes


def outer_steps(spec: OuterSpec | None, stage: Stage,
                rings: Sequence[tuple[str, Sequence[str]]]) -> dict[str, OuterStep]:
    """An outer step for each ring (id, its state's names) that shares parameters of `stage`,
    given `spec` (none without it)."""
    if spec is None:
        return {}
    stage_state = stage.stage_state_dict(keep_vars=True)
    params = dict(stage.named_parameters())
    out = {}
    for ring_id, names in rings:
        own = {n: stage_state[n] for n in names
               if f"graph_module.{n}" in params and stage_state[n].is_floating_point()}
        if own:
            out[ring_id] = OuterStep(spec, own)
    return out
