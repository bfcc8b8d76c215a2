"""Ring all-reduce over gRPC (or the TCP data plane of dataplane.py): the nodes that hold the same
parameters in different clusters average them (reduce-scatter, then all-gather), with the mean
written back only if the round completes.

A ring round that misses a peer for longer than the timeout is *skipped*: local tensors keep their
values, the round is counted as skipped, and pieces of it that arrive late are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from .dataplane import RingLink
from .errors import TransportError
from .framing import COMPRESSIONS, Frame
from .planning import RingPlan
from .transport import Inbox, Peer

log = logging.getLogger(__name__)

FINAL_ROUND = 2**40
"""Round id of the reduce every node joins after training."""

PIECE_BYTES = 4 << 20
"""fp32 bytes per ring piece: small enough to overlap the hops, large enough that per-call gRPC
overhead stays small."""


def _flatten(tensors: Sequence[torch.Tensor], buffer: torch.Tensor | None) -> torch.Tensor:
    """One float32 copy of all tensors, back to back (the ring works on the copy), in `buffer`
    when it has the right size: a buffer reused round after round costs no page faults."""
    numel = sum(t.numel() for t in tensors)
    if buffer is None or buffer.numel() != numel:
        buffer = torch.empty(numel, dtype=torch.float32)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            buffer[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
    return buffer


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

    def __init__(self, ring: RingPlan, me: str, peers: Mapping[str, Peer | RingLink], inbox: Inbox,
                 timeout: float, sender: str = "", compression: str = "none",
                 piece_bytes: int = PIECE_BYTES) -> None:
        self.ring = ring
        self.rank = ring.members.index(me)
        self.size = len(ring.members)
        self._next = peers[ring.successor(me)] if self.size > 1 else None
        self._inbox = inbox
        self._timeout = timeout
        self._sender = sender or me
        self._wire = COMPRESSIONS[compression]
        self._piece = max(1, piece_bytes // 4)  # float32 elements per piece
        self._flat: torch.Tensor | None = None

    def average(self, tensors: Sequence[torch.Tensor], round_: int) -> bool:
        """Average `tensors` in place with the other members; False if the round was skipped."""
        if self.size == 1:
            return True
        flat = self._flat = _flatten(tensors, self._flat)
        try:
            self._reduce(flat, round_)
        except TransportError as e:
            log.warning("ring %s round %d skipped: %s", self.ring.id, round_, e)
            return False
        _unflatten(flat, tensors)
        return True

    def all_reduce_(self, flat: torch.Tensor, round_: int) -> None:
        """Average one contiguous float32 tensor in place with the other members, without the
        copy in and out by which `average` keeps its tensors untouched by a failed round: here a
        failed round raises TransportError and leaves `flat` partly reduced. For callers that
        hold their own buffer (and for measuring the ring alone against gloo's all_reduce)."""
        if flat.dtype != torch.float32 or not flat.is_contiguous() or flat.dim() != 1:
            raise ValueError("all_reduce_ takes a contiguous 1-d float32 tensor")
        if self.size == 1:
            return
        self._reduce(flat, round_)

    def _reduce(self, flat: torch.Tensor, round_: int) -> None:
        """The ring on `flat`; after a failure, drop the round's late pieces and stop the link
        reading `flat` (the next round reuses it), then raise."""
        try:
            self._all_reduce(flat, round_)
        except TransportError:
            self._inbox.forget_rounds_before(self.ring.id, round_ + 1)
            if isinstance(self._next, RingLink):
                self._next.abort()
            raise

    def _all_reduce(self, flat: torch.Tensor, round_: int) -> None:
        """Reduce-scatter then all-gather, pipelined piece by piece: each of the n segments is cut
        into pieces, and a piece goes on to the next node as soon as it is reduced (or gathered)
        here, so sending, receiving and adding overlap along the ring instead of each step
        waiting for a whole segment."""
        n, r = self.size, self.rank
        pieces = [list(seg.split(self._piece)) for seg in flat.tensor_split(n)]
        per = max(len(p) for p in pieces)  # phase id = ring step * per + piece

        def phase(step: int, k: int) -> int:
            return step * per + k

        for k, piece in enumerate(pieces[r]):
            self._post("reduce", piece, round_, phase(0, k))
        for s in range(n - 1):
            last = s == n - 2
            for k, piece in enumerate(pieces[(r - s - 1) % n]):
                self._take(round_, phase(s, k), piece, add=True)
                if not last:
                    self._post("reduce", piece, round_, phase(s + 1, k))
                    continue
                # fully reduced here: this node owns the piece's mean and starts its gather
                piece.div_(n)
                _round_like_wire(piece, self._wire)
                self._post("gather", piece, round_, phase(n - 1, k))
        for s in range(n - 1):
            for k, piece in enumerate(pieces[(r - s) % n]):
                self._take(round_, phase(n - 1 + s, k), piece, add=False)
                if s < n - 2:
                    self._post("gather", piece, round_, phase(n + s, k))
        assert self._next is not None
        self._next.flush(self._timeout)

    def _post(self, kind: str, seg: torch.Tensor, round_: int, phase: int) -> None:
        assert self._next is not None
        self._next.post(Frame(kind=kind, tensors={"x": seg}, step=round_, version=phase,
                              ring=self.ring.id, sender=self._sender), ordered=False)

    def _take(self, round_: int, phase: int, piece: torch.Tensor, add: bool) -> None:
        """Add the awaited piece into `piece`, or (`add` false) copy it there."""
        frame = self._inbox.take_ring(self.ring.id, round_, phase, self._timeout)
        try:
            x = frame.tensors.get("x")
            if x is None or x.shape != piece.shape:
                raise TransportError(f"ring {self.ring.id}: piece of shape "
                                     f"{None if x is None else tuple(x.shape)} from "
                                     f"{frame.sender}, expected {tuple(piece.shape)}")
            if add:
                piece.add_(x)
            else:
                piece.copy_(x)
        finally:
            if frame.release is not None:
                frame.release()  # the data plane reuses the buffer for a later piece


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
