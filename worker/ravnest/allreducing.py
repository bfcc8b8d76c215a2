"""Ring all-reduce over gRPC: the nodes that hold the same parameters in different clusters average
them (reduce-scatter, then all-gather), with the mean written back only if the round completes.

A ring round that misses a peer for longer than the timeout is *skipped*: local tensors keep their
values, the round is counted as skipped, and pieces of it that arrive late are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .errors import TransportError
from .framing import COMPRESSIONS, Frame
from .planning import RingPlan
from .transport import Inbox, Peer

log = logging.getLogger(__name__)

FINAL_ROUND = 2**40
"""Round id of the reduce every node joins after training."""


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 copy of all tensors, back to back (the ring works on the copy)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _round_like_wire(seg: torch.Tensor, wire: torch.dtype | None) -> None:
    """Round a segment the way the wire will, so its owner keeps what the others receive."""
    if wire is None:
        return
    if wire == torch.float16 and seg.numel() and seg.abs().max().item() > 65504.0:
        return  # framing sends such a tensor uncompressed
    seg.copy_(seg.to(wire))


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            piece = flat[offset:offset + n].view(t.shape)
            if not t.dtype.is_floating_point:
                piece = piece.round()
            t.copy_(piece.to(t.dtype))
            offset += n


class RingReducer:
    """One node's part in one ring."""

    def __init__(self, ring: RingPlan, me: str, peers: dict[str, Peer], inbox: Inbox,
                 timeout: float, sender: str = "", compression: str = "none") -> None:
        self.ring = ring
        self.rank = ring.members.index(me)
        self.size = len(ring.members)
        self._next = peers[ring.members[(self.rank + 1) % self.size]] if self.size > 1 else None
        self._inbox = inbox
        self._timeout = timeout
        self._sender = sender or me
        self._wire = COMPRESSIONS[compression]

    def average(self, tensors: Sequence[torch.Tensor], round_: int) -> bool:
        """Average `tensors` in place with the other members; False if the round was skipped."""
        if self.size == 1:
            return True
        flat = _flatten(tensors)
        try:
            self._all_reduce(flat, round_)
        except TransportError as e:
            log.warning("ring %s round %d skipped: %s", self.ring.id, round_, e)
            self._inbox.forget_rounds_before(self.ring.id, round_ + 1)
            return False
        _unflatten(flat, tensors)
        return True

    def _all_reduce(self, flat: torch.Tensor, round_: int) -> None:
        n, r = self.size, self.rank
        segs = list(flat.tensor_split(n))
        assert self._next is not None
        for s in range(n - 1):
            send, recv = (r - s) % n, (r - s - 1) % n
            self._post("reduce", segs[send], round_, s)
            segs[recv].add_(self._take(round_, s, segs[recv]))
        owned = segs[(r + 1) % n]
        owned.div_(n)
        _round_like_wire(owned, self._wire)
        for s in range(n - 1):
            send, recv = (r + 1 - s) % n, (r - s) % n
            self._post("gather", segs[send], round_, n - 1 + s)
            segs[recv].copy_(self._take(round_, n - 1 + s, segs[recv]))
        self._next.flush(self._timeout)

    def _post(self, kind: str, seg: torch.Tensor, round_: int, phase: int) -> None:
        assert self._next is not None
        self._next.post(Frame(kind=kind, tensors={"x": seg.clone()}, step=round_, version=phase,
                              ring=self.ring.id, sender=self._sender))

    def _take(self, round_: int, phase: int, like: torch.Tensor) -> torch.Tensor:
        frame = self._inbox.take_ring(self.ring.id, round_, phase, self._timeout)
        x = frame.tensors.get("x")
        if x is None or x.shape != like.shape:
            raise TransportError(f"ring {self.ring.id}: piece of shape "
                                 f"{None if x is None else tuple(x.shape)} from {frame.sender}, "
                                 f"expected {tuple(like.shape)}")
        return x


def reduce_all(reducers: Sequence[tuple[RingReducer, Callable[[], list[torch.Tensor]]]],
               round_: int) -> tuple[int, int]:
    """Run every ring of a node in ring-id order (deadlock-free); return (done, skipped)."""
    done = skipped = 0
    for reducer, tensors in sorted(reducers, key=lambda x: x[0].ring.id):
        if reducer.average(tensors(), round_):
            done += 1
        else:
            skipped += 1
    return done, skipped
