"""Receive buffers, reused instead of allocated afresh for every frame or ring piece.

A fresh buffer of many MiB is untouched memory and costs a page fault on every page as its bytes
are first written (64 MiB: about 25 ms here, more than the copy into it; a 4 MiB ring piece about
1.5 ms). Both receivers therefore take their buffers from a `BufferPool`: the gRPC server for
frames (framing.decode_wire), whose tensors are views of the buffer, and the data plane for ring
pieces (dataplane.RingServer), whose reader also knows when a piece is done with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    assert _use_count is not None
    return _use_count(t.untyped_storage()._cdata)


def _can_tell_unused() -> int | None:
    """The reference count of an unshared buffer's storage, as `_storage_refs` sees it, or None
    when this torch cannot count references to a storage (then only buffers given back are
    reused): checked once against a view, so a torch whose count means something else turns
    that reuse off."""
    if _use_count is None:
        return None
    try:
        probe = torch.empty(8, dtype=torch.uint8)
        alone = _storage_refs(probe)
        view = probe[2:4]
        shared = _storage_refs(probe)
        del view
        return alone if shared > alone == _storage_refs(probe) else None
    except (AttributeError, RuntimeError, TypeError):
        return None


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class BufferPool:
    """Receive buffers of at least `min_bytes`, handed out again for a request of the same size
    once they are free.

    A buffer is free once no tensor, view, NumPy array or autograd record holds its storage any
    more (counted by torch), or once its user gave it back (`give_back`: it is done with it, even
    if a reference is left). A buffer still referenced and not given back is never handed out.
    At most `max_bytes` of buffers are kept: past that the oldest are let go, free ones first
    (freed when their last user drops them); one given back after it was let go is kept again
    if there is room."""

    def __init__(self, max_bytes: int = 256 << 20, min_bytes: int = 1 << 20,
                 pinned: bool = False) -> None:
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self.pinned = pinned
        """Whether the buffers it keeps are in page-locked (pinned) memory, for a worker on a
        CUDA device: a copy from one to the device then goes without waiting for the host."""
        self._alone = _can_tell_unused()
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._given_back: set[int] = set()
        """Addresses of the kept buffers given back since they were last handed out."""
        self._bytes = 0
        self.reused = 0
        """Buffers handed out again (for tests and benchmarks)."""

    @property
    def enabled(self) -> bool:
        """Whether a buffer is reused once nothing refers to it."""
        return self._alone is not None and self.max_bytes >= self.min_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` that nothing else refers to (and nobody gave back)."""
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            for i, buffer in enumerate(self._buffers):
                if buffer.numel() == nbytes and self._free(buffer):
                    self._given_back.discard(_address(buffer))
                    self._buffers.append(self._buffers.pop(i))
                    self.reused += 1
                    return buffer[:]  # a view, made under the lock: the buffer counts as used
            if self._alone is None:  # torch cannot tell when it is free: kept once given back
                return torch.empty(nbytes, dtype=torch.uint8)
            self._make_room(nbytes)
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            self._keep(buffer)
            return buffer[:]

    def give_back(self, tensor: torch.Tensor) -> None:
        """Let the buffer that `tensor` (all of a buffer `take` handed out, as any dtype) lies in
        be handed out again; the caller must not touch it afterwards."""
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return
        address = _address(tensor)
        with self._lock:
            if not any(_address(b) == address for b in self._buffers):
                if self._bytes + nbytes > self.max_bytes:
                    return
                self._keep(tensor.reshape(-1).view(torch.uint8))
            self._given_back.add(address)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def _free(self, buffer: torch.Tensor) -> bool:
        return _address(buffer) in self._given_back or (
            self._alone is not None and _storage_refs(buffer) == self._alone)

    def _keep(self, buffer: torch.Tensor) -> None:
        self._buffers.append(buffer)
        self._bytes += buffer.numel()

    def _make_room(self, nbytes: int) -> None:
        while self._buffers and self._bytes + nbytes > self.max_bytes:
            i = next((i for i, b in enumerate(self._buffers) if self._free(b)), 0)
            gone = self._buffers.pop(i)  # by position: `list.remove` would compare tensors
            self._given_back.discard(_address(gone))
            self._bytes -= gone.numel()
