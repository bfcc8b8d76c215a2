"""Pipelining: one stage's forward and backward passes of the microbatches in flight.

A forward keeps what its microbatch's backward needs (inputs, outputs, the weights it ran on, the
leaf's labels) until that backward comes back; the leaf starts it at once from the loss, scaled
so that the gradients an update accumulates are those of the mean loss over its samples. Where
the activations and gradients go is the runtime's business: these passes only compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from ravnest.errors import RavnestError
from ravnest.plan.partitioning import OUTPUT, Stage
from ravnest.train.devices import Placement
from ravnest.train.messages import LABELS
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.scaling import OVERFLOW, SCALE, LossScale
from ravnest.train.schedules import WeightStash
from ravnest.train.targets import Labels, Targets


@dataclass
class Pending:
    """A microbatch between its forward and its backward."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    stash: dict[str, torch.Tensor] | None
    """The weights its forward ran on (None: the live ones)."""
    labels: Any
    """What came with it from the root (a job's labels tensor; None in the seed API)."""
    control: dict[str, Any]


class StagePasses:
    """The forward and backward passes of one node's stage."""

    def __init__(self, name: str, stage: Stage, is_root: bool,
                 criterion: Callable[..., torch.Tensor] | None, stash: WeightStash,
                 samples_per_update: int, metrics: WorkerMetrics,
                 targets: Targets | None = None, placement: Placement | None = None,
                 loss_as_given: bool = False) -> None:
        """`samples_per_update`: batch size x update frequency, what the leaf's loss is scaled by
        (times the microbatch's samples; an update of another size is corrected when the
        optimizer steps, see `Optimization`); with `loss_as_given` (the seed API), each batch's
        loss counts as the criterion gives it instead: a microbatch's scaled by its share of
        its batch's samples. `targets`: where the leaf's criterion gets its targets (default:
        the labels the root sends). `placement`: the stage's device (what arrives is taken
        there) and precision (default: the CPU, fp32)."""
        self.name = name
        self.stage = stage
        self.is_root = is_root
        self.criterion = criterion
        self.stash = stash
        self.samples_per_update = samples_per_update
        self.loss_as_given = loss_as_given
        self.metrics = metrics
        self.targets = targets or Labels(name)
        self.placement = placement or Placement()
        self.loss_scale = (LossScale() if criterion is not None
                           and self.placement.precision == "fp16" else None)
        """The leaf's loss scale in fp16 (train/scaling.py)."""
        self.pending: dict[int, Pending] = {}

    def forward(self, mb: int, tensors: dict[str, torch.Tensor], control: dict[str, Any]) -> None:
        """Run microbatch `mb` (inputs and labels by name) forward and keep it for its backward."""
        labels = tensors.pop(LABELS, None)
        inputs = {k: (v.requires_grad_() if v.dtype.is_floating_point and not self.is_root
                      else v) for k, v in self.placement.put(tensors).items()}
        missing = set(self.stage.input_names) - set(inputs)
        if missing:
            raise RavnestError(f"{self.name}: forward frame lacks {sorted(missing)}")
        self.stage.train()
        with self.metrics.timed("compute"):
            weights = self.stash.weights()
            t0 = time.perf_counter()
            outputs = self._run_stage({k: inputs[k] for k in self.stage.input_names}, weights)
            self.metrics.forward_seconds.observe(time.perf_counter() - t0)
        self.pending[mb] = Pending(inputs, outputs, weights, labels, control)

    def _run_stage(self, inputs: dict[str, torch.Tensor],
                   weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        with self.placement.autocast():
            if weights is None:
                return self.stage(**inputs)
            out: dict[str, torch.Tensor] = functional_call(self.stage, weights, args=(),
                                                           kwargs=inputs, strict=False)
        return out

    def downstream(self, mb: int) -> dict[str, torch.Tensor]:
        """What microbatch `mb`'s forward sends to the next stage: its outputs and labels."""
        p = self.pending[mb]
        send = {k: v.detach() for k, v in p.outputs.items()}
        if p.labels is not None:
            send[LABELS] = p.labels
        return send

    def leaf_backward(self, mb: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Run microbatch `mb` backward from its loss; return the gradients of the stage's inputs
        and the control its backward frame carries (the loss and the samples it is over)."""
        p = self.pending[mb]
        if self.criterion is None:
            raise RavnestError(f"{self.name}: a leaf needs a criterion")
        targets = self.placement.put(self.targets.train(p.control, p.labels))
        with self.metrics.timed("compute"), self.placement.autocast():
            loss = self.criterion(p.outputs[OUTPUT], targets)
        n = samples_of(p.control)
        if self.loss_as_given:  # the batch's microbatches add up to its loss; no update rescaled
            per_update, scale = 0, n / batch_samples_of(p.control)
        else:  # their share of the update's mean
            per_update = self.samples_per_update
            scale = n / per_update
        # the loss is read when the frame that carries it is sent (Placement.outgoing), not here:
        # on a device, reading it now would wait for this microbatch's forward to finish
        info = {**p.control, "loss": loss.detach().float(), "n": n, "per_update": per_update}
        info.pop(OVERFLOW, None)
        if self.loss_scale is not None:
            scale *= self.loss_scale.scale
            info[SCALE] = self.loss_scale.scale
        return self._run_backward(mb, [loss * scale], [None]), info

    def backward(self, mb: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run microbatch `mb` backward from the gradients of its outputs (by name); return the
        gradients of the stage's inputs."""
        p = self.pending[mb]
        outs, gs = [], []
        for k, g in grads.items():
            t = p.outputs.get(k)
            if t is None:
                raise RavnestError(f"{self.name}: gradient for unknown output {k!r}")
            if t.requires_grad:
                outs.append(t)
                gs.append(self.placement.put(g))
        return self._run_backward(mb, outs, gs)

    def _run_backward(self, mb: int, outs: list[torch.Tensor],
                      grads: list[Any]) -> dict[str, torch.Tensor]:
        p = self.pending.pop(mb)
        with self.metrics.timed("compute"):
            t0 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grads)
            self.metrics.backward_seconds.observe(time.perf_counter() - t0)
            if p.stash is not None:
                self.stash.land(p.stash)
        if self.is_root:
            return {}
        return {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                for k, v in p.inputs.items() if v.requires_grad}

    @torch.no_grad()
    def evaluate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run a validation batch (inputs by name) forward; return the stage's outputs."""
        self.stage.eval()
        with self.metrics.timed("compute"), self.placement.autocast():
            out: dict[str, torch.Tensor] = self.stage(
                **self.placement.put({k: tensors[k] for k in self.stage.input_names}))
        return out


def samples_of(control: dict[str, Any]) -> int:
    """The samples of a microbatch: its size as the root cut it (every forward names it)."""
    try:
        return int(control["sizes"][int(control["part"])])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise RavnestError(f"a forward frame does not name its microbatch's size: {e!r}") from e


def batch_samples_of(control: dict[str, Any]) -> int:
    """The samples of a microbatch's whole batch (the sizes of its microbatches, which every
    forward names), at least 1."""
    try:
        n = sum(int(x) for x in control["sizes"])
    except (KeyError, TypeError, ValueError) as e:
        raise RavnestError(f"a forward frame does not name its batch's sizes: {e!r}") from e
    if n < 1:
        raise RavnestError(f"a forward frame names a batch of {n} samples")
    return n
