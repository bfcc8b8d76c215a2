"""Where a node's stage trains (its provider's device) and in what precision its passes run.

A provider's `device` (`spec.providers[].device`: cpu, cuda or cuda:N) is a property of the
machine a worker runs on, not of the stage: whoever starts a worker says it
(`run.metadata.DEVICE_ENV`), so that a hot spare that takes over a stage trains it on its own
device.

Frames arrive in host memory and leave from it. On a CUDA device a `Mover` carries them across
on a stream of its own: what arrives (the transport receives large frames into pinned buffers)
goes to the device without the host waiting, and the stage's compute waits for it on the device;
what leaves is copied into pinned host memory once the compute that made it is done, and the
frame's sender thread waits for that copy (`Frame.ready`), not the thread that computes, which
goes on to the next microbatch meanwhile. The stage, its optimizer state and what a ring averages
stay on the device; checkpoints and the stage files a run leaves hold host tensors (`on_host`),
so that they load anywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
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


class Mover:
    """Copies between host memory and a CUDA device on a stream of their own (`stream`), so that
    they overlap the compute stream's work and nobody's thread waits for them but the one that
    reads what they made."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._held: deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = deque()
        """Host tensors being copied from, with the event their copies end at: kept referenced
        until then, so that a receive buffer they lie in is not handed out again meanwhile."""

    def to_device(self, item: Any) -> Any:
        """`item`'s tensors on the device. The copies are queued on `stream` (from pinned memory:
        a tensor not in it is first copied there), and the compute stream waits for them before
        any later work: the caller does not wait."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
        compute = torch.cuda.current_stream(self.device)
        sources: list[torch.Tensor] = []

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device:
                return t
            if t.device.type == "cpu":
                src = t if t.is_pinned() else t.pin_memory()
                sources.append(src)
                t = src
            moved = t.to(self.device, non_blocking=True)
            # made on this stream and used on the compute stream: the allocator does not reuse
            # its memory before the compute stream's work queued by then is done
            moved.record_stream(compute)
            return moved

        with torch.cuda.stream(self.stream):
            moved = _each_tensor(item, move)
        done = torch.cuda.Event()
        done.record(self.stream)
        compute.wait_event(done)
        if sources:
            self._held.append((done, sources))
        return moved

    def to_host(self, item: Any) -> tuple[Any, Callable[[], None]]:
        """`item`'s device tensors copied into pinned host memory once the compute queued so far
        is done, and what waits for the copies (call it before reading them)."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # (not reused by the allocator before the copy)
            return host

        with torch.cuda.stream(self.stream):
            moved = _each_tensor(item, move)
        done = torch.cuda.Event()
        done.record(self.stream)
        return moved, done.synchronize


@dataclass(frozen=True)
class Placement:
    """A stage's device and the precision its forward passes (and the leaf's loss) run in."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    mover: Mover | None = field(default=None, compare=False, repr=False)
    """A CUDA stage's copier (made with the placement)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise RavnestError(f"precision {self.precision!r}: one of {sorted(PRECISIONS)}")
        if self.device.type == "cuda" and self.mover is None:
            object.__setattr__(self, "mover", Mover(self.device))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the precision's dtype on the stage's device (nothing for fp32)."""
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def put(self, item: Any) -> Any:
        """`item`'s tensors on the stage's device (`Mover.to_device`)."""
        if self.mover is None:
            return item if self.device.type == "cpu" else put(item, self.device)
        return self.mover.to_device(item)

    def outgoing(self, tensors: dict[str, torch.Tensor], control: dict[str, Any]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                            Callable[[], None] | None]:
        """What a frame of `tensors` and `control` (a value of which may be a 0-d tensor, a loss
        read later) carries from this stage: its tensors on the host, its control with numbers,
        and what to call before either is read (`Frame.ready`; None: nothing to wait for)."""
        if self.mover is None:  # (the transport's encoding copies what is not on the host)
            return tensors, _numbers(control), None
        lazy = {k: v for k, v in control.items() if isinstance(v, torch.Tensor)}
        (host, values), wait = self.mover.to_host((tensors, lazy))

        def ready() -> None:
            wait()
            control.update({k: float(v) for k, v in values.items()})

        return host, control, ready


def _numbers(control: dict[str, Any]) -> dict[str, Any]:
    """`control` with its tensor values (0-d: a loss) as floats."""
    if not any(isinstance(v, torch.Tensor) for v in control.values()):
        return control
    return {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in control.items()}
