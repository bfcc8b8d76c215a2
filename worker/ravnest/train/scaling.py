"""Loss scaling for fp16 (spec.training.precision: fp16), across the stages of a pipeline.

fp16 holds gradients down to about 6e-8 only: small ones would vanish. As torch's GradScaler
does, the leaf multiplies its loss by a scale S before its backward, so every gradient of the
update (its own, and those it sends up, through every stage) is S times larger; each stage
divides its own parameters' gradients by S before it steps (`unscale`), and skips the step when
any of them is not finite (an overflow: S was too large).

The leaf owns S (`LossScale`) and writes it into the control of every backward frame, so that
each stage unscales by the S its gradients were made with. Each stage checks its gradients
before it sends its update's last backward frame up, and says in it whether this stage or one
after it overflowed (`SKIP`), so the root knows, once its own last backward ran, whether any
stage overflowed.

In the sync schedule no stage steps at its last backward: it holds the step, and the root sends
`step` down the pipeline with the update's outcome (`skip`), which every stage takes, the leaf's
S too. So the whole pipeline applies or drops an update alike, as GradScaler steps or skips the
whole model, wherever the overflow began. An epoch's short last update, stepped at the epoch's
end, is asked about first (`check` down the pipeline, `checked` up it). The held step costs one
control frame per update and link, sent before the root's next forward on the same link.

The async schedule does not wait for the root: a stage steps at its update's last backward, the
stages before an overflow skip with it, and those after it have stepped already. A stage whose
own gradients overflowed says so in its next forward (`OVERFLOW`), and S halves after the leaf's
next step.

S changes only between updates: it halves after an update in which any stage overflowed, and
doubles after `growth_interval` updates in a row without one. Across clusters each cluster
decides for its own copy, which the rings then average (DDP's GradScaler instead all-reduces the
overflow flag, so that every rank skips together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SCALE = "scale"
"""A backward frame's control key: the loss scale its gradients were made with."""
SKIP = "skip"
"""An update's last backward frame's control key: a stage after this one overflowed, and every
stage before it skips the update too."""
OVERFLOW = "overflow"
"""A forward frame's control key: a stage before the leaf overflowed in its last step."""


@dataclass
class LossScale:
    """The leaf's loss scale (torch.amp.GradScaler's defaults)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean: int = 0
    """Updates in a row without an overflow."""
    told: bool = False
    """A stage before the leaf overflowed since the leaf's last step."""

    def update(self, overflowed: bool) -> None:
        """After the leaf's step: back off after an overflow anywhere, grow after a long run
        without one."""
        if overflowed or self.told:
            self.scale *= self.backoff_factor
            self.clean, self.told = 0, False
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean = 0

    def state(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    def load(self, state: dict[str, Any] | None) -> None:
        if state:
            self.scale, self.clean = float(state["scale"]), int(state["clean"])


def unscale(params: Sequence[torch.Tensor], scale: float) -> bool:
    """Divide the parameters' gradients by `scale`; whether all are finite (one wait for the
    device, at the step)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    torch._foreach_mul_(grads, 1.0 / scale)
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    return bool(finite)
