"""Where a node's stage trains (its provider's device) and in what precision its passes run.

A provider's `device` (`spec.providers[].device`: cpu, cuda or cuda:N) is a property of the
machine a worker runs on, not of the stage: whoever starts a worker says it
(`run.metadata.DEVICE_ENV`), so that a hot spare that takes over a stage trains it on its own
device.

Frames arrive in host memory and leave from it (`framing.to_wire` copies a device tensor to the
host); `Placement.put` takes what arrives to the device. The stage, its optimizer state and what a
ring averages stay on the device; checkpoints and the stage files a run leaves hold host tensors
(`on_host`), so that they load anywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ravnest.errors import RavnestError

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}
"""spec.training.precision -> the dtype of autocast (None: none)."""


def cuda_report() -> str:
    """What torch says of CUDA here, for an error: its build, and the devices it finds."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    try:
        n = torch.cuda.device_count()
        why = "" if n else "; torch.cuda.is_available() is False"
    except Exception as e:  # a broken driver raises here
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}): {e}{shown}"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds {n} CUDA "
            f"device(s){why}{shown}")


def resolve(device: str | torch.device, who: str) -> torch.device:
    """`device` as torch will use it; RavnestError naming `who` (a provider, a node) and what
    torch reports when this machine cannot train there."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise RavnestError(f"{who}: {device!r} is no device: {e}") from None
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type != "cuda":
        raise RavnestError(f"{who}: device {str(d)!r}: a stage trains on cpu or cuda")
    if not torch.cuda.is_available():
        raise RavnestError(f"{who}: device {str(d)!r}, but {cuda_report()}")
    count = torch.cuda.device_count()
    if d.index is not None and d.index >= count:
        raise RavnestError(f"{who}: device {str(d)!r}, but {cuda_report()} (indices 0 to "
                           f"{count - 1})")
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


def _each_tensor(item: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`item` with `move` applied to every tensor in it (nested in dicts, lists and tuples, a
    named tuple kept whole); the rest as is."""
    if isinstance(item, torch.Tensor):
        return move(item)
    if isinstance(item, dict):
        return {k: _each_tensor(v, move) for k, v in item.items()}
    if isinstance(item, list | tuple) and not hasattr(item, "_fields"):
        return type(item)(_each_tensor(v, move) for v in item)
    return item


def put(item: Any, device: torch.device) -> Any:
    """`item`'s tensors on `device`. Copies from the host do not wait for the device (they are
    queued on its stream before any use of them)."""
    return _each_tensor(item, lambda t: t if t.device == device else t.to(device,
                                                                          non_blocking=True))


def on_host(state: Any) -> Any:
    """`state` with every tensor in host memory (copied there and waited for)."""
    return _each_tensor(state, lambda t: t if t.device.type == "cpu" else t.cpu())


@dataclass(frozen=True)
class Placement:
    """A stage's device and the precision its forward passes (and the leaf's loss) run in."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise RavnestError(f"precision {self.precision!r}: one of {sorted(PRECISIONS)}")

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the precision's dtype on the stage's device (nothing for fp32)."""
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def put(self, item: Any) -> Any:
        return item if self.device.type == "cpu" else put(item, self.device)
